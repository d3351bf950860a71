"""``broadcast`` shard mode: one rank (``distributed.master_rank``) holds the table; the others hold no rows.

For setups where only one rank can read the table's store (one node with the NVMe, or the only rank with access
to a network file system), or where a host has less memory than ranks x table. The master builds its
``ShardedEmbedding`` on the configured tier (NVMe store included) with the whole table and its optimizer state;
every other rank holds none of it. A lookup sends the batch's unique ids to the master, which serves the rows
from its cache and tier and sends them back; in backward the per-id gradients go to the master, which sums
the ranks' gradients of each row, averages them over the ranks (as DeepSpeed averages dense gradients) and
steps the rows. This is the partitioned mode's exchange with one owner (:class:`MasterPartition`), so the math
is that of one rank with the whole global batch.

Memory per rank: the master holds the table, its optimizer state and its row cache (``V x d x 4 x 3`` bytes
for fp32 AdamW, plus the cache), the others only the rows of the batch in flight (received per lookup, not kept),
where a copy of the table on every rank would hold all of it on each. Checkpoints are written and read by the
master alone: loading sends the other ranks only the table's step counters (and other modules' states whole).

Example::

    ds_config["maximus"]["distributed"] = {"shard_mode": "broadcast", "master_rank": 0}
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
"""
from __future__ import annotations

import copy
import os
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_maximus.config import EmbeddingConfig, MaximusConfig
from ds_maximus.distributed.collectives import Collectives
from ds_maximus.distributed.partition import MasterPartition
from ds_maximus.distributed.partitioned_embedding import PartitionedEmbedding
from ds_maximus.errors import ConfigError, DistributedError, ShardStoreError

HELD_BY_MASTER = "held_by_master"  # a state key: the table's rows stay on the master when it is loaded


def _check_master(master: int, comm: Collectives) -> int:
    if not 0 <= master < comm.world:
        raise ConfigError(f"maximus.distributed.master_rank={master} but the data-parallel group has {comm.world} "
                          f"ranks; use a rank in [0, {comm.world})", "maximus.distributed.master_rank")
    return master


class NoRows:
    """The local table of a rank that owns no rows (a broadcast mode's other ranks): no tier, no cache, no
    optimizer state; its step counter advances with the master's, for the collectives' error messages."""

    def __init__(self, num_rows: int, embedding_dim: int, config: EmbeddingConfig, device, dtype):
        from ds_maximus.optim import RowOptimizer
        self.num_embeddings, self.embedding_dim = 0, int(embedding_dim)
        self.table_rows = int(num_rows)  # the whole table's, for the stats' row sparsity
        self.padding_idx = None
        self.compute_device = torch.device(device) if device is not None else torch.device("cpu")
        self.out_dtype = dtype or torch.get_default_dtype()
        self.optimizer = RowOptimizer(config.optimizer, 0)
        self.steps = 0

    def _apply(self, fn, recurse=True):
        probe = fn(torch.zeros(1, dtype=self.out_dtype, device=self.compute_device))
        if probe.is_floating_point():
            self.out_dtype = probe.dtype
        self.compute_device = probe.device

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        pass  # no rows to load

    def set_grad_anchor(self, fn) -> None:
        pass  # no lookup of its own

    def sparse_grads(self):
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, self.embedding_dim, device=self.compute_device)

    def set_sparse_grads_(self, ids: Tensor, rows: Tensor) -> None:
        if ids.numel():
            raise DistributedError(f"a rank that holds no rows of the table got gradients for {ids.numel()} rows")

    def sparse_grad_norm_sq(self) -> Tensor:
        return torch.zeros((), device=self.compute_device)

    def scale_sparse_grads_(self, factor: float) -> None:
        pass

    def sparse_grads_finite(self) -> bool:
        return True

    def zero_sparse_grads(self) -> None:
        pass

    def sparse_step(self, lr: Optional[float] = None, weight_decay: Optional[float] = None) -> None:
        self.optimizer.begin_step(lr, weight_decay)
        self.steps += 1

    def flush(self) -> None:
        pass

    def load_step(self, optimizer_state: dict) -> None:
        """Take the master's step counter and lr history (the rows stay on the master)."""
        self.optimizer.step = int(optimizer_state["step"])
        if "lr_history" in optimizer_state:
            self.optimizer.lr_hist = [float(x) for x in optimizer_state["lr_history"].tolist()]
            self.optimizer.wd_hist = [float(x) for x in optimizer_state["wd_history"].tolist()]

    def stats(self) -> dict:
        zero = {"hit_rate": 0.0, "lookups": 0, "rows_fetched": 0, "rows_evicted": 0, "bytes_h2d": 0, "bytes_d2h": 0,
                "stall_ms": 0.0, "overflow_rows": 0, "overflow_batches": 0, "row_sparsity": 0.0}
        return {**zero, "steps": self.steps, "last_step": dict(zero)}


class BroadcastEmbedding(PartitionedEmbedding):
    """An embedding table held by one rank of the data-parallel group, ``master_rank``; the other ranks' lookups
    and gradients go to it (collective: every rank calls forward and backward).

    Example (under ``deepspeed --num_gpus 2``)::

        emb = BroadcastEmbedding(50000, 512, config=EmbeddingConfig(gpu_cache_rows=4096), master_rank=0)
        out = emb(ids)                 # every rank calls it with its own ids
        out.sum().backward(); emb.sparse_step(lr=1e-3)
        emb.table_bytes()              # the whole table's bytes on rank 0, 0 on the others
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 config: Union[EmbeddingConfig, MaximusConfig, None] = None, device=None, dtype=None,
                 _weight: Optional[Tensor] = None, group=None, timeout_s: Optional[float] = None,
                 master_rank: Optional[int] = None):
        if master_rank is None:
            master_rank = config.distributed.master_rank if isinstance(config, MaximusConfig) else 0
        object.__setattr__(self, "master", int(master_rank))  # read by _make_partition, before nn.Module's init
        super().__init__(num_embeddings, embedding_dim, padding_idx, config, device, dtype, _weight, group,
                         timeout_s)

    def _make_partition(self, config: EmbeddingConfig, block_rows: Optional[int]):
        return MasterPartition(self.num_embeddings, self.world, _check_master(self.master, self.comm))

    def _make_local(self, config: EmbeddingConfig, padding_idx, device, dtype, weight, log_interval):
        """The master's table on the configured tier (its NVMe store where it is configured); nothing elsewhere."""
        from ds_maximus.vocab import ShardedEmbedding
        if self.rank != self.master:
            return NoRows(self.num_embeddings, self.embedding_dim, config, device, dtype)
        return ShardedEmbedding(self.num_embeddings, self.embedding_dim, padding_idx, config, device=device,
                                dtype=dtype, _weight=weight, log_interval_steps=log_interval)

    @property
    def is_master(self) -> bool:
        return self.rank == self.master

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rank={self.rank}/{self.world}, master={self.master}"

    # -- bytes held ------------------------------------------------------------------------------------------
    def tier_bytes(self) -> int:
        """Bytes of this rank's table tier: the whole table's on the master, 0 elsewhere."""
        return super().tier_bytes() if self.is_master else 0

    def table_bytes(self) -> int:
        """Bytes this rank holds for the table (tier, row cache, per-row counters): 0 on the other ranks."""
        return super().table_bytes() if self.is_master else 0

    def stats(self) -> dict:
        s = super().stats()
        s["master"] = self.master
        return s

    # -- whole table (collective) ----------------------------------------------------------------------------
    def full_weight(self) -> Tensor:
        """The whole table, fp32 on CPU, on every rank (collective: the master sends it; for exports)."""
        w = self.local.full_weight() if self.is_master else torch.empty(self.num_embeddings, self.embedding_dim)
        return self.comm.broadcast("whole table", w, self.master)

    def keep_step_rows(self, mode: str) -> None:
        """Nothing to keep: the head's rows come from the master through a collective on the host."""

    def release_step_rows(self) -> None:
        """Nothing kept."""

    def stage_rows_for_compute(self, lo: int, hi: int, device=None) -> None:
        """Nothing to stage: the rows come from the master through a collective on the host."""

    def rows_for_compute(self, lo: int, hi: int, device=None, dtype=None) -> Tensor:
        """Rows ``[lo, hi)`` as they are now (a tied head's chunk), on every rank (collective: from the master)."""
        if self.is_master:
            buf = self.local.rows_for_compute(lo, hi, torch.device("cpu"), torch.float32)
        else:
            buf = torch.empty(hi - lo, self.embedding_dim, dtype=torch.float32)
        w = self.comm.broadcast("head rows", buf, self.master)
        return w.to(device or self.compute_device, dtype or self.local.out_dtype)

    def _sum_head_grads(self, rows: Tensor) -> Optional[Tensor]:
        """A tied head's chunk gradient summed over the ranks at the master, averaged (None elsewhere)."""
        total = self.comm.reduce("head grads", rows.detach().float().cpu(), self.master)
        return total / self.world if self.is_master else None

    # -- checkpoints: the master's (the module's own state dict holds no table, as in the partitioned mode) ------
    def maximus_state_dict(self) -> dict:
        """The whole table with its optimizer state, as a replicated table writes it (on the master only), marked
        ``"held_by_master"`` so that loading sends the other ranks its step counters only."""
        if not self.is_master:
            raise DistributedError(f"rank {self.rank} holds no rows of a broadcast table: its state is the master's "
                                   f"(rank {self.master}); the engine saves it there")
        return {**self.local.maximus_state_dict(), HELD_BY_MASTER: True}

    def load_maximus_state_dict(self, d: dict) -> None:
        """A whole table's state (replicated or broadcast checkpoint) on the master; the others take its step."""
        if self.is_master:
            self.local.load_maximus_state_dict(d)
        else:
            self.local.load_step(d["optimizer"])

    def load_maximus_state_dicts(self, states: Iterable[dict]) -> None:
        """States saved by any number of ranks in the partitioned mode: the master keeps every row."""
        if self.is_master:
            super().load_maximus_state_dicts(states)
        else:
            self.local.load_step(next(iter(states))["optimizer"])


def broadcast_embedding(old: nn.Embedding, cfg: MaximusConfig) -> BroadcastEmbedding:
    """The broadcast mode's table for ``old`` (collective): the master keeps ``old``'s rows, the others none."""
    return BroadcastEmbedding.from_embedding(old, cfg, master_rank=cfg.distributed.master_rank)


def _step_only(state: dict) -> dict:
    """A table's checkpoint state without its rows: what a rank that holds none needs (the step counters)."""
    opt = state["optimizer"]
    return {"optimizer": {k: opt[k] for k in ("step", "lr_history", "wd_history") if k in opt}}


def load_broadcast_state(path: str, cfg: MaximusConfig, group=None, trust: bool = False,
                         modules: Optional[dict] = None) -> dict:
    """The master reads the checkpoint state file at ``path`` (``weights_only``; see :mod:`ds_maximus.safe_load`
    for ``trust``) and sends every rank what it holds: the other modules' states whole, and of each broadcast
    table (a state a :class:`BroadcastEmbedding` wrote, or one of the ``modules`` that is one) only its step
    counters. The master keeps the whole state."""
    from ds_maximus.safe_load import safe_torch_load
    comm = Collectives(group, cfg.distributed.timeout_s)
    master = _check_master(cfg.distributed.master_rank, comm)
    tables = {n for n, m in (modules or {}).items() if isinstance(m, BroadcastEmbedding)}
    state, box = None, [None]
    if comm.rank == master:
        state = safe_torch_load(path, trust=trust) if os.path.exists(path) else None
        if state is not None:
            light = copy.copy(state)
            light["modules"] = {n: _step_only(s) if n in tables or (isinstance(s, dict) and s.get(HELD_BY_MASTER))
                                else s for n, s in state["modules"].items()}
            box = [light]
    if comm.world > 1:
        src = dist.get_global_rank(comm.group, master) if comm.group is not dist.group.WORLD else master
        dist.broadcast_object_list(box, src=src, group=comm.group)
    if box[0] is None:
        from ds_maximus.distributed.repartition import missing_whole_state
        err = missing_whole_state(os.path.dirname(path), path)
        raise ShardStoreError(f"on the master rank {master}: {err}", path)
    return state if comm.rank == master else box[0]
