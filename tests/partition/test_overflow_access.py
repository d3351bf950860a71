"""PartitionCache's overflow primitives: ``fits`` (what one acquire can hold beside the pins) and direct tier
reads/writes that bypass the slots."""
import torch

from ds_maximus.partition import PartitionCache, TensorTier


def _tier(n=20, d=3):
    return TensorTier({"w": torch.arange(n * d, dtype=torch.float32).view(n, d), "s": torch.zeros(n, d)})


def test_fits_keeps_hits_and_the_smallest_misses_up_to_the_unpinned_slots():
    cache = PartitionCache(4, _tier())
    pinned = cache.acquire(torch.tensor([1, 2]), pin=True)
    cache.acquire(torch.tensor([3]))                     # resident, unpinned: evictable unless in the batch
    assert cache.fits(torch.tensor([4, 5])).all()        # 2 free/evictable slots
    assert cache.fits(torch.tensor([3, 4, 5, 6])).tolist() == [True, True, False, False]  # 3 is a hit
    assert cache.fits(torch.tensor([2, 7, 8, 9])).tolist() == [True, True, True, False]   # 2 is pinned already
    cache.unpin(pinned)
    assert cache.fits(torch.tensor([10, 11, 12, 13])).all()
    assert cache.fits(torch.tensor([10, 11, 12, 13, 14])).tolist() == [True] * 4 + [False]
    sel = torch.tensor([3, 4, 5, 6])
    cache.acquire(sel[cache.fits(sel)])                  # what fits, fits
    assert (cache.slots_of(torch.tensor([3, 4])) >= 0).all()


def test_direct_reads_see_dirty_evictions_and_writes_bypass_the_slots():
    tier = _tier()
    cache = PartitionCache(2, tier)
    s = cache.acquire(torch.tensor([0, 1]))
    cache.storage["w"][s] += 1000.0
    cache.mark_dirty(s)
    cache.acquire(torch.tensor([5, 6]))                  # evicts 0 and 1 (written back)
    got = cache.read_direct(torch.tensor([1, 0, 9]))
    assert got["w"][:, 0].tolist() == [1003.0, 1000.0, 27.0]
    got["w"] += 1.0
    cache.write_direct(torch.tensor([1, 0, 9]), got)
    assert tier.tensors["w"][9, 0] == 28.0 and cache.slots_of(torch.tensor([9])).item() == -1
    cache.count_overflow(3)
    assert (cache.traffic.overflow_rows, cache.traffic.overflow_batches) == (3, 1)
    assert (cache.counters.lookups, cache.counters.misses) == (7, 7)
