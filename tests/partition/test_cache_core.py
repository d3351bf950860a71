"""The one partition cache, for a row table (``PartitionCache``: vocab rows) and an expert table
(``ExpertCache``, a ``SlotCache``): the same tests of hits, misses and eviction order, pinning, overflow,
write-back or read-only, and the one vocabulary of counters, on CPU."""
import pytest
import torch

from ds_maximus.config import CachePolicy
from ds_maximus.errors import CapacityError
from ds_maximus.experts.expert_cache import ExpertCache
from ds_maximus.experts.expert_store import CpuExpertStore
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.partition import PartitionCache, TensorTier
from ds_maximus.partition.cache import CacheCore
from ds_maximus.partition.transfer import CpuTransfer

N = 6  # entries (rows of the table, experts of a layer)


class Rows:
    """A row table: entry ``i`` is a row of 3 values ``10 * i``."""

    def __init__(self, slots, policy=CachePolicy.LRU):
        self.tier = TensorTier({"w": (10.0 * torch.arange(N, dtype=torch.float32)).repeat_interleave(3).view(N, 3)})
        self.cache = PartitionCache(slots, self.tier, policy=policy)
        self.entry_bytes = 3 * 4

    def acquire(self, ids):
        return self.cache.acquire(torch.tensor(ids), pin=True).tolist()

    def release(self, slots):
        self.cache.unpin(torch.tensor(slots))

    def value(self, slot):
        return float(self.cache.storage["w"][slot, 0])

    def resident(self):
        return sorted(self.cache.map.resident_ids().tolist())

    def fits(self, ids):
        return self.cache.fits(torch.tensor(ids)).tolist()

    def serve_overflowing(self, ids):
        """A batch larger than the cache: the entries that fit through the slots, the rest from the tier."""
        mask = self.cache.fits(torch.tensor(ids))
        inside = [i for i, m in zip(ids, mask.tolist()) if m]
        outside = [i for i, m in zip(ids, mask.tolist()) if not m]
        slots = self.acquire(inside)
        got = {i: self.value(s) for i, s in zip(inside, slots)}
        self.release(slots)
        rows = self.cache.read_direct(torch.tensor(outside))["w"]
        got.update({i: float(rows[k, 0]) for k, i in enumerate(outside)})
        self.cache.count_overflow(len(outside))
        return got


class Experts:
    """An expert table of two layers; the tests use layer 1, whose expert ``i`` holds ``10 * i`` (layer 0
    holds other values, so a slot of the wrong layer would show)."""

    def __init__(self, slots, policy=CachePolicy.LRU):
        lay = ExpertLayout.from_stacked({"w": torch.zeros(N, 3)}, num_experts=N)
        self.store = CpuExpertStore(lay, 2 * N, pin_memory=False)
        for e in range(N):
            self.store.write(e, {"w": torch.full((3,), -1.0 - e)})
            self.store.write(N + e, {"w": torch.full((3,), 10.0 * e)})
        self.cache = ExpertCache(self.store, 2, N, slots, "cpu", policy, transfer=CpuTransfer())
        self.entry_bytes = lay.nbytes

    def acquire(self, ids, needed=None):
        return self.cache.acquire(1, ids, needed)

    def release(self, slots):
        self.cache.release(1, slots)

    def value(self, slot):
        return float(self.cache.slot(1, slot)[0])

    def resident(self):
        return self.cache.resident(1)

    def fits(self, ids):
        return self.cache.fits(torch.tensor(ids), group=1).tolist()

    def serve_overflowing(self, ids):
        """A layer routed to more experts than the cache has slots: rounds of at most the slots."""
        got, n = {}, self.cache.slots_per_group
        for k in range(0, len(ids), n):
            chunk = ids[k:k + n]
            slots = self.acquire(chunk, needed=ids)
            got.update({i: self.value(s) for i, s in zip(chunk, slots)})
            self.release(slots)
        return got


KINDS = [Rows, Experts]


@pytest.mark.parametrize("kind", KINDS)
def test_hits_misses_and_lru_eviction_order(kind):
    t = kind(2)
    t.release(t.acquire([1, 4]))
    t.release(t.acquire([4]))                     # a hit; 1 is now the least recently used
    s = t.acquire([2])                            # evicts 1, keeps 4
    assert t.value(s[0]) == 20.0 and t.resident() == [2, 4]
    t.release(s)
    st = t.cache.stats()
    assert (st["lookups"], st["hits"], st["misses"], st["evictions"]) == (4, 1, 3, 1)
    assert st["hit_rate"] == 0.25
    assert st["rows_fetched"] == 3 and st["bytes_h2d"] == 3 * t.entry_bytes == st["bytes_moved"]
    assert st["prefetch_issued"] == 0 and st["stall_ms"] >= 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_lfu_keeps_the_frequent_entry(kind):
    t = kind(2, CachePolicy.LFU)
    for e in [0, 0, 0, 1, 2]:
        s = t.acquire([e])
        assert t.value(s[0]) == 10.0 * e
        t.release(s)
    assert t.resident() == [0, 2]


@pytest.mark.parametrize("kind", KINDS)
def test_pinned_entries_are_never_evicted(kind):
    t = kind(2)
    held = t.acquire([0, 1])
    with pytest.raises(CapacityError):
        t.acquire([2])                            # both slots pinned
    assert [t.value(s) for s in held] == [0.0, 10.0] and t.resident() == [0, 1]
    t.release(held[:1])                           # 0 may go now, 1 may not
    s = t.acquire([3])
    assert t.resident() == [1, 3] and t.value(s[0]) == 30.0
    t.release(s + held[1:])


@pytest.mark.parametrize("kind", KINDS)
def test_overflow_is_served_and_counted(kind):
    """A batch of 5 entries on 2 slots is served whole (rows: the rest from the tier; experts: in rounds)
    and counted the same way: 3 entries beyond the room, one batch."""
    t = kind(2)
    held = t.acquire([4])
    assert t.fits([0, 3]) == [True, False]        # one slot is pinned by 4: room for the smallest miss only
    assert t.fits([0, 3, 4]) == [True, False, True]
    t.release(held)
    assert t.fits([0, 3]) == [True, True]         # 4 may be evicted now
    got = t.serve_overflowing([0, 1, 2, 3, 5])
    assert got == {i: 10.0 * i for i in [0, 1, 2, 3, 5]}
    st = t.cache.stats()
    assert (st["overflow_rows"], st["overflow_batches"]) == (3, 1)


def test_rows_write_back_dirty_evictions():
    t = Rows(2)
    s = t.acquire([1, 2])
    t.cache.storage["w"][s[0]] = 7.0
    t.cache.mark_dirty(torch.tensor(s[:1]))
    t.release(s)
    t.release(t.acquire([3, 4]))                  # evicts 1 (dirty: written back) and 2 (clean)
    assert t.tier.tensors["w"][1].tolist() == [7.0] * 3 and t.tier.tensors["w"][2].tolist() == [20.0] * 3
    s = t.acquire([1])
    assert t.value(s[0]) == 7.0
    st = t.cache.stats()
    assert st["rows_written_back"] == 1 and st["bytes_d2h"] == t.entry_bytes
    assert st["bytes_moved"] == st["bytes_h2d"] + st["bytes_d2h"]


def test_experts_are_read_only_and_refreshed_in_place():
    """The expert cache writes nothing back; an expert changed in the store is refreshed in its slot."""
    t = Experts(2)
    s = t.acquire([1, 2])
    t.release(s)
    t.store.write(N + 1, {"w": torch.full((3,), 7.0)})
    assert t.cache.write_slot(1, 1, t.store.host_view(N + 1)) and t.value(s[0]) == 7.0
    assert not t.cache.write_slot(1, 5, t.store.host_view(N + 5))   # not resident: nothing to refresh
    t.release(t.acquire([3, 4]))                  # evicts 1 and 2: nothing is written back
    assert t.store.read(N + 2)[0] == 20.0
    st = t.cache.stats()
    assert st["rows_written_back"] == 0 and st["bytes_d2h"] == 0 and not t.cache.write_back


def test_both_report_one_vocabulary():
    """The row and the expert cache are variants of one core and report the same counters."""
    rows, experts = Rows(2), Experts(2)
    assert isinstance(rows.cache, CacheCore) and isinstance(experts.cache, CacheCore)
    common = set(rows.cache.stats())
    assert common <= set(experts.cache.stats())
    assert {"hits", "misses", "evictions", "bytes_moved", "prefetch_issued", "prefetch_used", "stall_ms",
            "overflow_rows"} <= common
