"""The host time ``offload_experts`` adds to a decode step, on any machine (CPU is enough).

A 32-layer tiny Mixtral (the offload tests' model, bf16, eager experts) decodes ``--tokens`` greedy tokens as the
plain model and through ``offload_experts`` with every expert resident (8 slots a layer: no copies, no misses), so the
difference is the offload path's own host work a token (the cache's acquire/release and policy, the routing's host
lists, the eager loop on slots). Then cProfile over one more decode lists the ds_maximus functions by cumulative
time. On a GPU the same gap appears with the layer's one host sync on top; scripts/gpu/host_decode.sh (OVERHEAD=1)
measures that at the Mixtral shape.

    DS_ACCELERATOR=cpu python scripts/probe_offload_host_time.py [--tokens 32] [--layers 32]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_maximus.experts.offload import offload_experts  # noqa: E402
from tests.experts.tiny_moe import clone, tiny_model  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ms_per_token(model, ids, n: int) -> float:
    """Wall ms a token of an ``n``-token greedy decode after a 4-token warm-up (the GPU waited for on either side)."""
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    a = p.parse_args()
    torch.set_num_threads(1)
    base = tiny_model("mixtral", experts_impl="eager", layers=a.layers, dtype=torch.bfloat16)
    ids = torch.randint(0, base.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    plain = min(ms_per_token(base, ids, a.tokens) for _ in range(2))
    model = clone(base)
    handle = offload_experts(model, {"gpu_experts_per_layer": base.config.num_local_experts})
    ours = min(ms_per_token(model, ids, a.tokens) for _ in range(2))
    print(f"| {a.layers} layers | plain ms/token | offload_experts ms/token | added ms/layer |")
    print("|---|---|---|---|")
    print(f"| tiny Mixtral, bf16, all resident | {plain:.2f} | {ours:.2f} | {(ours - plain) / a.layers:.3f} |")
    prof = cProfile.Profile()
    prof.enable()
    ms_per_token(model, ids, a.tokens // 2 or 1)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumtime").print_stats("ds_maximus", 15)
    handle.close()


if __name__ == "__main__":
    main()
