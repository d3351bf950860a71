import random

import pytest
import torch

from ds_maximus.config import CachePolicy
from ds_maximus.errors import CapacityError
from ds_maximus.partition import SlotMap
from ds_maximus.partition.policy import HostSlotMap


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


def _pair(num_slots, num_ids, policy):
    ops, ref = SlotMap(num_slots, num_ids, policy), SlotMap(num_slots, num_ids, policy)
    assert ops._op() is not None, "the slot_assign op did not build"
    ref.use_op = False
    return ops, ref


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_slot_assign_op_equals_the_reference(policy):
    """The host op and the torch reference make the same decisions (ties by slot number), pins included."""
    g = torch.Generator().manual_seed(3)
    ops, ref = _pair(24, 300, policy)
    pins, refused = [], 0
    for step in range(300):
        ids = torch.unique(torch.multinomial(torch.arange(1, 301, dtype=torch.float).pow(-1.1), 10,
                                             replacement=True, generator=g))
        results = []
        for m in (ops, ref):
            try:
                results.append(m.assign(ids))
            except CapacityError as e:
                results.append(str(e))
        a, b = results
        if isinstance(a, str) or isinstance(b, str):
            assert a == b  # both refuse, with the same message, and change nothing
            refused += 1
        else:
            for f in ("slots", "miss_ids", "miss_slots", "evicted_ids", "evicted_slots"):
                assert torch.equal(getattr(a, f), getattr(b, f)), (step, f)
            if step % 3 == 0:  # whole batches stay pinned for a while: some assigns find too few free slots
                for m, r in ((ops, a), (ref, b)):
                    m.pin(r.slots)
                pins.append(a.slots)
        if len(pins) > 2:
            s = pins.pop(0)
            ops.unpin(s)
            ref.unpin(s)
        for name in ("id_to_slot", "slot_to_id", "last_use", "id_freq", "slot_freq"):
            assert torch.equal(getattr(ops, name), getattr(ref, name)), (step, name)
        assert ops.counters == ref.counters and ops.clock == ref.clock
    assert ops.counters.evictions > 100 and refused > 0


def _same(ops, ref, a, b, where):
    for f in ("slots", "miss_ids", "miss_slots", "evicted_ids", "evicted_slots"):
        assert torch.equal(getattr(a, f), getattr(b, f)), (where, f)
    for name in ("id_to_slot", "slot_to_id", "last_use", "id_freq", "slot_freq"):
        assert torch.equal(getattr(ops, name), getattr(ref, name)), (where, name)


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_slot_assign_op_equals_the_reference_at_cache_scale(policy):
    """At thousands of slots the op bounds its victim search by a sample of the slots' scores; its choices
    still equal the reference's, pins and a steady stream of misses included."""
    g = torch.Generator().manual_seed(5)
    ops, ref = _pair(8192, 60000, policy)
    p = torch.arange(1, 60001, dtype=torch.float).pow(-1.1)
    pinned = None
    for step in range(40):
        ids = torch.unique(torch.multinomial(p, 3000, replacement=True, generator=g))
        a, b = ops.assign(ids), ref.assign(ids)
        _same(ops, ref, a, b, step)
        if pinned is not None:
            ops.unpin(pinned)
            ref.unpin(pinned)
        pinned = a.slots  # the last batch stays pinned (in use) through the next assign
        ops.pin(pinned)
        ref.pin(pinned)
    assert ops.counters.misses > 8192 and ops.counters.evictions > 1000


def test_slot_assign_op_when_the_sample_misjudges():
    """The sampled slots are exactly the least recently used ones: the sample's bound admits too few victims,
    and the op searches every slot instead, choosing as the reference does."""
    ops, ref = _pair(8192, 20000, CachePolicy.LRU)
    for m in (ops, ref):
        for lo in range(0, 8192, 2048):  # slot i holds id i
            m.assign(torch.arange(lo, lo + 2048))
        m.assign(torch.tensor([i for i in range(8192) if i % 8 != 4]))  # all but the sampled slots: newer
    a, b = ops.assign(torch.arange(10000, 11500)), ref.assign(torch.arange(10000, 11500))
    _same(ops, ref, a, b, "misjudged")
    assert set(range(4, 8192, 8)) <= set(a.evicted_slots.tolist())  # the 1024 oldest went first


def test_a_used_map_deep_copies_and_the_copy_is_independent():
    """Models holding a cache are deep-copied (EMA copies, trainers); the map keeps no op object."""
    import copy
    m = SlotMap(4, 20, CachePolicy.LRU)
    m.assign(torch.tensor([1, 2, 3]))
    c = copy.deepcopy(m)
    c.assign(torch.tensor([7]))
    assert int(m.id_to_slot[7]) == -1 and int(c.id_to_slot[7]) >= 0


@pytest.mark.parametrize("policy", list(CachePolicy))
@pytest.mark.parametrize("num_slots", [1, 3, 8])
def test_host_slot_map_decides_as_the_slot_map(policy, num_slots):
    """HostSlotMap (lists, the expert cache's) makes SlotMap's choices on the same sequence of assigns, pins,
    unpins and evictions: the same slots, misses, victims and evicted ids, the same capacity errors and the same
    final maps, with the slot_assign op and with the torch reference."""
    rng = random.Random(num_slots)
    num_ids = 12
    host = HostSlotMap(num_slots, num_ids, policy)
    maps = [SlotMap(num_slots, num_ids, policy), SlotMap(num_slots, num_ids, policy)]
    maps[1].use_op = False
    pinned = []
    for _ in range(400):
        r = rng.random()
        if r < 0.15 and pinned:
            s = pinned.pop(rng.randrange(len(pinned)))
            host.unpin([s])
            for m in maps:
                m.unpin(torch.tensor([s]))
            continue
        if r < 0.2:
            ids = rng.sample(range(num_ids), 2)
            got = host.evict(ids)
            for m in maps:
                assert sorted(m.evict(torch.tensor(ids)).tolist()) == sorted(got)
            continue
        ids = rng.sample(range(num_ids), rng.randint(1, num_slots + 1))
        count = rng.random() < 0.8
        try:
            a = host.assign(ids, count=count)
        except CapacityError as e:
            for m in maps:
                with pytest.raises(CapacityError) as theirs:
                    m.assign(torch.tensor(ids), count=count)
                assert str(theirs.value) == str(e)
            continue
        for m in maps:
            b = m.assign(torch.tensor(ids), count=count)
            assert (a.slots, a.miss_ids, a.miss_slots, a.evicted_ids, a.evicted_slots) == (
                b.slots.tolist(), b.miss_ids.tolist(), b.miss_slots.tolist(), b.evicted_ids.tolist(),
                b.evicted_slots.tolist())
        if rng.random() < 0.3:  # keep some in use, as a cache's acquire does until release
            s = rng.choice(a.slots)
            pinned.append(s)
            host.pin([s])
            for m in maps:
                m.pin(torch.tensor([s]))
        for m in maps:
            assert torch.equal(host.id_to_slot, m.id_to_slot) and torch.equal(host.slot_to_id, m.slot_to_id)
            assert torch.equal(host.pin_count, m.pin_count)
            assert host.counters == m.counters
            assert host.resident_ids() == m.resident_ids().tolist()


def test_host_slot_map_refuses_bad_use():
    m = HostSlotMap(2, 4)
    with pytest.raises(IndexError, match="out of range"):
        m.assign([4])
    with pytest.raises(AssertionError, match="unpin without pin"):
        m.unpin([0])
    with pytest.raises(CapacityError, match="at least one slot"):
        HostSlotMap(0, 4)
