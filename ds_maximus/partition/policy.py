"""Eviction bookkeeping of a partition cache, as tensors so a 65K-slot row cache stays on the GPU.

The cache knows nothing about what a partition is (a vocab row, an expert): it maps integer ids
in ``[0, num_ids)`` to slots in ``[0, num_slots)`` and decides which slots to give up.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import List

import numpy as np
import torch

from ds_maximus.config import CachePolicy
from ds_maximus.errors import CapacityError
from ds_maximus.ops import index_array


@dataclasses.dataclass
class CacheCounters:
    """Cumulative counters (entries, not bytes)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def delta(self, earlier: "CacheCounters") -> "CacheCounters":
        return CacheCounters(*(getattr(self, f.name) - getattr(earlier, f.name)
                               for f in dataclasses.fields(self)))


@dataclasses.dataclass
class Assignment:
    """Result of :meth:`SlotMap.assign` for a batch of unique ids.

    ``slots[i]`` is the slot of ``ids[i]``; ``miss_ids`` must be filled into ``miss_slots``;
    ``evicted_ids`` were in ``evicted_slots`` (the same slots as the misses that replaced them) and
    must be written back first if dirty.
    """

    slots: torch.Tensor
    miss_ids: torch.Tensor
    miss_slots: torch.Tensor
    evicted_ids: torch.Tensor
    evicted_slots: torch.Tensor


def capacity_error(num_slots: int, n_ids: int, n_miss: int, too_many: bool, pinned: int) -> CapacityError:
    """What an assign that cannot place ``n_miss`` of its ``n_ids`` ids says: more ids than slots
    (``too_many``), or too few slots neither pinned nor holding the batch."""
    if too_many:
        return CapacityError(
            f"a batch needs {n_ids} distinct entries but the cache has {num_slots} slots; "
            "raise gpu_cache_rows (or gpu_experts_per_layer), or use smaller batches")
    return CapacityError(
        f"cache of {num_slots} slots cannot take {n_miss} new entries: {pinned} slots are "
        f"pinned (in use or in flight) and {n_ids - n_miss} hold this batch; raise the cache size "
        "(gpu_cache_rows / gpu_experts_per_layer) or use smaller batches")


class SlotMap:
    """id -> slot map with LRU or LFU eviction and pinning.

    >>> m = SlotMap(num_slots=2, num_ids=10, policy=CachePolicy.LRU)
    >>> a = m.assign(torch.tensor([3, 5])); a.miss_ids.tolist()
    [3, 5]
    >>> a = m.assign(torch.tensor([3])); a.miss_ids.tolist()   # hit
    []
    >>> a = m.assign(torch.tensor([7])); a.evicted_ids.tolist() # 5 is least recently used
    [5]
    """

    def __init__(self, num_slots: int, num_ids: int, policy: CachePolicy = CachePolicy.LRU,
                 device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise CapacityError(f"a partition cache needs at least one slot, got {num_slots}")
        self.num_slots = int(num_slots)
        self.num_ids = int(num_ids)
        self.policy = CachePolicy(policy)
        self.device = torch.device(device)
        self.id_to_slot = torch.full((num_ids,), -1, dtype=torch.long, device=self.device)
        self.slot_to_id = torch.full((num_slots,), -1, dtype=torch.long, device=self.device)
        self.last_use = torch.zeros(num_slots, dtype=torch.float64, device=self.device)
        self.id_freq = torch.zeros(num_ids if self.policy == CachePolicy.LFU else 0, dtype=torch.float64,
                                   device=self.device)
        self.slot_freq = torch.zeros(num_slots if self.policy == CachePolicy.LFU else 0, dtype=torch.float64,
                                     device=self.device)  # id_freq of each slot's id, kept by touch()
        self.pin_count = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        self.clock = 0
        self.counters = CacheCounters()
        self.use_op = True  # False: always the torch reference (tests compare the two)

    # -- queries ---------------------------------------------------------------------------
    # (index_select / index_copy_ / index_fill_ throughout: CPU advanced indexing is ~20x slower)
    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (-1 where not resident)."""
        if self.device.type == "cpu":  # numpy: a third of the torch op's time, called several times a step
            return torch.from_numpy(self.id_to_slot.numpy()[index_array(ids)])
        return self.id_to_slot.index_select(0, ids.to(self.device, torch.long).reshape(-1))

    def resident_ids(self) -> torch.Tensor:
        return self.slot_to_id.index_select(0, torch.nonzero(self.slot_to_id >= 0).squeeze(1))

    # -- pinning ---------------------------------------------------------------------------
    def pin(self, slots: torch.Tensor) -> None:
        """Protect slots (in use or in flight) from eviction until :meth:`unpin`."""
        self.pin_count.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))

    def unpin(self, slots: torch.Tensor) -> None:
        self.pin_count.index_add_(0, slots, -torch.ones_like(slots, dtype=torch.int32))
        if self.device.type == "cpu":  # the touched slots only, in numpy (a torch min over all is ~25 us)
            ok = not slots.numel() or int(self.pin_count.numpy()[index_array(slots)].min()) >= 0
        else:
            ok = int(self.pin_count.min()) >= 0
        assert ok, "unpin without pin"

    # -- the one operation ------------------------------------------------------------------
    def assign(self, ids: torch.Tensor, count: bool = True) -> Assignment:
        """Give every id of ``ids`` (unique) a slot, evicting unpinned entries not in ``ids``.

        On the host this is one call of the ``slot_assign`` op (ties among victims broken by slot number);
        :meth:`assign_reference` is the same in torch ops, used where the op is not built.
        """
        ids = ids.to(self.device, torch.long).reshape(-1).contiguous()
        op = self._op()
        if op is None:
            return self.assign_reference(ids, count)
        status, slots, miss_pos, victims, evicted_ids, evicted_slots = op.slot_assign(
            ids, self.id_to_slot, self.slot_to_id, self.last_use, self.slot_freq, self.id_freq, self.pin_count,
            float(self.clock + 1), self.policy == CachePolicy.LFU)
        if status:
            self._capacity_error(ids, miss_pos.numel() if status == 1 else int((slots < 0).sum()), status == 1)
        self.clock += 1
        if count:
            self._count(ids.numel(), miss_pos.numel(), evicted_ids.numel())
        return Assignment(slots, ids.index_select(0, miss_pos), victims, evicted_ids, evicted_slots)

    def _op(self):
        """The built op with ``slot_assign``, or None (then the reference). Looked up on each call, not kept:
        a map holding a module object could not be deep-copied or pickled with its model."""
        if self.device.type != "cpu" or not self.use_op:
            return None
        from ds_maximus.ops.row_ops import host_op
        op = host_op()
        return op if op is not None and hasattr(op, "slot_assign") else None

    def _capacity_error(self, ids: torch.Tensor, n_miss: int, too_many: bool):
        raise capacity_error(self.num_slots, ids.numel(), n_miss, too_many, int((self.pin_count > 0).sum()))

    def assign_reference(self, ids: torch.Tensor, count: bool = True) -> Assignment:
        """:meth:`assign` in torch ops (any device)."""
        ids = ids.to(self.device, torch.long).reshape(-1)
        slots = self.id_to_slot.index_select(0, ids)
        miss_pos = torch.nonzero(slots < 0).squeeze(1)
        n_miss = miss_pos.numel()
        empty = ids.new_empty(0)
        evicted_ids, victims, evicted_slots = empty, empty, empty
        miss_ids = ids.index_select(0, miss_pos)
        if n_miss:
            if n_miss > self.num_slots:
                self._capacity_error(ids, n_miss, True)
            hit_slots = slots.index_select(0, torch.nonzero(slots >= 0).squeeze(1))
            score = self._score()
            score.masked_fill_(self.slot_to_id < 0, -1.0)  # free slots first
            score.masked_fill_(self.pin_count > 0, float("inf"))
            score.index_fill_(0, hit_slots, float("inf"))
            victims = self._lowest(score, n_miss)
            if bool(torch.isinf(score.index_select(0, victims)).any()):
                self._capacity_error(ids, n_miss, False)
            old = self.slot_to_id.index_select(0, victims)
            was = torch.nonzero(old >= 0).squeeze(1)
            evicted_ids = old.index_select(0, was)
            evicted_slots = victims.index_select(0, was)
            self.id_to_slot.index_fill_(0, evicted_ids, -1)
            self.slot_to_id.index_copy_(0, victims, miss_ids)
            self.id_to_slot.index_copy_(0, miss_ids, victims)
            slots = slots.clone()
            slots.index_copy_(0, miss_pos, victims)
        self.touch(ids, slots)
        if count:
            self._count(ids.numel(), n_miss, evicted_ids.numel())
        return Assignment(slots, miss_ids, victims, evicted_ids, evicted_slots)

    def _count(self, n_ids: int, n_miss: int, n_evicted: int) -> None:
        c = self.counters
        c.lookups, c.misses, c.hits = c.lookups + n_ids, c.misses + n_miss, c.hits + n_ids - n_miss
        c.evictions += n_evicted

    def touch(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Record a use of ``ids`` (already resident in ``slots``)."""
        self.clock += 1
        self.last_use.index_fill_(0, slots, float(self.clock))
        if self.policy == CachePolicy.LFU:
            self.id_freq.index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.float64, device=self.device))
            self.slot_freq.index_copy_(0, slots, self.id_freq.index_select(0, ids))

    def evict(self, ids: torch.Tensor) -> torch.Tensor:
        """Drop ``ids`` from the map (for explicit flushes); returns their former slots."""
        slots = self.slots_of(ids)
        slots = slots.index_select(0, torch.nonzero(slots >= 0).squeeze(1))
        self.id_to_slot.index_fill_(0, self.slot_to_id.index_select(0, slots), -1)
        self.slot_to_id.index_fill_(0, slots, -1)
        return slots

    @staticmethod
    def _lowest(score: torch.Tensor, k: int) -> torch.Tensor:
        """Slots of the ``k`` lowest scores, ties broken by slot number, in ascending slot order (as the
        ``slot_assign`` op chooses them)."""
        if score.device.type != "cpu":
            return torch.sort(torch.topk(score, k, largest=False, sorted=False).indices).values
        a = score.numpy()
        kth = np.partition(a, k - 1)[k - 1]
        less = np.flatnonzero(a < kth)
        chosen = np.concatenate([less, np.flatnonzero(a == kth)[:k - less.size]])
        return torch.from_numpy(np.sort(chosen).astype(np.int64, copy=False))

    def _score(self) -> torch.Tensor:
        if self.policy == CachePolicy.LRU:
            return self.last_use.clone()
        # least frequent first, least recent among equals (free slots are masked by the caller)
        return self.slot_freq * 1e9 + self.last_use


@dataclasses.dataclass
class HostAssignment:
    """:class:`Assignment` as host lists (:meth:`HostSlotMap.assign`)."""

    slots: List[int]
    miss_ids: List[int]
    miss_slots: List[int]
    evicted_ids: List[int]
    evicted_slots: List[int]


class HostSlotMap:
    """:class:`SlotMap`'s policy on Python lists, for the small maps of an expert cache (a layer's experts).

    A batch-1 decode step asks each MoE layer's map a dozen small questions (assign two experts, pin them, is
    the guess resident, unpin), between the layer's routing sync and its first expert kernel, on the host that
    also queues the GPU's work. On tensors each is a few ATen calls; on lists a few list operations
    (``scripts/probe_cache_bookkeeping.py`` times both). The decisions are :class:`SlotMap`'s, choice for
    choice (free slots first, then the lowest LRU or LFU score, ties by slot number, the i-th miss into the i-th
    lowest victim slot; ``tests/partition/test_slot_map.py`` runs both on the same sequences). A vocabulary
    cache of 65K slots keeps :class:`SlotMap` (its op and its device maps).

    >>> m = HostSlotMap(num_slots=2, num_ids=10)
    >>> m.assign([3, 5]).miss_ids, m.assign([3]).miss_ids, m.assign([7]).evicted_ids
    ([3, 5], [], [5])
    """

    def __init__(self, num_slots: int, num_ids: int, policy: CachePolicy = CachePolicy.LRU):
        if num_slots < 1:
            raise CapacityError(f"a partition cache needs at least one slot, got {num_slots}")
        self.num_slots = int(num_slots)
        self.num_ids = int(num_ids)
        self.policy = CachePolicy(policy)
        self.lfu = self.policy == CachePolicy.LFU
        self._i2s = [-1] * self.num_ids
        self._s2i = [-1] * self.num_slots
        self._last = [0.0] * self.num_slots
        self._id_freq = [0.0] * self.num_ids if self.lfu else []
        self._slot_freq = [0.0] * self.num_slots if self.lfu else []  # id_freq of each slot's id
        self._pins = [0] * self.num_slots
        self.clock = 0
        self.counters = CacheCounters()

    # -- queries ---------------------------------------------------------------------------
    def slot(self, entry: int) -> int:
        """The slot of ``entry``, or -1."""
        return self._i2s[entry]

    def owner(self, slot: int) -> int:
        """The id in ``slot``, or -1."""
        return self._s2i[slot]

    def resident_ids(self) -> List[int]:
        """The ids held, in slot order."""
        return [e for e in self._s2i if e >= 0]

    def pinned(self) -> int:
        """How many slots are pinned."""
        return sum(1 for p in self._pins if p > 0)

    def is_pinned(self, slot: int) -> bool:
        return self._pins[slot] > 0

    # read-only copies in SlotMap's dtypes, for reports and tests (writing them changes nothing)
    @property
    def id_to_slot(self) -> torch.Tensor:
        return torch.tensor(self._i2s, dtype=torch.long)

    @property
    def slot_to_id(self) -> torch.Tensor:
        return torch.tensor(self._s2i, dtype=torch.long)

    @property
    def pin_count(self) -> torch.Tensor:
        return torch.tensor(self._pins, dtype=torch.int32)

    def slots_of(self, ids) -> torch.Tensor:
        """Slots of ``ids`` (-1 where not resident), as :meth:`SlotMap.slots_of`."""
        return torch.tensor([self._i2s[int(e)] for e in _ints(ids)], dtype=torch.long)

    # -- pinning ---------------------------------------------------------------------------
    def pin(self, slots) -> None:
        """Protect ``slots`` (in use or in flight) from eviction until :meth:`unpin`."""
        for s in _ints(slots):
            self._pins[s] += 1

    def unpin(self, slots) -> None:
        for s in _ints(slots):
            self._pins[s] -= 1
            assert self._pins[s] >= 0, "unpin without pin"

    # -- the one operation ------------------------------------------------------------------
    def assign(self, ids, count: bool = True) -> HostAssignment:
        """Give every id of ``ids`` (unique ints) a slot, evicting unpinned entries not in ``ids``
        (:meth:`SlotMap.assign` on lists)."""
        ids = _ints(ids)
        i2s, s2i = self._i2s, self._s2i
        for e in ids:
            if not 0 <= e < self.num_ids:
                raise IndexError(f"id {e} out of range for a map of {self.num_ids} ids")
        slots = [i2s[e] for e in ids]
        miss_pos = [u for u, s in enumerate(slots) if s < 0]
        n_miss = len(miss_pos)
        victims, evicted_ids, evicted_slots = [], [], []
        if n_miss:
            if n_miss > self.num_slots:
                raise capacity_error(self.num_slots, len(ids), n_miss, True, self.pinned())
            hit = set(slots)
            pins, last = self._pins, self._last
            if self.lfu:
                freq = self._slot_freq
                cand = [(-1.0 if s2i[s] < 0 else freq[s] * 1e9 + last[s], s)
                        for s in range(self.num_slots) if s not in hit and pins[s] <= 0]
            else:
                cand = [(-1.0 if s2i[s] < 0 else last[s], s)
                        for s in range(self.num_slots) if s not in hit and pins[s] <= 0]
            if len(cand) < n_miss:
                raise capacity_error(self.num_slots, len(ids), n_miss, False, self.pinned())
            victims = sorted(s for _, s in heapq.nsmallest(n_miss, cand))
            for v in victims:
                old = s2i[v]
                if old >= 0:
                    evicted_ids.append(old)
                    evicted_slots.append(v)
                    i2s[old] = -1
            for u, v in zip(miss_pos, victims):
                s2i[v] = ids[u]
                i2s[ids[u]] = v
                slots[u] = v
        self.clock += 1
        clock = float(self.clock)
        for e, s in zip(ids, slots):  # touch: recency, and frequency for LFU
            self._last[s] = clock
            if self.lfu:
                self._id_freq[e] += 1.0
                self._slot_freq[s] = self._id_freq[e]
        if count:
            c = self.counters
            c.lookups, c.misses, c.hits = c.lookups + len(ids), c.misses + n_miss, c.hits + len(ids) - n_miss
            c.evictions += len(evicted_ids)
        return HostAssignment(slots, [ids[u] for u in miss_pos], victims, evicted_ids, evicted_slots)

    def evict(self, ids) -> List[int]:
        """Drop ``ids`` from the map; returns their former slots."""
        out = []
        for e in _ints(ids):
            s = self._i2s[e]
            if s >= 0:
                self._i2s[e] = -1
                self._s2i[s] = -1
                out.append(s)
        return out


def _ints(xs) -> List[int]:
    """A list of ints from a list, tuple or tensor of them."""
    if isinstance(xs, torch.Tensor):
        return xs.reshape(-1).tolist()
    return [int(x) for x in xs]
