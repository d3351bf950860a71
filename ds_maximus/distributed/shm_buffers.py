"""Remove, at exit, the shared-memory allreduce buffer DeepSpeed's CPU accelerator created for this process.

DeepSpeed's CPU communication op (``deepspeed/ops/csrc/cpu/comm/shm.cpp``) creates one 66 MiB
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` per rank when every rank
runs on one host, maps the other ranks' buffers too, and never unlinks its own: after many CPU runs they
fill the RAM-backed ``/dev/shm``. At exit this removes the one buffer that is this process's own: mapped by
this process (``/proc/self/maps``) and named with its rank. Other processes' buffers are never touched, and
a buffer that another live process still maps keeps its memory until that process exits.

Example::

    from ds_maximus.distributed import shm_buffers
    shm_buffers.remove_at_exit()   # once per process; ds_maximus.initialize calls it
"""
from __future__ import annotations

import atexit
import logging
import os
from typing import List, Optional

logger = logging.getLogger("ds_maximus")

SHM_DIR = "/dev/shm"
PREFIX = "deepspeed_allreduce_buffer_"
_registered = False


def _rank() -> Optional[int]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # at interpreter exit torch may be half torn down
        pass
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def mapped_buffers(maps_path: str = "/proc/self/maps") -> List[str]:
    """Names of the DeepSpeed allreduce buffers of this user that this process maps (its own and its peers')."""
    prefix = f"{PREFIX}{os.getuid()}_"
    names = set()
    try:
        with open(maps_path) as f:
            for line in f:
                parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(parts) < 6:
                    continue
                path = parts[5].strip().removesuffix(" (deleted)")
                if os.path.dirname(path) == SHM_DIR and os.path.basename(path).startswith(prefix):
                    names.add(os.path.basename(path))
    except OSError:
        return []
    return sorted(names)


def own_buffers(rank: Optional[int] = None, maps_path: str = "/proc/self/maps") -> List[str]:
    """The buffers among :func:`mapped_buffers` that this process created: the ones named with its rank."""
    rank = _rank() if rank is None else rank
    if rank is None:
        return []
    return [n for n in mapped_buffers(maps_path) if n.rsplit("_", 1)[-1] == str(rank)]


def remove_own_buffers() -> List[str]:
    """Unlink this process's own allreduce buffer(s); returns the names removed."""
    removed = []
    for name in own_buffers():
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:  # never fail an exit over housekeeping
            logger.debug("ds_maximus: could not remove %s: %s", name, e)
    return removed


def remove_at_exit() -> None:
    """Register :func:`remove_own_buffers` to run at interpreter exit (once per process)."""
    global _registered
    if not _registered and os.path.isdir(SHM_DIR):
        atexit.register(remove_own_buffers)
        _registered = True
