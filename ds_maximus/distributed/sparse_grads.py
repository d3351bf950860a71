"""Combine row-sparse gradients across data-parallel ranks.

Each rank holds ``(ids, rows)`` for the rows its micro-batches touched. ``allreduce_sparse_rows``
all-gathers them (padded to the largest rank), merges duplicate ids and averages, so every rank ends
with the same ``(ids, rows)`` as one rank that had seen the whole global batch.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist


def merge_rows(ids: torch.Tensor, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum rows of equal ids; returns sorted unique ids and their summed rows (fp32)."""
    uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
    out = torch.zeros(uniq.numel(), rows.shape[1], dtype=rows.dtype, device=rows.device)
    out.index_add_(0, inv, rows)
    return uniq, out


def allreduce_sparse_rows(ids: torch.Tensor, rows: torch.Tensor, group: Optional[object] = None,
                          average: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """All-reduce a row-sparse tensor given as unique ``ids`` [n] and ``rows`` [n, d]."""
    if not (dist.is_available() and dist.is_initialized()):
        return ids, rows
    world = dist.get_world_size(group)
    if world == 1:
        return ids, rows
    dev = rows.device
    n = torch.tensor([ids.numel()], dtype=torch.long, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(s) for s in sizes]
    cap = max(sizes)
    pad_ids = torch.full((cap,), -1, dtype=torch.long, device=dev)
    pad_ids[: ids.numel()] = ids.to(dev)
    pad_rows = torch.zeros(cap, rows.shape[1], dtype=rows.dtype, device=dev)
    pad_rows[: rows.shape[0]] = rows
    all_ids = [torch.empty_like(pad_ids) for _ in range(world)]
    all_rows = [torch.empty_like(pad_rows) for _ in range(world)]
    dist.all_gather(all_ids, pad_ids, group=group)
    dist.all_gather(all_rows, pad_rows, group=group)
    cat_ids = torch.cat([a[:s] for a, s in zip(all_ids, sizes)])
    cat_rows = torch.cat([r[:s] for r, s in zip(all_rows, sizes)])
    uniq, summed = merge_rows(cat_ids, cat_rows)
    if average:
        summed /= world
    return uniq, summed
