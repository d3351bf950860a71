"""The AdamW step of a CPU-placed LM head, run on the compute device chunk by chunk.

The head's fp32 master rows, both AdamW moments and the accumulated gradient live in pinned CPU
memory (:class:`~ds_maximus.vocab.lm_head_tier.HeadTier`). A host-side step over 262144 x 2048
rows is seconds of memory-bound CPU work; here every block of ``rows`` rows instead travels:

* host -> device on the ``h2d`` side stream: weight, exp_avg, exp_avg_sq, grad (16 B/param);
* on the ``opt`` stream: the gradient scale (clipping coefficient), ``adamw_rows_`` (the very same
  arithmetic as the host path) and the conversion to each compute-dtype mirror;
* device -> host on the ``d2h`` side stream: weight, moments and mirrors (12 + 2 B/param).

Two staging sets are in flight, so the copies in both directions overlap the update of the
previous block; the host never waits. The streams, the staging sets and their events are the partition
core's :class:`~ds_maximus.partition.staged_update.StagedUpdate`, the same pipeline MoE training steps
its experts through. The returned event marks the end of the whole step: the
tier's next weight fetch makes its copy stream wait on it, so the step also overlaps the next
forward pass up to the LM head. On a CPU device the same code runs without streams (tests compare
it with the host path bit for bit).

With ``background=True`` (what the tier uses on a GPU) a worker thread issues the blocks and keeps
at most two blocks of copies queued ahead of the link. Issuing a step's blocks costs tens of ms of host
time, and a step queued whole fills the copy engines for longer still: any other host<->device copy of the
next step (the embedding's cache fills, a small ``.to(device)``) then waits behind it, and the compute
stream idles for both (profile figures: docs/bench/code_history.md). The thread returns at once; ``PendingStep.event()``
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

from typing import Dict, Optional

import torch

from ds_maximus.optim.sparse_adamw import adamw_rows_
from ds_maximus.partition.staged_update import BackgroundStep, StagedUpdate, device_with_index

__all__ = ["PendingStep", "StagedAdamW", "device_with_index"]

_STATE = ("weight", "exp_avg", "exp_avg_sq")

PendingStep = BackgroundStep  # the head's name for a step a worker thread is still issuing


class StagedAdamW:
    """AdamW of a whole ``[V, dim]`` host table through :class:`~ds_maximus.partition.staged_update.StagedUpdate`
    in blocks of ``rows`` rows; the staging buffers are made on first use and kept."""

    def __init__(self, device: torch.device, rows: int, dim: int):
        self.pipeline = StagedUpdate(device)
        self.device = self.pipeline.device
        self.rows = int(rows)
        self.dim = int(dim)

    @property
    def h2d(self) -> Optional[torch.cuda.Stream]:
        return self.pipeline.load

    @property
    def opt(self) -> Optional[torch.cuda.Stream]:
        return self.pipeline.update

    @property
    def d2h(self) -> Optional[torch.cuda.Stream]:
        return self.pipeline.store

    def release(self) -> None:
        """Free the device staging buffers (they come back on the next step)."""
        self.pipeline.release()

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
            return PendingStep(issue, name="maximus-head-step")
        return self._issue(host, grad_rows, mirrors, throttle=False, **kw)

    def _issue(self, host, grad_rows, mirrors, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale, after,
               throttle: bool):
        pl = self.pipeline
        vocab = host["weight"].shape[0]
        blocks = [(lo, min(vocab, lo + self.rows)) for lo in range(0, vocab, self.rows)]
        nb = self.device.type == "cuda"
        resident = tuple(n for n in _STATE + ("grad",) if host[n].device == self.device)
        size = self.rows * self.dim
        for k, (lo, hi) in pl.pieces(blocks, after=after, throttle=throttle):
            n = hi - lo
            dev = {name: pl.buffer(k, name, size)[:n * self.dim].view(n, self.dim)
                   for name in _STATE + ("grad",) if name not in resident}
            dev.update({dt: pl.buffer(k, str(dt), size, dt)[:n * self.dim].view(n, self.dim) for dt in mirrors})
            dev.update({name: host[name][lo:hi] for name in resident})
            with pl.loading(k):
                for name in _STATE + ("grad",):
                    if name not in resident:
                        dev[name].copy_(host[name][lo:hi], non_blocking=nb)
            have = grad_rows[lo:hi]
            partial = not bool(have.all())
            with pl.updating(pl.update):
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
            with pl.storing(k):
                for name in _STATE:
                    if name not in resident:
                        host[name][lo:hi].copy_(dev[name], non_blocking=nb)
                for dt, m in mirrors.items():
                    m[lo:hi].copy_(dev[dt], non_blocking=nb)
        return pl.end()
