"""Where the offload path's own time a decode token goes on the GPU (#37), with every expert resident.

Mixtral-8x7B layers (``--layers``, default 8; the bench's random model), batch-1 greedy decode: the plain model, then
the same model through ``offload_experts`` with all 8 experts of a layer in slots (no misses, no copies after the
warm-up) for each of ``--modes`` (``int4``: ``moe.quant`` 4-bit, group 64; ``bf16``: exact). For each: ms a token
without the profiler, then ``--trace-tokens`` tokens under ``torch.profiler``, from which it prints

* ms a token of wall time, of compute-stream busy time and of compute-stream idle time (the gaps: what the GPU
  waits for the host);
* the gaps' split by the host op that ends them (the first CUDA runtime call after a gap), over 0.05 ms;
* the host ops and kernels by total time a token (top ``--top``).

The trace of each mode goes to ``$OUT/overhead_<mode>.json.gz`` (``python -m benchmarks.trace_timeline``
reads it). Needs a CUDA GPU; ~25 GB of GPU memory at 8 layers.

    python scripts/gpu/probe_offload_overhead.py [--layers 8] [--modes int4,bf16] [--tokens 32] [--trace-tokens 4]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gc
import gzip
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_moe_offload import build, resolve_shape  # noqa: E402
from benchmarks.trace_timeline import _streams, load, stream_gaps  # noqa: E402
from ds_maximus.experts import compute  # noqa: E402
from ds_maximus.experts.offload import offload_experts  # noqa: E402
from ds_maximus.experts.quant_triton import MMA_CONFIG  # noqa: E402
from scripts.probe_offload_host_time import ms_per_token, sync  # noqa: E402


def traced(model, ids, n: int, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
    raw = path[:-3]
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f, gzip.open(path, "wb") as g:
        g.write(f.read())
    os.remove(raw)


def summarize(path: str, tokens: int, top: int) -> None:
    ev = [e for e in load(path) if e.get("ph") == "X"]
    found = _streams(ev)
    if found is None:
        print("  (no GPU events: the host ops alone)")
        ks, gaps = [], []
    else:
        _, by, compute = found
        ks = sorted(by[compute], key=lambda e: e["ts"])
        gaps = stream_gaps(ks)
        wall = (max(e["ts"] + e["dur"] for e in ks) - ks[0]["ts"]) / 1e3
        idle = sum(b - a for a, b, _, _ in gaps) / 1e3
        print(f"  traced span {wall:.1f} ms over {tokens} tokens (the prompt's prefill included): "
              f"{wall / tokens:.2f} ms/token wall, {(wall - idle) / tokens:.2f} busy, {idle / tokens:.2f} idle on "
              f"the compute stream; {len(gaps) / tokens:.0f} gaps a token")
    # what each gap waited for: the host op running when the kernel that ends it was launched
    host = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    launches = sorted((e for e in ev if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    corr = {e["args"].get("correlation"): e for e in launches if "args" in e}
    by = collections.Counter()
    nby = collections.Counter()
    starts = [h["ts"] for h in host]
    for a, b, _, k in gaps:
        if (b - a) < 50:
            continue
        la = corr.get(k.get("args", {}).get("correlation"))
        name = "?"
        if la is not None:
            i = bisect.bisect_right(starts, la["ts"]) - 1
            while i >= 0 and host[i]["ts"] + host[i]["dur"] < la["ts"]:
                i -= 1
            name = host[i]["name"] if i >= 0 else la["name"]
        by[name] += (b - a) / 1e3
        nby[name] += 1
    print("  gaps over 0.05 ms, by the host op that launched the kernel ending them (ms a token, count a token):")
    for name, ms in by.most_common(top):
        print(f"    {ms / tokens:7.3f}  {nby[name] / tokens:5.1f}  {name}")
    agg = collections.Counter()
    cnt = collections.Counter()
    for e in host:
        agg[e["name"]] += e["dur"] / 1e3
        cnt[e["name"]] += 1
    print("  host ops by inclusive ms a token (count a token):")
    for name, ms in agg.most_common(top):
        print(f"    {ms / tokens:7.3f}  {cnt[name] / tokens:6.1f}  {name}")
    kagg = collections.Counter()
    for e in ks:
        kagg[e["name"][:90]] += e["dur"] / 1e3
    print("  kernels by ms a token:")
    for name, ms in kagg.most_common(top):
        print(f"    {ms / tokens:7.3f}  {name}")
    syncs = [e for e in launches if "Synchronize" in e["name"] or "MemcpyAsync" in e["name"]]
    waits = collections.Counter()
    for e in syncs:
        waits[e["name"]] += e["dur"] / 1e3
    print("  host waits in CUDA runtime calls (ms a token): " +
          ", ".join(f"{n} {ms / tokens:.2f}" for n, ms in waits.most_common(4)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--modes", default="int4,bf16", help="comma-separated: bf16, int8, int4, int2; a quantized mode "
                   "with ':tile' runs the token-tile kernel for every round instead of the one-row gemv and the "
                   "tensor-core kernel (compute.DECODE_GEMV, compute.ROUND_MMA)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--trace-tokens", type=int, default=4)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--small", action="store_true", help="the bench's CPU-sized Mixtral on the CPU (a smoke test)")
    a = p.parse_args()
    device = "cpu" if a.small or not torch.cuda.is_available() else "cuda"
    out = os.environ.get("OUT", ".")
    args = argparse.Namespace(family="mixtral", small=a.small, layers=a.layers, hidden=None, ffn=None, experts=None,
                              top_k=None, vocab=None, tokens=a.tokens, baseline_tokens=None, agree_tokens=None,
                              init="scaled", dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    resolve_shape(args)
    ids = torch.randint(1, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    first = True
    for mode in a.modes.split(","):
        model = build(args, device)
        if first:
            name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
            full = min(ms_per_token(model, ids, a.tokens) for _ in range(2))
            print(f"## {a.layers} Mixtral layers, batch 1, every expert resident ({name})")
            print(f"full model on GPU: {full:.2f} ms/token ({full / a.layers:.3f} a layer)")
            path = f"{out}/overhead_full.json.gz"
            traced(model, ids, a.trace_tokens, path)
            summarize(path, a.trace_tokens + 1, a.top)
            first = False
        cfg = {"gpu_experts_per_layer": args.experts}
        bits, _, gemv = mode.partition(":")
        if bits != "bf16":
            cfg["quant"] = {"bits": int(bits.removeprefix("int")), "group_size": 64}
        compute.DECODE_GEMV = gemv != "tile"
        compute.ROUND_MMA = None if gemv == "tile" else MMA_CONFIG
        handle = offload_experts(model, cfg)
        for _ in range(2):
            ms_per_token(model, ids, 8)  # every expert into its slot
        handle.reset_stats()
        ours = min(ms_per_token(model, ids, a.tokens) for _ in range(2))
        s = handle.stats()
        print(f"ours {mode}: {ours:.2f} ms/token ({(ours - full) / a.layers:.3f} ms a layer over full), hit rate "
              f"{s.get('hit_rate', float('nan')):.3f}, stall ms {s.get('stall_ms', 0):.1f}")
        path = f"{out}/overhead_{mode.replace(':', '_')}.json.gz"
        traced(model, ids, a.trace_tokens, path)
        summarize(path, a.trace_tokens + 1, a.top)
        handle.close()
        del model, handle
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
