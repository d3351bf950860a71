"""PartitionCache over TensorTier / ShardStoreTier: fills, dirty write-backs, pinning, counters."""
import pytest
import torch

from ds_maximus.config import CachePolicy
from ds_maximus.errors import CapacityError
from ds_maximus.partition import PartitionCache, TensorTier
from ds_maximus.partition.store_tier import ShardStoreTier


def _tier(n=20, d=3):
    return TensorTier({"w": torch.arange(n * d, dtype=torch.float32).view(n, d), "s": torch.zeros(n, d)})


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_dirty_rows_written_back_on_eviction_clean_rows_not(policy):
    tier = _tier()
    cache = PartitionCache(4, tier, policy=policy)
    slots = cache.acquire(torch.tensor([0, 1, 2, 3]))
    cache.storage["w"][slots[:2]] += 100.0  # rows 0 and 1 modified
    cache.mark_dirty(slots[:2])
    cache.acquire(torch.tensor([10, 11, 12, 13]))  # evicts all four
    assert cache.traffic.rows_evicted == 4 and cache.traffic.rows_written_back == 2
    assert torch.equal(tier.tensors["w"][0], torch.tensor([100.0, 101.0, 102.0]))
    assert torch.equal(tier.tensors["w"][2], torch.tensor([6.0, 7.0, 8.0]))
    back = cache.acquire(torch.tensor([1]))
    assert cache.storage["w"][back[0], 0] == 103.0  # comes back with its update


def test_pinned_entries_survive_and_capacity_error_names_fix():
    cache = PartitionCache(3, _tier())
    a = cache.acquire(torch.tensor([5, 6]), pin=True)
    cache.acquire(torch.tensor([7]))
    cache.acquire(torch.tensor([8]))
    assert torch.equal(cache.slots_of(torch.tensor([5, 6])), a)
    with pytest.raises(CapacityError, match="pinned"):
        cache.acquire(torch.tensor([1, 2]))
    cache.unpin(a)
    cache.acquire(torch.tensor([1, 2]))
    assert int(cache.map.pin_count.sum()) == 0


def test_flush_keeps_entries_resident_and_clean():
    tier = _tier()
    cache = PartitionCache(5, tier)
    s = cache.acquire(torch.tensor([4, 9]))
    cache.storage["s"][s] = 1.5
    cache.mark_dirty(s)
    cache.flush()
    assert torch.equal(tier.tensors["s"][[4, 9]], torch.full((2, 3), 1.5))
    assert not bool(cache.dirty.any())
    cache.acquire(torch.tensor([4, 9]))
    assert cache.counters.hits == 2 and cache.traffic.rows_fetched == 2
    assert cache.traffic.bytes_h2d == 2 * 2 * 3 * 4


def test_heavy_churn_against_a_dict_model():
    """Random acquire / modify cycles: the cache + tier always equal a plain dict model of the table."""
    g = torch.Generator().manual_seed(0)
    tier = _tier(50, 2)
    model = tier.tensors["w"].clone()
    cache = PartitionCache(8, tier, policy=CachePolicy.LFU)
    for _ in range(200):
        ids = torch.unique(torch.randint(0, 50, (6,), generator=g))
        slots = cache.acquire(ids)
        assert torch.equal(cache.storage["w"][slots], model[ids])
        cache.storage["w"][slots] += 1.0
        model[ids] += 1.0
        cache.mark_dirty(slots)
    cache.flush()
    assert torch.equal(tier.tensors["w"], model)


def test_shard_store_tier_bounded_cpu_cache(tmp_path):
    tier = ShardStoreTier.for_table(str(tmp_path / "s"), 40, 2, ("m",), rows_per_shard=8, cpu_cache_shards=2,
                                    init=lambda lo, hi: torch.arange(lo, hi, dtype=torch.float32)[:, None].repeat(1, 2))
    cache = PartitionCache(4, tier)
    for ids in ([1, 9, 17, 33], [2, 25, 38, 10]):
        s = cache.acquire(torch.tensor(ids))
        assert torch.equal(cache.storage["weight"][s][:, 0], torch.tensor(ids, dtype=torch.float32))
        cache.storage["m"][s] = 7.0
        cache.mark_dirty(s)
    cache.flush()
    assert len(tier._shards) <= 2
    from ds_maximus.store import ShardStore
    m = ShardStore.open(str(tmp_path / "s")).read_all("m")
    assert m[[1, 9, 17, 33, 2, 25, 38, 10], 0].tolist() == [7.0] * 8 and m[0, 0] == 0


@pytest.mark.gpu
def test_gpu_cache_uva_fill_and_write_back():
    tier = TensorTier({"w": torch.randn(100, 64), "s": torch.zeros(100, 64)}, pin_memory=True)
    model = tier.tensors["w"].clone()
    cache = PartitionCache(16, tier, device="cuda", policy=CachePolicy.LRU)
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        ids = torch.unique(torch.randint(0, 100, (10,), generator=g))
        slots = cache.acquire(ids)
        ds = slots.cuda()
        assert torch.equal(cache.storage["w"][ds].cpu(), model[ids])
        cache.storage["w"][ds] *= 2.0
        model[ids] *= 2.0
        cache.mark_dirty(slots)
    cache.flush()
    assert torch.equal(tier.tensors["w"], model)


class _InFlight:
    """Stands for the event of tier writes queued on other streams: it 'lands' ``value`` in the tier's row 0
    when the host waits for it, and records that wait."""

    def __init__(self, tier, value):
        self.tier, self.value, self.waits = tier, value, 0

    def query(self):
        return False

    def synchronize(self):
        self.waits += 1
        self.tier.tensors["w"][0] = self.value


@pytest.mark.parametrize("access", ["fill", "read_direct", "write_direct", "flush", "finish_write_backs"])
def test_host_access_to_the_tier_waits_for_its_writes_in_flight(access):
    """tier_written_until: every host read or write of the tier comes after the writes in flight (a staged
    step's copies, which on a GPU run on into the next forward), once; a fill reads what they wrote."""
    tier = _tier()
    cache = PartitionCache(4, tier)
    ev = _InFlight(tier, torch.tensor([-1.0, -2.0, -3.0]))
    cache.tier_written_until(ev)
    if access == "fill":
        slots = cache.acquire(torch.tensor([0]))
        assert torch.equal(cache.storage["w"][slots[0]], torch.tensor([-1.0, -2.0, -3.0]))
    elif access == "read_direct":
        assert torch.equal(cache.read_direct(torch.tensor([0]))["w"][0], torch.tensor([-1.0, -2.0, -3.0]))
    elif access == "write_direct":
        cache.write_direct(torch.tensor([0]), {"w": torch.full((1, 3), 7.0), "s": torch.zeros(1, 3)})
        assert torch.equal(tier.tensors["w"][0], torch.full((3,), 7.0))  # written after the copies landed
    elif access == "flush":
        cache.flush()
    else:
        cache._finish_write_backs(block=True)
    assert ev.waits == 1
    cache.tier_sync()  # nothing in flight any more
    assert ev.waits == 1
