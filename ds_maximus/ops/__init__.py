"""Thin Python wrappers that load each maximus op once and own its handle."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Optional

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor goes to CUDA through pinned memory with no host sync (a plain
    ``.to("cuda")`` of pageable memory waits for the whole stream)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(ids.flatten(), minlength=n)`` for ids in ``[0, n)`` (int64, ``ids``' device), without a host
    wait: on a GPU, bincount reads the ids' min and max on the host to size its output, two waits for the stream
    (which an MoE layer's routing counts would pay twice a layer on top of its one sync); there the ids are compared
    with ``arange(n)`` and the matches summed (deterministic, no atomics).

    >>> count_ids(torch.tensor([[2, 0], [2, 3]]), 5).tolist()
    [1, 0, 2, 1, 0]
    """
    ids = ids.reshape(-1)
    if ids.device.type == "cpu":
        return torch.bincount(ids, minlength=n)
    return _count_by_compare(ids, n)


def _count_by_compare(ids: torch.Tensor, n: int, max_elems: int = 1 << 24) -> torch.Tensor:
    """:func:`count_ids` off the host: each id compared with ``arange(n)``, the matches summed (int64); at most
    ``max_elems`` comparisons at once (a training batch's routing: the ids a slice at a time)."""
    ids = ids.reshape(-1)
    ar = torch.arange(n, device=ids.device)
    step = max(1, max_elems // max(n, 1))
    if ids.numel() <= step:
        return (ids.unsqueeze(1) == ar).sum(0)
    out = torch.zeros(n, dtype=torch.long, device=ids.device)
    for lo in range(0, ids.numel(), step):
        out += (ids[lo:lo + step].unsqueeze(1) == ar).sum(0)
    return out


def rows_where(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t[mask]`` for a host boolean ``mask`` over ``t``'s rows, by an index copy with indices uploaded from pinned
    memory: indexing a GPU tensor with a device mask (its ``nonzero``), or uploading a pageable mask, makes the host
    wait for the stream.

    >>> rows_where(torch.arange(6.).view(3, 2), torch.tensor([True, False, True])).tolist()
    [[0.0, 1.0], [4.0, 5.0]]
    """
    pos = torch.from_numpy(index_array(mask).nonzero()[0]) if mask.dtype == torch.bool else mask
    return t.index_select(0, to_device(pos, t.device))


def index_array(t: torch.Tensor):
    """An index tensor as a flat int64 numpy array on the host (sharing memory when it is one already).

    The host bookkeeping of the caches indexes numpy views: a numpy op on a few thousand entries costs
    ~1-7 us, the torch op on CPU tensors ~5-25 us (its reductions start a thread pool).
    """
    return t.to("cpu", torch.long).reshape(-1).numpy()


def to_device_pair(a: torch.Tensor, b: Optional[torch.Tensor], device):
    """CPU index tensors ``a`` and ``b`` (int64) on ``device``: to a GPU in one pinned copy, not two."""
    device = torch.device(device)
    if b is None or device.type != "cuda" or a.is_cuda or b.is_cuda:
        return to_device(a, device), (to_device(b, device) if b is not None else None)
    n = a.numel()
    buf = torch.empty(n + b.numel(), dtype=torch.long, pin_memory=True)
    h = buf.numpy()
    h[:n], h[n:] = index_array(a), index_array(b)
    buf = buf.to(device, non_blocking=True)
    return buf[:n], buf[n:]


def op_builder_module():
    """``ds_maximus.op_builder``: installed by ``pip install -e .``, or found next to the package
    when the repository is only on ``PYTHONPATH`` (as on the GPU machine)."""
    try:
        return importlib.import_module("ds_maximus.op_builder")
    except ImportError:
        root = Path(__file__).resolve().parents[2] / "op_builder"
        spec = importlib.util.spec_from_file_location("ds_maximus.op_builder", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        if spec is None:
            raise
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


def builder(module: str, cls: str):
    """Instantiate builder ``cls`` from ``ds_maximus.op_builder.<module>``."""
    op_builder_module()
    return getattr(importlib.import_module(f"ds_maximus.op_builder.{module}"), cls)()
