"""Where a decoded token's time goes with the expert cache: a torch.profiler trace per mode.

    python -m benchmarks.profile_moe_offload --out DIR            # H200: Mixtral-shaped, 8 layers
    python -m benchmarks.profile_moe_offload --small --out DIR    # CPU-sized smoke run

Builds the model of ``bench_moe_offload``, offloads its experts (``--slots`` per layer; ``--quant BITS`` and
``--cpu-compute`` as in the ``moe`` section), and for each mode
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
from benchmarks.bench_moe_offload import build, decode, resolve_shape
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
    p.add_argument("--layers", type=int, default=None, help="override the family's layer count (Mixtral: 8)")
    p.add_argument("--family", default="mixtral", choices=("mixtral", "qwen3"))
    p.add_argument("--init", default="scaled", choices=("scaled", "hf"))
    p.add_argument("--quant", type=int, default=None, help="moe.quant.bits (group 64); default exact bf16")
    p.add_argument("--cpu-compute", default="off", choices=("off", "misses", "auto"))
    p.add_argument("--table-rows", type=int, default=25, help="rows of the profiler's op tables (0: none)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for k in ("hidden", "ffn", "experts", "top_k", "vocab", "baseline_tokens", "agree_tokens"):
        setattr(a, k, None)
    resolve_shape(a)  # the family's shape (--small: CPU-sized), then --layers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(a, device)
    ids = torch.randint(0, a.vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    moe = {"gpu_experts_per_layer": a.slots, "speculative_prefetch": False, "cpu_compute": a.cpu_compute}
    if a.quant:
        moe["quant"] = {"bits": a.quant, "group_size": 64}
    handle = offload_experts(model, moe)
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
        if a.table_rows:  # where the host's and the device's time go, by op
            for key in ("self_cpu_time_total",) + (("self_device_time_total",) if device.type == "cuda" else ()):
                print(f"\n--- {mode}: ops by {key} ---")
                print(prof.key_averages().table(sort_by=key, row_limit=a.table_rows, max_name_column_width=60))
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
