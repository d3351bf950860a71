"""Why a missed expert computed on the host takes longer inside a decode than alone (#37, ``moe.cpu_compute``).

The 32-layer runs timed the host expert (``expert_cpu.swiglu``) at 4-5 ms an int4 expert inside the decode against
1.77 ms alone on the same host, and bf16 + ``cpu_compute: misses`` at ~13 ms a host expert. This probe tells the
suspects apart on ``--layers`` Mixtral-8x7B layers (the bench's random model), batch-1 greedy decode with
``cpu_compute: misses`` and ``--slots`` GPU slots a layer, for each weight kind of ``--modes`` and each OpenMP team
size of ``--threads`` (``torch.set_num_threads``: torch and the op share the process's OpenMP runtime; the op's
own ``omp_max_threads`` is printed to show it):

* **alone**: the op on one expert of the CPU tier, in this process, back to back (min / median ms);
* **in the decode**: ms a decode token (two ``generate`` lengths, differenced: the prompt's prefill cancels), host
  experts a token, and the op's own ms a call inside the decode, with the layer's guesses on (the link reading
  host memory beside the op) and off (``handle.speculative_prefetch = False``). The prompt is one token, so every
  forward is one token.

Needs a CUDA GPU; ~25 GB of GPU memory and ~23 GB of pinned host memory (bf16) at 8 layers.

    python scripts/gpu/probe_host_misses.py [--layers 8] [--modes bf16,int4] [--threads 16,15,12,8] [--slots 1]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_moe_offload import build, resolve_shape  # noqa: E402
from ds_maximus.experts.offload import offload_experts  # noqa: E402
from ds_maximus.ops import expert_cpu  # noqa: E402
from scripts.probe_offload_host_time import sync  # noqa: E402


class OpTimer:
    """``expert_cpu.swiglu`` wrapped: one-token calls' wall ms (the host compute reads the op's names at call time)."""

    def __init__(self):
        self.inner = expert_cpu.swiglu
        self.ms = []

    def __call__(self, x, *a, **kw):
        t0 = time.perf_counter()
        y = self.inner(x, *a, **kw)
        if x.shape[0] == 1:
            self.ms.append((time.perf_counter() - t0) * 1e3)
        return y


def decode_ms(model, ids, short: int, long: int) -> float:
    """ms a decode token: ``generate`` of ``long`` minus ``short`` new tokens, over their difference."""
    def run(n):
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0
    with torch.no_grad():
        run(2)
        return (run(long) - run(short)) / (long - short) * 1e3


def alone(host, uid: int, hidden: int, reps: int = 9):
    """(min, median) ms of the op on expert ``uid``'s CPU-tier weights, one bf16-exact token."""
    x = torch.randn(1, hidden).to(torch.bfloat16).float()
    w = host.weights(uid)
    expert_cpu.swiglu(x, *w)
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        expert_cpu.swiglu(x, *w)
        ms.append((time.perf_counter() - t0) * 1e3)
    return min(ms), statistics.median(ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--modes", default="bf16,int4", help="comma-separated: bf16, int8, int4, int2")
    p.add_argument("--threads", default="16,15,12,8", help="OpenMP team sizes to try, comma-separated")
    p.add_argument("--slots", type=int, default=1, help="GPU expert slots a layer")
    p.add_argument("--short", type=int, default=4)
    p.add_argument("--long", type=int, default=20)
    p.add_argument("--small", action="store_true", help="the bench's CPU-sized Mixtral on the CPU (a smoke test)")
    a = p.parse_args()
    device = "cpu" if a.small or not torch.cuda.is_available() else "cuda"
    args = argparse.Namespace(family="mixtral", small=a.small, layers=a.layers, hidden=None, ffn=None, experts=None,
                              top_k=None, vocab=None, tokens=a.long, baseline_tokens=None, agree_tokens=None,
                              init="scaled", dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    resolve_shape(args)
    ids = torch.randint(1, args.vocab, (1, 1), generator=torch.Generator().manual_seed(1)).to(device)
    threads = [int(t) for t in a.threads.split(",")]
    print(f"## {a.layers} Mixtral layers, batch 1, cpu_compute: misses, {a.slots} slot(s) a layer "
          f"({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; host cores {torch.get_num_threads()}, "
          f"op ISA {expert_cpu.kernel_isa()})")
    print("| mode | threads | op omp | alone min / med ms | guesses | ms a decode token | host experts a token | "
          "op ms a call in the decode (med / mean / max) | op ms a token |")
    print("|---|---|---|---|---|---|---|---|---|")
    timer = OpTimer()
    expert_cpu.swiglu = timer
    try:
        for mode in a.modes.split(","):
            model = build(args, device)
            cfg = {"gpu_experts_per_layer": a.slots, "cpu_compute": "misses"}
            if mode != "bf16":
                cfg["quant"] = {"bits": int(mode.removeprefix("int")), "group_size": 64}
            handle = offload_experts(model, cfg)
            host = handle.host_compute
            for n in threads:
                torch.set_num_threads(n)
                expert_cpu.swiglu = timer.inner
                lo, med = alone(host, 1, args.hidden)
                expert_cpu.swiglu = timer
                for guesses in (True, False):
                    handle.speculative_prefetch = guesses
                    decode_ms(model, ids, 2, 4)  # warm: the slots hold what this setting's decode keeps
                    timer.ms.clear()
                    ms = decode_ms(model, ids, a.short, a.long)
                    calls = list(timer.ms)
                    tokens = 2 + a.short + a.long  # a one-token prompt: every forward of the three is one token
                    per_tok = len(calls) / tokens
                    print(f"| {mode} | {n} | {expert_cpu.max_threads()} | {lo:.2f} / {med:.2f} | "
                          f"{'on' if guesses else 'off'} | {ms:.1f} | {per_tok:.1f} | "
                          f"{statistics.median(calls) if calls else float('nan'):.2f} / "
                          f"{statistics.fmean(calls) if calls else float('nan'):.2f} / "
                          f"{max(calls) if calls else float('nan'):.2f} | "
                          f"{sum(calls) / max(1, tokens):.1f} |", flush=True)
            handle.close()
            del model, handle, host
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        expert_cpu.swiglu = timer.inner


if __name__ == "__main__":
    main()
