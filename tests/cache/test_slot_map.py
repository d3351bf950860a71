import pytest
import torch

from ds_maximus.cache import SlotMap
from ds_maximus.config import CachePolicy
from ds_maximus.errors import CapacityError


def _check_consistent(m: SlotMap):
    res = m.slot_to_id >= 0
    ids = m.slot_to_id[res]
    assert torch.equal(m.id_to_slot[ids], torch.nonzero(res).flatten())
    assert int((m.id_to_slot >= 0).sum()) == int(res.sum())


def test_lru_evicts_least_recent():
    m = SlotMap(3, 10, CachePolicy.LRU)
    m.assign(torch.tensor([0, 1, 2]))
    m.assign(torch.tensor([0]))
    m.assign(torch.tensor([2]))
    a = m.assign(torch.tensor([5]))
    assert a.evicted_ids.tolist() == [1]
    assert m.counters.hits == 2 and m.counters.misses == 4 and m.counters.evictions == 1
    _check_consistent(m)


def test_lfu_evicts_least_frequent():
    m = SlotMap(2, 10, CachePolicy.LFU)
    for _ in range(3):
        m.assign(torch.tensor([4]))
    m.assign(torch.tensor([7]))
    a = m.assign(torch.tensor([9]))
    assert a.evicted_ids.tolist() == [7]
    _check_consistent(m)


def test_pinned_never_evicted_and_capacity_error():
    m = SlotMap(2, 10, CachePolicy.LRU)
    a = m.assign(torch.tensor([1, 2]))
    m.pin(a.slots[:1])
    b = m.assign(torch.tensor([3]))
    assert b.evicted_ids.tolist() == [2]
    m.pin(b.slots)
    with pytest.raises(CapacityError, match="pinned"):
        m.assign(torch.tensor([4]))
    m.unpin(b.slots)
    assert m.assign(torch.tensor([4])).evicted_ids.tolist() == [3]
    with pytest.raises(CapacityError, match="distinct entries"):
        m.assign(torch.tensor([5, 6, 7]))


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_churn_keeps_map_consistent(policy):
    g = torch.Generator().manual_seed(0)
    m = SlotMap(16, 200, policy)
    for _ in range(200):
        ids = torch.unique(torch.randint(0, 200, (12,), generator=g))
        a = m.assign(ids)
        assert torch.equal(m.slot_to_id[a.slots], ids)  # every requested id resident in its slot
        assert not set(a.evicted_ids.tolist()) & set(ids.tolist())
        _check_consistent(m)
