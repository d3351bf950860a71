"""Whole-table gathers and re-partitioning of checkpoints across world sizes.

A partitioned checkpoint is one ``maximus_states_rank{r:05d}.pt`` per rank, each holding that rank's
rows plus the partition they were cut with. ``load_partitioned`` reads them one at a time and keeps
the rows this rank owns under the *current* partition, so a checkpoint written by N ranks loads on M.
A replicated or broadcast checkpoint (one ``maximus_states.pt`` with the whole table, no ``partition`` key)
loads the same way, so a run can also switch to the partitioned mode at a checkpoint.

Example::

    states = (safe_torch_load(p)["modules"]["model.embed_tokens"] for p in rank_files)
    emb.load_maximus_state_dicts(states)
"""
from __future__ import annotations

import glob
import os
from typing import Dict, Iterable, Iterator, List, Optional

import torch
from torch import Tensor

from ds_maximus.distributed.partition import RowPartition
from ds_maximus.engine.protocol import MaximusModule
from ds_maximus.errors import DistributedError, ShardStoreError
from ds_maximus.safe_load import safe_torch_load

RANK_FILE = "maximus_states_rank{rank:05d}.pt"
WHOLE_FILE = "maximus_states.pt"  # the replicated and broadcast modes' one file (ds_maximus.engine.runtime)


def rank_files(folder: str) -> List[str]:
    """The per-rank state files of a partitioned checkpoint folder, in rank order."""
    files = sorted(glob.glob(os.path.join(folder, "maximus_states_rank*.pt")))
    if not files:
        raise ShardStoreError(f"checkpoint {folder} has no maximus_states_rank*.pt files: it was not saved by a "
                              "partitioned maximus engine, or the files were removed", folder)
    return files


def iter_module_states(files: List[str], name: str, trust: bool = False,
                       first: Optional[dict] = None) -> Iterator[dict]:
    """Module ``name``'s state from each file, loading one file at a time (``weights_only``; see
    :mod:`ds_maximus.safe_load` for ``trust``). ``first``: what ``files[0]`` holds, when the caller has it
    already (that file is not read again)."""
    for i, f in enumerate(files):
        st = first if i == 0 and first is not None else safe_torch_load(f, trust=trust)
        if name not in st["modules"]:
            raise ShardStoreError(f"{f} has no state for module {name} (it has {sorted(st['modules'])})", f)
        yield st["modules"][name]


def gather_rows(module, local_table: Tensor) -> Tensor:
    """Assemble the whole table on every rank from each rank's local rows (collective)."""
    comm, part = module.comm, module.partition
    cap = max(part.num_local(r) for r in range(part.world))
    pad = torch.zeros(cap, local_table.shape[1], dtype=local_table.dtype)
    pad[: local_table.shape[0]] = local_table
    parts = comm.all_gather("gather table", pad)
    full = torch.empty(part.num_rows, local_table.shape[1], dtype=local_table.dtype)
    for r, t in enumerate(parts):
        ids = part.global_ids(r)
        full[ids] = t[: ids.numel()].cpu()
    return full


def load_partitioned(module, states: Iterable[dict]) -> None:
    """Keep the rows ``module``'s rank owns out of states saved under any partition."""
    part, rank = module.partition, module.rank
    n_local = module.owned.numel()
    local = module.local
    names = ("weight", *local.optimizer.state_names)
    tensors = {n: torch.zeros(n_local, module.embedding_dim) for n in names}
    last_step = torch.zeros(n_local, dtype=torch.long)
    covered = torch.zeros(n_local, dtype=torch.bool)
    opt = None
    for d in states:
        if (d["num_embeddings"] if "partition" not in d else d["partition"]["num_rows"]) != module.num_embeddings:
            rows = d["partition"]["num_rows"] if "partition" in d else d["num_embeddings"]
            raise ShardStoreError(f"checkpoint table has {rows} rows, this embedding {module.num_embeddings}; "
                                  "load it into a model of the same vocabulary size")
        p = d.get("partition") or {"num_rows": d["num_embeddings"], "world": 1, "block_rows": d["num_embeddings"],
                                   "rank": 0}
        old = RowPartition(p["num_rows"], p["world"], p["block_rows"])
        ids = old.global_ids(p["rank"])
        mine = part.owner(ids) == rank
        if not bool(mine.any()):
            continue
        dst = part.to_local(ids[mine])
        missing = [n for n in names if n not in d["tensors"]]
        if missing:
            raise ShardStoreError(f"checkpoint of rank {p['rank']} lacks optimizer tensors {missing}; was it saved "
                                  "with another optimizer type?")
        for n in names:
            tensors[n][dst] = d["tensors"][n][mine].float()
        last_step[dst] = d["optimizer"]["last_step"][mine]
        covered[dst] = True
        if opt is None:
            opt = d["optimizer"]
        elif int(opt["step"]) != int(d["optimizer"]["step"]):
            raise ShardStoreError(f"checkpoint ranks disagree on the optimizer step ({opt['step']} vs "
                                  f"{d['optimizer']['step']}): the files come from different saves")
    if not bool(covered.all()):
        lost = module.owned[~covered][:8].tolist()
        raise DistributedError(f"rank {rank}: the checkpoint holds no data for {int((~covered).sum())} of the rows "
                               f"this rank owns (first {lost}); are rank files missing from the folder?")
    local.load_maximus_state_dict({"num_embeddings": n_local, "embedding_dim": module.embedding_dim,
                                   "tensors": tensors, "optimizer": {**opt, "last_step": last_step}})


def load_partitioned_checkpoint(folder: str, modules: Dict[str, MaximusModule], trust: bool = False):
    """Load every module of a runtime from a checkpoint folder; returns ``(steps, skipped_steps)``.

    Each module takes its states from the per-rank files through
    :meth:`~ds_maximus.engine.protocol.MaximusModule.load_maximus_state_dicts`: partitioned modules
    re-partition them, other modules take rank 0's copy.
    """
    whole = os.path.join(folder, WHOLE_FILE)
    if not glob.glob(os.path.join(folder, "maximus_states_rank*.pt")) and os.path.isfile(whole):
        files = [whole]  # written in replicated or broadcast mode: the whole table, cut here by ownership
    else:
        files = rank_files(folder)
    head = safe_torch_load(files[0], trust=trust)
    for name, m in modules.items():
        m.load_maximus_state_dicts(iter_module_states(files, name, trust, first=head))
    return head["steps"], head["skipped_steps"]


def missing_whole_state(folder: str, path: str) -> ShardStoreError:
    """The error for a checkpoint folder without the replicated/broadcast modes' ``maximus_states.pt``: one saved
    in the partitioned mode is named as such (its table is cut into per-rank files, which those modes do not read)."""
    if glob.glob(os.path.join(folder, "maximus_states_rank*.pt")):
        return ShardStoreError(f"checkpoint {folder} was saved in the partitioned shard mode (one "
                               f"maximus_states_rank*.pt per rank, no {WHOLE_FILE}); the replicated and broadcast "
                               "modes read the whole table from one file. fix: resume it with maximus.distributed."
                               "shard_mode 'partitioned' (on any number of ranks)", path)
    return ShardStoreError(f"checkpoint {folder} has no {WHOLE_FILE}: it was not saved by a maximus engine, or the "
                           "file was removed", path)


def check_whole_state(folder: str) -> None:
    """Before DeepSpeed reads a checkpoint for the replicated or broadcast mode: a folder saved in the partitioned
    mode is refused with :func:`missing_whole_state` (DeepSpeed would otherwise stop at the table's weight missing
    from its module file, which the partitioned mode keeps in the per-rank files instead)."""
    ranks = glob.glob(os.path.join(folder, "maximus_states_rank*.pt"))
    if ranks and not os.path.isfile(os.path.join(folder, WHOLE_FILE)):
        raise missing_whole_state(folder, os.path.join(folder, WHOLE_FILE))

