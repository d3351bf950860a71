"""#38: where a step's time goes without a profiler, for bench_peft_vocab's ``--peer`` at the Gemma-3-4B shape: for
each phase of the watched steps (forward, backward, step, the loss read) the host's time in it and when the compute
stream finished the phase's work, from CUDA events recorded at the phase's ends (no added host wait: the bench's loss
read already drains the compute stream, and its end is the anchor between the host's clock and the GPU's).

Per phase: ``host ms`` (the host inside it), ``gpu ms`` (from the GPU reaching the phase's first event to its last:
the phase's GPU work plus the GPU's idle time inside it), ``gpu done +ms`` (how long after the host left the phase the
GPU finished its work: large = the GPU is behind, the host is ahead; near 0 = the host holds the GPU back). On the GPU
machine, after ``. .device/env.sh`` and ``. scripts/gpu/common.sh``::

    python scripts/gpu/peft_phase_times.py --peer ours_capped --steps 10 --watched 4
"""
import argparse
import collections
import contextlib
import time

import torch
from step_watch import run_watched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", default="ours_capped")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--watched", type=int, default=4)
    a, rest = ap.parse_known_args()
    rec = []   # per phase: (step, name, host t0, host t1, event at t0, event at t1)
    anchors = []  # (step, host time, event): the loss read has drained the compute stream
    step_no = [0]

    def event():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @contextlib.contextmanager
    def around():
        step_no[0] += 1
        yield

    @contextlib.contextmanager
    def phase(name):
        e0, t0 = event(), time.perf_counter()
        try:
            yield
        finally:
            t1, e1 = time.perf_counter(), event()
            rec.append((step_no[0], name, t0, t1, e0, e1))
            if name == "loss read":
                anchors.append((step_no[0], t1, e1))

    watching = [False]

    def sub(name, fn):   # a sub-phase of ours (the head's forward, the table's sparse step), timed the same way
        def wrapped(*args, **kw):
            if not watching[0]:
                return fn(*args, **kw)
            with phase(name):
                return fn(*args, **kw)
        return wrapped

    import ds_maximus.vocab.lm_head as lm_head
    from ds_maximus.vocab.sharded_embedding import ShardedEmbedding
    lm_head.streamed_linear_cross_entropy = sub("  head fwd", lm_head.streamed_linear_cross_entropy)
    ShardedEmbedding.sparse_step = sub("  sparse step", ShardedEmbedding.sparse_step)
    base_around = around

    @contextlib.contextmanager
    def around():   # noqa: F811 - the watched flag for the sub-phases
        watching[0] = True
        with base_around():
            yield
        watching[0] = False

    run_watched(a.peer, a.steps, a.watched, rest, around=around, phase=phase)
    torch.cuda.synchronize()
    by_step = collections.defaultdict(list)
    for r in rec:
        by_step[r[0]].append(r)
    rows = collections.defaultdict(list)
    for k in sorted(by_step)[1:]:   # each watched step after the first: the step before ends at an anchor
        prev = [x for x in anchors if x[0] == k - 1]
        if not prev:
            continue
        _, th, ea = prev[0]
        for _, name, t0, t1, e0, e1 in by_step[k]:
            host = (t1 - t0) * 1e3
            gpu = e0.elapsed_time(e1)
            done = th * 1e3 + ea.elapsed_time(e1) - t1 * 1e3
            rows[name].append((host, gpu, done))
        first = next(r for r in by_step[k] if r[1] == "forward")
        last = next(r for r in by_step[k] if r[1] == "loss read")
        rows["(step total)"].append(((last[3] - first[2]) * 1e3, first[4].elapsed_time(last[5]), 0.0))
    print(f"{a.peer}: {len(rows.get('forward', []))} steps, mean over them")
    print(f"{'phase':14s} {'host ms':>9s} {'gpu ms':>9s} {'gpu done +ms':>13s}")
    for name, vals in rows.items():
        n = len(vals)
        print(f"{name:14s} {sum(v[0] for v in vals) / n:9.1f} {sum(v[1] for v in vals) / n:9.1f} "
              f"{sum(v[2] for v in vals) / n:13.1f}")


if __name__ == "__main__":
    main()
