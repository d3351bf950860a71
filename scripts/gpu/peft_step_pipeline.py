"""#38: the tied table's staged step on the GPU, window by window, for bench_peft_vocab's ``--peer`` (ours) at the
Gemma-3-4B shape: when each window's load (host -> device), update and store (device -> host) ran on their streams,
from CUDA events recorded around each one (no host wait added), against the compute stream's own marks (the step,
the loss read, the next forward, its lookup, decoder layers 0, 1, 17 and 33, its head), each also at the host's
time; and where the host thread sat from the step to the next forward's first layer (its Python stack sampled every
``--sample-ms``; runs of one stack of 8 ms or more). That is how the forward's wait for the step's copies was found
(docs/bench/peft_vocab.md, 2026-12-06 midday). On the GPU machine, after ``. .device/env.sh`` and
``. scripts/gpu/common.sh``::

    python scripts/gpu/peft_step_pipeline.py --steps 9 --watched 2
"""
import argparse
import contextlib
import sys
import threading
import time
import traceback

import torch
from step_watch import run_watched, stack_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", default="ours_capped")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--watched", type=int, default=3)
    ap.add_argument("--sample-ms", type=float, default=2.0,
                    help="the host thread's stack sampled this often while a step is watched (0: not)")
    a, rest = ap.parse_known_args()
    import ds_maximus.vocab.lm_head as lm_head
    from ds_maximus.partition.staged_update import StagedUpdate
    from ds_maximus.vocab.sharded_embedding import ShardedEmbedding

    step_no, watching = [0], [False]
    samples = []   # (host time, the main thread's stack) while watching
    main_id = threading.get_ident()

    def sampler():
        while True:
            time.sleep(a.sample_ms / 1e3)
            if watching[0]:
                f = sys._current_frames().get(main_id)
                if f is not None:
                    fr = [(x.filename, x.lineno, x.name) for x in reversed(traceback.extract_stack(f))]
                    samples.append((time.perf_counter(), stack_text(fr, 3)))
    if a.sample_ms > 0:
        threading.Thread(target=sampler, daemon=True).start()
    marks = []   # (step, name, event on the compute stream, host time)
    spans = []   # (step, kind, start event, end event) on the pipeline's streams

    def event(stream=None):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream) if stream is not None else e.record()
        return e

    def timed(kind, orig):
        """``orig`` (a StagedUpdate phase, a context manager yielding its stream) with events around its work."""
        @contextlib.contextmanager
        def ctx(self, *args, **kw):
            with orig(self, *args, **kw) as st:
                if not (watching[0] and self.cuda):
                    yield st
                else:
                    s = st if st is not None else torch.cuda.current_stream(self.device)
                    e0 = event(s)   # after the phase's waits on its stream: when its work could start
                    yield st
                    spans.append((step_no[0], kind, e0, event(s)))
        return ctx

    StagedUpdate.loading = timed("load", StagedUpdate.loading)
    StagedUpdate.updating = timed("update", StagedUpdate.updating)
    StagedUpdate.storing = timed("store", StagedUpdate.storing)

    def marked(name, fn):
        def wrapped(*args, **kw):
            if watching[0]:
                marks.append((step_no[0], name, event(), time.perf_counter()))
            return fn(*args, **kw)
        return wrapped
    lm_head.streamed_linear_cross_entropy = marked("head fwd", lm_head.streamed_linear_cross_entropy)
    ShardedEmbedding.sparse_step = marked("sparse step", ShardedEmbedding.sparse_step)
    ShardedEmbedding.forward = marked("embedding fwd", ShardedEmbedding.forward)
    import ds_maximus.vocab.function as vf
    vf.ids_on_host = marked("ids read", vf.ids_on_host)
    from transformers.models.gemma3 import modeling_gemma3 as mg
    layer_fwd = mg.Gemma3DecoderLayer.forward

    def layer_marked(self, *args, **kw):
        i = self.layer_idx
        if watching[0] and i in (0, 1, 17, 33):
            marks.append((step_no[0], f"layer {i} fwd", event(), time.perf_counter()))
        return layer_fwd(self, *args, **kw)
    mg.Gemma3DecoderLayer.forward = layer_marked

    @contextlib.contextmanager
    def around():
        step_no[0] += 1
        watching[0] = True
        try:
            yield
        finally:
            watching[0] = False

    @contextlib.contextmanager
    def phase(name):
        marks.append((step_no[0], name, event(), time.perf_counter()))
        try:
            yield
        finally:
            marks.append((step_no[0], name + " end", event(), time.perf_counter()))

    run_watched(a.peer, a.steps, a.watched, rest, around=around, phase=phase)
    torch.cuda.synchronize()
    for k in sorted({s for s, *_ in spans}):
        base, hbase = next(((e, h) for s, n, e, h in marks if s == k and n == "sparse step"), (None, None))
        if base is None:
            continue
        print(f"step {k}: ms after the compute stream reached the table's sparse step")
        print(f"  {'stream':8s} {'pieces':>6s} {'first start':>12s} {'last end':>9s} {'busy':>8s} {'max piece':>10s}")
        for kind in ("load", "update", "store"):
            mine = [(e0, e1) for s, kd, e0, e1 in spans if s == k and kd == kind]
            if not mine:
                continue
            starts = [base.elapsed_time(e0) for e0, _ in mine]
            ends = [base.elapsed_time(e1) for _, e1 in mine]
            lengths = [e0.elapsed_time(e1) for e0, e1 in mine]
            print(f"  {kind:8s} {len(mine):6d} {min(starts):12.1f} {max(ends):9.1f} {sum(lengths):8.1f} "
                  f"{max(lengths):10.1f}")
        later = [(s, n, e, h) for s, n, e, h in marks if s in (k, k + 1) and n not in ("sparse step",)]
        seen = set()
        print(f"  {'mark':30s} {'GPU +ms':>9s} {'host +ms':>9s}")
        for s, n, e, h in later:
            t = base.elapsed_time(e)
            if t < 0 or (s, n) in seen:
                continue
            seen.add((s, n))
            print(f"  {('next ' if s == k + 1 else '') + n:30s} {t:9.1f} {1e3 * (h - hbase):9.1f}")
        # where the host thread sat from the step to the next forward's layer 0: runs of one stack >= 8 ms
        end = next((h for s, n, e, h in marks if s == k + 1 and n == "layer 0 fwd"), None)
        if end is not None:
            run, t0 = None, None
            for h, st in [x for x in samples if hbase <= x[0] <= end] + [(end, None)]:
                if st != run:
                    if run is not None and h - t0 >= 8e-3:
                        print(f"  host +{1e3 * (t0 - hbase):7.1f} .. +{1e3 * (h - hbase):7.1f}: {run}")
                    run, t0 = st, h


if __name__ == "__main__":
    main()
