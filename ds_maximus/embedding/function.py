"""The lookup of ``ShardedEmbedding`` and its autograd function (row-sparse backward).

``lookup`` does the one host sync of the forward: the unique ids of the batch come to the host,
where the range is checked (the unique ids are sorted, so their first and last are the min and
max: no kernel ever sees a bad id) and the cache decides residency.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor


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


def unique_sorted_cpu(flat: Tensor, vocab_size: int, mask: Optional[np.ndarray] = None) -> Tensor:
    """Sorted unique ids of CPU ``flat``: a vocabulary-sized mask when the batch is large (no sort).

    ``mask`` (all False, ``vocab_size`` numpy bools) is a buffer kept by the caller and left all False
    again: a fresh one costs page faults (~0.25 ms at 262K) on every call. The mask is numpy's, on one
    thread: torch's parallel ``nonzero`` over it cost 3-13 ms in some steps on a 16-core host (its
    threads waited for one another), against ~0.1 ms.
    """
    if flat.numel() * 64 < vocab_size:  # a mask costs ~V/64 sort elements' time
        return torch.unique(flat)
    a = flat.numpy()
    if a.min() < 0 or a.max() >= vocab_size:
        return torch.unique(flat)  # the caller's range check names the bad id
    if mask is None or mask.shape != (vocab_size,):
        mask = np.zeros(vocab_size, dtype=bool)
    mask[a] = True
    uniq = np.flatnonzero(mask)
    mask[uniq] = False
    return torch.from_numpy(uniq.astype(np.int64, copy=False))


def lookup(module, input: Tensor, pin: bool):
    """Gather the rows of ``input`` (any shape) -> ``(out [N, d], unique ids on CPU, backward plan)``."""
    from ds_maximus.ops import sharded_embedding as ops, to_device
    dev = module.compute_device
    flat = input.reshape(-1).to(dev, torch.long)
    if dev.type == "cuda":
        uniq_cpu, inverse, order, offsets = ops.sorted_unique(flat, module.num_embeddings)  # the one host sync of the step
    else:
        uniq_cpu, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        order = offsets = None
    check_range(uniq_cpu, module.num_embeddings)
    slots = module._resident(uniq_cpu, pin=pin)
    module._release_prefetch(slots)
    w = module.cache.storage["weight"]
    out = ops.gather(w, to_device(slots, dev), inverse, module.out_dtype)
    return out, uniq_cpu, (inverse, order, offsets)


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
        from ds_maximus.ops import sharded_embedding as ops
        saved = ctx.saved_tensors
        inverse, order, offsets = (saved + (None, None))[:3]
        module, uniq = ctx.module, ctx.uniq_cpu
        grad = grad_out.reshape(-1, module.embedding_dim)
        rows = ops.segment_reduce(grad, inverse, uniq.numel(), order=order, offsets=offsets)
        if module.padding_idx is not None:
            keep = uniq != module.padding_idx
            if not bool(keep.all()):
                uniq, rows = uniq[keep], rows[keep.to(rows.device)]
        module._accumulate(uniq, rows)
        # a zero (not None) anchor gradient, so an anchor's own backward (the norm carrier) still runs; on
        # the anchor's device: a GPU zero for the standalone module's CPU anchor would cost a device-to-host
        # copy, i.e. a host wait for all queued GPU work, in every backward
        return torch.zeros((), dtype=torch.float32, device=ctx.anchor_device), None, None, None, None
