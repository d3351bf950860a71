"""``PartitionedEmbedding``: an embedding table whose rows are owned by the data-parallel ranks.

Each rank holds a local :class:`~ds_maximus.vocab.ShardedEmbedding` with only its own rows (see
:class:`RowPartition`), so its tiers, cache and optimizer state are about ``1/world`` of the table.
A lookup sends the batch's unique ids to their owners (all-to-all), the owners gather the rows from
their local table and send them back (all-to-all). In backward the per-id gradients go back to the
owners (all-to-all), which sum the duplicates from every rank, average over the ranks as DeepSpeed
does for dense gradients, and accumulate them; ``sparse_step`` then updates the owned rows only.

On one rank (a group of one) the table is the plain ``ShardedEmbedding``: the lookup, its backward, prefetch,
a tied head's rows and gradient and the whole-table reads call the local table directly, with no exchange, no
collective and no extra copy.

Example (under ``deepspeed --num_gpus 2``)::

    emb = PartitionedEmbedding(50000, 512, config=EmbeddingConfig(gpu_cache_rows=4096))
    out = emb(ids)                 # every rank calls it with its own ids (collective)
    out.sum().backward(); emb.sparse_step(lr=1e-3)
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Iterable, Optional, Union

import torch
from torch import Tensor, nn

from ds_maximus.config import EmbeddingConfig, MaximusConfig, OffloadDevice
from ds_maximus.distributed.collectives import Collectives
from ds_maximus.distributed.partition import RowPartition, default_block_rows
from ds_maximus.engine.protocol import MaximusModule, ModuleRole, align_adam_with_engine
from ds_maximus.errors import DistributedError
from ds_maximus.ops import rows_where
from ds_maximus.vocab.sharded_state import whole_table
from ds_maximus.vocab.table_view import WeightView


class _Exchange(torch.autograd.Function):
    """Forward: rows of ``plan``'s ids from their owners; backward: their grads to the owners."""

    @staticmethod
    def forward(ctx, anchor, rows_uniq, module, plan):
        ctx.module, ctx.plan = module, plan
        return rows_uniq.view_as(rows_uniq)

    @staticmethod
    def backward(ctx, grad_uniq):
        ctx.module._send_grads(ctx.plan, grad_uniq)
        return torch.zeros((), dtype=torch.float32, device=grad_uniq.device), None, None, None


class _Plan:
    """One lookup's routing: what this rank asked for and what it was asked for."""

    __slots__ = ("order", "send_splits", "recv_splits", "recv_local", "world", "pad_grad")

    def __init__(self, order, send_splits, recv_splits, recv_local, world, pad_grad=False):
        self.order, self.send_splits, self.recv_splits = order, send_splits, recv_splits
        self.recv_local, self.world = recv_local, world
        self.pad_grad = pad_grad   # the padding row takes its gradient (a read of .weight, not a lookup)


@dataclasses.dataclass
class OwnerStats:
    """What this rank saw as the owner of its rows: of the distinct rows the ranks' lookups asked of it, how many
    were already in (or on their way into) its cache when asked (``owner_hit_rate``: prefetch raises it), and
    the time it spent serving them from its local table (``owner_serve_ms``: fills included)."""

    asked_rows: int = 0
    ready_rows: int = 0
    serve_ms: float = 0.0
    last: dict = dataclasses.field(default_factory=dict)
    _mark: tuple = (0, 0, 0.0)

    def asked(self, cache, local_ids: Tensor) -> None:
        uniq = torch.unique(local_ids)
        self.asked_rows += int(uniq.numel())
        self.ready_rows += int((cache.slots_of(uniq) >= 0).sum())

    def served(self, ms: float) -> None:
        self.serve_ms += ms

    @staticmethod
    def _rates(asked: int, ready: int, ms: float) -> dict:
        return {"owner_hit_rate": ready / asked if asked else 0.0, "owner_rows_asked": int(asked),
                "owner_serve_ms": float(ms)}

    def end_step(self) -> None:
        a, r, ms = self._mark
        self.last = self._rates(self.asked_rows - a, self.ready_rows - r, self.serve_ms - ms)
        self._mark = (self.asked_rows, self.ready_rows, self.serve_ms)

    def as_dict(self) -> dict:
        return self._rates(self.asked_rows, self.ready_rows, self.serve_ms)


class _HeadGrads:
    """A tied head's gradient for a contiguous range of rows, from every rank to the rows' owners.

    The head computes a gradient for every row of each vocabulary chunk from this rank's tokens; the ranks'
    gradients are summed (all-reduce, every rank calls it for the same chunks in the same order), averaged
    over the ranks as DeepSpeed averages dense gradients, and each owner keeps its rows. The padding row is
    kept too: ``padding_idx`` stops only the lookup's gradient.
    """

    def __init__(self, module: "PartitionedEmbedding"):
        self.module = module

    def add(self, ids: Tensor, rows: Tensor) -> None:
        m = self.module
        lo, hi = int(ids[0]), int(ids[-1]) + 1
        if ids.numel() != hi - lo:
            raise ValueError(f"a tied head's gradient covers a contiguous range of rows, got {ids.numel()} ids "
                             f"over [{lo}, {hi})")
        total = m._sum_head_grads(rows)
        if total is not None:
            m._keep_head_grads(lo, hi, total)


class PartitionedEmbedding(WeightView, MaximusModule, nn.Module):
    """Row-partitioned embedding over the data-parallel group; implements the maximus module protocol.

    ``group`` defaults to DeepSpeed's data-parallel group; ``block_rows`` to about 16 blocks per rank.
    ``_weight`` (the full initial table, the same on every rank) is optional. Every call that moves
    rows (forward, backward, ``full_weight``, ``maximus_state_dict`` loading) is collective.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 config: Union[EmbeddingConfig, MaximusConfig, None] = None, device=None, dtype=None,
                 _weight: Optional[Tensor] = None, group=None, timeout_s: Optional[float] = None,
                 block_rows: Optional[int] = None):
        super().__init__()
        log_interval = None
        if isinstance(config, MaximusConfig):
            timeout_s = timeout_s or config.distributed.timeout_s
            log_interval = config.logging.interval_steps
            config = config.embedding
        config = config or EmbeddingConfig()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.padding_idx = None if padding_idx is None else padding_idx % self.num_embeddings
        self.comm = Collectives(group, timeout_s or 600.0)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.partition = self._make_partition(config, block_rows)
        if not self.comm.single:
            self._check_agreement()
        self.owned = self.partition.global_ids(self.rank)
        local_pad = None
        if self.padding_idx is not None and int(self.partition.owner(torch.tensor(self.padding_idx))) == self.rank:
            local_pad = int(self.partition.to_local(torch.tensor(self.padding_idx)))
        w = None
        if _weight is not None:
            w = _weight.detach()  # a rank that owns every row (one rank, a broadcast master) takes it whole
            if self.owned.numel() != self.num_embeddings:
                w = w.index_select(0, self.owned.to(w.device))
        # not a registered child: the model's state_dict (DeepSpeed's module checkpoint) must not carry a
        # rank's slice; the maximus state files hold the table (see ds_maximus/distributed/repartition.py)
        object.__setattr__(self, "local", self._make_local(config, local_pad, device, dtype, w, log_interval))
        self._anchor = torch.zeros((), requires_grad=True)
        self._anchor_fn = None
        self._last_comm = self.comm.stats()
        self._step_comm: dict = {}
        self.prefetches = 0  # look-aheads this rank took part in
        self.owner = OwnerStats()

    def _make_partition(self, config: EmbeddingConfig, block_rows: Optional[int]):
        """Which rank owns which rows: round-robin blocks (:class:`RowPartition`)."""
        return RowPartition(self.num_embeddings, self.world,
                            block_rows or default_block_rows(self.num_embeddings, self.world, config.rows_per_shard))

    def _make_local(self, config: EmbeddingConfig, padding_idx, device, dtype, weight, log_interval):
        """This rank's table of its owned rows; an NVMe store in a folder of its own (``rank{r:05d}``)."""
        from ds_maximus.vocab import ShardedEmbedding
        if config.offload.device == OffloadDevice.NVME and config.offload.nvme_path:
            config = copy.deepcopy(config)  # each rank's store holds only its rows
            config.offload.nvme_path = os.path.join(config.offload.nvme_path, f"rank{self.rank:05d}")
        return ShardedEmbedding(self.owned.numel(), self.embedding_dim, padding_idx, config, device=device,
                                dtype=dtype, _weight=weight, log_interval_steps=log_interval)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, config=None, **kwargs) -> "PartitionedEmbedding":
        w = embedding.weight
        kwargs.setdefault("device", w.device)
        kwargs.setdefault("dtype", w.dtype)
        return cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, config,
                   _weight=w.detach(), **kwargs)

    def _check_agreement(self) -> None:
        sig = torch.cat([self.partition.signature(), torch.tensor([self.embedding_dim])])
        sigs = self.comm.all_gather("partition agreement", sig)
        bad = [r for r, s in enumerate(sigs) if not torch.equal(s, sig)]
        if bad:
            raise DistributedError(f"ranks disagree on the partition of the table: rank {self.rank} has "
                                   f"(rows, world, block_rows, dim)={sig.tolist()}, ranks {bad} have "
                                   f"{[sigs[r].tolist() for r in bad]}; fix: build the model identically on "
                                   "every rank")

    # -- nn.Module plumbing -------------------------------------------------------------------------------
    @property
    def out_dtype(self) -> torch.dtype:
        return self.local.out_dtype

    def read_rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` (CPU long, in range) of the whole table on the compute device in the output dtype, from their
        owners; under grad mode their gradient goes back to the owners, the padding row's too (a read of the
        weight, not a lookup). Collective, as a lookup is: every rank reads (model code reads the same rows on every
        rank; the ids may differ)."""
        if self.comm.single:
            return self.local.read_rows(ids)
        uniq, inverse = torch.unique(ids.to("cpu", torch.long), sorted=True, return_inverse=True)
        rows = self._rows_from_owners(uniq, torch.is_grad_enabled(), pad_grad=True)
        return rows.index_select(0, inverse.to(rows.device))

    def compute_weight(self) -> Tensor:
        """The whole ``[V, d]`` table on the compute device (every row from its owner; differentiable into the
        owners' rows): what ``.weight`` gives code that uses it as a tensor. Collective; costs a dense table."""
        return self.read_rows(torch.arange(self.num_embeddings))

    @property
    def compute_device(self) -> torch.device:
        return self.local.compute_device

    @property
    def optimizer(self):
        return self.local.optimizer

    def _apply(self, fn, recurse=True):
        """``.to()/.half()`` reach the local table's cache and output dtype (the fp32 rows stay)."""
        self.local._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A whole table under ``<prefix>weight`` (a replicated or broadcast checkpoint's module file, an HF state
        dict): this rank keeps its own rows. Optional: the module's own state dict holds no table (the maximus
        state files do, and a checkpoint resume loads them after this)."""
        key = prefix + "weight"
        if key in state_dict:
            w = whole_table(state_dict, key, (self.num_embeddings, self.embedding_dim), error_msgs)
            if w is not None:
                mine = w.detach().to("cpu").index_select(0, self.owned)
                self.local._load_from_state_dict({key: mine}, prefix, local_metadata, strict, [], [], error_msgs)
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rank={self.rank}/{self.world}, {self.partition}"

    # -- forward / backward --------------------------------------------------------------------------------
    def forward(self, input: Tensor) -> Tensor:
        if self.comm.single:
            return self._forward_local(input)
        dev = self.compute_device
        flat = input.reshape(-1).to(dev, torch.long)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        rows_uniq = self._rows_from_owners(uniq.cpu(), torch.is_grad_enabled())
        return rows_uniq.index_select(0, inverse).view(*input.shape, self.embedding_dim)

    def _rows_from_owners(self, uniq: Tensor, track: bool, pad_grad: bool = False) -> Tensor:
        """Rows of sorted unique ids ``uniq`` (CPU) from their owners (collective), in ``uniq``'s order; ``track``:
        their gradient goes back to the owners (``pad_grad``: the padding row's too)."""
        from ds_maximus.vocab.function import lookup
        dev = self.compute_device
        self.comm.step = self.local.optimizer.step
        order, send_splits, recv_splits, recv_local = self._route(uniq, "")
        if recv_local.numel():
            t0 = time.perf_counter()
            self.owner.asked(self.local.cache, recv_local)
            rows, local_uniq, local_inv = lookup(self.local, recv_local, pin=track)
            self.owner.served((time.perf_counter() - t0) * 1e3)
        else:
            rows = torch.zeros(0, self.embedding_dim, dtype=self.local.out_dtype, device=dev)
        got = self.comm.all_to_all("rows from owners", rows.detach(), recv_splits, send_splits, defer=True).to(dev)
        rows_uniq = torch.empty_like(got)
        rows_uniq[order.to(dev)] = got
        if track:
            plan = _Plan(order, send_splits, recv_splits, recv_local, self.world, pad_grad)
            anchor = self._anchor_fn() if self._anchor_fn is not None else self._anchor
            rows_uniq = _Exchange.apply(anchor, rows_uniq, self, plan)
        return rows_uniq

    def _forward_local(self, input: Tensor) -> Tensor:
        """One rank owns every row: the local table's own lookup and backward. Its cache serves this rank alone,
        so the owner figures are its counters."""
        t0 = time.perf_counter()
        out = self.local(input)
        counters = self.local.cache.counters
        self.owner.asked_rows, self.owner.ready_rows = int(counters.lookups), int(counters.hits)
        self.owner.served((time.perf_counter() - t0) * 1e3)
        return out

    def _route(self, uniq: Tensor, what: str):
        """Send sorted unique ids ``uniq`` (CPU) to their owners (collective); returns ``(order, send_splits,
        recv_splits, recv_local)``: the owner-sorted order of ``uniq``, the split sizes both ways, and the local
        rows this rank was asked for (in the order of the asking ranks). ``what`` prefixes the collectives'
        names ("prefetch" for a look-ahead)."""
        pre = f"{what} " if what else ""
        bad = uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.num_embeddings)
        owners = self.partition.owner(uniq)
        order = torch.argsort(owners, stable=True)
        counts = torch.bincount(owners, minlength=self.world)
        if bad:  # tell every rank (a count of -1) so they all fail now instead of waiting for us
            counts = torch.full((self.world,), -1, dtype=torch.long)
        recv_counts = self.comm.exchange_counts(f"{pre}id counts", counts)
        if bad or bool((recv_counts < 0).any()):
            who = [r for r in range(self.world) if int(recv_counts[r]) < 0]
            first = int(uniq[0]) if bad and int(uniq[0]) < 0 else (int(uniq[-1]) if bad else None)
            msg = (f"token id {first} on rank {self.rank} is outside the table [0, {self.num_embeddings})"
                   if bad else f"rank(s) {who} looked up token ids outside the table [0, {self.num_embeddings})")
            raise DistributedError(f"PartitionedEmbedding: {msg}; no rank holds rows for them. fix: check the "
                                   "tokenizer / TokenMap matches the model's vocabulary")
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()
        asked = self.comm.all_to_all(f"{pre}ids to owners", uniq[order], send_splits, recv_splits).cpu()
        if asked.numel() and bool((self.partition.owner(asked) != self.rank).any()):
            wrong = asked[self.partition.owner(asked) != self.rank][:4].tolist()
            raise DistributedError(f"rank {self.rank} was asked for rows {wrong} it does not own ({self.partition}); "
                                   "ranks route ids with different partitions")
        return order, send_splits, recv_splits, self.partition.to_local(asked)

    def _send_grads(self, plan: _Plan, grad_uniq: Tensor) -> None:
        """Backward of one lookup: per-id grads to their owners, who sum, average and accumulate them."""
        g = grad_uniq.float().index_select(0, plan.order.to(grad_uniq.device))
        got = self.comm.all_to_all("row grads to owners", g, plan.send_splits, plan.recv_splits)
        if plan.recv_local.numel() == 0:
            return
        got = got.to(self.compute_device) / plan.world  # DeepSpeed averages dense grads over ranks: so do we
        uniq, inv = torch.unique(plan.recv_local, sorted=True, return_inverse=True)
        rows = torch.zeros(uniq.numel(), self.embedding_dim, dtype=torch.float32, device=got.device)
        rows.index_add_(0, inv.to(got.device), got)
        pad = self.local.padding_idx
        if pad is not None and not plan.pad_grad:
            keep = uniq != pad
            uniq, rows = uniq[keep], rows_where(rows, keep)
        self.local._accumulate(uniq, rows)

    # -- the maximus module protocol (local: each rank's owned rows) ------------------------------------------
    role = ModuleRole.ROWS

    @property
    def owns_partition(self) -> bool:
        """Each rank holds the gradient of its own rows: the backward sent every row's gradient to its owner."""
        return True

    def reduce_grads(self, group=None) -> None:
        """Nothing to sum: each row's gradient is already at its owner, summed over the ranks."""

    def reduce_norm_sq(self, local: Tensor) -> Tensor:
        """The global squared norm: every rank's share of the rows, summed."""
        return self.comm.all_reduce("sparse grad norm", local)

    def configure_from_engine(self, engine, cfg: MaximusConfig) -> None:
        """The local table's optimizer betas/eps follow DeepSpeed's unless ``embedding.optimizer`` sets them."""
        align_adam_with_engine(self.optimizer, engine, cfg.embedding.optimizer)

    def train_padding_row(self) -> None:
        """A tied head's gradient reaches the ``padding_idx`` row: the local table's optimizer updates it too."""
        self.optimizer.frozen_row = None

    def set_grad_anchor(self, fn) -> None:
        self._anchor_fn = fn
        self.local.set_grad_anchor(fn)  # the one-rank path's lookup is the local table's

    def sparse_grads(self):
        """Owned accumulated grads as ``(global ids, rows)``."""
        ids, rows = self.local.sparse_grads()
        return self.owned.index_select(0, ids), rows

    def set_sparse_grads_(self, ids: Tensor, rows: Tensor) -> None:
        ids = ids.to("cpu", torch.long)
        if ids.numel() and bool((self.partition.owner(ids) != self.rank).any()):
            raise DistributedError(f"set_sparse_grads_ on rank {self.rank} got ids it does not own")
        self.local.set_sparse_grads_(self.partition.to_local(ids), rows)

    def sparse_grad_norm_sq(self) -> Tensor:
        """Squared norm of this rank's OWNED grads (sum it over ranks for the global norm)."""
        return self.local.sparse_grad_norm_sq()

    def scale_sparse_grads_(self, factor: float) -> None:
        self.local.scale_sparse_grads_(factor)

    def sparse_grads_finite(self) -> bool:
        return self.local.sparse_grads_finite()

    def take_zero_grad_steps(self, steps: int, lr: Optional[float], weight_decay: Optional[float]) -> None:
        """As :meth:`ShardedEmbedding.take_zero_grad_steps`: steps that touch no row (every rank takes them)."""
        if not self.optimizer.lazy:
            for _ in range(int(steps)):
                self.sparse_step(lr, weight_decay)

    def sparse_step(self, lr: Optional[float] = None, weight_decay: Optional[float] = None) -> None:
        self.comm.settle()
        self.local.sparse_step(lr, weight_decay)
        self.owner.end_step()
        now = self.comm.stats()
        self._step_comm = {k: now[k] - self._last_comm[k] for k in now}
        self._last_comm = now

    def zero_sparse_grads(self) -> None:
        self.local.zero_sparse_grads()

    def prefetch(self, ids: Tensor) -> None:
        """Exact prefetch of an upcoming batch (collective: every rank calls it with its own next batch).

        The batch's unique ids go to their owners now, one step ahead, routed exactly as the batch's forward
        will route them; each owner stages the rows it was asked for in its local cache
        (:meth:`ShardedEmbedding.prefetch`), so when the forward asks for them they are resident: the owner's
        lookup adopts the staged set (its hit rate counts them as hits) instead of filling them then.
        Only the rows' staging moves ahead: the forward exchanges ids and rows as before.
        """
        if self.comm.single:
            self.local.prefetch(ids)
            self.prefetches += 1
            return
        uniq = torch.unique(ids.detach().reshape(-1).to("cpu", torch.long), sorted=True)
        self.comm.step = self.local.optimizer.step
        _, _, _, recv_local = self._route(uniq, "prefetch")
        if recv_local.numel():
            self.local.prefetch(recv_local)
        self.prefetches += 1

    def flush(self) -> None:
        self.local.flush()

    def tier_bytes(self) -> int:
        """Bytes of this rank's table tier (rows + optimizer state): about 1/world of the whole table."""
        return self.local.tier.nbytes()

    def table_bytes(self) -> int:
        """Bytes this rank holds for the table: tier, row cache and per-row optimizer counters."""
        cache = sum(t.numel() * t.element_size() for t in self.local.cache.storage.values())
        return self.tier_bytes() + cache + self.local.optimizer.last_step.numel() * 8

    def stats(self) -> dict:
        s = dict(self.local.stats())
        s.update(self.comm.stats())
        s["table_bytes"], s["tier_bytes"] = self.table_bytes(), self.tier_bytes()
        # hit_rate and stall_ms (from the local table) are this rank's, as the owner of its rows
        s["rank"], s["world"], s["prefetches"] = self.rank, self.world, self.prefetches
        s.update(self.owner.as_dict())
        s["last_step"].update(self.owner.last)
        s["last_step"] = {**s.get("last_step", {}), **self._step_comm}
        return s

    # -- whole table (collective) --------------------------------------------------------------------------
    def full_weight(self) -> Tensor:
        """The whole table, fp32 on CPU, on every rank (collective: all ranks must call it)."""
        from ds_maximus.distributed.repartition import gather_rows
        if self.comm.single:
            return self.local.full_weight()
        return gather_rows(self, self.local.full_weight())

    def _owned_range(self, lo: int, hi: int):
        """This rank's rows among global ``[lo, hi)``: their positions in the range and their local rows, which
        are one contiguous local range (a rank stores its blocks in global order)."""
        ids = torch.arange(lo, hi)
        mine = self.partition.owner(ids) == self.rank
        if not bool(mine.any()):
            return mine, None, None
        local = self.partition.to_local(ids[mine])
        return mine, int(local[0]), int(local[-1]) + 1

    def keep_step_rows(self, mode: str) -> None:
        """A tied head's ``reuse_rows``: on one rank the local table leaves its stepped rows on the device for the
        head (``ShardedEmbedding.keep_step_rows``); across ranks the head's rows come through a collective."""
        self.local.keep_step_rows(mode if self.comm.single else "off")

    def release_step_rows(self) -> None:
        self.local.release_step_rows()

    def stage_rows_for_compute(self, lo: int, hi: int, device=None) -> None:
        """A tied head's hint that :meth:`rows_for_compute` of ``[lo, hi)`` comes next: on one rank the local table
        copies the span ahead; across ranks the rows come through a collective on the host, with nothing to stage."""
        if self.comm.single:
            self.local.stage_rows_for_compute(lo, hi, device)

    def rows_for_compute(self, lo: int, hi: int, device=None, dtype=None) -> Tensor:
        """Rows ``[lo, hi)`` as they are now (a tied head's chunk), on every rank (collective): each owner
        contributes its rows, the others zeros, summed (exact: one non-zero term per element)."""
        if self.comm.single:
            return self.local.rows_for_compute(lo, hi, device, dtype)
        mine, a, b = self._owned_range(lo, hi)
        buf = torch.zeros(hi - lo, self.embedding_dim, dtype=torch.float32)
        if a is not None:
            buf[mine] = self.local.rows_for_compute(a, b, torch.device("cpu"), torch.float32)
        w = self.comm.all_reduce("head rows", buf)
        return w.to(device or self.compute_device, dtype or self.local.out_dtype)

    @property
    def grad(self) -> "_HeadGrads":
        """Where a tied head adds its gradient for rows of the table (``grad.add(ids, rows)``, as on a
        ``ShardedEmbedding``); collective here: see :class:`_HeadGrads`. On one rank, the local table's."""
        return self.local.grad if self.comm.single else _HeadGrads(self)

    def add_head_grad_(self, ids: Tensor, grad: Tensor) -> None:
        """A tied head's gradient for rows ``ids`` (a contiguous chunk of the vocabulary, after the chunks before it):
        on one rank into the local table's (its kept memory on a GPU); across ranks summed to the rows' owners
        (:class:`_HeadGrads`)."""
        if self.comm.single:
            self.local.add_head_grad_(ids, grad)
        else:
            _HeadGrads(self).add(ids, grad)

    def _sum_head_grads(self, rows: Tensor) -> Optional[Tensor]:
        """A tied head's chunk gradient summed over the ranks (every rank computes one) and averaged."""
        return self.comm.all_reduce("head grads", rows.detach().float().cpu()) / self.world

    def _keep_head_grads(self, lo: int, hi: int, total: Tensor) -> None:
        """This rank's rows of a tied head's gradient ``total`` for rows ``[lo, hi)``."""
        mine, a, b = self._owned_range(lo, hi)
        if a is not None:
            self.local.grad.add(torch.arange(a, b), total[mine].to(self.compute_device))

    # -- checkpoints ---------------------------------------------------------------------------------------
    def maximus_state_dict(self) -> dict:
        """This rank's rows: local table, optimizer state, and the partition they were cut with."""
        d = self.local.maximus_state_dict()
        d["partition"] = {"num_rows": self.num_embeddings, "world": self.world,
                          "block_rows": self.partition.block_rows, "rank": self.rank}
        return d

    def load_maximus_state_dict(self, d: dict) -> None:
        """Load a state saved by the same rank of the same partition (else use ``load_maximus_state_dicts``)."""
        self.load_maximus_state_dicts([d])

    def load_maximus_state_dicts(self, states: Iterable[dict]) -> None:
        """Re-partition states saved by any number of ranks (an iterable: one rank's dict at a time)."""
        from ds_maximus.distributed.repartition import load_partitioned
        load_partitioned(self, states)
