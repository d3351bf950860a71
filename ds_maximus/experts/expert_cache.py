"""The expert cache core: per-group slot buffers on the compute device, filled from a slow tier.

It knows nothing about models. A *group* is one MoE layer; ids inside a group are expert indices;
the store addresses ``uid = group * num_experts + expert``. Each group has a :class:`SlotMap`
(LRU/LFU, pinning, counters) and one buffer ``[slots, numel]``; a slot holds one expert as one flat
vector, so a load is one ``copy_(non_blocking=True)`` on the transfer engine's side stream.

Ordering (CUDA): a load into a slot first waits on the slot's *last-use* event (recorded on the
compute stream by :meth:`release`), and the compute stream waits on the slot's *load* event before
reading it (:meth:`acquire`). The host never waits for a copy, except when every slot of a group is
pinned by loads in flight and a demand needs one of them.

Never evicted: experts being computed with (pinned between ``acquire`` and ``release``) and
experts in flight (pinned from ``prefetch`` until their load event has completed).

With ``prefetch_chunk_bytes`` (inference), a prefetch is a guess of which only the first chunk is
queued (see ``transfer.PrefetchJob``): when the layer's routing arrives (``acquire``), a guess the
layer does not need is dropped and its slot forgotten, and the rest of one it needs is queued at once.
With ``stage_guesses`` as well, the head goes into one staging buffer instead of a slot: a guess then
evicts nothing (the eviction is decided when the routing is known, as without prefetch), a wrong guess
costs only its head's link time, and a right one only moves the rest (the head is copied on the device).

A later training issue reuses this core unchanged: the store then also holds fp32 masters and
optimizer state, and the SlotMap's ``evicted_ids`` say which slots to write back first.

    >>> import torch
    >>> from ds_maximus.experts.layout import ExpertLayout
    >>> from ds_maximus.experts.expert_store import CpuExpertStore
    >>> lay = ExpertLayout.from_stacked({"w": torch.zeros(4, 2, 2)}, num_experts=4)
    >>> store = CpuExpertStore(lay, num_uids=4, pin_memory=False)
    >>> for e in range(4): store.write(e, {"w": torch.full((2, 2), float(e))})
    >>> cache = ExpertCache(store, num_groups=1, num_experts=4, slots_per_group=2, device="cpu")
    >>> slots = cache.acquire(0, [3, 1]); float(lay.view(cache.slot(0, slots[0]), "w")[0, 0])
    3.0
    >>> cache.release(0, slots); cache.stats()["hit_rate"]
    0.0
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import torch

from ds_maximus.partition.policy import SlotMap
from ds_maximus.config import CachePolicy
from ds_maximus.errors import CapacityError
from ds_maximus.experts.expert_store import ExpertStore
from ds_maximus.experts.transfer import CpuTransfer, CudaTransfer


@dataclasses.dataclass
class ExpertCacheStats:
    """Cumulative counters of the expert cache (experts and bytes)."""

    demand_lookups: int = 0
    demand_hits: int = 0          # resident (or in flight) when asked for
    demand_misses: int = 0        # loaded on demand
    prefetch_issued: int = 0      # loads started by speculative prefetch
    prefetch_useful: int = 0      # prefetched experts later used before eviction
    prefetch_cancelled: int = 0   # guesses dropped part-way when the routing showed them wrong
    bytes_demand: int = 0
    bytes_prefetch: int = 0
    host_stall_ms: float = 0.0    # host blocked on loads (CPU engine, or all slots in flight)
    gpu_stall_ms: float = 0.0     # compute stream blocked on load events (CUDA)
    evictions: int = 0


class _Group:
    def __init__(self, slots: int, num_experts: int, numel: int, dtype, device, policy):
        self.map = SlotMap(slots, num_experts, policy)
        self.buffer = torch.empty((slots, numel), dtype=dtype, device=device)
        self.load_ev: List[object] = [None] * slots
        self.use_ev: List[object] = [None] * slots
        self.inflight: Dict[int, object] = {}      # slot -> load event of a prefetch not yet landed
        self.prefetched = [False] * slots           # holds a prefetched expert not yet used
        self.in_use = [0] * slots                   # acquire/release balance (test hook)


class ExpertCache:
    """Per-group expert slots on ``device`` backed by an :class:`ExpertStore` (see module docstring)."""

    def __init__(self, store: ExpertStore, num_groups: int, num_experts: int, slots_per_group: int,
                 device, policy: CachePolicy = CachePolicy.LRU, transfer=None,
                 prefetch_chunk_bytes: Optional[int] = None, stage_guesses: bool = False):
        self.store = store
        self.prefetch_chunk_bytes = prefetch_chunk_bytes  # None: a prefetch is one whole load
        self.stage_guesses = stage_guesses
        self._stage: Optional[torch.Tensor] = None  # the staged guess's head (allocated on first use)
        self._stage_ev = None                       # the staging buffer's last copy
        self._guess: Optional[tuple] = None         # (group, expert) whose head is staged
        self.layout = store.layout
        self.num_groups = int(num_groups)
        self.num_experts = int(num_experts)
        self.slots_per_group = int(min(slots_per_group, num_experts))
        if self.slots_per_group < 1:
            raise CapacityError(f"the expert cache needs at least one slot per layer, got {slots_per_group}; "
                                "raise moe.gpu_experts_per_layer or moe.gpu_expert_bytes")
        self.device = torch.device(device)
        if transfer is None:
            transfer = CudaTransfer(self.device) if self.device.type == "cuda" else CpuTransfer()
        self.transfer = transfer
        self.groups = [_Group(self.slots_per_group, self.num_experts, self.layout.numel, self.layout.dtype,
                              self.device, policy) for _ in range(self.num_groups)]
        self.counters = ExpertCacheStats()

    # -- views -----------------------------------------------------------------------------
    def slot(self, group: int, slot: int) -> torch.Tensor:
        """The flat buffer of one slot."""
        return self.groups[group].buffer[slot]

    def slot_buffer(self, group: int) -> torch.Tensor:
        """All slots of a group, ``[slots, numel]`` (see ``ExpertLayout.stacked_view``)."""
        return self.groups[group].buffer

    def device_bytes(self) -> int:
        """Bytes of the slots (and the staged guess's head) on the device."""
        ts = [g.buffer for g in self.groups] + ([self._stage] if self._stage is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def resident(self, group: int) -> List[int]:
        return sorted(int(i) for i in self.groups[group].map.resident_ids())

    def pinned_slots(self, group: int) -> List[int]:
        return [int(s) for s in (self.groups[group].map.pin_count > 0).nonzero().flatten()]

    # -- in-flight bookkeeping ---------------------------------------------------------------
    def _reap(self, g: _Group) -> None:
        """Unpin prefetches whose load has landed."""
        done = [s for s, ev in g.inflight.items() if self.transfer.done(ev)]
        for s in done:
            del g.inflight[s]
        if done:
            g.map.unpin(torch.tensor(done, dtype=torch.long))

    def _drain(self, g: _Group) -> None:
        """Wait (host) for every prefetch of the group in flight, then unpin them."""
        t0 = time.perf_counter()
        for ev in g.inflight.values():
            self.transfer.synchronize(ev)
        self.counters.host_stall_ms += (time.perf_counter() - t0) * 1e3
        self._reap(g)

    def _load(self, gi: int, g: _Group, slot: int, expert: int, head: Optional[torch.Tensor] = None) -> object:
        ev = self.transfer.load(g.buffer[slot], self.store, gi * self.num_experts + expert, g.use_ev[slot],
                                head=head)
        g.load_ev[slot] = ev
        return ev

    # -- staged guesses ---------------------------------------------------------------------
    def _stage_guess(self, group: int, experts: Sequence[int]) -> Optional[int]:
        """Stage the head of the first of ``experts`` not resident (replacing an unresolved guess);
        None when the tier cannot stage (NVMe: the guess goes into a slot, read whole)."""
        g = self.groups[group]
        for e in (int(x) for x in experts):
            if int(g.map.id_to_slot[e]) >= 0:
                continue
            uid = group * self.num_experts + e
            if self.store.host_view(uid) is None:
                return None
            if self._stage is None:
                n = min(self.layout.numel, max(1, self.prefetch_chunk_bytes // self.layout.dtype.itemsize))
                self._stage = torch.empty(n, dtype=self.layout.dtype, device=self.device)
            self._drop_staged()
            self._stage_ev = self.transfer.load_head(self._stage, self.store, uid, self._stage_ev)
            self._guess = (group, e)
            self.counters.prefetch_issued += 1
            self.counters.bytes_prefetch += self._stage_bytes()
            return 1
        return 0

    def _stage_bytes(self) -> int:
        return 0 if self._stage is None else self._stage.numel() * self._stage.element_size()

    def _drop_staged(self) -> None:
        if self._guess is not None:
            self._guess = None
            self.counters.prefetch_cancelled += 1

    def _take_staged(self, group: int, experts: Sequence[int], needed: Sequence[int]) -> Optional[int]:
        """The staged guess's expert if this round of ``group`` asks for it; a guess the layer does not
        need at all is dropped, one for a later round of the layer is kept."""
        if self._guess is None or self._guess[0] != group:
            return None
        e = self._guess[1]
        if e in experts:
            self._guess = None
            return e
        if e not in needed:
            self._drop_staged()
        return None

    def _drop_guesses(self, g: _Group, needed: Sequence[int]) -> None:
        """Drop the group's prefetches in flight whose expert is not in ``needed``; a dropped slot's
        contents are partial, so its expert is forgotten (a later load into it queues behind its chunk)."""
        want = set(int(e) for e in needed)
        for s, h in list(g.inflight.items()):
            e = int(g.map.slot_to_id[s])
            if e in want or self.transfer.cancel(h):
                continue
            g.map.evict(torch.tensor([e]))
            g.map.unpin(torch.tensor([s]))
            del g.inflight[s]
            g.prefetched[s] = False
            self.counters.prefetch_cancelled += 1
            self.counters.bytes_prefetch -= h.unqueued_bytes()

    # -- demand ----------------------------------------------------------------------------
    def acquire(self, group: int, experts: Sequence[int], needed: Optional[Sequence[int]] = None) -> List[int]:
        """Make ``experts`` (unique ids) resident and usable by the compute stream; returns their slots.

        The slots stay pinned until :meth:`release`. Raises :class:`CapacityError` when more experts
        are asked for at once than the group has slots (callers split into rounds of ``slots_per_group``).
        ``needed``: every expert this layer computes with now (all rounds; default ``experts``):
        prefetches in flight for any other expert are dropped.
        """
        g = self.groups[group]
        needed = experts if needed is None else needed
        self._drop_guesses(g, needed)
        staged = self._take_staged(group, experts, needed)
        if len(experts) > self.slots_per_group:
            raise CapacityError(f"{len(experts)} experts asked for at once in layer {group}, but the cache has "
                                f"{self.slots_per_group} slots per layer; compute in rounds, or raise "
                                "moe.gpu_experts_per_layer")
        ids = torch.tensor(list(experts), dtype=torch.long)
        self._reap(g)
        try:
            a = g.map.assign(ids)
        except CapacityError:
            self._drain(g)   # every free slot was a prefetch in flight: let them land
            a = g.map.assign(ids)
        miss_slots = set(int(s) for s in a.miss_slots)
        c = self.counters
        c.demand_lookups += len(experts)
        c.demand_misses += len(miss_slots)
        c.demand_hits += len(experts) - len(miss_slots)
        c.evictions += int(a.evicted_ids.numel())
        slots = [int(s) for s in a.slots]
        for e, s in zip(experts, slots):
            if s in miss_slots and int(e) == staged:  # the guess was right: only the rest crosses the link
                g.prefetched[s] = False
                self._stage_ev = self._load(group, g, s, int(e), head=self._stage)
                c.bytes_demand += self.layout.nbytes - self._stage_bytes()
                c.demand_misses -= 1
                c.demand_hits += 1
                c.prefetch_useful += 1
                staged = None
            elif s in miss_slots:
                g.prefetched[s] = False
                self._load(group, g, s, int(e))
                c.bytes_demand += self.layout.nbytes
            elif g.prefetched[s]:
                g.prefetched[s] = False
                c.prefetch_useful += 1
        if staged is not None:  # staged, but resident after all
            self.counters.prefetch_cancelled += 1
        g.map.pin(torch.tensor(slots, dtype=torch.long))
        for s in slots:
            g.in_use[s] += 1
            stall = self.transfer.wait(g.load_ev[s])
            c.host_stall_ms += stall
        return slots

    def release(self, group: int, slots: Sequence[int]) -> None:
        """The compute queued so far is the last use of ``slots``; they may be evicted again."""
        g = self.groups[group]
        ev = self.transfer.record_use()
        for s in slots:
            g.use_ev[s] = ev
            g.in_use[s] -= 1
            assert g.in_use[s] >= 0, "release without acquire"
        g.map.unpin(torch.tensor(list(slots), dtype=torch.long))

    # -- speculation -----------------------------------------------------------------------
    def prefetch(self, group: int, experts: Sequence[int], keep: Optional[Sequence[int]] = None) -> int:
        """Start loading ``experts`` of ``group`` if absent (best effort); returns loads started.

        Never evicts a pinned slot, nor a resident expert in ``keep``, and never loads more experts than
        there are slots left to evict.
        """
        if self.stage_guesses and self.prefetch_chunk_bytes:
            started = self._stage_guess(group, experts)
            if started is not None:
                return started
        g = self.groups[group]
        self._reap(g)
        held = [int(g.map.id_to_slot[int(e)]) for e in (keep or ())]
        held = torch.tensor([s for s in held if s >= 0], dtype=torch.long)
        g.map.pin(held)  # for this call only: the victims come from the other slots
        try:
            free = self.slots_per_group - int((g.map.pin_count > 0).sum())
            want = [int(e) for e in experts if int(g.map.id_to_slot[int(e)]) < 0]
            want = want[:max(0, free)]
            if not want:
                return 0
            a = g.map.assign(torch.tensor(want, dtype=torch.long), count=False)
        except CapacityError:
            return 0
        finally:
            g.map.unpin(held)
        self.counters.evictions += int(a.evicted_ids.numel())
        started = []
        for e, s in zip(a.miss_ids.tolist(), a.miss_slots.tolist()):
            h = self.transfer.prefetch(g.buffer[s], self.store, group * self.num_experts + e, g.use_ev[s],
                                       self.prefetch_chunk_bytes)
            g.inflight[s] = g.load_ev[s] = h
            g.prefetched[s] = True
            started.append(s)
        if started:
            g.map.pin(torch.tensor(started, dtype=torch.long))
        self.counters.prefetch_issued += len(started)
        self.counters.bytes_prefetch += len(started) * self.layout.nbytes
        return len(started)

    # -- training: slots whose expert changed in the slow tier ---------------------------------
    def write_slot(self, group: int, expert: int, src: torch.Tensor, offset: int = 0) -> bool:
        """If ``expert`` is resident, overwrite its slot from element ``offset`` with ``src`` (flat, any
        dtype/device) on the compute stream, and mark that as the slot's last use (a later load into the
        slot waits for it). Returns whether it was resident."""
        g = self.groups[group]
        self._drain(g)
        s = int(g.map.id_to_slot[int(expert)])
        if s < 0:
            return False
        g.buffer[s][offset:offset + src.numel()].copy_(src, non_blocking=True)
        g.use_ev[s] = self.transfer.record_use()
        return True

    # -- reporting -------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        if isinstance(self.transfer, CudaTransfer):
            c.gpu_stall_ms += self.transfer.gpu_stall_ms()
        lookups = max(c.demand_lookups, 1)
        return {
            "hit_rate": c.demand_hits / lookups if c.demand_lookups else 0.0,
            "demand_lookups": c.demand_lookups,
            "demand_hits": c.demand_hits,
            "demand_misses": c.demand_misses,
            "prefetch_issued": c.prefetch_issued,
            "prefetch_useful": c.prefetch_useful,
            "prefetch_cancelled": c.prefetch_cancelled,
            "prefetch_precision": c.prefetch_useful / c.prefetch_issued if c.prefetch_issued else 0.0,
            "prefetch_recall": (c.prefetch_useful / (c.prefetch_useful + c.demand_misses)
                                if c.prefetch_useful + c.demand_misses else 0.0),
            "bytes_demand": c.bytes_demand,
            "bytes_prefetch": c.bytes_prefetch,
            "bytes_moved": c.bytes_demand + c.bytes_prefetch,
            "stall_ms": c.host_stall_ms + c.gpu_stall_ms,
            "host_stall_ms": c.host_stall_ms,
            "gpu_stall_ms": c.gpu_stall_ms,
            "evictions": c.evictions,
            "expert_bytes": self.layout.nbytes,
            "staging_bytes": self._stage_bytes(),
            "slots_per_layer": self.slots_per_group,
        }

    def reset_stats(self) -> None:
        if isinstance(self.transfer, CudaTransfer):
            self.transfer.gpu_stall_ms()
        self.counters = ExpertCacheStats()

    def synchronize(self) -> None:
        self.transfer.synchronize(self._stage_ev)
        for g in self.groups:
            for ev in g.load_ev:
                self.transfer.synchronize(ev)
            self._reap(g)

    def close(self) -> None:
        self.synchronize()
        self.transfer.close()
