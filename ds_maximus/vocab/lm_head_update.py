"""The AdamW step of a CPU-placed LM head, run on the compute device chunk by chunk.

The head's fp32 master rows, both AdamW moments and the accumulated gradient live in pinned CPU
memory (:class:`~ds_maximus.vocab.lm_head_tier.HeadTier`). A host-side step over 262144 x 2048
rows is seconds of memory-bound CPU work; here every block of ``rows`` rows instead travels:

* host -> device on the ``h2d`` side stream: weight, exp_avg, exp_avg_sq, grad (16 B/param);
* on the ``opt`` stream: the gradient scale (clipping coefficient), ``adamw_rows_`` (the very same
  arithmetic as the host path) and the conversion to each compute-dtype mirror;
* device -> host on the ``d2h`` side stream: weight, moments and mirrors (12 + 2 B/param).

Two staging sets are in flight, so the copies in both directions overlap the update of the
previous block; the host never waits. The returned event marks the end of the whole step: the
tier's next weight fetch makes its copy stream wait on it, so the step also overlaps the next
forward pass up to the LM head. On a CPU device the same code runs without streams (tests compare
it with the host path bit for bit).

With ``background=True`` (what the tier uses on a GPU) a worker thread issues the blocks and keeps
at most two blocks of copies queued ahead of the link. Issuing 64 blocks costs ~45 ms of host time,
and a step queued whole fills the copy engines for ~110 ms: any other host<->device copy of the next
step (the embedding's cache fills, a small ``.to(device)``) then waits behind it, and the measured
H200 profile showed the compute stream idle for both. The thread returns at once; ``PendingStep.event()``
joins it and gives the end event.

Device memory: ``2 * rows * dim * (16 + 2 * mirrors)`` bytes (4096 x 2048 rows: ~300 MiB).

Example::

    >>> import torch
    >>> from ds_maximus.vocab.lm_head_tier import HeadTier
    >>> tier = HeadTier(torch.randn(10, 4), chunk_rows=4, update_device="cpu", update_rows=3)
    >>> tier.add_grad_(0, 10, torch.ones(10, 4))
    >>> tier.step_(lr=0.1, weight_decay=0.0)
    True
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, List, Optional, Tuple

import torch

from ds_maximus.optim.sparse_adamw import adamw_rows_

_STATE = ("weight", "exp_avg", "exp_avg_sq")


def device_with_index(device) -> torch.device:
    """``device`` with its index ("cuda" and "cuda:0" compare unequal)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _ctx(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class PendingStep:
    """A step whose blocks a worker thread is still issuing; ``event()`` joins it (re-raising its error)
    and returns the step's end event."""

    def __init__(self, fn):
        self._result = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="maximus-head-step", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by event()
            self._error = e

    def event(self) -> Optional[torch.cuda.Event]:
        self._thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result


class StagedAdamW:
    """Double-buffered device staging for one tier; buffers are made on first use and kept."""

    def __init__(self, device: torch.device, rows: int, dim: int):
        self.device = device_with_index(device)
        self.rows = int(rows)
        self.dim = int(dim)
        self._bufs: List[Dict[str, torch.Tensor]] = []
        self._free: List[Optional[torch.cuda.Event]] = [None, None]
        cuda = self.device.type == "cuda"
        self.h2d = torch.cuda.Stream(device=self.device) if cuda else None
        self.opt = torch.cuda.Stream(device=self.device) if cuda else None
        self.d2h = torch.cuda.Stream(device=self.device) if cuda else None

    def _buf(self, i: int, mirror_dtypes, resident=()) -> Dict[str, torch.Tensor]:
        while len(self._bufs) <= i:
            self._bufs.append({})
        b = self._bufs[i]
        for name in _STATE + ("grad",):
            if name not in b and name not in resident:
                b[name] = torch.empty(self.rows, self.dim, dtype=torch.float32, device=self.device)
        for dt in mirror_dtypes:
            if dt not in b:
                b[dt] = torch.empty(self.rows, self.dim, dtype=dt, device=self.device)
        return b

    def release(self) -> None:
        """Free the device staging buffers (they come back on the next step)."""
        if self.d2h is not None:
            self.d2h.synchronize()
        self._bufs.clear()
        self._free = [None, None]

    def step(self, host: Dict[str, torch.Tensor], grad_rows: torch.Tensor, mirrors: Dict[torch.dtype, torch.Tensor],
             *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             grad_scale: float = 1.0, after: Optional[torch.cuda.Event] = None, background: bool = False):
        """One AdamW step over every row of ``host`` (weight/exp_avg/exp_avg_sq/grad, ``[V, dim]`` fp32 CPU).

        Rows whose ``grad_rows`` flag is False take a zero-gradient step (as the host path). ``after``:
        an event the first host->device copy waits for (the gradient copies of the backward pass).
        A state tensor already on this device (the fp32 master of ``placement: cpu_optimizer``) is updated
        in place and never copied; so is a gradient already there (``grad_on_device``, fp32 or bf16: it is
        consumed, zeroed rows and the scale are applied to it in place).
        Returns the event that marks the step's end on the device (``None`` on CPU: done on return), or
        with ``background`` on a GPU a :class:`PendingStep` that yields it.
        """
        kw = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                  grad_scale=grad_scale, after=after)
        if background and self.device.type == "cuda":
            def issue():
                with torch.cuda.device(self.device):
                    return self._issue(host, grad_rows, mirrors, throttle=True, **kw)
            return PendingStep(issue)
        return self._issue(host, grad_rows, mirrors, throttle=False, **kw)

    def _issue(self, host, grad_rows, mirrors, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale, after,
               throttle: bool):
        vocab = host["weight"].shape[0]
        blocks: List[Tuple[int, int]] = [(lo, min(vocab, lo + self.rows)) for lo in range(0, vocab, self.rows)]
        if after is not None and self.h2d is not None:
            self.h2d.wait_event(after)
        nb = self.device.type == "cuda"
        resident = tuple(n for n in _STATE + ("grad",) if host[n].device == self.device)
        loads: List[torch.cuda.Event] = []
        for i, (lo, hi) in enumerate(blocks):
            if throttle and len(loads) >= 2:
                loads[-2].synchronize()              # at most two blocks queued on the copy engine
            k = i % 2
            b = self._buf(k, list(mirrors), resident)
            n = hi - lo
            dev = {name: t[:n] for name, t in b.items()}
            dev.update({name: host[name][lo:hi] for name in resident})
            if self.h2d is not None and self._free[k] is not None:
                self.h2d.wait_event(self._free[k])       # the set's previous block has left the device
            with _ctx(self.h2d):
                for name in _STATE + ("grad",):
                    if name not in resident:
                        dev[name].copy_(host[name][lo:hi], non_blocking=nb)
                loaded = torch.cuda.Event() if nb else None
                if nb:
                    loaded.record(self.h2d)
                    loads.append(loaded)
            have = grad_rows[lo:hi]
            partial = not bool(have.all())
            if self.opt is not None:
                self.opt.wait_event(loaded)
            with _ctx(self.opt):
                g = dev["grad"]
                if g.dtype != torch.float32:  # a device-resident bf16 gradient
                    g = g.float()
                if partial:
                    g[~have.to(self.device, non_blocking=nb)] = 0
                if grad_scale != 1.0:
                    g.mul_(grad_scale)
                adamw_rows_(dev["weight"], g, dev["exp_avg"], dev["exp_avg_sq"], step=step, lr=lr, beta1=beta1,
                            beta2=beta2, eps=eps, weight_decay=weight_decay)
                for dt in mirrors:
                    dev[dt].copy_(dev["weight"])
                done = torch.cuda.Event() if nb else None
                if nb:
                    done.record(self.opt)
            if self.d2h is not None:
                self.d2h.wait_event(done)
            with _ctx(self.d2h):
                for name in _STATE:
                    if name not in resident:
                        host[name][lo:hi].copy_(dev[name], non_blocking=nb)
                for dt, m in mirrors.items():
                    m[lo:hi].copy_(dev[dt], non_blocking=nb)
                if nb:
                    self._free[k] = torch.cuda.Event()
                    self._free[k].record(self.d2h)
        if not nb:
            return None
        end = torch.cuda.Event()
        end.record(self.d2h)
        return end
