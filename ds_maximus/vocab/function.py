"""The lookup of ``ShardedEmbedding`` and its autograd function (row-sparse backward).

``lookup`` does the one host sync of the forward: the batch's ids come to the host, where the range is
checked (no kernel ever sees a bad id), the batch is planned (:class:`BatchPlanner`; a prefetched batch
was planned by ``prefetch``) and the cache decides residency.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor

from ds_maximus.ops import index_array, rows_where, to_device


def check_range(uniq_sorted_cpu: Tensor, vocab_size: int) -> None:
    """Raise ``IndexError`` naming the first bad id and the vocabulary size."""
    if uniq_sorted_cpu.numel() == 0:
        return
    lo, hi = int(uniq_sorted_cpu[0]), int(uniq_sorted_cpu[-1])
    if lo < 0:
        raise IndexError(f"token id {lo} is negative; ids must lie in [0, {vocab_size}) for this embedding "
                         f"of {vocab_size} rows")
    if hi >= vocab_size:
        raise IndexError(f"token id {hi} is out of range for an embedding of {vocab_size} rows (ids must lie in "
                         f"[0, {vocab_size})); check the tokenizer / TokenMap matches the model")


class BatchPlan(NamedTuple):
    """What a lookup and its backward need of a batch of ids: ``uniq`` (sorted unique ids, CPU long),
    ``inverse`` (each token's position in ``uniq``), ``order`` (token positions sorted stably by id) and
    ``offsets`` ([U + 1] segment starts in ``order``), on the compute device."""

    uniq: Tensor
    inverse: Tensor
    order: Tensor
    offsets: Tensor


class HostPlan(NamedTuple):
    """A :class:`BatchPlan` on the host: ``uniq`` and one int64 buffer ``[inverse | order | offsets]``
    (pinned when it is bound for a GPU), so that :meth:`to` is one copy."""

    uniq: Tensor
    buf: Tensor

    def to(self, device=None) -> BatchPlan:
        n = (self.buf.numel() - self.uniq.numel() - 1) // 2
        buf = self.buf if device is None else to_device(self.buf, device)
        return BatchPlan(self.uniq, buf[:n], buf[n:2 * n], buf[2 * n:])


class BatchPlanner:
    """Plans batches of token ids on the host, with vocabulary-sized buffers kept between calls.

    One call of the ``batch_plan`` op (C++: a vocabulary mask gives the unique ids without a sort, a rank
    table the inverse, a counting sort the stable order), or the same in numpy where the op is not built
    (the reference; ~0.5 ms for 16K ids over a 262K vocabulary on one core). Sorting on the GPU instead takes
    ~20 small kernels a lookup, which wait behind the cache's copies on the PCIe link
    (``benchmarks/profile_sharded_embedding.py``; figures: docs/bench/code_history.md).

    >>> import numpy as np
    >>> p = BatchPlanner(10).plan(np.array([7, 2, 7, 5]))
    >>> p.uniq.tolist(), p.inverse.tolist(), p.order.tolist(), p.offsets.tolist()
    ([2, 5, 7], [2, 0, 2, 1], [1, 3, 0, 2], [0, 1, 2, 4])
    """

    def __init__(self, vocab_size: int, use_op: bool = True):
        self.vocab_size = int(vocab_size)
        self.use_op = use_op  # False: the numpy reference (tests compare the two)
        self._mask: Optional[Tensor] = None  # bool, all False between calls
        self._rank: Optional[Tensor] = None

    def _buffers(self):
        if self._mask is None:  # fresh ones would cost page faults (~0.25 ms at 262K) on every call
            self._mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            self._rank = torch.zeros(self.vocab_size, dtype=torch.long)
        return self._mask, self._rank

    def _check(self, a: np.ndarray) -> None:
        if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
            check_range(torch.tensor([int(a.min()), int(a.max())]), self.vocab_size)

    def plan(self, a: np.ndarray, device=None) -> BatchPlan:
        """The plan of int64 ``a`` with its index tensors on ``device`` (one host-to-device copy)."""
        cuda = device is not None and torch.device(device).type == "cuda"
        return self.plan_host(a, pin=cuda).to(device)

    def plan_host(self, a: np.ndarray, pin: bool = False) -> HostPlan:
        """The plan of int64 ``a`` on the host (raises ``IndexError`` naming an id outside the vocabulary)."""
        a = np.ascontiguousarray(a, dtype=np.int64)
        n = a.size
        mask, rank = self._buffers()
        from ds_maximus.ops.row_ops import host_op
        op = host_op() if self.use_op else None
        if op is not None and hasattr(op, "batch_plan"):
            uniq = torch.empty(n, dtype=torch.long)
            buf = torch.empty(3 * n + 1, dtype=torch.long, pin_memory=pin)
            u = op.batch_plan(torch.from_numpy(a), mask, rank, uniq, buf)
            if u < 0:  # the op checks the range before it writes anything
                self._check(a)  # the IndexError naming the id
            return HostPlan(uniq[:u], buf[:2 * n + u + 1])
        self._check(a)
        m, r = mask.numpy(), rank.numpy()
        if n * 64 < self.vocab_size:  # a mask scan costs ~V/64 sort elements' time
            uniq = np.unique(a)
        else:
            m[a] = True
            uniq = np.flatnonzero(m)
            m[uniq] = False
        u = uniq.size
        r[uniq] = np.arange(u)
        buf = torch.empty(2 * n + u + 1, dtype=torch.long, pin_memory=pin)
        b = buf.numpy()
        inverse, order, offsets = b[:n], b[n:2 * n], b[2 * n:]
        np.take(r, a, out=inverse)
        # stable: token order within an id; a radix sort when the inverse fits 16 bits
        order[:] = np.argsort(inverse.astype(np.uint16) if u <= 1 << 16 else inverse, kind="stable")
        offsets[0] = 0
        np.cumsum(np.bincount(inverse, minlength=u), out=offsets[1:])
        return HostPlan(torch.from_numpy(uniq.astype(np.int64, copy=False)), buf)


def ids_on_host(flat: Tensor) -> np.ndarray:
    """``flat`` (any integer dtype, any device) as int64 numpy; from a GPU, one copy and one host sync."""
    if flat.device.type == "cuda":
        host = torch.empty(flat.numel(), dtype=torch.long, pin_memory=True)
        host.copy_(flat.to(torch.long), non_blocking=True)
        torch.cuda.current_stream(flat.device).synchronize()  # the one host sync of the lookup
        return host.numpy()
    return index_array(flat)


def lookup(module, input: Tensor, pin: bool):
    """Gather the rows of ``input`` (any shape) -> ``(out [N, d], unique ids on CPU, backward plan)``.

    The ids come to the host (one sync on a GPU), where a prefetched batch with the same ids gives its plan
    (made and uploaded by ``prefetch``); otherwise the host plans them now. The range is checked on the host,
    so no kernel ever sees a bad id, and the cache decides residency there. A batch with more distinct rows
    than the cache can hold is gathered from a ``[U, d]`` table of its own rows (cached ones copied, the rest
    read from the tier), which holds the same values.
    """
    from ds_maximus.ops import row_ops as ops
    dev = module.compute_device
    host = ids_on_host(input.reshape(-1))
    plan = module._prefetched_plan(host)
    if plan is None:
        plan = module._planner.plan(host, dev)
    slots = module._resident(plan.uniq, pin=pin)
    s = index_array(slots)
    if s.size and s.min() < 0:  # more rows than the cache holds (on_overflow: serve): gather from the batch's own
        module._release_prefetch(torch.from_numpy(s[s >= 0]))
        table = module._overflow_table(plan.uniq, slots)
        out = ops.gather(table, torch.arange(s.size, device=dev), plan.inverse, module.out_dtype)
        return out, plan.uniq, (plan.inverse, plan.order, plan.offsets)
    module._release_prefetch(slots)
    w = module.cache.storage["weight"]
    out = ops.gather(w, to_device(slots, dev), plan.inverse, module.out_dtype)
    return out, plan.uniq, (plan.inverse, plan.order, plan.offsets)


class ShardedEmbeddingFunction(torch.autograd.Function):
    """Identity on the gathered rows; backward reduces the output gradient per unique id into the module."""

    @staticmethod
    def forward(ctx, anchor, out, module, uniq_cpu, plan):
        ctx.module = module
        ctx.uniq_cpu = uniq_cpu
        ctx.anchor_device = anchor.device
        ctx.save_for_backward(*(t for t in plan if t is not None))
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.profiler.record_function("maximus.rows.backward"):
            return ShardedEmbeddingFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        from ds_maximus.ops import row_ops as ops
        saved = ctx.saved_tensors
        inverse, order, offsets = (saved + (None, None))[:3]
        module, uniq = ctx.module, ctx.uniq_cpu
        grad = grad_out.reshape(-1, module.embedding_dim)
        rows = ops.segment_reduce(grad, inverse, uniq.numel(), order=order, offsets=offsets)
        if module.padding_idx is not None:
            keep = uniq != module.padding_idx
            if not bool(keep.all()):
                uniq, rows = uniq[keep], rows_where(rows, keep)
        module._accumulate(uniq, rows)
        # a zero (not None) anchor gradient, so an anchor's own backward (the norm carrier) still runs; on
        # the anchor's device: a GPU zero for the standalone module's CPU anchor would cost a device-to-host
        # copy, i.e. a host wait for all queued GPU work, in every backward
        return torch.zeros((), dtype=torch.float32, device=ctx.anchor_device), None, None, None, None
