"""The accumulated weight gradient of a CPU-tier LM head (:class:`HeadGradients`, a part of ``HeadTier``).

Gradient chunks arrive from the streamed cross-entropy's backward. By default they go device-to-host
on the write-back stream of the partition core's transfer engine into the ``grad`` table of the head's pinned
CPU tier (``[V, dim]`` fp32), added on the GPU to what earlier micro-batches accumulated. With
``grad_on_device`` (fp32 or bf16) they stay where they are computed (``dgrad``), and the staged step reads
them in place. Either way the squared norm of each chunk is summed on the device as it
arrives and a clipping scale is only recorded (applied by the step), so the host never walks the
``[V, dim]`` gradient.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ds_maximus.vocab.lm_head_update import device_with_index


class HeadGradients:
    """Gradient accumulation, norm, scaling and finiteness of :class:`~ds_maximus.vocab.lm_head_tier.HeadTier`
    (its ``__init__`` sets the attributes used here: ``grad``, ``dgrad``, ``grad_rows``, ``_sq`` ..., and it gives
    the tables of its CPU tier, ``_table(name)``, and the copy engine of a device, ``_transfer(device)``)."""

    def _grad_buffer(self) -> torch.Tensor:
        """The ``grad`` table of the CPU tier (zeros when first used)."""
        if self.grad is None:
            self.grad = self._table("grad")
        return self.grad

    def _grads(self) -> Optional[torch.Tensor]:
        """The accumulated gradient ``[V, dim]``: on the device (``grad_on_device``) or in the CPU tier."""
        return self.dgrad if self.grad_on_device is not None else self.grad

    def _device_grad_buffer(self, device: torch.device) -> torch.Tensor:
        """``grad_on_device``'s ``[V, dim]`` buffer on ``device`` (a new one starts with no rows holding a gradient)."""
        if self.dgrad is None or self.dgrad.device != device:
            self.dgrad = torch.zeros(self.vocab_size, self.dim, dtype=self.grad_on_device, device=device)
            self.grad_rows.zero_()
            self._clear_grad_meta()
        return self.dgrad

    def _add_grad_on_device(self, lo: int, hi: int, grad: torch.Tensor) -> None:
        """``add_grad_`` with ``grad_on_device``: accumulate in fp32 on ``grad``'s device, store in the dtype."""
        self._device_grad_buffer(grad.device)
        ev = self._step_event
        if ev is not None:                      # the in-flight step still reads the gradient
            torch.cuda.current_stream(grad.device).wait_event(ev)
        if self._grad_scale != 1.0:             # a scale recorded for the step, now applied before adding
            self.dgrad.mul_(self._grad_scale)
            self._sq = {k: v * self._grad_scale ** 2 for k, v in self._sq.items()}
            self._grad_scale = 1.0
        stored = self.dgrad[lo:hi]
        g = grad.to(torch.float32)
        if not self._mark_rows(lo, hi, self.dgrad):
            g = stored.to(torch.float32) + g
        stored.copy_(g)
        self._sq[(lo, hi)] = torch.linalg.vector_norm(stored, dtype=torch.float64).square()  # what the step uses
        self._grad_device = grad.device

    def _mark_rows(self, lo: int, hi: int, buf: torch.Tensor) -> bool:
        """Rows ``lo:hi`` receive a gradient chunk: where only some of them held one, the others' stale rows
        of ``buf`` are zeroed (and the per-chunk norms no longer cover the sum). Returns True when none did."""
        have = self.grad_rows[lo:hi]
        fresh = not bool(have.any())
        if not fresh and not bool(have.all()):
            buf[lo:hi][~have.to(buf.device)] = 0
            self._sq_ok = False
        if not fresh and (lo, hi) not in self._sq:
            self._sq_ok = False
        self.grad_rows[lo:hi] = True
        return fresh

    def add_grad_(self, lo: int, hi: int, grad: torch.Tensor) -> None:
        if self.grad_on_device is not None:
            return self._add_grad_on_device(lo, hi, grad)
        buf = self._grad_buffer()
        self._apply_scale()
        fresh = self._mark_rows(lo, hi, buf)
        self._grad_device = grad.device
        if grad.device.type != "cuda":
            if self._step_event is not None:
                self.sync()
            if fresh:
                buf[lo:hi].copy_(grad)
            else:
                buf[lo:hi].add_(grad.to(torch.float32))
            if self._device_update() is not None:
                self._sq[(lo, hi)] = torch.linalg.vector_norm(buf[lo:hi], dtype=torch.float64).square()
            return
        # on the write-back stream, after the backward's kernels that made ``grad`` and after an in-flight step,
        # which still reads this gradient; the host reads ``buf`` only after ``sync`` waited on the event
        with self._transfer(grad.device).storing(after=self._step_event) as out:
            g = grad.to(torch.float32)
            if not fresh:
                prev = torch.empty_like(g)
                prev.copy_(buf[lo:hi], non_blocking=True)
                g = prev.add_(g)
                self.counters["bytes_h2d"] += g.numel() * 4
            self._sq[(lo, hi)] = torch.linalg.vector_norm(g, dtype=torch.float64).square()
            buf[lo:hi].copy_(g, non_blocking=True)
            out.keep(grad, g)
        self._pending.append(out.event)
        self.counters["bytes_d2h"] += g.numel() * 4

    def sync(self) -> None:
        """Wait for every gradient copy in flight (before the host reads ``grad``)."""
        if self._pending:
            t0 = time.perf_counter()
            for ev in self._pending:
                ev.synchronize()
            self.counters["stall_ms"] += (time.perf_counter() - t0) * 1e3
            self._pending.clear()
        for transfer in self._transfers.values():
            transfer.drain()
        if self._step_event is not None:
            self._step_event.synchronize()
            self._step_event = None
        self._staged.clear()

    def _device_update(self) -> Optional[torch.device]:
        """The device the AdamW step runs on (``None``: on the host)."""
        if self.update_device == "host":
            return None
        if self.update_device == "auto":
            d = self._grad_device
            return device_with_index(d) if d is not None and d.type == "cuda" else None
        return device_with_index(self.update_device)

    def _apply_scale(self) -> None:
        """Apply a deferred gradient scale to the stored gradient (before anyone reads it there)."""
        if self._grad_scale != 1.0:
            self.sync()
            if self._grads() is not None:
                self._grads().mul_(self._grad_scale)
            self._grad_scale = 1.0

    def has_grads(self) -> bool:
        return self._grads() is not None and bool(self.grad_rows.any())

    def _sq_usable(self) -> bool:
        return self._device_update() is not None and self._sq_ok and self.has_grads()

    def grad_norm_sq(self) -> torch.Tensor:
        if self._sq_usable():                    # summed on the device as the chunks arrived
            total = torch.stack([v.to(self._device_update()) for v in self._sq.values()]).sum()
            return (total * self._grad_scale ** 2).float()
        self._apply_scale()
        self.sync()
        if not self.has_grads():
            return torch.zeros((), dtype=torch.float32)
        grads = self._grads()
        total = torch.zeros((), dtype=torch.float64, device=grads.device)
        for lo in range(0, self.vocab_size, self.chunk_rows):
            have = self.grad_rows[lo:lo + self.chunk_rows].to(grads.device)
            total += grads[lo:lo + self.chunk_rows][have].double().pow(2).sum()
        return total.float().cpu()

    def scale_grads_(self, factor: float) -> None:
        if self._device_update() is not None:
            self._grad_scale *= float(factor)    # applied on the device by the step
            return
        self.sync()
        if self._grads() is not None:
            self._grads().mul_(factor)

    def grads_finite(self) -> bool:
        if self._sq_usable():
            return bool(torch.isfinite(self.grad_norm_sq()))
        self._apply_scale()
        self.sync()
        grads = self._grads()
        return not self.has_grads() or bool(torch.isfinite(grads[self.grad_rows.to(grads.device)]).all())

    def zero_grads(self) -> None:
        self.sync()
        self.grad_rows.zero_()
        self._clear_grad_meta()

    def _clear_grad_meta(self) -> None:
        self._grad_scale = 1.0
        self._sq.clear()
        self._sq_ok = True
