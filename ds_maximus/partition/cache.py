"""``PartitionCache``: fixed slots on the compute device over a backing :class:`~ds_maximus.partition.tier.Tier`.

The cache knows nothing about what an entry is. It maps ids to slots (:class:`SlotMap`, on the
host so no device sync is needed to decide), fills misses and writes dirty evictions back:

* CUDA, pinned CPU tier: a fill is one kernel on the *fill stream* reading the pinned tier through
  its mapped address (no host copy). A dirty eviction is first copied on the GPU into a staging
  buffer (so the fill can reuse the slot at once), then written to the tier by a kernel on the
  *write-back stream*: fills (H2D) and write-backs (D2H) overlap on the full-duplex link. The
  compute stream waits only on the fills of the slots it reads (``wait_fills(slots)``), never the
  host; a fill of an id whose write-back has not landed waits for it on the GPU.
* CUDA, other tiers (NVMe): copies run on the fill stream through pinned staging buffers; a
  write-back is finished on the host lazily (when its event has completed, or the id is read again).
* CPU (CI machines): the same code path with plain copies, synchronous.

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
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ds_maximus.partition.policy import CacheCounters, SlotMap
from ds_maximus.partition.tier import Tier
from ds_maximus.config import CachePolicy
from ds_maximus.ops import index_array, to_device, to_device_pair


@dataclasses.dataclass
class TrafficCounters:
    """Cumulative traffic of a cache (entries and bytes; ``stall_ms`` is time the consumer waited)."""

    rows_fetched: int = 0
    rows_evicted: int = 0
    rows_written_back: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    stall_ms: float = 0.0
    overflow_rows: int = 0      # entries a batch needed beyond the cache's room, served from the tier directly
    overflow_batches: int = 0   # acquires that overflowed


class PartitionCache:
    """Fixed-slot cache of tier entries on ``device`` (see the module docstring)."""

    def __init__(self, num_slots: int, tier: Tier, device="cpu", policy: CachePolicy = CachePolicy.LRU,
                 names: Optional[Tuple[str, ...]] = None):
        self.tier = tier
        self.device = torch.device(device)
        self.names = tuple(names or tier.names)
        self.num_slots = int(num_slots)
        self.map = SlotMap(self.num_slots, tier.num_ids, policy, device="cpu")
        self.storage: Dict[str, Tensor] = {
            n: torch.zeros((self.num_slots, *tier.entry_shape(n)), dtype=tier.dtype(n), device=self.device)
            for n in self.names}
        self.entry_bytes = sum(s[0].numel() * s.element_size() for s in self.storage.values())
        self.dirty = torch.zeros(self.num_slots, dtype=torch.bool)
        self.traffic = TrafficCounters()
        self.cuda = self.device.type == "cuda"
        # fills and UVA write-backs at high priority: their few copy blocks are scheduled ahead of the compute
        # stream's queued blocks, so the link does not wait for SMs (exact mode on the H200, ms a step: 3.8-3.9
        # in two runs against 4.4 in one at normal priority; the replay on a third stream was 3.7-5.3)
        self.stream = torch.cuda.Stream(device=self.device, priority=-1) if self.cuda else None     # fills
        self.wb_stream = torch.cuda.Stream(device=self.device, priority=-1) if self.cuda else None  # write-backs
        # fill events by sequence number; _slot_seq[s] = the fill that last wrote slot s
        self._fill_seq = 0
        self._fill_events: "collections.OrderedDict[int, object]" = collections.OrderedDict()
        self._slot_seq = torch.zeros(self.num_slots, dtype=torch.long)
        self._waited_seq = 0
        self._wb_event = None
        self._uva_pending: List[Tuple[Tensor, object]] = []   # (ids, event) of UVA write-backs in flight
        self._pending: List[Tuple[Tensor, Dict[str, Tensor], object]] = []  # (ids, staging, event)
        self._pending_mask = torch.zeros(tier.num_ids, dtype=torch.bool)
        self._stall_events: List[Tuple[object, object]] = []
        self.last_misses: Tuple[Tensor, Tensor] = (torch.zeros(0, dtype=torch.long),) * 2  # of the last acquire
        # numpy views of the host bookkeeping (see ds_maximus.ops.index_array): a step makes dozens of updates
        self._dirty, self._seq, self._pending_np = self.dirty.numpy(), self._slot_seq.numpy(), self._pending_mask.numpy()
        self._uva = self._uva_op()
        self._uva_in_flight = False
        # blocks of each fill/write-back kernel (0: the op's default, a quarter of the SMs). Eight already
        # carry the link (50 GB/s on an H200) and leave it and the SMs freer for the compute stream: a step
        # of benchmarks/bench_sharded_embedding.py took 3.96 ms with 8, 4.17 with 16 and 4.68 with 33
        # (benchmarks/profile_sharded_embedding.py, its copy grid table)
        self.copy_blocks = 8
        self._iota = torch.arange(self.num_slots, device=self.device) if self._uva is not None else None
        self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.cuda else 0

    def _uva_op(self):
        """The CUDA op when fills/write-backs can be single kernels reading/writing the pinned tier directly."""
        if not (self.cuda and getattr(self.tier, "pinned", False) and hasattr(self.tier, "tensors")):
            return None
        from ds_maximus.ops.row_ops import load_op
        op = load_op("cuda")
        ok = op is not None and hasattr(op, "copy_rows") and all(
            self.tier.tensors[n].dtype == torch.float32 for n in self.names)
        return op if ok else None

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
            self.traffic.stall_ms += (time.perf_counter() - t0) * 1e3
        self._finish_write_backs(block=False)
        return a.slots

    def fits(self, ids: Tensor) -> Tensor:
        """Mask of unique ``ids`` that one :meth:`acquire` can hold: all resident ones, and the first misses
        (smallest ids: the hot rows of a frequency-ordered vocabulary) up to the slots neither pinned nor
        holding this batch. All True when the whole batch fits.

        >>> from ds_maximus.partition.tier import TensorTier
        >>> cache = PartitionCache(2, TensorTier({"w": torch.zeros(5, 1)}))
        >>> cache.fits(torch.tensor([0, 3, 4])).tolist()
        [True, True, False]
        """
        ids = ids.to("cpu", torch.long)
        slots = self.map.slots_of(ids).numpy()
        hit = slots >= 0
        pinned = self.map.pin_count.numpy() > 0
        room = self.num_slots - int(pinned.sum()) - int((~pinned[slots[hit]]).sum())
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
        c = self.map.counters
        c.lookups, c.misses = c.lookups + int(n), c.misses + int(n)

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
        self._stall_events.append((before, ev))
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

    def unpin(self, slots: Tensor) -> None:
        self.map.unpin(slots.to("cpu", torch.long))

    def mark_dirty(self, slots: Tensor) -> None:
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
        keep = []
        for before, after in self._stall_events:
            if after.query() and before.query():
                self.traffic.stall_ms += max(0.0, before.elapsed_time(after))
            else:
                keep.append((before, after))
        self._stall_events = keep[-1024:]

    # -- copies -------------------------------------------------------------------------------------
    def _staging(self, n: int) -> Dict[str, Tensor]:
        pin = self.cuda and torch.cuda.is_available()
        return {k: torch.empty((n, *v.shape[1:]), dtype=v.dtype, pin_memory=pin) for k, v in self.storage.items()}

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
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)  # the compute stream's last writes to these slots come first
        with torch.cuda.stream(self.stream):
            dslots = to_device(slots, self.device)
            for k, v in self.storage.items():
                staging[k].copy_(v.index_select(0, dslots), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._pending.append((ids, staging, ev))
        self._pending_np[index_array(ids)] = True

    def _uva_write_back(self, ids: Tensor, slots: Tensor, stage: bool) -> None:
        cur = torch.cuda.current_stream(self.device)
        if stage:
            # on the fill stream, before the fills that reuse these slots: a device-to-device copy
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                dslots, dids = to_device_pair(slots, ids, self.device)
                src_idx = self._iota[:ids.numel()]
                src = {}
                for k, v in self.storage.items():  # the op's kernel: a third of index_select's host time
                    src[k] = torch.empty((ids.numel(), *v.shape[1:]), dtype=v.dtype, device=self.device)
                    self._uva.copy_rows(v, dslots, src[k], src_idx, self._sms)  # device to device: every SM
                staged = torch.cuda.Event()
                staged.record(self.stream)
            self.wb_stream.wait_event(staged)
        else:
            self.wb_stream.wait_stream(cur)
            src = self.storage
            with torch.cuda.stream(self.wb_stream):
                src_idx, dids = to_device_pair(slots, ids, self.device)
        with torch.cuda.stream(self.wb_stream):
            for k, v in src.items():
                self._uva.copy_rows(v, src_idx, self.tier.tensors[k], dids, self.copy_blocks)
                if stage:
                    v.record_stream(self.wb_stream)
            if stage:  # made on the fill stream, read on this one
                dids.record_stream(self.wb_stream)
            ev = torch.cuda.Event()
            ev.record(self.wb_stream)
        self._wb_event = ev
        self._uva_pending.append((ids, ev))
        self._pending_np[index_array(ids)] = True

    def _finish_write_backs(self, block: bool) -> None:
        """Retire write-backs whose copies have landed (``block``: wait for all, fills included)."""
        if self._uva_pending:
            keep = []
            for i, (ids, ev) in enumerate(self._uva_pending):
                if block or ev.query():
                    if block and not ev.query():
                        t0 = time.perf_counter()
                        ev.synchronize()  # GPU-written rows of the tier are now visible to the host
                        self.traffic.stall_ms += (time.perf_counter() - t0) * 1e3
                    self._pending_np[index_array(ids)] = False
                else:
                    keep.extend(self._uva_pending[i:])  # one stream: they land in order
                    break
            self._uva_pending = keep
        if block and self._uva_in_flight:
            t0 = time.perf_counter()
            self.stream.synchronize()  # no fill is still reading the tier (the host may write it next)
            self.traffic.stall_ms += (time.perf_counter() - t0) * 1e3
            self._uva_in_flight = False
        keep = []
        for i, (ids, staging, ev) in enumerate(self._pending):
            if block or ev.query():
                if block and not ev.query():
                    t0 = time.perf_counter()
                    ev.synchronize()
                    self.traffic.stall_ms += (time.perf_counter() - t0) * 1e3
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
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # earlier readers of these slots
            if back:
                self.stream.wait_event(self._wb_event)  # an id coming back before its write-back landed
            with torch.cuda.stream(self.stream):
                dslots, dids = to_device_pair(slots, ids, self.device)
                for k, v in self.storage.items():
                    self._uva.copy_rows(self.tier.tensors[k], dids, v, dslots, self.copy_blocks)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(self.stream)
            self._register_fill(ev, slots)
            self._uva_in_flight = True
            return
        if self._pending and bool(self._pending_np[index_array(ids)].any()):
            self._finish_write_backs(block=True)  # an id coming back before its write-back landed
        staging = self._staging(n)
        self.tier.read(ids, staging)
        if not self.cuda:
            dslots = slots.to(self.device)
            for k, v in self.storage.items():
                v.index_copy_(0, dslots, staging[k])
            return
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)  # earlier readers of these slots (a gather in flight) come first
        with torch.cuda.stream(self.stream):
            dslots = to_device(slots, self.device)
            for k, v in self.storage.items():
                v.index_copy_(0, dslots, staging[k].to(self.device, non_blocking=True))
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
        self._register_fill(ev, slots)
