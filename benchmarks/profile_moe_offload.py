"""Where a decoded token's time goes with the expert cache: a torch.profiler trace per mode.

    python -m benchmarks.profile_moe_offload --out DIR            # H200: Mixtral-shaped, 8 layers
    python -m benchmarks.profile_moe_offload --small --out DIR    # CPU-sized smoke run

Builds the model of ``bench_moe_offload``, offloads its experts (2 slots per layer), and for each mode
(LRU only, speculative prefetch top-1) decodes a few warm-up tokens, then ``--tokens`` under the
profiler. Writes ``DIR/trace_<mode>.json.gz`` and prints, per mode, the per-stream busy time and the
compute stream's idle gaps (``benchmarks.trace_timeline``), the host's time blocked in syncs, and the
cache's counters: what the link, the compute stream and the host each do while a token decodes.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks import trace_timeline
from benchmarks.bench_moe_offload import build, decode
from benchmarks.harness import progress
from ds_maximus.experts import offload_experts


def _host_blocked_ms(events) -> dict:
    """Host ms inside CUDA sync-like runtime calls (the places the host waits for the GPU)."""
    out = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            n = e["name"]
            if "Synchronize" in n or n in ("cudaMemcpyAsync", "cudaMemcpy"):
                out[n] = out.get(n, 0.0) + e["dur"] / 1e3
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--modes", default="lru,top1")
    p.add_argument("--small", action="store_true")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    a.layers, a.hidden, a.ffn, a.experts, a.top_k, a.vocab = 8, 4096, 14336, 8, 2, 32000
    if a.small:
        a.layers, a.hidden, a.ffn, a.vocab = 4, 256, 512, 1024
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(a, device)
    ids = torch.randint(0, a.vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    handle = offload_experts(model, {"gpu_experts_per_layer": a.slots, "speculative_prefetch": False})
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if device.type == "cuda" else [])
    for mode in a.modes.split(","):
        handle.speculative_prefetch = mode != "lru"
        handle.cfg.prefetch_top_k = 1 if mode == "top1" else None
        decode(model, ids, a.warmup)
        handle.reset_stats()
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            tps = decode(model, ids, a.tokens)
        wall = time.perf_counter() - t0
        path = os.path.join(a.out, f"trace_{mode}.json.gz")
        prof.export_chrome_trace(path)
        st = handle.stats()
        print(f"\n=== {mode}: {tps:.2f} tokens/s under the profiler ({wall:.1f} s wall); hit rate "
              f"{st['hit_rate']:.3f}, prefetch precision {st['prefetch_precision']:.3f}, GB moved "
              f"{st['bytes_moved'] / 1e9:.2f} over {st['tokens']} tokens, stall ms {st['stall_ms']:.1f}", flush=True)
        if device.type == "cuda":
            ev = trace_timeline.load(path)
            print(trace_timeline.timeline(ev, bucket_ms=10.0))
            print("host blocked (ms):", {k: round(v, 1) for k, v in _host_blocked_ms(ev).items()}, flush=True)
        progress(f"{mode} done")
    handle.close()


if __name__ == "__main__":
    main()
