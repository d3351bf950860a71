"""#38: which code makes the host wait for the GPU inside a training step of bench_peft_vocab's ``--peer`` (Gemma-3-4B
shape), phase by phase. A wait on the host lets the GPU drain its queue; with LoRA's many small kernels the host then
issues barely ahead of the GPU, so each wait in the forward or the backward costs idle GPU time after it too.

The last ``--watched`` steps run with ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing op (``item``,
a copy into pageable memory, ``nonzero``, a stream synchronize, ...) is counted under its Python stack (the frames in
ds_maximus, transformers, peft, deepspeed, torch.nn and the bench). Explicit ``torch.cuda.Event.synchronize``,
``Stream.synchronize`` and ``torch.cuda.synchronize`` calls are also timed. On the GPU machine, after
``. .device/env.sh`` and ``. scripts/gpu/common.sh``::

    python scripts/gpu/peft_sync_waits.py --peer ours_capped --steps 8 --watched 2
"""
import argparse
import collections
import contextlib
import sys
import time
import traceback
import warnings

import torch
from step_watch import run_watched, stack_text


def _stack(depth: int) -> str:
    return stack_text([(f.filename, f.lineno, f.name) for f in reversed(traceback.extract_stack())], depth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", default="ours_capped")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--watched", type=int, default=2)
    ap.add_argument("--depth", type=int, default=7, help="frames kept per stack")
    a, rest = ap.parse_known_args()
    seen = collections.defaultdict(lambda: [0, 0.0])   # (phase, what, stack) -> [count, timed ms]
    state = {"on": False, "phase": "-"}

    def note(what: str, ms: float = 0.0) -> None:
        if state["on"]:
            k = seen[(state["phase"], what, _stack(a.depth))]
            k[0] += 1
            k[1] += ms

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            note("sync op")
        elif not state["on"]:
            orig_show(message, category, filename, lineno, file, line)
    orig_show = warnings.showwarning
    warnings.showwarning = showwarning

    def timed(fn, what):
        def wrapper(*args, **kw):
            if not state["on"]:
                return fn(*args, **kw)
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                note(what, 1e3 * (time.perf_counter() - t))
        return wrapper
    torch.cuda.Event.synchronize = timed(torch.cuda.Event.synchronize, "Event.synchronize")
    torch.cuda.Stream.synchronize = timed(torch.cuda.Stream.synchronize, "Stream.synchronize")
    torch.cuda.synchronize = timed(torch.cuda.synchronize, "torch.cuda.synchronize")

    phase_ms = collections.defaultdict(float)

    @contextlib.contextmanager
    def watching():
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        state["on"] = True
        try:
            yield
        finally:
            state["on"] = False
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)

    @contextlib.contextmanager
    def phase(name):
        state["phase"] = name
        t = time.perf_counter()
        try:
            yield
        finally:
            phase_ms[name] += 1e3 * (time.perf_counter() - t)
    run_watched(a.peer, a.steps, a.watched, rest, around=watching, phase=phase)
    print(f"# {a.peer}: host waits in the last {a.watched} of {a.steps} steps (sync debug mode 'warn'; explicit "
          f"synchronize calls timed)")
    print("host ms a phase (mean): " + ", ".join(f"{p} {v / a.watched:.1f}" for p, v in phase_ms.items()))
    for ph in ("forward", "backward", "step", "loss read"):
        rows = sorted(((k, v) for k, v in seen.items() if k[0] == ph), key=lambda kv: -kv[1][0])
        print(f"\n## {ph}: {sum(v[0] for _, v in rows)} waits, {sum(v[1] for _, v in rows):.1f} ms timed")
        for (_, what, stack), (n, ms) in rows:
            print(f"{n:5d} {ms:8.1f} ms  {what:22} {stack}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
