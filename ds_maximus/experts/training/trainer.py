"""``ExpertTrainer``: MoE experts trained as swappable partitions (a maximus runtime module).

Every expert's fp32 master and optimizer state live in the CPU tier (or on NVMe); the compute device
holds an :class:`~ds_maximus.experts.expert_cache.ExpertCache` of compute copies. Per micro-batch and
layer, after the router ran, only the routed experts are brought in (rounds of at most
``gpu_experts_per_layer``), with speculative prefetch of the next layer's likely experts; backward
brings an evicted expert back and accumulates its gradient (:class:`ExpertGrads`). At the step the
experts that received gradient are updated by the row optimizer (each expert is one row of
``numel`` elements; ``exact`` mode replays skipped steps when an expert is next routed, so unrouted
experts end where dense AdamW puts them), and every copy of them (shadow, resident slot) refreshed.

The engine drives it through the maximus module protocol (``sparse_step``, ``maximus_state_dict``, ...)
like :class:`~ds_maximus.vocab.ShardedEmbedding`; the model sees one thin module per layer
(:mod:`ds_maximus.experts.training.modules`).

    >>> # built by ds_maximus.initialize when "moe": {"enabled": true, "train": true}; see
    >>> # ds_maximus/experts/training/build.py and tests/experts/training/
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from ds_maximus.config import ExpertOptimizerDevice, MaximusConfig, OffloadDevice
from ds_maximus.engine.protocol import MaximusModule, ModuleRole
from ds_maximus.errors import ConfigError
from ds_maximus.experts.compute import rounds
from ds_maximus.experts.expert_cache import ExpertCache, layer_slots, slot_range
from ds_maximus.experts.training.function import ExpertKind, ExpertRound
from ds_maximus.experts.training.grads import ExpertGrads
from ds_maximus.experts.training.state import ExpertStateMixin
from ds_maximus.experts.training.stats import ExpertTrainStats
from ds_maximus.experts.training.step import InPlaceStep, SplitStep, StagedStep, StepParts
from ds_maximus.experts.training.store import ExpertTrainStore
from ds_maximus.ops import count_ids
from ds_maximus.optim import RowOptimizer

logger = logging.getLogger("ds_maximus")
SUBROW_MAX_ELEMS = 1 << 16  # the row-update op parallelises over rows: an expert is stepped as sub-rows


@dataclasses.dataclass
class LayerSpec:
    """One MoE layer as the trainer sees it (built by an adapter)."""

    name: str
    kind: ExpertKind
    num_experts: int
    top_k: int
    tensors: Optional[Callable[[], Dict[str, Tensor]]]       # initial tensors, stacked {name: [E, ...]}
    router_weight: Optional[Callable[[], Optional[Tensor]]] = None  # for speculative prefetch


def _subrow(numel: int) -> int:
    """Largest multiple of 256 dividing ``numel``, at most ``SUBROW_MAX_ELEMS`` and ``numel / 64`` (so even a
    small expert is 64 rows for the op's threads)."""
    if numel % 256:
        return numel
    units, cap = numel // 256, max(1, min(SUBROW_MAX_ELEMS, numel // 64) // 256)
    return 256 * max(k for k in range(1, cap + 1) if units % k == 0)


class ExpertTrainer(ExpertStateMixin, MaximusModule, nn.Module):
    """The experts of every MoE layer of a model, trained through an expert cache (see module docstring)."""

    def __init__(self, layers: Sequence[LayerSpec], cfg: MaximusConfig, device, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        mcfg = cfg.moe
        self.layers = list(layers)
        self.num_layers = len(self.layers)
        self.num_experts = self.layers[0].num_experts
        layout = self.layers[0].kind.layout
        for spec in self.layers[1:]:
            if spec.num_experts != self.num_experts or spec.kind.layout != layout:
                raise ConfigError(f"MoE layer '{spec.name}' differs in expert count or shapes from "
                                  f"'{self.layers[0].name}'; layers with different experts are not supported")
        self.numel = layout.numel
        self.sub = _subrow(self.numel)
        self.num_uids = self.num_layers * self.num_experts
        self.optimizer_config = mcfg.optimizer
        self.row_optimizer = RowOptimizer(mcfg.optimizer, self.num_uids)
        off = mcfg.offload
        t0 = time.perf_counter()
        gb = (1 + len(self.row_optimizer.state_names)) * 4 * self.num_uids * self.numel / 1e9
        logger.info("ExpertTrainer: allocating %d experts x %d elements, fp32 master + %s: %.1f GB %s",
                    self.num_uids, self.numel, "/".join(self.row_optimizer.state_names) or "no state", gb,
                    off.nvme_path if off.device == OffloadDevice.NVME else
                    ("pinned CPU" if off.pin_memory and torch.cuda.is_available() else "CPU"))
        self.store = ExpertTrainStore(layout, self.num_uids, self.row_optimizer.state_names, torch.float32,
                                      nvme_path=off.nvme_path if off.device == OffloadDevice.NVME else None,
                                      cpu_cache_shards=off.cpu_cache_shards, pin_memory=off.pin_memory)
        t1 = time.perf_counter()
        logger.info("ExpertTrainer: tier allocated in %.1f s; copying the experts of %d layers", t1 - t0,
                    self.num_layers)
        with torch.no_grad():
            for gi, spec in enumerate(self.layers):
                self.store.write_layer(gi * self.num_experts, spec.tensors())
                spec.tensors = None  # the master is the trainer's copy now: the model's may be freed
        t2 = time.perf_counter()
        logger.info("ExpertTrainer: experts copied in %.1f s; building the %s compute copy", t2 - t1,
                    str(dtype).replace("torch.", ""))
        self.slots = layer_slots(mcfg, layout.nbytes, self.num_layers, self.num_experts)  # one count a layer
        self.compute_device = torch.device(device)
        self._dtype = torch.float32
        self.store.set_compute_dtype(dtype)
        self._dtype = dtype
        if mcfg.gpu_state_experts:  # their masters and state live on the device too, stepped there (step.py)
            self.store.make_resident(range(min(mcfg.gpu_state_experts, self.num_uids)), self.compute_device)
        self.cache: Optional[ExpertCache] = None
        self._pending = None  # split: the step still running into the next forward (pending.py)
        self._step_parts: Optional[StepParts] = None  # what the step variants work on (step.py)
        self._build_cache()
        # the fused row-update op is JIT-built once per machine (~70 s cold for CUDA): load it here, where
        # set-up time is expected and logged, not inside the first training step
        from ds_maximus.ops.row_ops import load_op
        on_cpu = mcfg.optimizer_device == ExpertOptimizerDevice.CPU or self.compute_device.type != "cuda"
        load_op("cpu" if on_cpu else "cuda")
        if mcfg.optimizer_device == ExpertOptimizerDevice.SPLIT and not on_cpu:
            load_op("cpu")
        logger.info("ExpertTrainer: compute copy, expert cache and optimizer op in %.1f s (set-up %.1f s)",
                    time.perf_counter() - t2, time.perf_counter() - t0)
        self.grads = ExpertGrads(self.compute_device, mcfg.gpu_grad_experts or max(self.slots))
        self.counters = ExpertTrainStats(self.num_layers, self.num_experts)
        # the optimizer step's variants (step.py), over the store, gradients, optimizer, counters and cache
        self._step_parts = StepParts(store=self.store, grads=self.grads, optimizer=self.row_optimizer,
                                     counters=self.counters, num_layers=self.num_layers, num_experts=self.num_experts,
                                     numel=self.numel, sub=self.sub, step_chunk_bytes=mcfg.step_chunk_bytes,
                                     cache=self.cache)
        self.in_place_step = InPlaceStep(self._step_parts)
        self.staged_step = StagedStep(self._step_parts)
        self.split_step = SplitStep(self._step_parts, self.in_place_step, self.staged_step, mcfg.cpu_step_share)
        self.log_interval_steps = cfg.logging.interval_steps
        self.carrier_host: Optional[nn.Module] = None
        self._anchor_fn = None
        self._cur_anchor: Optional[Tensor] = None
        self._pending_prefetch = None
        self._used: List[List[int]] = [[] for _ in self.layers]
        self._bwd_prefetched: set = set()

    # -- placement ----------------------------------------------------------------------------------
    def _build_cache(self) -> None:
        self.finish_step()
        if self.cache is not None:
            self.cache.close()
        self.cache = ExpertCache(self.store, self.num_layers, self.num_experts, self.slots, self.compute_device,
                                 self.cfg.moe.cache_policy)
        if self._step_parts is not None:
            self._step_parts.cache = self.cache

    @property
    def out_dtype(self) -> torch.dtype:
        return self._dtype

    @out_dtype.setter
    def out_dtype(self, dtype: torch.dtype) -> None:
        if dtype != self._dtype:
            self.flush()
            self.store.set_compute_dtype(dtype)
            self._dtype = dtype
            self._build_cache()

    def place(self, device: torch.device, dtype: Optional[torch.dtype] = None) -> None:
        """Follow the model to ``device`` (and ``dtype``): called by the layer modules' ``_apply``."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device != self.compute_device:
            self.compute_device = device
            self.grads.device = device
            if self.store.resident:  # moe.gpu_state_experts: their masters and state follow (brought up to date)
                self.store.make_resident(list(self.store.resident), device)
            self._build_cache()
        if dtype is not None and dtype.is_floating_point:
            self.out_dtype = dtype

    def extra_repr(self) -> str:
        return (f"layers={self.num_layers}, experts={self.num_experts}, slots_per_layer={slot_range(self.slots)}, "
                f"tier={self.store.tier}, optimizer={self.optimizer_config.type.value}/"
                f"{self.optimizer_config.mode.value} on {self.cfg.moe.optimizer_device.value}, "
                f"device={self.compute_device}, dtype={self._dtype}")

    # -- forward --------------------------------------------------------------------------------------
    def begin_layer(self, group: int, counts: List[int], hidden: Optional[Tensor] = None) -> List[int]:
        """Routing of layer ``group`` is known (``counts`` tokens per expert): record it, bring routed experts
        that skipped steps up to date, plan the next layer's prefetch. Returns the routed experts."""
        used = [e for e in range(self.num_experts) if counts[e] > 0]
        if self._pending is not None and self._pending.await_layer(group):  # the last step's updates
            self.counters.overlapped_layers += 1                                   # of this layer, just in time
        self.counters.route(group, counts)
        self._used[group] = used
        if group == 0:
            self._bwd_prefetched.clear()
            self._cur_anchor = None
            if torch.is_grad_enabled() and self._anchor_fn is not None:
                self._cur_anchor = self._anchor_fn()
        self._catch_up(group, used)
        self._pending_prefetch = self._plan_prefetch(group, hidden)
        return used

    def anchor(self, like: Tensor) -> Tensor:
        if self._cur_anchor is not None:
            return self._cur_anchor
        return torch.zeros((), dtype=torch.float32, device=like.device)

    def round(self, group: int, experts: List[int], counts: List[int], x: Tensor) -> Tensor:
        """Experts ``experts`` of layer ``group`` on their rows ``x`` (autograd-tracked when training)."""
        anchor = self.anchor(x)
        if torch.is_grad_enabled() and (x.requires_grad or anchor.requires_grad):
            return ExpertRound.apply(anchor, x, self, group, experts, counts)
        return self.run_round(group, experts, counts, x)

    def rounds(self, used: List[int], group: int) -> List[List[int]]:
        return rounds(used, self.cache.slots_of(group))

    def run_round(self, group: int, experts: List[int], counts: List[int], x: Tensor) -> Tensor:
        slots = self.cache.acquire(group, experts)
        if self._pending_prefetch is not None:  # demand loads first, then the next layer's guesses
            fn, self._pending_prefetch = self._pending_prefetch, None
            fn()
        try:
            return self.layers[group].kind.compute(self.cache.slot_buffer(group), slots, counts, x)
        finally:
            self.cache.release(group, slots)

    def backward_round(self, group: int, experts: List[int], counts: List[int], x: Tensor,
                       grad_out: Tensor) -> Optional[Tensor]:
        if self._pending is not None:  # a backward without its forward's begin_layer (never in a model)
            self._pending.await_layer(group)
        slots = self.cache.acquire(group, experts)   # a reload if it was evicted since forward
        self._prefetch_backward(group)
        try:
            with torch.enable_grad():
                buf = self.cache.slot_buffer(group).detach().requires_grad_(True)
                xl = x.detach().requires_grad_(x.requires_grad)
                y = self.layers[group].kind.compute(buf, slots, counts, xl)
                inputs = (xl, buf) if x.requires_grad else (buf,)
                grads = torch.autograd.grad(y, inputs, grad_out)
        finally:
            self.cache.release(group, slots)
        gbuf = grads[-1]
        base = group * self.num_experts
        for e, s in zip(experts, slots):
            self.grads.add(base + e, gbuf[s])
        return grads[0] if x.requires_grad else None

    # -- prefetch -------------------------------------------------------------------------------------
    def _plan_prefetch(self, group: int, hidden: Optional[Tensor]):
        mcfg = self.cfg.moe
        if not mcfg.speculative_prefetch or hidden is None or group + 1 >= self.num_layers:
            return None
        getter = self.layers[group + 1].router_weight
        w = getter() if getter is not None else None
        if w is None or w.numel() == 0 or w.dim() != 2 or w.shape[1] != hidden.shape[-1]:
            return None  # e.g. partitioned by ZeRO-3 outside its module's forward
        k = min(mcfg.guesses(self.layers[group + 1].top_k), self.num_experts, self.cache.slots_of(group + 1))
        with torch.no_grad():
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).to(w.dtype), w)
            votes = count_ids(torch.topk(logits, k, dim=-1).indices, self.num_experts)

        def issue():
            v = votes.tolist()
            ranked = sorted((e for e in range(self.num_experts) if v[e] > 0), key=lambda e: -v[e])
            self._prefetch(group + 1, ranked[:k])
        return issue

    def _prefetch(self, group: int, experts: List[int]) -> None:
        """Load ``experts`` of ``group`` early, except those that skipped steps (their copy is not current)."""
        if not experts:
            return
        if self._pending is not None:  # the layer's updates may still run: guess only once they are done
            if not self._pending.ready(group):
                return
            self._pending.await_layer(group)
        uids = torch.tensor([group * self.num_experts + e for e in experts])
        lag = self.row_optimizer.lagging(uids)
        self.cache.prefetch(group, [e for e, stale in zip(experts, lag.tolist()) if not stale])

    def _prefetch_backward(self, group: int) -> None:
        if not self.cfg.moe.backward_prefetch or group == 0 or group in self._bwd_prefetched:
            return
        self._bwd_prefetched.add(group)
        self._prefetch(group - 1, self._used[group - 1][-self.cache.slots_of(group - 1):])

    # -- optimizer ------------------------------------------------------------------------------------
    def _row_views(self, flat_rows: Tensor) -> Tensor:
        """``[n, numel]`` as ``[n * numel/sub, sub]`` (the op parallelises over rows)."""
        return flat_rows.view(-1, self.sub)

    def _sub_ids(self, uids: Tensor) -> Tensor:
        return uids.repeat_interleave(self.numel // self.sub)

    def _sub_slots(self, uids: Tensor) -> Tensor:
        k = self.numel // self.sub
        return (uids[:, None] * k + torch.arange(k)).flatten()

    def _catch_up(self, group: int, experts: Sequence[int]) -> None:
        """Exact mode: replay the steps these experts skipped (on the CPU tier), then refresh their copies."""
        if not experts:
            return
        uids = torch.tensor([group * self.num_experts + e for e in experts])
        lag = self.row_optimizer.lagging(uids)
        if not bool(lag.any()):
            return
        self._catch_up_uids(uids[lag])

    def _catch_up_uids(self, uids: Tensor) -> None:
        opt, names = self.row_optimizer, self.row_optimizer.state_names
        if self.store.in_memory:  # (resident experts: caught up on the tier, as the CPU side would, then copied)
            self.store.pull(uids.tolist())
            t = self.store.tables
            opt.catch_up(self._row_views(t["weight"]), [self._row_views(t[n]) for n in names],
                         self._sub_slots(uids), self._sub_ids(uids))
            masters = [t["weight"][u] for u in uids.tolist()]
            self.store.push([u for u in uids.tolist() if u in self.store.resident])
        else:
            rows = self.store.read_rows(uids)
            local = torch.arange(uids.numel())
            opt.catch_up(self._row_views(rows["weight"]), [self._row_views(rows[n]) for n in names],
                         self._sub_slots(local), self._sub_ids(uids))
            self.store.write_rows(uids, rows)
            masters = list(rows["weight"])
        self.counters.caught_up += uids.numel()
        for u, m in zip(uids.tolist(), masters):
            self.refresh(u, m)

    def refresh(self, uid: int, master: Tensor, offset: int = 0) -> None:
        """Elements ``offset:`` of ``uid``'s master were updated to ``master``: refresh the shadow and, when
        resident, the cache slot (so no stale copy is ever computed with)."""
        self._step_parts.refresh(uid, master, offset)

    def refresh_slot(self, uid: int, src: Tensor, offset: int = 0) -> None:
        """If ``uid`` is resident, overwrite its cache slot from element ``offset`` with ``src``."""
        self._step_parts.refresh_slot(uid, src, offset)

    @property
    def cpu_step_share(self) -> Optional[float]:
        """The split step's measured share of the CPU side (``None`` before its first measurement)."""
        return self.split_step.share

    def _step_device(self) -> torch.device:
        if self.cfg.moe.optimizer_device == ExpertOptimizerDevice.CPU:
            return torch.device("cpu")
        return self.compute_device

    def sparse_step(self, lr: Optional[float] = None, weight_decay: Optional[float] = None) -> None:
        """Step every expert with gradient (AdamW on the compute device by default), refresh its copies."""
        t0 = time.perf_counter()
        self.finish_step()
        opt = self.row_optimizer
        opt.begin_step(lr, weight_decay)
        t1 = time.perf_counter()
        self.cache.synchronize()
        t2 = time.perf_counter()
        uids = self.grads.uids()
        dev = self._step_device()
        split = self.cfg.moe.optimizer_device == ExpertOptimizerDevice.SPLIT and self.store.in_memory
        if uids and split:
            self._pending = self.split_step.run(uids, dev)
            if not self.cfg.moe.overlap_step:
                self.finish_step()
        elif uids and dev.type == "cpu" and self.store.in_memory:
            self.in_place_step.run(uids, dev)
        elif uids:
            self.staged_step.run(uids, dev)
        self.grads.clear()
        t3 = time.perf_counter()
        # where the step's host time went: the last step's finish, the expert cache's copies in flight, this one's issue
        self.counters.step_parts_ms = ((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
        self.counters.end_step(self.cache, (t3 - t0) * 1e3)
        if opt.step % self.log_interval_steps == 0:
            logger.info("ExpertTrainer step %d: %s", opt.step, self.counters.line())

    @property
    def step_running(self) -> bool:
        """Whether the last optimizer step still updates experts (a split step that overlaps the next forward;
        :meth:`finish_step` waits for it)."""
        return self._pending is not None

    def finish_step(self) -> None:
        """Wait until the last optimizer step has updated every expert and each copy of it (a split step runs
        on into the next forward unless ``moe.overlap_step`` is false); a no-op when none is running."""
        p, self._pending = self._pending, None
        if p is None:
            return
        try:
            t_cpu, t_dev = p.finish()
        finally:
            self.counters.step_wait_ms += p.wait_s * 1e3
        self.counters.split_sides = (t_cpu * 1e3, t_dev * 1e3, p.n_cpu, p.n_dev)
        self.split_step.rebalance(p, t_cpu, t_dev)

    def configure_from_engine(self, engine, cfg: Optional[MaximusConfig] = None) -> None:
        """Betas/eps follow the DeepSpeed optimizer's unless ``moe.optimizer`` sets them (exact equals dense).
        ``cfg`` is the protocol's argument; the trainer reads its own ``moe`` section."""
        opt = getattr(engine, "basic_optimizer", None) or engine.optimizer
        groups = getattr(opt, "param_groups", None)
        if not groups:
            return
        g, oc, ro = groups[0], self.optimizer_config, self.row_optimizer
        if "betas" not in oc.model_fields_set and "betas" in g:
            ro.beta1, ro.beta2 = (float(b) for b in g["betas"])
        if "eps" not in oc.model_fields_set and "eps" in g:
            ro.eps = float(g["eps"])

    # -- the maximus module protocol ------------------------------------------------------------------
    role = ModuleRole.EXPERTS

    def set_out_dtype(self, dtype: torch.dtype) -> None:
        self.out_dtype = dtype

    def grad_anchor_host(self) -> nn.Module:
        """The first MoE layer's experts module: every layer's backward feeds its anchor."""
        return self.carrier_host

    def set_grad_anchor(self, fn) -> None:
        self._anchor_fn = fn

    def sparse_grads(self):
        """``(uids [U] CPU long, grads [U, numel] fp32)`` of the experts with gradient."""
        uids = self.grads.uids()
        if not uids:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, self.numel, device=self.compute_device)
        return torch.tensor(uids), torch.stack([self.grads.get(u, self.compute_device) for u in uids])

    def set_sparse_grads_(self, ids: Tensor, rows: Tensor) -> None:
        self.grads.clear()
        for u, r in zip(ids.tolist(), rows):
            self.grads.add(int(u), r.to(self.compute_device))

    def reduce_grads(self, group=None) -> None:
        """Each expert's gradient summed over the ranks as one dense buffer per expert (no id exchange)."""
        self.grads.allreduce_(self.num_uids, group)

    def sparse_grad_norm_sq(self) -> Tensor:
        return self.grads.norm_sq()

    def scale_sparse_grads_(self, factor: float) -> None:
        self.grads.scale_(factor)

    def sparse_grads_finite(self) -> bool:
        return self.grads.finite()

    def zero_sparse_grads(self) -> None:
        self.grads.clear()

    def flush(self) -> None:
        self.finish_step()
        self.cache.synchronize()
        self.store.flush()

    def device_bytes(self) -> dict:
        """Bytes this trainer holds on the compute device now, by use: what a memory cap has to fit beside the
        model's dense part and the activations."""
        def size(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        return {"expert slots": self.cache.device_bytes(),
                "device-state experts": size(self.store.device_tables.values()),
                "step pipeline": self.staged_step.device_bytes(), **self.grads.device_bytes()}

    def stats(self) -> dict:
        """Cumulative figures and ``"last_step"`` (experts moved, bytes, stall ms, hit rate, routing)."""
        return self.counters.as_dict(self.cache)
