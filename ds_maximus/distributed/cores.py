"""Ranks of one host share its cores.

Every rank that the ``deepspeed`` launcher starts on a host would otherwise run PyTorch's and maximus'
CPU work (row gathers from the pinned tier, write-backs, the CPU optimizer ops) on all of the host's
cores, so N ranks run N x cores threads that spin against each other. Measured with
``benchmarks/bench_distributed_embedding.py --ranks 1,2 --vocab 8192 --dim 32 --tokens 1024 --steps 4
--cache-frac 0.3`` on the 2-core CI machine (2 gloo ranks), before -> after: 17.4 -> 6.4-10.6 ms per step
(replicated), 37.3 -> 7.3-7.6 ms (partitioned). torchrun sets ``OMP_NUM_THREADS=1``
for the same reason; the deepspeed launcher does so only with ``--bind_cores_to_rank``.

Example::

    share_host_cores()   # under `deepspeed --num_gpus 2` on 32 cores: 16 intra-op threads per rank
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger("ds_maximus")


def local_world_size() -> int:
    """Ranks on this host: torchrun's ``LOCAL_WORLD_SIZE`` or the deepspeed launcher's ``LOCAL_SIZE``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share_host_cores() -> Optional[int]:
    """Cap this rank's intra-op threads at cores / ranks on the host; returns the cap, or None if unchanged
    (one rank per host, or ``OMP_NUM_THREADS`` set by the user: theirs wins)."""
    local = local_world_size()
    if local <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    n = max(1, host_cores() // local)
    if torch.get_num_threads() > n:
        torch.set_num_threads(n)  # also OpenMP's, which the maximus CPU ops use
        logger.info("ds_maximus: %d ranks on this host share its %d cores: %d CPU threads per rank "
                    "(set OMP_NUM_THREADS to choose)", local, host_cores(), n)
    return n
