"""The cache core on the CPU engine: hits, eviction, prefetch accounting, and safety under churn."""
import random

import pytest
import torch

from ds_maximus.config import CachePolicy
from ds_maximus.errors import CapacityError
from ds_maximus.experts.expert_cache import ExpertCache
from ds_maximus.experts.expert_store import CpuExpertStore
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.partition.transfer import CpuTransfer

G, E = 3, 6


def make_cache(slots, policy=CachePolicy.LRU, delay_s=0.0, chunk_bytes=None, stage=False):
    lay = ExpertLayout.from_stacked({"w": torch.zeros(E, 8, 4)}, num_experts=E)
    store = CpuExpertStore(lay, G * E, pin_memory=False)
    for uid in range(G * E):
        store.write(uid, {"w": torch.full((8, 4), float(uid))})
    return ExpertCache(store, G, E, slots, "cpu", policy, transfer=CpuTransfer(delay_s=delay_s),
                       prefetch_chunk_bytes=chunk_bytes, stage_guesses=stage)


def content(cache, g, s):
    return cache.slot(g, s)[:32]


def test_acquire_loads_then_hits_and_lru_evicts():
    c = make_cache(2)
    s = c.acquire(0, [1, 4])
    c.release(0, s)
    assert c.stats()["demand_misses"] == 2
    s = c.acquire(0, [4])
    c.release(0, s)
    assert c.stats()["demand_hits"] == 1
    s = c.acquire(0, [2])  # evicts 1 (least recent), keeps 4
    c.release(0, s)
    assert c.resident(0) == [2, 4]
    assert torch.all(content(c, 0, s[0]) == 2.0)
    assert c.stats()["bytes_demand"] == 3 * c.layout.nbytes


def test_lfu_keeps_the_frequent_expert():
    c = make_cache(2, CachePolicy.LFU)
    for e in [0, 0, 0, 1, 2]:
        s = c.acquire(0, [e])
        c.release(0, s)
    assert 0 in c.resident(0)


def test_too_many_at_once_and_all_pinned_raise():
    c = make_cache(2)
    with pytest.raises(CapacityError, match="rounds"):
        c.acquire(0, [0, 1, 2])
    s = c.acquire(0, [0, 1])
    with pytest.raises(CapacityError):
        c.acquire(0, [2])          # both slots in use
    c.release(0, s)
    c.release(0, c.acquire(0, [2]))


def test_prefetch_precision_recall():
    c = make_cache(2, delay_s=0.01)
    assert c.prefetch(1, [3, 5]) == 2
    assert c.prefetch(1, [3]) == 0                 # already there (in flight)
    s = c.acquire(1, [3])  # useful prefetch, waits for the load in flight
    c.release(1, s)
    assert torch.all(content(c, 1, s[0]) == float(E + 3))
    s = c.acquire(1, [0])  # a miss: evicts the unused prefetch of 5
    c.release(1, s)
    st = c.stats()
    assert st["prefetch_issued"] == 2 and st["prefetch_useful"] == 1
    assert st["prefetch_precision"] == 0.5 and st["prefetch_recall"] == 0.5
    assert st["bytes_prefetch"] == 2 * c.layout.nbytes
    assert st["hits"] == 1 and st["resident_hit_rate"] == 0.0  # the one hit was the guess, which crossed
    c.release(1, c.acquire(1, [0]))                            # expert 0 is resident now: no copy
    assert c.stats()["resident_hit_rate"] == 1 / 3


def test_staged_guess_evicts_nothing_and_a_right_one_moves_only_the_rest():
    """A staged guess (a 32-byte head of a 128-byte expert) leaves the residents alone; when the routing
    confirms it, the slot gets the head from the staging buffer and only the rest from the store."""
    c = make_cache(2, delay_s=0.01, chunk_bytes=32, stage=True)
    for e in (1, 2):
        c.release(0, c.acquire(0, [e]))
    assert c.prefetch(0, [4]) == 1
    assert c.resident(0) == [1, 2]                  # nothing evicted by the guess
    s = c.acquire(0, [4])
    assert torch.all(content(c, 0, s[0]) == 4.0)
    c.release(0, s)
    st = c.stats()
    assert st["prefetch_useful"] == 1 and st["demand_hits"] == 1 and st["demand_misses"] == 2
    assert st["bytes_demand"] == 3 * c.layout.nbytes - 32 and st["bytes_prefetch"] == 32
    assert st["staging_bytes"] == 32


def test_staged_guess_that_is_wrong_costs_only_its_head():
    c = make_cache(2, delay_s=0.01, chunk_bytes=32, stage=True)
    for e in (1, 2):
        c.release(0, c.acquire(0, [e]))
    c.prefetch(0, [4])
    s = c.acquire(0, [2, 5])                        # 2 still hits: the guess evicted nothing
    assert [float(content(c, 0, x)[0]) for x in s] == [2.0, 5.0]
    c.release(0, s)
    st = c.stats()
    assert st["prefetch_cancelled"] == 1 and st["prefetch_useful"] == 0 and st["demand_hits"] == 1
    c.prefetch(0, [3])
    s = c.acquire(0, [1], needed=[1, 3])            # a guess for a later round of the layer is kept
    c.release(0, s)
    s = c.acquire(0, [3], needed=[1, 3])
    assert torch.all(content(c, 0, s[0]) == 3.0)
    c.release(0, s)
    assert c.stats()["prefetch_useful"] == 1


def test_two_staged_guesses_each_in_its_buffer():
    """stage_guesses=2: the first two guesses that are not resident stage their heads in two buffers (a resident
    one is skipped); both right ones move only their rest; a guess the layer does not need is dropped alone; a
    guess staged again stays as it is."""
    c = make_cache(3, delay_s=0.005, chunk_bytes=32, stage=2)
    c.release(0, c.acquire(0, [1]))
    assert c.prefetch(0, [1, 4, 5, 3]) == 2          # 1 is resident: 4 and 5 staged, 3 is a third guess
    assert c.staged_ids(0) == [4, 5] and c.resident(0) == [1]
    assert c.prefetch(0, [5, 4]) == 0                # both already staged: nothing queued again
    assert c.stats()["staging_bytes"] == 64
    s = c.acquire(0, [4, 5])
    assert [float(content(c, 0, x)[0]) for x in s] == [4.0, 5.0]
    c.release(0, s)
    st = c.stats()
    assert st["prefetch_useful"] == 2 and st["demand_hits"] == 2 and st["demand_misses"] == 1
    assert st["bytes_prefetch"] == 64 and st["bytes_demand"] == 3 * c.layout.nbytes - 64
    assert c.prefetch(1, [2, 3]) == 2
    s = c.acquire(1, [3, 0])                         # 3 right, 2 wrong: dropped
    assert [float(content(c, 1, x)[0]) for x in s] == [E + 3.0, E + 0.0]
    c.release(1, s)
    st = c.stats()
    assert st["prefetch_useful"] == 3 and st["prefetch_cancelled"] == 1 and c.staged_ids(1) == []


def test_prefetch_keeps_the_predicted_residents():
    """A guess evicts a resident outside ``keep`` (the predicted routing), not simply the least recent;
    with every resident kept it does not guess at all."""
    c = make_cache(2)
    for e in (1, 2):
        c.release(0, c.acquire(0, [e]))            # 1 is now the least recently used
    assert c.prefetch(0, [4], keep=[1, 4]) == 1
    c.synchronize()
    assert c.resident(0) == [1, 4]                  # LRU alone would have evicted 1
    assert c.prefetch(0, [5], keep=[1, 4]) == 0     # both residents predicted: no room for a guess
    assert c.resident(0) == [1, 4]
    assert int(c.groups[0].map.pin_count.sum()) == 0


def test_prefetch_never_takes_a_pinned_slot():
    c = make_cache(1, delay_s=0.01)
    s = c.acquire(0, [2])
    assert c.prefetch(0, [4]) == 0                 # the only slot is in use
    c.release(0, s)
    assert c.prefetch(0, [4]) == 1                 # now in flight, pinned
    s = c.acquire(0, [5])                          # demand drains the in-flight load, then evicts it
    assert torch.all(content(c, 0, s[0]) == 5.0)
    c.release(0, s)


def test_chunked_guess_that_is_needed_is_finished():
    """A guess (128-byte experts, a 32-byte head chunk) that the routing confirms: the rest is queued
    at once and the compute sees the whole expert."""
    c = make_cache(2, delay_s=0.01, chunk_bytes=32)
    assert c.prefetch(1, [3]) == 1
    s = c.acquire(1, [3])
    assert torch.all(content(c, 1, s[0]) == float(E + 3))
    c.release(1, s)
    st = c.stats()
    assert st["prefetch_useful"] == 1 and st["prefetch_cancelled"] == 0 and st["demand_misses"] == 0
    assert st["bytes_prefetch"] == c.layout.nbytes


def test_chunked_guess_that_is_wrong_is_stopped_and_forgotten():
    """The routing asks for another expert while a guess is in flight: the rest of the guess is
    never queued, its slot is forgotten (partial contents are never a hit), the demand load is exact."""
    c = make_cache(1, delay_s=0.02, chunk_bytes=32)
    assert c.prefetch(0, [4]) == 1
    s = c.acquire(0, [5])
    assert torch.all(content(c, 0, s[0]) == 5.0)
    c.release(0, s)
    st = c.stats()
    assert st["prefetch_cancelled"] == 1 and st["prefetch_useful"] == 0
    assert st["bytes_prefetch"] < c.layout.nbytes  # the chunks never queued are not counted
    assert c.resident(0) == [5]
    s = c.acquire(0, [4])                           # asked for later: a miss, loaded whole
    assert torch.all(content(c, 0, s[0]) == 4.0)
    c.release(0, s)
    assert c.stats()["demand_misses"] == 2


def test_guess_for_a_later_round_is_kept():
    """``needed`` spans the layer's rounds: a guess for an expert of a later round is not stopped."""
    c = make_cache(2, delay_s=0.02, chunk_bytes=32)
    c.prefetch(0, [4])
    s = c.acquire(0, [1], needed=[1, 4])
    c.release(0, s)
    s = c.acquire(0, [4], needed=[1, 4])
    assert torch.all(content(c, 0, s[0]) == 4.0)
    c.release(0, s)
    assert c.stats()["prefetch_useful"] == 1 and c.stats()["prefetch_cancelled"] == 0


@pytest.mark.parametrize("chunk_bytes,stage", [(None, False), (32, False), (32, True)])
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_churn_never_evicts_in_use_or_in_flight(slots, chunk_bytes, stage):
    """Random demand and speculation on a slow copier: an acquired slot holds its expert from
    acquire to release, and a slot with a load in flight is never handed to another expert
    (whole-expert guesses, and chunked guesses that demand loads stop)."""
    rng = random.Random(slots)
    c = make_cache(slots, delay_s=0.0005, chunk_bytes=chunk_bytes, stage=stage)
    for step in range(150):
        g = rng.randrange(G)
        want = sorted(rng.sample(range(E), rng.randint(1, slots)))
        held = c.acquire(g, want)
        for e, s in zip(want, held):
            assert torch.all(content(c, g, s) == float(g * E + e)), (step, g, e, s)
        # speculation on another group (and on this one: must skip the held slots)
        c.prefetch((g + 1) % G, rng.sample(range(E), rng.randint(1, E)))
        c.prefetch(g, rng.sample(range(E), rng.randint(1, E)))
        grp = c.groups[g]
        for s in held:
            assert grp.map.pin_count[s] > 0
            assert int(grp.map.slot_to_id[s]) in want
        for s, ev in list(grp.inflight.items()):
            assert grp.map.pin_count[s] > 0
        for e, s in zip(want, held):   # still intact after the speculation
            assert torch.all(content(c, g, s) == float(g * E + e)), (step, g, e, s)
        c.release(g, held)
    c.synchronize()
    for g in range(G):   # whatever is resident is what the map says
        for s in range(c.slots_per_group):
            e = int(c.groups[g].map.slot_to_id[s])
            if e >= 0:
                assert torch.all(content(c, g, s) == float(g * E + e))
    st = c.stats()
    assert st["demand_lookups"] == st["demand_hits"] + st["demand_misses"]
    assert 0.0 <= st["prefetch_precision"] <= 1.0
    c.close()


def test_layers_with_different_slot_counts():
    """Per-layer slot counts (moe.gpu_expert_total_bytes' remainder): each layer holds and refuses by its own."""
    c = make_cache([1, 3, 2])
    assert [c.slots_of(g) for g in range(G)] == [1, 3, 2] and c.slots_per_group == 1
    assert [c.slot_buffer(g).shape[0] for g in range(G)] == [1, 3, 2]
    assert c.device_bytes() == 6 * c.layout.nbytes
    c.release(1, c.acquire(1, [0, 2, 5]))
    assert c.resident(1) == [0, 2, 5]
    with pytest.raises(CapacityError, match="1 slots in that layer"):
        c.acquire(0, [0, 1])
    c.release(0, c.acquire(0, [4]))
    assert c.prefetch(2, [1, 3, 5]) == 2      # no more loads than the layer's slots
    s = c.acquire(2, [1, 3])
    assert [float(content(c, 2, x)[0]) for x in s] == [2 * E + 1.0, 2 * E + 3.0]
    c.release(2, s)
    assert c.stats()["slots_per_layer"] == 2.0
