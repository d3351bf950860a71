"""The host-side work of a ShardedEmbedding step, op against reference: the batch plan and the slot map.

Every step plans the next batch on the host (``BatchPlanner``: unique ids, inverse, stable order, segment
offsets) and gives its unique ids cache slots (``SlotMap.assign``: hits, victims, evictions). On the GPU
machine both run on the host while the GPU waits for the step's launches, so their time is step time.
This measures both at ``bench_sharded_embedding``'s sizes (V=262144, a 10% cache, 8 x 2048 Zipf(1.1) tokens)
after a warm-up that fills the cache, C++ op against the numpy / torch reference it is tested against:

    python -m benchmarks.bench_host_plan                  # ~10 s on 2 cores once the op is built
    python -m benchmarks.bench_host_plan --policy lru --repeat 200
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import numpy as np
import torch

from benchmarks.bench_sharded_embedding import zipf_batches
from benchmarks.harness import Bench, progress


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--cache-frac", type=float, default=0.10)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--policy", default="lfu", choices=["lfu", "lru"])
    ap.add_argument("--warmup-batches", type=int, default=100, help="batches assigned before timing (cache full)")
    ap.add_argument("--repeat", type=int, default=100)
    a = ap.parse_args(argv)

    from ds_maximus.config import CachePolicy
    from ds_maximus.ops.row_ops import host_op
    from ds_maximus.partition.policy import SlotMap
    from ds_maximus.vocab.function import BatchPlanner

    torch.set_num_threads(1)  # the host work is single-threaded; keep torch's pool out of the reference
    V, S = a.vocab, int(a.vocab * a.cache_frac)
    sizes = {"V": V, "slots": S, "tokens": a.tokens, "zipf": a.zipf, "policy": a.policy}
    notes = ("ms per call on the host (median); the op is ds_maximus' C++ host op, the reference the numpy / "
             "torch code the tests compare it with")
    if host_op() is None:
        raise SystemExit("the maximus_row_ops op did not build; nothing to compare")
    progress("drawing batches")
    batches = [b.numpy() for b in zipf_batches(V, a.tokens, a.warmup_batches + 40, a.zipf)]
    uniq = [torch.from_numpy(np.unique(b)) for b in batches]

    plan = Bench("host_batch_plan", dtype="int64", sizes=sizes, notes=notes)
    for use_op, name in ((True, "batch_plan op"), (False, "BatchPlanner numpy reference")):
        planner = BatchPlanner(V, use_op=use_op)
        it = itertools.cycle(batches)
        plan.measure(name, lambda: planner.plan_host(next(it)), warmup=5, repeat=a.repeat,
                     **{"unique ids/call": int(np.mean([u.numel() for u in uniq]))})
    plan.report(baseline="BatchPlanner numpy reference")

    slots = Bench("host_slot_assign", dtype="int64", sizes=sizes, notes=notes)
    for use_op, name in ((True, "slot_assign op"), (False, "SlotMap.assign_reference (torch)")):
        m = SlotMap(S, V, CachePolicy(a.policy))
        m.use_op = use_op
        progress(f"{name}: filling the cache with {a.warmup_batches} batches")
        for u in uniq[:a.warmup_batches]:
            m.assign(u)
        before = dataclasses.replace(m.counters)
        it = itertools.cycle(uniq[a.warmup_batches:])
        res = slots.measure(name, lambda: m.assign(next(it)), warmup=2, repeat=a.repeat)
        c = m.counters.delta(before)
        res.extra.update({"hit rate": round(c.hit_rate, 3), "misses/call": c.misses // (a.repeat + 2)})
    slots.report(baseline="SlotMap.assign_reference (torch)")


if __name__ == "__main__":
    main()
