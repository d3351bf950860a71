"""The lookup of ``ShardedEmbedding`` and its autograd function (row-sparse backward).

``lookup`` does the one host sync of the forward: the unique ids of the batch come to the host,
where the range is checked (the unique ids are sorted, so their first and last are the min and
max: no kernel ever sees a bad id) and the cache decides residency.
"""
from __future__ import annotations

from typing import Tuple

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


def lookup(module, input: Tensor, pin: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Gather the rows of ``input`` (any shape) -> ``(out [N, d], unique ids on CPU, inverse on device)``."""
    from ds_maximus.ops import sharded_embedding as ops
    dev = module.compute_device
    flat = input.reshape(-1).to(dev, torch.long)
    uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    uniq_cpu = uniq.cpu()  # the one host sync of the step
    check_range(uniq_cpu, module.num_embeddings)
    slots = module._resident(uniq_cpu, pin=pin)
    module._release_prefetch(slots)
    w = module.cache.storage["weight"]
    slots_dev = slots.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else slots
    out = ops.gather(w, slots_dev, inverse, module.out_dtype)
    return out, uniq_cpu, inverse


class ShardedEmbeddingFunction(torch.autograd.Function):
    """Identity on the gathered rows; backward reduces the output gradient per unique id into the module."""

    @staticmethod
    def forward(ctx, anchor, out, module, uniq_cpu, inverse):
        ctx.module = module
        ctx.uniq_cpu = uniq_cpu
        ctx.save_for_backward(inverse)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        from ds_maximus.ops import sharded_embedding as ops
        (inverse,) = ctx.saved_tensors
        module, uniq = ctx.module, ctx.uniq_cpu
        grad = grad_out.reshape(-1, module.embedding_dim)
        rows = ops.segment_reduce(grad, inverse, uniq.numel())
        if module.padding_idx is not None:
            keep = uniq != module.padding_idx
            if not bool(keep.all()):
                uniq, rows = uniq[keep], rows[keep.to(rows.device)]
        module._accumulate(uniq, rows)
        # a zero (not None) anchor gradient, so an anchor's own backward (the norm carrier) still runs
        return torch.zeros((), dtype=torch.float32, device=grad_out.device), None, None, None, None
