"""Disk space for a checkpoint: the bytes a save will write, checked against the folder's free space before
anything is written, and a write that fills the disk anyway reported as a :class:`ShardStoreError` that names
the path and the bytes, where torch says ``[enforce fail at inline_container.cc:672] . unexpected pos``.

The estimate counts what is known without serialising: the tensors of the maximus state, the module's
weights and the optimizer's own tensors (moments and, under ZeRO and the bf16 optimizer, the fp32 partitions),
each storage once. It is a lower bound (pickled metadata and DeepSpeed's extra files are not counted), so it
never refuses a save that would fit.

    >>> import torch
    >>> w = torch.zeros(1024)
    >>> state_bytes({"a": w, "b": [w[:10], torch.ones(3, dtype=torch.bfloat16)], "n": 7})
    4102
"""
from __future__ import annotations

import contextlib
import errno
import os
from typing import Iterator, Optional

import torch

from ds_maximus.errors import ShardStoreError
from ds_maximus.partition.host_memory import free_disk_bytes

# the texts torch's zip writer and its file layer give when a write comes up short (disk full, quota)
_SHORT_WRITE_TEXTS = ("inline_container", "unexpected pos", "PytorchStreamWriter failed", "file write failed")
# DeepSpeed's optimizers keep their fp32 weights in these (ZeRO 1/2, ZeRO 3, the bf16 optimizer); saved per rank
_FP32_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def state_bytes(obj, _seen: Optional[set] = None) -> int:
    """Bytes of the tensor storages in ``obj`` (nested dicts, lists, tuples), each storage once, as
    ``torch.save`` writes them (a view saves its whole storage)."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            return 0
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return obj.numel() * obj.element_size()
        key = (storage.device, storage.data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(state_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v, seen) for v in obj)
    return 0


def engine_bytes(engine) -> int:
    """What DeepSpeed's own files of this rank hold at least: the module's weights (not ZeRO-3's partitioned
    placeholders) and the optimizer's tensors."""
    seen: set = set()
    total = 0
    for t in list(engine.module.parameters()) + list(engine.module.buffers()):
        if not hasattr(t, "ds_numel"):
            total += state_bytes(t, seen)
    opt = getattr(engine, "optimizer", None)
    if opt is not None:
        inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            total += state_bytes(list(inner.state.values()), seen)
        for name in _FP32_PARTITIONS:
            total += state_bytes(getattr(opt, name, None), seen)
    return total


def check_free_space(folder: str, need_bytes: int, what: str) -> None:
    """Raise :class:`ShardStoreError` before writing when ``folder``'s disk has less than ``need_bytes`` free."""
    free = free_disk_bytes(folder)
    if need_bytes > free:
        raise ShardStoreError(f"cannot save the checkpoint to {folder}: it needs at least {_mib(need_bytes)} "
                              f"({what}) but its disk has {_mib(free)} free. Nothing was written; free space "
                              "there (older checkpoints) or pass a save_dir on a larger disk", folder)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that came up short for want of space."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _SHORT_WRITE_TEXTS)


@contextlib.contextmanager
def disk_full_reported(path: str, need_bytes: int, what: str) -> Iterator[None]:
    """Re-raise a disk-full failure of the writes in the block as a :class:`ShardStoreError` naming ``path``,
    the bytes needed and free; other errors pass unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if isinstance(e, ShardStoreError) or not is_disk_full(e):
            raise
        try:
            free = _mib(free_disk_bytes(path))
        except OSError:
            free = "an unknown amount"
        raise ShardStoreError(f"saving the checkpoint to {path} failed: its disk is full ({free} free; this save "
                              f"writes at least {_mib(need_bytes)}: {what}). The previous checkpoint and `latest` "
                              f"are untouched; free space there or pass a save_dir on a larger disk, and remove the "
                              f"partial folder {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                              path) from e


def remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
