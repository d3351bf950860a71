"""The partition cache: fixed slots on the compute device over a slow tier, for vocab rows and experts alike.

The cache knows nothing about what an entry is (a vocab row with its optimizer state, an expert as one
flat buffer). :class:`CacheCore` is what every variant shares: ``groups x slots`` slot maps
(:class:`SlotMap`, on the host so no device sync is needed to decide), write-back or read-only, the
overflow rule (:meth:`CacheCore.fits`) and one vocabulary of counters (:class:`TrafficCounters`,
:meth:`CacheCore.stats`). Copies go through the one transfer engine (:mod:`ds_maximus.partition.transfer`).
Two variants move entries in the two shapes their users need:

:class:`PartitionCache` (vocab rows, LM-head rows: one group, batches of rows, write-back over a
:class:`~ds_maximus.partition.tier.Tier`) fills misses and writes dirty evictions back:

* CUDA, pinned CPU tier: a fill is one kernel on the *fill stream* reading the pinned tier through
  its mapped address (no host copy). A dirty eviction is first copied on the GPU into a staging
  buffer (so the fill can reuse the slot at once), then written to the tier by a kernel on the
  *write-back stream*: fills (H2D) and write-backs (D2H) overlap on the full-duplex link. The
  compute stream waits only on the fills of the slots it reads (``wait_fills(slots)``), never the
  host; a fill of an id whose write-back has not landed waits for it on the GPU.
* CUDA, other tiers (NVMe): copies run on the fill stream through pinned staging buffers; a
  write-back is finished on the host lazily (when its event has completed, or the id is read again).
* CPU (CI machines): the same code path with plain copies, synchronous.

:class:`SlotCache` (MoE experts: one group per layer, one flat entry per slot, read-only) loads entries
one by one with per-slot events and speculation (see its docstring).

Entries in use or in flight are pinned (never evicted) until unpinned.

>>> import torch
>>> from ds_maximus.partition.tier import TensorTier
>>> tier = TensorTier({"w": torch.arange(10.).view(5, 2)})
>>> cache = PartitionCache(2, tier, device="cpu")
>>> slots = cache.acquire(torch.tensor([3, 1]))
>>> cache.storage["w"][slots].tolist()
[[6.0, 7.0], [2.0, 3.0]]
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ds_maximus.config import CachePolicy
from ds_maximus.errors import CapacityError
from ds_maximus.ops import index_array
from ds_maximus.partition.policy import CacheCounters, HostSlotMap, SlotMap
from ds_maximus.partition.speculation import StagedGuess
from ds_maximus.partition.tier import Tier
from ds_maximus.partition.transfer import CpuTransfer, CudaTransfer, host_staging, row_copy_op


@dataclasses.dataclass
class TrafficCounters:
    """Cumulative traffic of a cache, the one vocabulary of every partition cache (vocab rows, LM-head rows,
    experts). A *row* is one entry (a vocab row, an expert); bytes are what crossed between the device
    and the tier; ``stall_ms`` is time the consumer waited for copies (device and host waits)."""

    rows_fetched: int = 0       # entries copied into slots (demand and prefetch)
    rows_evicted: int = 0       # entries that gave up their slot
    rows_written_back: int = 0  # dirty entries written to the tier (a write-back cache)
    bytes_h2d: int = 0          # tier to device (demand and prefetch)
    bytes_d2h: int = 0          # device to tier (write-backs)
    stall_ms: float = 0.0
    host_stall_ms: float = 0.0  # of stall_ms, the time the host itself was blocked on a copy
    overflow_rows: int = 0      # entries a batch needed beyond the cache's room (served from the tier directly,
    overflow_batches: int = 0   # or computed in rounds); acquires that overflowed
    prefetch_issued: int = 0    # speculative loads started
    prefetch_used: int = 0      # speculative loads later asked for before eviction
    prefetch_cancelled: int = 0  # guesses dropped when the demand showed them wrong
    bytes_prefetch: int = 0     # of bytes_h2d, what speculation moved


class CacheCore:
    """What every partition cache shares: ``groups x slots`` slot maps (one :class:`SlotMap` per group over
    ``num_ids`` ids), write-back or read-only, the overflow rule and one vocabulary of counters.

    The variants are :class:`PartitionCache` (one group of rows, moved in batches over a :class:`Tier`,
    write-back) and :class:`SlotCache` (groups of slots holding one flat entry each, moved one by one with
    per-slot events and speculation, read-only).
    """

    counters: CacheCounters  # demand lookups, hits, misses (a variant says where they are kept)
    map_class = SlotMap  # a group's slot map (SlotCache: HostSlotMap, on lists)

    def __init__(self, num_groups: int, num_slots: Union[int, Sequence[int]], num_ids: int, policy: CachePolicy,
                 write_back: bool):
        self.num_groups = int(num_groups)
        # ``num_slots``: one count for every group, or one per group (a budget that does not divide evenly)
        counts = ([int(num_slots)] * self.num_groups if isinstance(num_slots, (int, np.integer))
                  else [int(n) for n in num_slots])
        if len(counts) != self.num_groups:
            raise ValueError(f"{len(counts)} slot counts for {self.num_groups} groups")
        self.group_slots: List[int] = counts
        self.num_slots = min(counts)  # the fewest any group has
        self.write_back = bool(write_back)
        self.maps = [self.map_class(n, num_ids, policy) for n in counts]
        self.traffic = TrafficCounters()

    def fits(self, ids: Tensor, group: int = 0) -> Tensor:
        """Mask of unique ``ids`` that one acquire of ``group`` can hold: all resident ones, and the first
        misses (smallest ids: the hot rows of a frequency-ordered vocabulary) up to the slots neither pinned
        nor holding this batch. All True when the whole batch fits.

        >>> from ds_maximus.partition.tier import TensorTier
        >>> cache = PartitionCache(2, TensorTier({"w": torch.zeros(5, 1)}))
        >>> cache.fits(torch.tensor([0, 3, 4])).tolist()
        [True, True, False]
        """
        m = self.maps[group]
        ids = ids.to("cpu", torch.long)
        slots = m.slots_of(ids).numpy()
        hit = slots >= 0
        pinned = m.pin_count.numpy() > 0
        room = self.group_slots[group] - int(pinned.sum()) - int((~pinned[slots[hit]]).sum())
        miss = np.flatnonzero(~hit)
        if miss.size <= room:
            return torch.ones(ids.numel(), dtype=torch.bool)
        mask = hit.copy()
        mask[miss[:max(0, room)]] = True
        return torch.from_numpy(mask)

    def count_overflow(self, n: int) -> None:
        """Count ``n`` entries of one batch served from the tier directly (lookups and misses too)."""
        self.traffic.overflow_rows += int(n)
        self.traffic.overflow_batches += 1
        c = self.counters
        c.lookups, c.misses = c.lookups + int(n), c.misses + int(n)

    def stats(self) -> dict:
        """The counters in the one vocabulary every partition cache reports (cumulative).

        >>> from ds_maximus.partition.tier import TensorTier
        >>> cache = PartitionCache(2, TensorTier({"w": torch.zeros(5, 1)}))
        >>> _ = cache.acquire(torch.tensor([1, 2])); _ = cache.acquire(torch.tensor([1]))
        >>> s = cache.stats(); s["hits"], s["misses"], s["bytes_moved"]
        (1, 2, 8)
        """
        self.resolve_stalls()
        c, t = self.counters, self.traffic
        return {"hit_rate": c.hit_rate, "lookups": c.lookups, "hits": c.hits, "misses": c.misses,
                "evictions": t.rows_evicted, "rows_fetched": t.rows_fetched, "rows_evicted": t.rows_evicted,
                "rows_written_back": t.rows_written_back, "bytes_h2d": t.bytes_h2d, "bytes_d2h": t.bytes_d2h,
                "bytes_moved": t.bytes_h2d + t.bytes_d2h, "bytes_prefetch": t.bytes_prefetch,
                "prefetch_issued": t.prefetch_issued, "prefetch_used": t.prefetch_used,
                "prefetch_cancelled": t.prefetch_cancelled, "stall_ms": t.stall_ms,
                "host_stall_ms": t.host_stall_ms, "overflow_rows": t.overflow_rows,
                "overflow_batches": t.overflow_batches}

    def resolve_stalls(self) -> None:
        """Add the measured device-side waits that have completed to ``traffic.stall_ms``."""

    def _host_stall(self, t0: float) -> None:
        """Count the host time since ``t0`` (``time.perf_counter()``) as a stall."""
        ms = (time.perf_counter() - t0) * 1e3
        self.traffic.stall_ms += ms
        self.traffic.host_stall_ms += ms


class PartitionCache(CacheCore):
    """Fixed-slot cache of tier entries on ``device`` (see the module docstring); ``write_back=False`` makes
    it read-only (nothing may be marked dirty; no write-back stream)."""

    def __init__(self, num_slots: int, tier: Tier, device="cpu", policy: CachePolicy = CachePolicy.LRU,
                 names: Optional[Tuple[str, ...]] = None, write_back: bool = True):
        super().__init__(1, num_slots, tier.num_ids, policy, write_back)
        self.tier = tier
        self.device = torch.device(device)
        self.names = tuple(names or tier.names)
        self.map = self.maps[0]
        self.storage: Dict[str, Tensor] = {
            n: torch.zeros((self.num_slots, *tier.entry_shape(n)), dtype=tier.dtype(n), device=self.device)
            for n in self.names}
        self.entry_bytes = sum(s[0].numel() * s.element_size() for s in self.storage.values())
        self.dirty = torch.zeros(self.num_slots, dtype=torch.bool)
        self.cuda = self.device.type == "cuda"
        # fills and UVA write-backs at high priority: their few copy blocks are scheduled ahead of the compute
        # stream's queued blocks, so the link does not wait for SMs (measured against normal priority:
        # docs/bench/code_history.md)
        self.transfer = CudaTransfer(self.device, priority=-1, write_back=self.write_back) if self.cuda else None
        self.stream = self.transfer.stream if self.cuda else None        # fills
        self.wb_stream = self.transfer.wb_stream if self.cuda else None  # write-backs
        # fill events by sequence number; _slot_seq[s] = the fill that last wrote slot s
        self._fill_seq = 0
        self._fill_events: "collections.OrderedDict[int, object]" = collections.OrderedDict()
        self._slot_seq = torch.zeros(self.num_slots, dtype=torch.long)
        self._waited_seq = 0
        self._wb_event = None
        self._tier_event = None   # copies on other streams write the tier until this event (tier_written_until)
        self._uva_pending: List[Tuple[Tensor, object]] = []   # (ids, event) of UVA write-backs in flight
        self._pending: List[Tuple[Tensor, Dict[str, Tensor], object]] = []  # (ids, staging, event)
        self._pending_mask = torch.zeros(tier.num_ids, dtype=torch.bool)
        self.last_misses: Tuple[Tensor, Tensor] = (torch.zeros(0, dtype=torch.long),) * 2  # of the last acquire
        # numpy views of the host bookkeeping (see ds_maximus.ops.index_array): a step makes dozens of updates
        self._dirty, self._seq = self.dirty.numpy(), self._slot_seq.numpy()
        self._pending_np = self._pending_mask.numpy()
        self._uva = row_copy_op(self.tier, self.names, self.device)
        self._uva_in_flight = False
        # blocks of each fill/write-back kernel (0: the op's default, a quarter of the SMs). Eight already
        # carry a ~50 GB/s link and leave it and the SMs freer for the compute stream: more blocks make the
        # step slower (benchmarks/profile_sharded_embedding.py's copy grid table; docs/bench/code_history.md)
        self.copy_blocks = 8
        self._iota = torch.arange(self.num_slots, device=self.device) if self._uva is not None else None
        self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.cuda else 0

    # -- the main operations -----------------------------------------------------------------------
    def acquire(self, ids: Tensor, *, pin: bool = False, wait: bool = True, count: bool = True) -> Tensor:
        """Make unique ``ids`` (CPU LongTensor) resident; returns their slots (CPU LongTensor).

        ``pin`` keeps them resident until :meth:`unpin`; ``wait`` makes the compute stream wait
        for the fills (set it False for a prefetch). Raises ``CapacityError`` when they cannot fit.
        """
        ids = ids.to("cpu", torch.long)
        t0 = time.perf_counter()
        a = self.map.assign(ids, count=count)
        self.last_misses = (a.miss_ids, a.miss_slots)
        if a.evicted_ids.numel():
            self.traffic.rows_evicted += int(a.evicted_ids.numel())
            self._write_back(a.evicted_ids, a.evicted_slots)
        if a.miss_ids.numel():
            self._fill(a.miss_ids, a.miss_slots)
        if pin:
            self.map.pin(a.slots)
        if wait:
            self.wait_fills(a.slots)
        if not self.cuda:
            self._host_stall(t0)
        self._finish_write_backs(block=False)
        return a.slots

    def read_direct(self, ids: Tensor) -> Dict[str, Tensor]:
        """Entries ``ids`` read straight from the tier into host buffers (pinned on a GPU), bypassing the slots,
        after every write-back in flight has landed (so the tier is current). FBGEMM's cache serves the rows
        of a batch that do not fit this way."""
        ids = ids.to("cpu", torch.long)
        self._finish_write_backs(block=True)
        buf = self._staging(int(ids.numel()))
        self.tier.read(ids, buf)
        return buf

    def write_direct(self, ids: Tensor, src: Dict[str, Tensor]) -> None:
        """Store ``src[name][i]`` (host tensors) as entry ``ids[i]`` of the tier, bypassing the slots; the
        entries must not be resident (their slots would hold a stale copy)."""
        self.tier_sync()
        self.tier.write(ids.to("cpu", torch.long), src)

    def wait_fills(self, slots: Optional[Tensor] = None) -> None:
        """Order the compute stream after the fills of ``slots`` (CPU LongTensor; all fills when None).

        No host wait: the compute stream waits on the fill stream's event. Fills run in order on one
        stream, so waiting for the latest fill a slot needs covers every earlier one.
        """
        if not self.cuda or not self._fill_events:
            return
        if slots is None:
            seq = self._fill_seq
        else:
            seq = int(self._seq[index_array(slots)].max()) if slots.numel() else 0
        if seq <= self._waited_seq:
            return
        ev = self._fill_events[seq]
        cur = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event(enable_timing=True)
        before.record(cur)
        cur.wait_event(ev)
        self.transfer.stalls.add(before, ev)
        self._waited_seq = seq
        while self._fill_events and next(iter(self._fill_events)) <= seq:
            self._fill_events.popitem(last=False)

    def after_fills(self, slots: Tensor, work) -> None:
        """Run ``work()`` on the fill stream, after the fills queued so far, and make the compute stream's
        :meth:`wait_fills` of ``slots`` wait for it too (on a CPU cache: just run it)."""
        if not self.cuda:
            work()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # what work reads (lr history) first
        with torch.cuda.stream(self.stream):
            work()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
        self._register_fill(ev, slots)

    def _register_fill(self, ev, slots: Tensor) -> None:
        self._fill_seq += 1
        self._fill_events[self._fill_seq] = ev
        self._seq[index_array(slots)] = self._fill_seq

    def tier_written_until(self, event) -> None:
        """Copies queued on other streams (a staged optimizer step of the rows outside the cache) write the tier
        until ``event`` (a CUDA event; ``None``: nothing in flight). Until it has passed, fills and write-backs
        queue after it on their streams, and every host read or write of the tier (:meth:`tier_sync`) waits for it
        on the host: the compute stream goes on meanwhile."""
        self._tier_event = event

    def tier_sync(self) -> None:
        """Wait on the host for the copies of :meth:`tier_written_until` (the tier is read or written on the host
        next)."""
        ev, self._tier_event = self._tier_event, None
        if ev is not None and not ev.query():
            t0 = time.perf_counter()
            ev.synchronize()
            self._host_stall(t0)

    def order_tier_read(self, stream) -> bool:
        """Order ``stream`` after every write of the tier in flight (the copies of :meth:`tier_written_until`, UVA
        write-backs), so that a copy queued on it next may read the tier's host memory; False where a write is
        still to be made on the host (the staged write-backs of a cache without UVA)."""
        if self._pending:
            return False
        self._tier_stream_wait(stream)
        if self._uva_pending and self._wb_event is not None:
            stream.wait_event(self._wb_event)
        return True

    def _tier_stream_wait(self, stream) -> None:
        """Order ``stream`` (a fill or write-back stream) after the tier's copies in flight."""
        if self._tier_event is not None:
            if self._tier_event.query():
                self._tier_event = None
            else:
                stream.wait_event(self._tier_event)

    def unpin(self, slots: Tensor) -> None:
        self.map.unpin(slots.to("cpu", torch.long))

    def mark_dirty(self, slots: Tensor) -> None:
        assert self.write_back, "mark_dirty on a read-only cache"
        self._dirty[index_array(slots)] = True

    def slots_of(self, ids: Tensor) -> Tensor:
        """Slots of ``ids`` (-1 where not resident), without touching the policy."""
        return self.map.slots_of(ids.to("cpu", torch.long))

    def flush(self) -> None:
        """Write every dirty resident entry back (entries stay resident, now clean); sync."""
        slots = torch.nonzero(self.dirty).flatten()
        if slots.numel():
            self._write_back(self.map.slot_to_id[slots], slots, stage=False)
        self._finish_write_backs(block=True)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.tier.flush()

    def clear(self) -> None:
        """Flush, then forget every entry (pins included)."""
        self.flush()
        self.map.evict(self.map.resident_ids())
        self.map.pin_count.zero_()

    @property
    def counters(self) -> CacheCounters:
        return self.map.counters

    def resolve_stalls(self) -> None:
        """Add the measured GPU-side waits of completed fills to ``traffic.stall_ms``."""
        if self.transfer is not None:
            self.traffic.stall_ms += self.transfer.stalls.resolve(block=False)

    # -- copies -------------------------------------------------------------------------------------
    def _staging(self, n: int) -> Dict[str, Tensor]:
        return host_staging(self.storage, n, pin=self.cuda and torch.cuda.is_available())

    def _write_back(self, ids: Tensor, slots: Tensor, stage: bool = True) -> None:
        """Write the dirty entries among ``slots`` (holding ``ids``) back to the tier.

        ``stage`` (UVA path): copy them on the GPU first so the slots can be refilled at once; a
        flush, which refills nothing, writes straight from the slots.
        """
        s = index_array(slots)
        dirty = self._dirty[s]
        self._dirty[s] = False
        ids, slots = torch.from_numpy(index_array(ids)[dirty]), torch.from_numpy(s[dirty])
        n = int(ids.numel())
        if not n:
            return
        self.traffic.rows_written_back += n
        self.traffic.bytes_d2h += n * self.entry_bytes
        if self._uva is not None:
            self._uva_write_back(ids, slots, stage)
            return
        staging = self._staging(n)
        if not self.cuda:
            for k, v in self.storage.items():
                torch.index_select(v, 0, slots.to(self.device), out=staging[k])
            self.tier.write(ids, staging)
            return
        ev = self.transfer.read_rows(self.storage, slots, staging)
        self._pending.append((ids, staging, ev))
        self._pending_np[index_array(ids)] = True

    def _uva_write_back(self, ids: Tensor, slots: Tensor, stage: bool) -> None:
        self._tier_stream_wait(self.wb_stream)
        ev = self.transfer.write_back_rows_uva(self._uva, self.storage, slots, ids, self.tier.tensors, self.copy_blocks,
                                               stage, iota=self._iota, stage_blocks=self._sms)
        self._wb_event = ev
        self._uva_pending.append((ids, ev))
        self._pending_np[index_array(ids)] = True

    def _finish_write_backs(self, block: bool) -> None:
        """Retire write-backs whose copies have landed (``block``: wait for all, fills and the tier's copies in
        flight included)."""
        if block:
            self.tier_sync()
        if self._uva_pending:
            keep = []
            for i, (ids, ev) in enumerate(self._uva_pending):
                if block or ev.query():
                    if block and not ev.query():
                        t0 = time.perf_counter()
                        ev.synchronize()  # GPU-written rows of the tier are now visible to the host
                        self._host_stall(t0)
                    self._pending_np[index_array(ids)] = False
                else:
                    keep.extend(self._uva_pending[i:])  # one stream: they land in order
                    break
            self._uva_pending = keep
        if block and self._uva_in_flight:
            t0 = time.perf_counter()
            self.stream.synchronize()  # no fill is still reading the tier (the host may write it next)
            self._host_stall(t0)
            self._uva_in_flight = False
        keep = []
        for i, (ids, staging, ev) in enumerate(self._pending):
            if block or ev.query():
                if block and not ev.query():
                    t0 = time.perf_counter()
                    ev.synchronize()
                    self._host_stall(t0)
                self.tier_sync()
                self.tier.write(ids, staging)
                self._pending_np[index_array(ids)] = False
            else:
                keep.extend(self._pending[i:])  # finish in order
                break
        self._pending = keep

    def _fill(self, ids: Tensor, slots: Tensor) -> None:
        n = int(ids.numel())
        self.traffic.rows_fetched += n
        self.traffic.bytes_h2d += n * self.entry_bytes
        if self._uva is not None:
            self._finish_write_backs(block=False)
            back = bool(self._pending_np[index_array(ids)].any())
            # after an id's write-back not yet landed (it comes back before the tier holds it)
            self._tier_stream_wait(self.stream)
            ev = self.transfer.fill_rows_uva(self._uva, self.tier.tensors, ids, self.storage, slots, self.copy_blocks,
                                             after=self._wb_event if back else None)
            self._register_fill(ev, slots)
            self._uva_in_flight = True
            return
        if self._pending and bool(self._pending_np[index_array(ids)].any()):
            self._finish_write_backs(block=True)  # an id coming back before its write-back landed
        staging = self._staging(n)
        self.tier_sync()
        self.tier.read(ids, staging)
        if not self.cuda:
            dslots = slots.to(self.device)
            for k, v in self.storage.items():
                v.index_copy_(0, dslots, staging[k])
            return
        self._register_fill(self.transfer.fill_rows(staging, self.storage, slots), slots)


class _Group:
    """One group of a :class:`SlotCache`: its slot map, its ``[slots, numel]`` device table and per-slot events."""

    def __init__(self, slot_map: HostSlotMap, slots: int, numel: int, dtype, device):
        self.map = slot_map
        self.buffer = torch.empty((slots, numel), dtype=dtype, device=device)
        self.load_ev: List[object] = [None] * slots
        self.use_ev: List[object] = [None] * slots
        self.inflight: Dict[int, object] = {}      # slot -> load event of a prefetch not yet landed
        self.prefetched = [False] * slots           # holds a prefetched entry not yet used
        self.in_use = [0] * slots                   # acquire/release balance (test hook)


class SlotCache(CacheCore):
    """Groups of slots on ``device``, each slot one flat entry of ``numel`` elements, over a ``store``.

    ``store`` addresses entry ``uid = group * num_ids + id`` and offers ``host_view(uid)`` (a CPU flat
    tensor to copy from, or None when the entry must first be read) and ``read_into(uid, dst)``. A load
    is one ``copy_(non_blocking=True)`` on the transfer engine's side stream.

    Ordering (CUDA): a load into a slot first waits on the slot's *last-use* event (recorded on the
    compute stream by :meth:`release`), and the compute stream waits on the slot's *load* event before
    reading it (:meth:`acquire`). The host never waits for a copy, except when every slot of a group is
    pinned by loads in flight and a demand needs one of them.

    Never evicted: entries being computed with (pinned between ``acquire`` and ``release``) and
    entries in flight (pinned from ``prefetch`` until their load event has completed).

    With ``prefetch_chunk_bytes``, a prefetch is a guess of which only the first chunk is queued
    (:class:`~ds_maximus.partition.speculation.PrefetchJob`): when the demand arrives (``acquire``), a guess
    it does not need is dropped and its slot forgotten, and the rest of one it needs is queued at once.
    With ``stage_guesses`` as well, the head goes into a staging buffer instead of a slot
    (:class:`~ds_maximus.partition.speculation.StagedGuess`): a guess then evicts nothing (the eviction is
    decided when the demand is known, as without prefetch), a wrong guess costs only its head's link time,
    and a right one only moves the rest (the head is copied on the device). ``stage_guesses`` is the number
    of staging buffers (``True``: one): a prefetch stages that many of its ids that are not resident, each
    in its own buffer, best first.

    The cache is read-only: a user that changes an entry in the store refreshes a resident copy with
    :meth:`write_slot`.

    >>> class Store:  # entry uid holds the value uid
    ...     def host_view(self, uid): return torch.full((4,), float(uid))
    >>> cache = SlotCache(Store(), num_groups=2, num_ids=3, slots_per_group=1, numel=4, dtype=torch.float32,
    ...                   device="cpu")
    >>> slots = cache.acquire(1, [2]); cache.slot_buffer(1)[slots[0]].tolist()
    [5.0, 5.0, 5.0, 5.0]
    >>> cache.release(1, slots); cache.stats()["misses"]
    1
    """

    entry_name, group_name, size_key = "entries", "group", "the slots per group"  # for error messages
    map_class = HostSlotMap  # a few entries a group, asked about a dozen times a layer: lists, not tensors

    def __init__(self, store, num_groups: int, num_ids: int, slots_per_group: Union[int, Sequence[int]], numel: int,
                 dtype, device, policy: CachePolicy = CachePolicy.LRU, transfer=None,
                 prefetch_chunk_bytes: Optional[int] = None, stage_guesses: Union[bool, int] = False):
        super().__init__(num_groups, slots_per_group, num_ids, policy, write_back=False)
        self.store = store
        self.num_ids = int(num_ids)
        self.slots_per_group = self.num_slots  # the fewest any group has; slots_of(group) is the group's own
        self.numel, self.dtype = int(numel), dtype
        self.entry_bytes = self.numel * dtype.itemsize
        self.device = torch.device(device)
        self.prefetch_chunk_bytes = prefetch_chunk_bytes  # None: a prefetch is one whole load
        self.stage_guesses = int(stage_guesses)   # staging buffers (0: guesses go into slots)
        self.stages: List[StagedGuess] = []       # made by the first staged guesses
        if transfer is None:
            transfer = CudaTransfer(self.device) if self.device.type == "cuda" else CpuTransfer()
        self.transfer = transfer
        self.groups = [_Group(m, n, self.numel, dtype, self.device) for m, n in zip(self.maps, self.group_slots)]
        self.counters = CacheCounters()  # demand only: a right staged guess counts as a hit

    # -- views -----------------------------------------------------------------------------
    def slots_of(self, group: int) -> int:
        """The slots of ``group`` (groups differ by the remainder of a budget spread over them)."""
        return self.group_slots[group]

    def slot_buffer(self, group: int) -> Tensor:
        """All slots of a group, ``[slots, numel]``."""
        return self.groups[group].buffer

    def device_bytes(self) -> int:
        """Bytes of the slots (and the staged guess's head) on the device."""
        return sum(g.buffer.numel() * g.buffer.element_size() for g in self.groups) + self._stage_bytes()

    def resident(self, group: int) -> List[int]:
        return sorted(self.groups[group].map.resident_ids())

    def pinned_slots(self, group: int) -> List[int]:
        m = self.groups[group].map
        return [s for s in range(m.num_slots) if m.is_pinned(s)]

    # -- in-flight bookkeeping ---------------------------------------------------------------
    def _reap(self, g: _Group) -> None:
        """Unpin prefetches whose load has landed."""
        done = [s for s, ev in g.inflight.items() if self.transfer.done(ev)]
        for s in done:
            del g.inflight[s]
        if done:
            g.map.unpin(done)

    def _drain(self, g: _Group) -> None:
        """Wait (host) for every prefetch of the group in flight, then unpin them."""
        t0 = time.perf_counter()
        for ev in g.inflight.values():
            self.transfer.synchronize(ev)
        self._host_stall(t0)
        self._reap(g)

    def _load(self, gi: int, g: _Group, slot: int, entry: int, head: Optional[Tensor] = None) -> object:
        ev = self.transfer.load(g.buffer[slot], self.store, gi * self.num_ids + entry, g.use_ev[slot],
                                head=head)
        g.load_ev[slot] = ev
        return ev

    # -- staged guesses ---------------------------------------------------------------------
    def _stage_guess(self, group: int, ids: Sequence[int]) -> Optional[int]:
        """Stage the heads of the first ``stage_guesses`` of ``ids`` not resident, one a buffer (replacing
        unresolved guesses; one already staged stays); returns how many were started, or None when the tier
        cannot stage (NVMe: the guess goes into a slot, read whole)."""
        g = self.groups[group]
        want = []
        for e in (int(x) for x in ids):
            if len(want) == self.stage_guesses:
                break
            if g.map.slot(e) < 0 and e not in want:
                if self.store.host_view(group * self.num_ids + e) is None:
                    return None
                want.append(e)
        kept = {(group, e) for e in want} & {st.key for st in self.stages}  # already staged: left as they are
        free = iter([st for st in self.stages if st.key not in kept])
        started = 0
        for e in want:
            if (group, e) in kept:
                continue
            started += 1
            stage = next(free, None)
            if stage is None:
                stage = StagedGuess(self.prefetch_chunk_bytes, self.numel, self.dtype, self.device)
                self.stages.append(stage)
            dropped = stage.cancelled
            buf = stage.begin((group, e))
            self.traffic.prefetch_cancelled += stage.cancelled - dropped
            stage.event = self.transfer.load_head(buf, self.store, group * self.num_ids + e, stage.event)
            self.traffic.prefetch_issued += 1
            self.traffic.bytes_prefetch += stage.nbytes
            self.traffic.bytes_h2d += stage.nbytes
        return started

    def _stage_bytes(self) -> int:
        return sum(st.nbytes for st in self.stages)

    def staged_ids(self, group: int) -> List[int]:
        """The ids of ``group`` whose heads are staged (unresolved guesses), best first."""
        return [st.key[1] for st in self.stages if st.key is not None and st.key[0] == group]

    def _take_staged(self, group: int, ids: Sequence[int], needed: Sequence[int]) -> Dict[int, StagedGuess]:
        """The staged guesses this round of ``group`` asks for, by id; a guess the group does not need at all
        is dropped, one for a later round is kept."""
        taken = {}
        for st in self.stages:
            if st.key is None or st.key[0] != group:
                continue
            e = st.key[1]
            if e in ids:
                st.take(st.key)
                taken[e] = st
            elif e not in needed:
                st.drop()
                self.traffic.prefetch_cancelled += 1
        return taken

    def _drop_guesses(self, g: _Group, needed: Sequence[int]) -> None:
        """Drop the group's prefetches in flight whose id is not in ``needed``; a dropped slot's
        contents are partial, so its entry is forgotten (a later load into it queues behind its chunk)."""
        want = set(int(e) for e in needed)
        for s, h in list(g.inflight.items()):
            e = g.map.owner(s)
            if e in want or self.transfer.cancel(h):
                continue
            g.map.evict([e])
            g.map.unpin([s])
            del g.inflight[s]
            g.prefetched[s] = False
            self.traffic.prefetch_cancelled += 1
            self.traffic.bytes_prefetch -= h.unqueued_bytes()
            self.traffic.bytes_h2d -= h.unqueued_bytes()

    # -- demand ----------------------------------------------------------------------------
    def acquire(self, group: int, ids: Sequence[int], needed: Optional[Sequence[int]] = None) -> List[int]:
        """Make ``ids`` (unique) of ``group`` resident and usable by the compute stream; returns their slots.

        The slots stay pinned until :meth:`release`. Raises :class:`CapacityError` when more ids are asked
        for at once than the group has slots (callers split into rounds of ``slots_of(group)``).
        ``needed``: every id this group computes with now (all rounds; default ``ids``): prefetches in
        flight for any other id are dropped; when it is more than the slots, the first round counts the
        overflow (``overflow_rows``: the ids beyond the slots, brought in by later rounds).
        """
        g = self.groups[group]
        needed = ids if needed is None else needed
        self._drop_guesses(g, needed)
        staged = self._take_staged(group, ids, needed)
        n_slots = self.group_slots[group]
        if len(ids) > n_slots:
            raise CapacityError(f"{len(ids)} {self.entry_name} asked for at once in {self.group_name} {group}, but "
                                f"the cache has {n_slots} slots in that {self.group_name}; compute in rounds, "
                                f"or raise {self.size_key}")
        if len(needed) > n_slots and list(ids) == list(needed[:len(ids)]):
            self.traffic.overflow_rows += len(needed) - n_slots
            self.traffic.overflow_batches += 1
        self._reap(g)
        ids = [int(e) for e in ids]
        try:
            a = g.map.assign(ids)
        except CapacityError:
            self._drain(g)   # every free slot was a prefetch in flight: let them land
            a = g.map.assign(ids)
        miss_slots = set(a.miss_slots)
        c, t = self.counters, self.traffic
        c.lookups += len(ids)
        c.misses += len(miss_slots)
        c.hits += len(ids) - len(miss_slots)
        c.evictions += len(a.evicted_ids)
        t.rows_evicted += len(a.evicted_ids)
        slots = a.slots
        for e, s in zip(ids, slots):
            if s in miss_slots and e in staged:  # the guess was right: only the rest crosses the link
                st = staged.pop(e)
                g.prefetched[s] = False
                st.event = self._load(group, g, s, e, head=st.buffer)
                t.rows_fetched += 1
                t.bytes_h2d += self.entry_bytes - st.nbytes
                c.misses -= 1
                c.hits += 1
                t.prefetch_used += 1
            elif s in miss_slots:
                g.prefetched[s] = False
                self._load(group, g, s, e)
                t.rows_fetched += 1
                t.bytes_h2d += self.entry_bytes
            elif g.prefetched[s]:
                g.prefetched[s] = False
                t.prefetch_used += 1
        t.prefetch_cancelled += len(staged)  # staged, but resident after all
        g.map.pin(slots)
        for s in slots:
            g.in_use[s] += 1
            ev = g.load_ev[s]
            if ev is None:  # landed before an earlier acquire: nothing to order behind
                continue
            stall = self.transfer.wait(ev)
            t.stall_ms += stall
            t.host_stall_ms += stall
            if self.transfer.done(ev):  # landed: a resident expert's later acquires skip the wait
                g.load_ev[s] = None
        return slots

    def release(self, group: int, slots: Sequence[int]) -> None:
        """The compute queued so far is the last use of ``slots``; they may be evicted again."""
        g = self.groups[group]
        ev = self.transfer.record_use()
        for s in slots:
            g.use_ev[s] = ev
            g.in_use[s] -= 1
            assert g.in_use[s] >= 0, "release without acquire"
        g.map.unpin(slots)

    # -- speculation -----------------------------------------------------------------------
    def prefetch(self, group: int, ids: Sequence[int], keep: Optional[Sequence[int]] = None) -> int:
        """Start loading ``ids`` of ``group`` if absent (best effort); returns loads started.

        Never evicts a pinned slot, nor a resident entry in ``keep``, and never loads more entries than
        there are slots left to evict.
        """
        if self.stage_guesses and self.prefetch_chunk_bytes:
            started = self._stage_guess(group, ids)
            if started is not None:
                return started
        g = self.groups[group]
        self._reap(g)
        held = [s for s in (g.map.slot(int(e)) for e in (keep or ())) if s >= 0]
        g.map.pin(held)  # for this call only: the victims come from the other slots
        try:
            free = self.group_slots[group] - g.map.pinned()
            want = [int(e) for e in ids if g.map.slot(int(e)) < 0]
            want = want[:max(0, free)]
            if not want:
                return 0
            a = g.map.assign(want, count=False)
        except CapacityError:
            return 0
        finally:
            g.map.unpin(held)
        self.counters.evictions += len(a.evicted_ids)
        self.traffic.rows_evicted += len(a.evicted_ids)
        started = []
        for e, s in zip(a.miss_ids, a.miss_slots):
            h = self.transfer.prefetch(g.buffer[s], self.store, group * self.num_ids + e, g.use_ev[s],
                                       self.prefetch_chunk_bytes)
            g.inflight[s] = g.load_ev[s] = h
            g.prefetched[s] = True
            started.append(s)
        if started:
            g.map.pin(started)
        t = self.traffic
        t.prefetch_issued += len(started)
        t.rows_fetched += len(started)
        t.bytes_prefetch += len(started) * self.entry_bytes
        t.bytes_h2d += len(started) * self.entry_bytes
        return len(started)

    # -- a user changed an entry in the store --------------------------------------------------
    def write_slot(self, group: int, entry: int, src: Tensor, offset: int = 0) -> bool:
        """If ``entry`` is resident, overwrite its slot from element ``offset`` with ``src`` (flat, any
        dtype/device) on the compute stream, and mark that as the slot's last use (a later load into the
        slot waits for it). Returns whether it was resident."""
        g = self.groups[group]
        self._drain(g)
        s = g.map.slot(int(entry))
        if s < 0:
            return False
        g.buffer[s][offset:offset + src.numel()].copy_(src, non_blocking=True)
        g.use_ev[s] = self.transfer.record_use()
        return True

    # -- reporting -------------------------------------------------------------------------
    def resolve_stalls(self) -> None:
        """Add the compute stream's measured waits on loads to ``traffic.stall_ms`` (CUDA)."""
        if isinstance(self.transfer, CudaTransfer):
            self.traffic.stall_ms += self.transfer.gpu_stall_ms()

    def reset_stats(self) -> None:
        if isinstance(self.transfer, CudaTransfer):
            self.transfer.gpu_stall_ms()
        self.counters = CacheCounters()
        self.traffic = TrafficCounters()

    def synchronize(self) -> None:
        for st in self.stages:
            self.transfer.synchronize(st.event)
        for g in self.groups:
            for ev in g.load_ev:
                self.transfer.synchronize(ev)
            self._reap(g)

    def close(self) -> None:
        self.synchronize()
        self.transfer.close()
