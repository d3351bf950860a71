"""Which checkpoints move between rank counts, and the error that says so where DeepSpeed refuses.

The maximus part of a checkpoint moves between data-parallel world sizes in every shard mode: a replicated or
broadcast checkpoint holds the whole table in one file, a partitioned one is re-partitioned row by row
(:mod:`ds_maximus.distributed.repartition`). DeepSpeed's own part decides the rest:

=============  ==========================================================================================
ZeRO stage     checkpoint written by N ranks, loaded by M != N ranks
=============  ==========================================================================================
0              loads (the optimizer state is whole on every rank)
1, 2, 3        DeepSpeed refuses: its optimizer state is partitioned by rank and it does not re-partition
               it; the :class:`~ds_maximus.errors.DistributedError` below names both world sizes and the ways on
=============  ==========================================================================================

Example::

    try:
        load_path, state = orig_load_checkpoint(load_dir, tag=tag)
    except Exception as e:
        err = zero_world_size_error(e, engine, load_dir, tag)
        if err is None:
            raise
        raise err from e
"""
from __future__ import annotations

import os
from typing import Optional

from ds_maximus.errors import DistributedError


def zero_world_size_error(err: BaseException, engine, load_dir: str, tag) -> Optional[DistributedError]:
    """A :class:`DistributedError` for DeepSpeed's refusal to load a ZeRO-1/2/3 checkpoint written by another
    number of data-parallel ranks, or None when ``err`` is something else."""
    try:
        from deepspeed.runtime.zero.utils import ZeRORuntimeException
    except ImportError:  # an older DeepSpeed: nothing to translate
        return None
    saved = getattr(engine, "loaded_checkpoint_dp_world_size", None)
    now = getattr(engine, "seq_dp_world_size", None) or getattr(engine, "dp_world_size", None)
    if not isinstance(err, ZeRORuntimeException) or saved is None or now is None or int(saved) == int(now):
        return None
    stage = engine.zero_optimization_stage()
    folder = os.path.join(load_dir, str(tag)) if tag is not None else load_dir
    return DistributedError(
        f"checkpoint {folder} was written by {saved} data-parallel ranks and this run has {now}: under ZeRO stage "
        f"{stage} DeepSpeed partitions the optimizer state by rank and does not re-partition it for another number "
        f"of ranks (the maximus tables would move, in every shard mode). fix: resume with {saved} ranks, or train "
        "with ZeRO stage 0, whose checkpoints load on any number of ranks")
