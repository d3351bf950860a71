"""``ShardedEmbedding``: an ``nn.Embedding`` whose table lives in the CPU tier (or on NVMe) and whose
rows, with their optimizer state, are cached on the compute device and updated sparsely.

No ``nn.Parameter`` and no buffer holds the table, so DeepSpeed/ZeRO never see or cast it. The
engine drives it through the "maximus module protocol" (``sparse_step`` and friends below).
"""
from __future__ import annotations

import collections
import logging
from typing import NamedTuple, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

from ds_maximus.config import EmbeddingConfig, MaximusConfig, OffloadDevice
from ds_maximus.engine.protocol import MaximusModule, ModuleRole, align_adam_with_engine
from ds_maximus.ops import rows_where
from ds_maximus.optim import RowOptimizer, SparseRowGrad
from ds_maximus.partition import PartitionCache, TensorTier
from ds_maximus.partition.staged_update import StagedUpdate, device_with_index
from ds_maximus.partition.transfer import CudaTransfer, device_bytes_free
from ds_maximus.vocab.function import BatchPlan, BatchPlanner, ids_on_host
from ds_maximus.vocab.sharded_state import ShardedStateMixin
from ds_maximus.vocab.stats import EmbeddingStats, format_line
from ds_maximus.vocab.table_view import WeightView, sharded_rows

logger = logging.getLogger("ds_maximus")


class _Prefetched(NamedTuple):
    ids: Tensor        # sorted unique ids (CPU)
    slots: Tensor      # their slots, pinned until a lookup adopts or releases them
    flat: np.ndarray   # the batch's ids as given (a copy): a lookup of exactly these takes ``plan``
    plan: BatchPlan    # its index tensors already on the compute device


def _masked(t: Tensor, mask: Tensor) -> Tensor:
    """``t[mask]`` for CPU tensors, in numpy (torch's CPU boolean indexing costs milliseconds here)."""
    return torch.from_numpy(t.numpy()[mask.numpy()])


class ShardedEmbedding(ShardedStateMixin, WeightView, MaximusModule, nn.Module):
    """Embedding table with a row cache on the compute device and a row-sparse optimizer.

    Example::

        >>> import torch
        >>> from ds_maximus.config import EmbeddingConfig
        >>> emb = ShardedEmbedding(100, 8, config=EmbeddingConfig(gpu_cache_rows=16,
        ...                        optimizer={"lr": 0.1, "weight_decay": 0.0}))
        >>> out = emb(torch.tensor([[1, 2, 2]]))
        >>> out.shape
        torch.Size([1, 3, 8])
        >>> out.sum().backward(); emb.sparse_step()     # updates rows 1 and 2 only
        >>> emb.full_weight().shape
        torch.Size([100, 8])

    ``config`` is an ``EmbeddingConfig`` (or a whole ``MaximusConfig``, whose logging interval is
    then used too). ``device``/``dtype`` are the compute device and output dtype; the master rows
    are fp32 always. ``_weight`` gives the initial table (copied).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 config: Union[EmbeddingConfig, MaximusConfig, None] = None, device=None, dtype=None,
                 _weight: Optional[Tensor] = None, log_interval_steps: Optional[int] = None):
        super().__init__()
        if isinstance(config, MaximusConfig):
            log_interval_steps = log_interval_steps or config.logging.interval_steps
            config = config.embedding
        self.config = config or EmbeddingConfig()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise IndexError(f"padding_idx {padding_idx} out of range for a vocabulary of {num_embeddings}")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        self.log_interval_steps = int(log_interval_steps or 100)
        self.compute_device = torch.device(device) if device is not None else torch.device("cpu")
        self.out_dtype = dtype or torch.get_default_dtype()
        self.optimizer = RowOptimizer(self.config.optimizer, self.num_embeddings, frozen_row=padding_idx)
        self.tier = self._make_tier(_weight)
        self.cache = self._make_cache(self.compute_device)
        self.grad = SparseRowGrad()
        self.stats_tracker = EmbeddingStats(self.num_embeddings)
        self._step_pins: list = []
        self._tier_pipeline: Optional[StagedUpdate] = None  # the GPU pipeline of out-of-cache row steps
        self._span_transfer: Optional[CudaTransfer] = None  # a tied head's chunk copies (stage_rows_for_compute)
        self._staged_spans: dict = {}  # (lo, hi, device) -> (device copy, its event, resident mask, optimizer step)
        self._step_rows_mode = "off"   # keep_step_rows: a tied head's lm_head.reuse_rows
        self._step_rows: Optional[tuple] = None  # (rows [V, d] in out_dtype, stepped there [V] bool, ready event)
        self._step_rows_current = False  # the table above holds every row as it is now (rows_for_compute)
        self.staged_tier_update: Optional[bool] = None  # those steps through it: None = on a CUDA device
        self._prefetched: collections.deque = collections.deque()
        self._planner = BatchPlanner(self.num_embeddings)
        self._overflow_warned = False  # the one-time warning of a batch too large for the cache
        self._anchor = torch.zeros((), requires_grad=True)  # not a Parameter: autograd reaches backward through it
        self._anchor_fn = None  # set by the engine integration (ds_maximus/engine/norm_carrier.py)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, config: Union[EmbeddingConfig, MaximusConfig, None] = None,
                       **kwargs) -> "ShardedEmbedding":
        """A ``ShardedEmbedding`` with ``embedding``'s table, padding row, device and dtype."""
        w = embedding.weight
        if w.device.type == "meta":
            raise ValueError("from_embedding needs a materialised weight, not one on the meta device")
        kwargs.setdefault("device", w.device)
        kwargs.setdefault("dtype", w.dtype)
        return cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, config,
                   _weight=w.detach(), **kwargs)

    # -- construction helpers ------------------------------------------------------------------------
    def _initial_rows(self, weight: Optional[Tensor], lo: int, hi: int, pin: bool = False) -> Tensor:
        rows = torch.empty(hi - lo, self.embedding_dim, pin_memory=pin)  # pinned in place: no second copy
        if weight is not None:
            return rows.copy_(weight[lo:hi].detach())
        rows.normal_()
        if self.padding_idx is not None and lo <= self.padding_idx < hi:
            rows[self.padding_idx - lo].zero_()
        return rows

    def _make_tier(self, weight: Optional[Tensor]):
        if weight is not None and tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"_weight has shape {tuple(weight.shape)}, expected "
                             f"({self.num_embeddings}, {self.embedding_dim})")
        names = self.optimizer.state_names
        off = self.config.offload
        if off.device == OffloadDevice.NVME:
            from ds_maximus.partition.store_tier import ShardStoreTier
            return ShardStoreTier.for_table(off.nvme_path, self.num_embeddings, self.embedding_dim, names,
                                            self.config.rows_per_shard, off.cpu_cache_shards,
                                            init=lambda lo, hi: self._initial_rows(weight, lo, hi),
                                            pin_memory=off.pin_memory, overwrite=weight is not None)
        from ds_maximus.partition.host_memory import check_cpu_tier
        check_cpu_tier(self.num_embeddings * self.embedding_dim * 4 * (1 + len(names)),
                       f"{self.num_embeddings} x {self.embedding_dim} fp32 rows with {list(names) or 'no'} state",
                       "use the NVMe tier (embedding.offload.device = 'nvme' with offload.nvme_path) or free host "
                       "memory")
        pin = bool(off.pin_memory and torch.cuda.is_available())
        tensors = {"weight": self._initial_rows(weight, 0, self.num_embeddings, pin)}
        for n in names:
            tensors[n] = torch.zeros(self.num_embeddings, self.embedding_dim, pin_memory=pin)
        return TensorTier(tensors, pin_memory=off.pin_memory)

    def _make_cache(self, device) -> PartitionCache:
        rows = min(int(self.config.gpu_cache_rows), self.num_embeddings)
        return PartitionCache(rows, self.tier, device=device, policy=self.config.cache_policy,
                              names=("weight", *self.optimizer.state_names))

    def _tables(self):
        st = self.cache.storage
        return st["weight"], [st[n] for n in self.optimizer.state_names]

    # -- nn.Module plumbing -----------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """``.to()/.cuda()/.half()/.bfloat16()`` move the cache and set the output dtype; the fp32 table stays."""
        probe = fn(torch.zeros(1, dtype=self.out_dtype, device=self.compute_device))
        if probe.is_floating_point():
            self.out_dtype = probe.dtype
        if probe.device != self.compute_device:
            self.cache.clear()
            self._step_pins.clear()
            self._prefetched.clear()
            if self.grad:
                self.grad.rows = self.grad.rows.to(probe.device)
            self.compute_device = probe.device
            self.cache = self._make_cache(probe.device)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        s = (f"{self.num_embeddings}, {self.embedding_dim}, cache_rows={self.cache.num_slots}, "
             f"tier={self.config.offload.device.value}, optimizer={self.config.optimizer.type.value}/"
             f"{self.config.optimizer.mode.value}, device={self.compute_device}, dtype={self.out_dtype}")
        return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")

    # -- forward ------------------------------------------------------------------------------------------
    def forward(self, input: Tensor) -> Tensor:
        from ds_maximus.vocab.function import ShardedEmbeddingFunction, lookup
        if input.dtype not in (torch.long, torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"ShardedEmbedding expects integer token ids, got {input.dtype}")
        track = torch.is_grad_enabled()
        with torch.profiler.record_function("maximus.rows.lookup"):
            out, uniq_cpu, plan = lookup(self, input, pin=track)
        if track:
            anchor = self._anchor_fn() if self._anchor_fn is not None else self._anchor
            out = ShardedEmbeddingFunction.apply(anchor, out, self, uniq_cpu, plan)
        return out.view(*input.shape, self.embedding_dim)

    def _resident(self, uniq_cpu: Tensor, pin: bool, wait: bool = True) -> Tensor:
        """Make rows ``uniq_cpu`` resident and current (exact-mode catch-up); returns their slots.

        A batch with more distinct rows than the cache can hold beside its pinned rows overflows: with
        ``on_overflow: serve`` the rows that do not fit get slot -1 (the lookup reads them from the tier,
        :meth:`_overflow_table`, and the step updates them there); with ``error`` it raises ``CapacityError``.
        """
        from ds_maximus.errors import CapacityError
        slots = self._adopt_prefetch(uniq_cpu, wait) if pin else None
        fit = None
        if slots is None:
            try:
                slots = self.cache.acquire(uniq_cpu, pin=pin, wait=wait)
            except CapacityError:
                while self._prefetched:  # prefetched rows are a hint: give their slots up and retry
                    self.cache.unpin(self._prefetched.popleft().slots)
                fit = self.cache.fits(uniq_cpu)
                if bool(fit.all()):
                    fit = None
                    slots = self.cache.acquire(uniq_cpu, pin=pin, wait=wait)
                else:
                    slots = self._acquire_fitting(uniq_cpu, fit, pin, wait)
        ids, live = (uniq_cpu, slots) if fit is None else (_masked(uniq_cpu, fit), _masked(slots, fit))
        if pin and live.numel():
            self._step_pins.append(live)
        self._replay(ids, live)
        return slots

    def _acquire_fitting(self, uniq_cpu: Tensor, fit: Tensor, pin: bool, wait: bool) -> Tensor:
        """Overflow: acquire the rows of ``uniq_cpu`` that ``fit``; the others get slot -1 (served from the tier).
        Counted in the stats; warns once (or raises ``CapacityError`` with ``on_overflow: error``), naming the
        ``gpu_cache_rows`` that would hold such a batch."""
        from ds_maximus.config import OverflowPolicy
        from ds_maximus.errors import CapacityError
        n, n_over = int(uniq_cpu.numel()), int((~fit).sum())
        pinned = self.cache.map.pin_count.numpy() > 0
        held = self.cache.slots_of(uniq_cpu).numpy()
        others = int(pinned.sum()) - int(pinned[held[held >= 0]].sum())  # pinned by earlier micro-batches
        what = (f"a batch needs {n} distinct embedding rows but the row cache of {self.cache.num_slots} rows can "
                f"take only {n - n_over} of them now ({others} rows are pinned by earlier micro-batches of this "
                f"step); a maximus.embedding.gpu_cache_rows of at least {n + others} would hold it")
        if self.config.on_overflow == OverflowPolicy.ERROR:
            raise CapacityError(f"{what}; raise gpu_cache_rows, use smaller batches, or set "
                                "maximus.embedding.on_overflow to 'serve' (the extra rows are then read and "
                                "stepped in the tier directly)")
        if not self._overflow_warned:
            self._overflow_warned = True
            logger.warning("%s; the %d rows that do not fit are read from and stepped in the %s tier directly "
                           "(same results, slower; counted in stats()['overflow_rows']). Warned once.",
                           what, n_over, self.config.offload.device.value)
        self.cache.count_overflow(n_over)
        slots = torch.full((n,), -1, dtype=torch.long)
        part = _masked(uniq_cpu, fit)
        if part.numel():
            slots.numpy()[fit.numpy()] = self.cache.acquire(part, pin=pin, wait=wait).numpy()
        return slots

    def _overflow_table(self, uniq_cpu: Tensor, slots: Tensor) -> Tensor:
        """The rows of an overflowing batch as one ``[U, d]`` fp32 table on the compute device (row i holds
        ``uniq_cpu[i]``): cached rows copied from their slots, the rest read from the tier
        (:meth:`_direct_rows`). Copies only, so a gather from it equals one from a cache that held them all."""
        from ds_maximus.ops import to_device
        dev = self.compute_device
        s = slots.numpy()
        over = s < 0
        table = torch.empty(uniq_cpu.numel(), self.embedding_dim, device=dev)
        pos = np.flatnonzero(~over)
        if pos.size:
            w = self.cache.storage["weight"]
            rows = w.index_select(0, to_device(torch.from_numpy(s[pos]), dev))
            table.index_copy_(0, to_device(torch.from_numpy(pos), dev), rows)
        pos = np.flatnonzero(over)
        rows = self._direct_rows(torch.from_numpy(uniq_cpu.numpy()[pos]))
        table.index_copy_(0, to_device(torch.from_numpy(pos), dev), rows)
        return table

    def _direct_rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` (not resident) read from the tier for one lookup, without taking cache slots; in exact
        mode made current on the compute device (the same kernel as a cached row's catch-up) and written back;
        fp32 on the compute device."""
        dev = self.compute_device
        buf = self.cache.read_direct(ids)
        work = {k: v.to(dev, non_blocking=True) for k, v in buf.items()}  # on a CPU: the same tensors
        changed = self.optimizer.catch_up(work["weight"], [work[k] for k in self.optimizer.state_names],
                                          torch.arange(ids.numel()), ids)
        if changed.numpy().any():
            if dev.type == "cuda":
                for k, v in buf.items():
                    v.copy_(work[k], non_blocking=True)
                torch.cuda.current_stream(dev).synchronize()  # the tier write reads the copies
            self.cache.write_direct(ids, buf)
        return work["weight"]

    def prefetch(self, ids: Tensor) -> None:
        """Stage the rows of an upcoming batch asynchronously (pinned until the next forward uses them).

        The batch is planned here too (unique ids, inverse, order; uploaded at once), so the forward of the
        same ids only brings them to the host to compare.
        """
        from ds_maximus.errors import CapacityError
        flat = ids_on_host(ids.detach().reshape(-1))
        host = self._planner.plan_host(flat, pin=self.compute_device.type == "cuda")  # IndexError on a bad id
        while len(self._prefetched) >= 2:
            self.cache.unpin(self._prefetched.popleft().slots)
        try:  # counted here: a lookup of exactly these ids adopts them without a second count
            slots = self.cache.acquire(host.uniq, pin=True, wait=False, count=True)
        except CapacityError:
            logger.debug("prefetch of %d rows skipped: the cache cannot hold them beside the rows in use",
                         host.uniq.numel())
            return
        self._replay_fills()
        plan = host.to(self.compute_device)  # uploaded after the fills are queued
        self._prefetched.append(_Prefetched(plan.uniq, slots, flat.copy(), plan))

    def _replay_fills(self) -> None:
        """Exact mode on a GPU: replay the skipped steps of the rows the prefetch just brought in, on the fill
        stream right after their fills, where the GPU runs it beside the current step's work.

        Rows back from the tier lag by hundreds of steps (0.8 ms a step at V=262144, d=4096); in the lookup
        this sat between the host sync and the gather, and at the end of the optimizer step it made the
        compute stream wait for the fills. Only fresh rows: no work queued on the compute stream uses their
        slots, and the lookup's ``wait_fills`` orders it after this replay. Rows that were already resident
        and lag (by a step or so) are replayed by the lookup."""
        if self.optimizer.lazy or not self.cache.cuda:
            return
        ids, slots = self.cache.last_misses
        if not ids.numel():
            return
        lag = self.optimizer.lagging(ids)
        if lag.numpy().any():
            self.optimizer.history(self.compute_device)  # any upload on the compute stream, not the fill stream
            self.cache.after_fills(_masked(slots, lag), lambda: self._replay(ids, slots, lag))

    def _prefetched_plan(self, flat: np.ndarray) -> Optional[BatchPlan]:
        """The plan of a prefetched batch whose ids are exactly ``flat``, or None."""
        for p in self._prefetched:
            if p.flat.size == flat.size and np.array_equal(p.flat, flat):
                return p.plan
        return None

    def _adopt_prefetch(self, uniq_cpu: Tensor, wait: bool) -> Optional[Tensor]:
        """Slots of a prefetched set with exactly the ids ``uniq_cpu`` (its pins pass to the step), or None.

        The common case (``prefetch(batch t+1)`` during step t): the lookup skips the cache's bookkeeping
        a second time; the rows were counted, pinned and their fills queued by the prefetch.
        """
        for i, p in enumerate(self._prefetched):
            if p.ids is uniq_cpu or (p.ids.numel() == uniq_cpu.numel() and torch.equal(p.ids, uniq_cpu)):
                del self._prefetched[i]  # the prefetch's assign already touched them (recency, frequency)
                if wait:
                    self.cache.wait_fills(p.slots)
                return p.slots
        return None

    def _release_prefetch(self, used_slots: Tensor) -> None:
        """Unpin the prefetched sets this lookup consumed (all their rows are among ``used_slots``)."""
        if not self._prefetched:
            return
        used = np.zeros(self.cache.num_slots, dtype=bool)  # a mask: torch.isin sorts both sides (~1 ms)
        used[used_slots.numpy()] = True
        keep = collections.deque()
        for p in self._prefetched:
            if p.slots.numel() <= used_slots.numel() and used[p.slots.numpy()].all():
                self.cache.unpin(p.slots)
            else:
                keep.append(p)
        self._prefetched = keep

    def _accumulate(self, ids: Tensor, rows: Tensor) -> None:
        self.grad.add(ids, rows)

    # -- the maximus module protocol ---------------------------------------------------------------------
    role = ModuleRole.ROWS

    def set_out_dtype(self, dtype: torch.dtype) -> None:
        self.out_dtype = dtype

    def take_zero_grad_steps(self, steps: int, lr: Optional[float], weight_decay: Optional[float]) -> None:
        """Exact mode takes them as steps that touch no row (a row's replay applies their decay); lazy mode, whose
        reference is ``torch.optim.SparseAdam``, does not."""
        if not self.optimizer.lazy:
            for _ in range(int(steps)):
                self.sparse_step(lr, weight_decay)

    def configure_from_engine(self, engine, cfg: MaximusConfig) -> None:
        """The row optimizer's betas/eps follow DeepSpeed's unless ``embedding.optimizer`` sets them."""
        align_adam_with_engine(self.optimizer, engine, cfg.embedding.optimizer)

    def train_padding_row(self) -> None:
        """A tied head's gradient reaches the ``padding_idx`` row: the row optimizer updates it too."""
        self.optimizer.frozen_row = None

    #: rows a ``weight`` read brings to the device at once (its gradient goes back in chunks of the same size)
    WEIGHT_CHUNK_ROWS = 16384

    def read_rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` (CPU long, in range) as they are now, on the compute device in the output dtype; under grad
        mode their gradient goes to those rows, the padding row's too (a read of ``.weight``, not a lookup)."""
        return sharded_rows(self, ids)

    def compute_weight(self) -> Tensor:
        """The whole ``[V, d]`` table as it is now, on the compute device in the dtype the model computes in; under
        grad mode its gradient goes into the rows (as a tied head's does). It costs a dense table's memory while
        it is held, and every row crosses the link: what ``emb.weight`` gives code that reads it."""
        from ds_maximus.vocab.lm_head_stream import streamed_weight
        from ds_maximus.vocab.lm_head_tier import TiedSource
        anchor = self._anchor_fn() if torch.is_grad_enabled() and self._anchor_fn is not None else self._anchor
        return streamed_weight(TiedSource(self, reuse=None), self.WEIGHT_CHUNK_ROWS, anchor, self.compute_device,
                               self.out_dtype)

    def set_grad_anchor(self, fn) -> None:
        """Use ``fn()`` as the autograd anchor of each lookup (its backward runs after this module's)."""
        self._anchor_fn = fn

    def sparse_grads(self):
        """The accumulated sparse gradient as ``(ids [U] CPU long, rows [U, d] fp32)`` (empty when none)."""
        if not self.grad:
            return (torch.zeros(0, dtype=torch.long),
                    torch.zeros(0, self.embedding_dim, device=self.compute_device))
        return self.grad.ids, self.grad.rows

    def set_sparse_grads_(self, ids: Tensor, rows: Tensor) -> None:
        """Replace the accumulated sparse gradient (unique ids), e.g. after combining across ranks."""
        self.grad.clear()
        if ids.numel():
            self.grad.add(ids.to("cpu", torch.long), rows.to(self.compute_device, torch.float32))

    def sparse_grad_norm_sq(self) -> Tensor:
        """Sum of squares of the accumulated sparse gradient (fp32 scalar on the compute device)."""
        return self.grad.norm_sq(self.compute_device)

    def scale_sparse_grads_(self, factor: float) -> None:
        self.grad.scale_(factor)

    def sparse_grads_finite(self) -> bool:
        return self.grad.finite()

    def zero_sparse_grads(self) -> None:
        self.grad.clear()
        self._unpin_step()

    def _unpin_step(self) -> None:
        for s in self._step_pins:
            self.cache.unpin(s)
        self._step_pins.clear()

    def sparse_step(self, lr: Optional[float] = None, weight_decay: Optional[float] = None) -> None:
        """Apply the sparse optimizer to the accumulated gradient, advance the step, clear the gradient.

        On a GPU the rows outside the cache are stepped by copies and kernels on side streams that run on into the
        next forward (the last step's, if still in flight, is waited for here first)."""
        self.cache.tier_sync()
        self._rows_changed()
        self.optimizer.begin_step(lr, weight_decay)
        touched = 0
        if self.grad:
            ids, rows = self.grad.ids, self.grad.rows
            touched = ids.numel()
            slots = self.cache.slots_of(ids)
            res = slots >= 0
            w, states = self._tables()
            if res.numpy().all():
                self.optimizer.update(w, states, slots, rows, ids)
                self.cache.mark_dirty(slots)
            else:
                self.optimizer.update(w, states, slots[res], rows_where(rows, res), ids[res])
                self.cache.mark_dirty(slots[res])
                with torch.profiler.record_function("maximus.rows.tier_step"):
                    self._tier_update(ids[~res], rows, torch.from_numpy(np.flatnonzero(~res.numpy())))
        self.grad.clear()
        self._unpin_step()
        self.stats_tracker.end_step(self.cache, touched)
        step = self.optimizer.step
        if step % self.log_interval_steps == 0:
            logger.info(format_line(f"ShardedEmbedding({self.num_embeddings}x{self.embedding_dim})", step,
                                    self.stats()))

    #: at most this many rows of the tier's step cross at once (the staged pipeline holds two such windows of the
    #: weights and every moment on the device: at 2560 columns, ~1 GB)
    TIER_WINDOW_ROWS = 16384

    def _tier_update(self, ids: Tensor, rows: Tensor, where: Tensor) -> None:
        """Step rows ``ids`` that are not in the cache (another rank's rows in data-parallel training, after the
        gradient all-reduce; a tied head's gradient reaches every row); their gradient is ``rows[where]``. On a
        GPU they cross to it for the step and back, without taking cache slots, at most a cache's worth of rows
        at a time (a whole vocabulary's weights and moments at once would be three more V x d fp32 tables on
        the device): exact mode replays every skipped step per element, which on the CPU cost 104 ms a step at
        V=262144, d=4096 on 2 H200s (``docs/bench/distributed.md``). Without a GPU they are stepped in the tier."""
        self.cache._finish_write_backs(block=True)
        dev = rows.device
        step = max(1, min(int(self.cache.num_slots), self.TIER_WINDOW_ROWS, ids.numel()))
        if self._tier_update_in_place(ids, rows, where, step, staged=self.staged_tier_update):
            return
        staging = self.cache._staging(step)  # pinned when the cache is on a GPU
        for lo in range(0, ids.numel(), step):
            part, n = ids[lo:lo + step], min(step, ids.numel() - lo)
            grad = rows.index_select(0, where[lo:lo + step].to(dev))
            buf = {k: v[:n] for k, v in staging.items()}
            self.tier.read(part, buf)
            work = {k: v.to(dev, non_blocking=True) for k, v in buf.items()}  # on a CPU: the same tensors
            self.optimizer.update(work["weight"], [work[k] for k in self.optimizer.state_names],
                                  torch.arange(n, device=dev), grad, part)
            if dev.type == "cuda":
                for k, v in buf.items():
                    v.copy_(work[k], non_blocking=True)
                torch.cuda.current_stream(dev).synchronize()  # the tier write reads the copies
            self.tier.write(part, buf)

    def _tier_update_in_place(self, ids: Tensor, rows: Tensor, where: Tensor, step: int,
                              staged: Optional[bool] = None) -> bool:
        """``_tier_update`` straight on the tier's host memory when it keeps every table there in the same pieces
        (not on NVMe): each window of ``step`` id values goes to the device and back as one slice of every table
        (the span from its first to its last id; cached rows inside it cross unchanged), so no rows are gathered
        into or scattered out of staging buffers on the host. ``ids`` are sorted. False where it does not apply.

        On a GPU (``staged``, default: the device is CUDA) the windows go through the staged-update pipeline
        (:class:`~ds_maximus.partition.StagedUpdate`): window ``i + 1`` is loaded while window ``i`` is
        updated and window ``i - 1`` goes back, so the two link directions and the update overlap (a tied
        head's gradient reaches every row: every step moves the whole table's weights and moments both ways).
        Otherwise (``staged=False``) the windows run one after another on the current stream; on a CPU device
        that updates the host views in place."""
        from ds_maximus.ops import to_device
        names = ("weight", *self.optimizer.state_names)
        pieces = {n: self.tier.pieces(n) for n in names}
        ranges = [(lo, hi) for lo, hi, _ in pieces["weight"]]
        if not ranges or any([(lo, hi) for lo, hi, _ in pieces[n]] != ranges for n in names):
            return False
        dev = rows.device
        ids_np = ids.numpy()
        if ids_np.size > 1 and not bool((ids_np[1:] > ids_np[:-1]).all()):
            return False
        table = self._step_rows_table(dev)   # the new weights for a tied head's next passes, or None
        windows = []  # (host slices of every table, a, b, first id): the window's ids are ids[a:b]
        for k, (plo, phi) in enumerate(ranges):
            tables = {n: pieces[n][k][2].view(phi - plo, -1) for n in names}
            for wlo in range(plo, phi, step):
                a, b = np.searchsorted(ids_np, [wlo, min(wlo + step, phi)])
                if a == b:
                    continue
                first, last = int(ids_np[a]), int(ids_np[b - 1])
                windows.append(({n: t[first - plo:last + 1 - plo] for n, t in tables.items()}, int(a), int(b),
                                first))
        if not (dev.type == "cuda" if staged is None else staged):
            for host, a, b, first in windows:  # one window after another, on the current stream
                work = {n: v.to(dev, non_blocking=True) for n, v in host.items()}  # on a CPU: the views themselves
                grad = rows.index_select(0, where[a:b].to(dev))
                self.optimizer.update(work["weight"], [work[n] for n in names[1:]], (ids[a:b] - first).to(dev),
                                      grad, ids[a:b])
                if table is not None:
                    table[first:first + work["weight"].shape[0]].copy_(work["weight"])
                for n, v in host.items():
                    if work[n] is not v:
                        v.copy_(work[n], non_blocking=True)
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()  # the tier is read on the host next
            self._keep_step_rows(table, ids, None)
            return True
        if self._tier_pipeline is None or self._tier_pipeline.device != device_with_index(dev):
            self._tier_pipeline = StagedUpdate(dev)
        pl = self._tier_pipeline
        # the updates run on the pipeline's own stream, not the current one: the next forward queues on the current
        # stream while the table's state crosses (the lookup's rows are in the cache; a tied head's first read of
        # the tier waits for the step's end on the host, see PartitionCache.tier_written_until)
        upd = pl.update if pl.cuda else None
        where_d = to_device(where, dev)  # from pinned memory: a pageable upload may wait for the stream
        if upd is not None:  # read on the update stream after the caller drops them
            rows.record_stream(upd)
            where_d.record_stream(upd)
        width = step * self.embedding_dim
        after = torch.cuda.current_stream(dev) if pl.cuda else None
        for s, (host, a, b, first) in pl.pieces(windows, after=after):
            n = host["weight"].shape[0]
            bufs = {nm: pl.buffer(s, nm, width, host[nm].dtype)[:n * self.embedding_dim].view(n, -1) for nm in names}
            with pl.loading(s):  # the index pair first: the update then needs no copy of its own
                index = self.optimizer.device_index(ids[a:b] - first, ids[a:b], dev)
                if upd is not None:  # made on the load stream, read by the update: its memory waits for that
                    for t in index:
                        t.record_stream(upd)
                for nm in names:
                    bufs[nm].copy_(host[nm], non_blocking=True)
            with pl.updating(upd):
                grad = rows.index_select(0, where_d[a:b])
                self.optimizer.update(bufs["weight"], [bufs[nm] for nm in names[1:]], ids[a:b] - first, grad,
                                      ids[a:b], index=index)
                if table is not None:
                    table[first:first + n].copy_(bufs["weight"])
            if upd is not None:  # the gradient's kept memory up to this window's rows may be written again after it
                self.grad.read_on(upd, upto=int(where[b - 1]) + 1)
            with pl.storing(s):
                for nm in names:
                    host[nm].copy_(bufs[nm], non_blocking=True)
        # no host wait: the tier is written until the end event; the staging sets go back to the allocator once
        # the pipeline's streams are past them
        self.cache.tier_written_until(pl.end())
        ready = None
        if table is not None and upd is not None:   # the table is complete once the last update has run
            ready = torch.cuda.Event()
            ready.record(upd)
            table.record_stream(upd)
        self._keep_step_rows(table, ids, ready)
        pl.release(wait=False)
        return True

    def _keep_step_rows(self, table: Optional[Tensor], ids: Tensor, ready) -> None:
        if table is None:
            return
        stepped = torch.zeros(self.num_embeddings, dtype=torch.bool)
        stepped[ids] = True
        self._step_rows = (table, stepped, ready)
        self._step_rows_current = False

    # -- the rows a step leaves on the device for a tied head ------------------------------------------------------
    #: what ``auto`` leaves free on the device beside the table the step leaves there
    STEP_ROWS_MARGIN = 512 * 2 ** 20
    #: a tied head's gradient reaches every row each step: on a GPU the memory of that [V, d] fp32 gradient is kept
    #: from step to step (:class:`~ds_maximus.optim.SparseRowGrad` ``keep_buffer``): allocated anew beside the head's
    #: chunks it made a capped allocator free its cache once a step, a host wait for every stream (the step's copies
    #: included; ``scripts/gpu/peft_alloc_retries.py``)
    KEEP_GRAD_BUFFER = True

    def keep_step_rows(self, mode: str) -> None:
        """A tied head reads every row in its forward and again in its backward, and on a GPU those reads cross the
        link from the tier. With ``mode`` ``on`` (or ``auto``: on a CUDA device where the table in ``out_dtype``
        fits the free memory under the process's cap with :attr:`STEP_ROWS_MARGIN` to spare) the step of the rows
        outside the cache also casts their new weights into a ``[V, d]`` table on the compute device, which
        :meth:`rows_for_compute` reads instead, until the head's backward is done (:meth:`release_step_rows`)."""
        mode = getattr(mode, "value", mode)
        if mode not in ("on", "off", "auto"):
            raise ValueError(f"reuse_rows={mode!r}: use 'auto', 'on' or 'off'")
        self._step_rows_mode = mode

    def release_step_rows(self) -> None:
        """Free the rows the last step left on the device (the head's backward has read them all): later reads
        until the next step copy from the tier again."""
        self._step_rows = None

    def _rows_changed(self) -> None:
        """The tier's rows change outside a step (a load): nothing copied or kept from them before is current."""
        self._staged_spans.clear()
        self._step_rows = None

    def _step_rows_table(self, dev: torch.device) -> Optional[Tensor]:
        """The ``[V, d]`` table a step writes its rows' new weights into, or ``None`` (:meth:`keep_step_rows`)."""
        mode = self._step_rows_mode
        if mode == "off" or (mode == "auto" and dev.type != "cuda"):
            return None
        nbytes = self.num_embeddings * self.embedding_dim * torch.empty((), dtype=self.out_dtype).element_size()
        if mode == "auto" and device_bytes_free(dev) < nbytes + self.STEP_ROWS_MARGIN:
            return None
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.out_dtype, device=dev)

    def _step_rows_for(self, lo: int, hi: int, device: torch.device, dtype, wait: bool = True):
        """``(rows, stepped)``: rows ``[lo, hi)`` of the table the last step left on ``device`` (a view, which the
        caller completes: cached rows and rows not stepped into it, e.g. a row cached during the step and evicted
        since) and which of them the step wrote; ``None`` without such a table. ``wait``: the current stream waits
        for the step's updates first."""
        if self._step_rows is None:
            return None
        table, stepped, ready = self._step_rows
        if table.device != device_with_index(device) or table.dtype != dtype:
            return None
        if wait and ready is not None:
            torch.cuda.current_stream(table.device).wait_event(ready)
        return table[lo:hi], stepped[lo:hi]

    def _resident_catch_up(self, ids: Tensor) -> None:
        self.cache.wait_fills()  # rows in flight (a prefetch) are replayed where they land, not before
        self._replay(ids, self.cache.slots_of(ids))

    def _replay(self, ids: Tensor, slots: Tensor, lag: Optional[Tensor] = None) -> None:
        """Exact mode: replay the skipped steps of cached rows ``ids`` in ``slots``; mark the changed ones dirty."""
        w, states = self._tables()
        changed = self.optimizer.catch_up(w, states, slots, ids, lag=lag)
        if changed.numpy().any():
            self.cache.mark_dirty(_masked(slots, changed))

    def stage_rows_for_compute(self, lo: int, hi: int, device=None) -> None:
        """A hint from a tied head: :meth:`rows_for_compute` of ``[lo, hi)`` comes next. Where it would copy the
        range's span of the tier's host memory (a GPU device, no row with steps to replay, one piece holding the
        range), that copy starts now on a side stream, after the tier's writes in flight, so the compute stream
        waits for no copy of its own and the host for none of the tier's writes."""
        device = torch.device(device) if device is not None else self.compute_device
        key = (lo, hi, device_with_index(device)) if device.type == "cuda" else None
        if key is None or key in self._staged_spans:
            return
        if self._step_rows_for(lo, hi, device, self.out_dtype, wait=False) is not None:
            return   # the last step left them on the device
        ids = torch.arange(lo, hi)
        res = self.cache.slots_of(ids) >= 0
        if bool(res.all()) or bool(self.optimizer.lagging(ids[~res]).any()):
            return
        span = self._host_weight_span(lo, hi)
        if span is None or not span.is_pinned():
            return
        if self._span_transfer is None or self._span_transfer.device != key[2]:
            self._span_transfer = CudaTransfer(key[2], timing=False)
        if not self.cache.order_tier_read(self._span_transfer.stream):
            return
        t, ev = self._span_transfer.load_chunk(span)
        self._staged_spans[key] = (t, ev, res, self.optimizer.step)

    def _take_staged_span(self, lo: int, hi: int, device: torch.device, res: Tensor) -> Optional[Tensor]:
        """The span :meth:`stage_rows_for_compute` copied for ``[lo, hi)``, if still current: no step since, and no
        row that was resident then (its tier entry stale) has left the cache."""
        key = (lo, hi, device_with_index(device)) if device.type == "cuda" else None
        staged = self._staged_spans.pop(key, None) if self._staged_spans else None
        if staged is None:
            return None
        t, ev, res_then, step = staged
        if step != self.optimizer.step or bool((res_then & ~res).any()):
            return None
        return self._span_transfer.take(t, ev)

    def rows_for_compute(self, lo: int, hi: int, device=None, dtype=None) -> Tensor:
        """Rows ``[lo, hi)`` as they are now (catch-up applied), on ``device`` in ``dtype`` (tied heads).

        With the table the last step left on the device (:meth:`keep_step_rows`), the first call after the step
        brings the whole table up to date (the cached rows written over it, any row the step did not write read
        from the tier) and every call until the next step returns a view of it: a tied head's 32 chunks a pass
        otherwise each paid that bookkeeping on the host (in a traced step at the Gemma-3-4B shape, 73 ms of host
        time for the head's forward, whose GPU work was 19 ms). Until the next step no row changes: steps, loads
        (:meth:`_rows_changed`) and the replays of skipped steps change rows, and the table's rows were all
        stepped in the last step, so none has a step to replay."""
        device = torch.device(device) if device is not None else self.compute_device
        dtype = dtype or self.out_dtype
        kept = self._step_rows_for(lo, hi, device, dtype)
        if kept is None:
            out = torch.empty(hi - lo, self.embedding_dim, dtype=dtype, device=device)
            self._current_rows_into(out, lo, hi, device, dtype, None)
            return out
        if not self._step_rows_current:
            table, stepped = self._step_rows_for(0, self.num_embeddings, device, dtype, wait=False)
            self._current_rows_into(table, 0, self.num_embeddings, device, dtype, stepped)
            self._step_rows_current = True
        return kept[0]

    #: at most this many cached rows are gathered at once when they are written over the step's table
    OVERLAY_ROWS = 8192

    def _current_rows_into(self, out: Tensor, lo: int, hi: int, device, dtype, stepped: Optional[Tensor]) -> None:
        """Write rows ``[lo, hi)`` as they are now into ``out``. ``stepped`` (or None): which of them ``out``
        already holds as the last step left them (the step's table); the cached rows are written over those."""
        from ds_maximus.ops import to_device
        ids = torch.arange(lo, hi)
        slots = self.cache.slots_of(ids)
        res = slots >= 0
        if stepped is None:
            self._copy_tier_rows(out, lo, hi, ids, res, device, dtype)
        else:
            missing = ~(stepped | res)
            if bool(missing.any()):   # rows the step did not write (cached then, evicted since): from the tier
                self._copy_tier_rows(out, lo, hi, ids, ~missing, device, dtype, span=False)
                stepped |= missing     # the table holds them now (a view: the next read finds them)
        if bool(res.any()):
            self._resident_catch_up(ids[res])
            w, _ = self._tables()
            self.cache.wait_fills()
            # index copies with indices uploaded from pinned memory: a boolean mask on the device, or a pageable
            # upload, would make the host wait for the compute stream
            pos_all = torch.from_numpy(np.flatnonzero(res.numpy()))
            slots_all = slots[res]
            for a in range(0, pos_all.numel(), self.OVERLAY_ROWS):
                pos, sl = pos_all[a:a + self.OVERLAY_ROWS], slots_all[a:a + self.OVERLAY_ROWS]
                rows_res = w.index_select(0, to_device(sl, w.device)).to(device, dtype)
                out.index_copy_(0, to_device(pos, device), rows_res)

    def _copy_tier_rows(self, out: Tensor, lo: int, hi: int, ids: Tensor, res: Tensor, device, dtype,
                        span: bool = True) -> None:
        """Write rows ``ids[~res]`` of ``[lo, hi)`` into ``out`` from the tier, current (``span``: where that is
        cheaper, by copying the whole span of ``[lo, hi)``, the cached rows among it to be written over)."""
        from ds_maximus.ops import to_device
        staged = self._take_staged_span(lo, hi, device, res) if span else None
        if staged is not None:  # the tier's span, copied ahead on a side stream
            out.copy_(staged)
            return
        if bool(res.all()):
            return
        cold = ids[~res]
        self.cache._finish_write_backs(block=True)
        lag = self.optimizer.lagging(cold)
        # rows with no step to replay need only their weights (a tied head reads every row, twice a step): the
        # range in one copy from the tier's host memory, the cached rows among it written over below
        lagging = bool(lag.any())
        span = None if lagging or not span else self._host_weight_span(lo, hi)
        rows = None if span is not None or lagging else self._host_weight_rows(cold)
        if span is not None:
            out.copy_(span, non_blocking=True)
        elif rows is None:
            names = ("weight", *self.optimizer.state_names)
            buf = {n: torch.empty(cold.numel(), self.embedding_dim) for n in names}
            self.tier.read(cold, buf)
            changed = self.optimizer.catch_up(buf["weight"], [buf[n] for n in names[1:]],
                                              torch.arange(cold.numel()), cold, lag=lag)
            if bool(changed.any()):
                self.tier.write(cold, buf)
            rows = buf["weight"]
        if rows is not None:
            cold_pos = torch.from_numpy(np.flatnonzero(~res.numpy()))
            out.index_copy_(0, to_device(cold_pos, device), to_device(rows, device).to(dtype))

    def _host_weight_span(self, lo: int, hi: int) -> Optional[Tensor]:
        """Weights of rows ``[lo, hi)`` as a view of the tier's host memory (one piece holds them), else ``None``."""
        for plo, phi, t in self.tier.pieces("weight"):
            if plo <= lo and hi <= phi:
                return t.view(phi - plo, self.embedding_dim)[lo - plo:hi - plo]
        return None

    def _host_weight_rows(self, ids: Tensor) -> Optional[Tensor]:
        """Weights of rows ``ids`` read from the tier's host memory alone (no optimizer state), or ``None``
        where the tier keeps none there (NVMe)."""
        pieces = self.tier.pieces("weight")
        if not pieces:
            return None
        out = torch.empty(ids.numel(), self.embedding_dim)
        if len(pieces) == 1:
            return torch.index_select(pieces[0][2].view(-1, self.embedding_dim), 0, ids - pieces[0][0], out=out)
        for lo, hi, t in pieces:
            m = (ids >= lo) & (ids < hi)
            if bool(m.any()):
                out[m] = t.view(-1, self.embedding_dim).index_select(0, ids[m] - lo)
        return out

    def add_dense_row_grad_(self, lo: int, hi: int, grad: Tensor) -> None:
        """Add a gradient for the contiguous rows ``[lo, hi)`` to the accumulated sparse gradient."""
        if tuple(grad.shape) != (hi - lo, self.embedding_dim):
            raise ValueError(f"grad has shape {tuple(grad.shape)}, expected ({hi - lo}, {self.embedding_dim})")
        ids = torch.arange(lo, hi)
        if self.padding_idx is not None and lo <= self.padding_idx < hi:
            keep = ids != self.padding_idx
            ids, grad = ids[keep], rows_where(grad, keep)
        self.add_head_grad_(ids, grad)

    def add_head_grad_(self, ids: Tensor, grad: Tensor) -> None:
        """Add a tied head's gradient for rows ``ids`` (a chunk of the vocabulary, ascending, after the chunks
        before it). Each step's chunks together cover every row: on a GPU they are written into memory kept from step
        to step (:attr:`KEEP_GRAD_BUFFER`), as a new ``[V, d]`` fp32 gradient each step would not fit beside the
        chunks under a capped allocator without it freeing its cache (a wait for every stream)."""
        self.grad.keep_buffer = self.KEEP_GRAD_BUFFER and self.compute_device.type == "cuda"
        self.grad.add(ids, grad.detach().to(self.compute_device, torch.float32))

    def stats(self) -> dict:
        """Cumulative figures, and ``"last_step"``: the same for the last optimizer step."""
        return self.stats_tracker.as_dict(self.cache)


def plain_weight(m: nn.Module) -> Optional[Tensor]:
    """``m.weight`` where reading it builds nothing: None for a maximus table (``ShardedEmbedding`` or
    ``ShardedLMHead``, whose ``.weight`` is the whole table, made on each read) and for a wrapper that forwards
    ``.weight`` to one inside it (PEFT's ModulesToSaveWrapper). For the scans that compare modules' weights."""
    from ds_maximus.vocab.lm_head import ShardedLMHead
    maximus = (ShardedEmbedding, ShardedLMHead)
    if isinstance(m, maximus):
        return None
    if "weight" in m._parameters:
        return m._parameters["weight"]
    if any(isinstance(c, maximus) for c in m.modules()):
        return None
    w = getattr(m, "weight", None)
    return w if isinstance(w, Tensor) else None
