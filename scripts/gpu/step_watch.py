"""Shared by the #38 host tools (``peft_host_profile.py``, ``peft_sync_waits.py``, ``peft_alloc_retries.py``): run
bench_peft_vocab's ``--peer`` in this process and watch its last steps, and print Python stacks the same way."""
import contextlib

import benchmarks.bench_peft_vocab as bench

# the frames a stack keeps: our code, the libraries a step goes through, the bench (not these tools)
KEEP = ("ds_maximus", "transformers", "peft", "deepspeed", "torch/nn", "bench_peft_vocab", "torch/autograd",
        "torch/utils/checkpoint", "torch/optim")


def stack_text(frames, depth: int) -> str:
    """``frames`` (``(filename, line, function)``, innermost first) as one line: the first ``depth`` kept ones."""
    kept = [f for f in frames if any(k in f[0] for k in KEEP) and "/scripts/gpu/" not in f[0]]
    return " <- ".join(f"{fn.rsplit('/', 2)[-1]}:{line} {name}" for fn, line, name in kept[:depth])


def run_watched(peer: str, steps: int, watched: int, rest, around=None, phase=None) -> None:
    """Train ``peer`` ``steps`` steps (batch 4, one warm-up step; ``rest``: more bench options); each of the last
    ``watched`` runs inside ``around()`` (a context manager factory), with ``phase(name)`` around each of its
    phases (``bench_peft_vocab._train_step``)."""
    calls, step = [0], bench._train_step

    def wrapped(engine, ids):
        calls[0] += 1
        if calls[0] <= steps - watched:
            return step(engine, ids)
        with around() if around is not None else contextlib.nullcontext():
            return step(engine, ids, phase=phase)
    bench._train_step = wrapped
    try:
        bench.main(["--peer", peer, "--steps", str(steps), "--warmup", "1", "--batch", "4", "--json-out",
                    "/dev/null", *rest])
    finally:
        bench._train_step = step
