"""The expert cache's own host bookkeeping a layer of a batch-1 decode step, with the copies taken out.

A decode step asks each MoE layer's expert cache to ``acquire`` its routed experts, to ``prefetch`` the next layer's
guesses (a staged head, or whole into a slot) and to ``release`` the slots. The GPU path pays that on the host that
also queues the GPU's work, so at 32 layers its cost is paid 32 times a token. Here the cache runs on the CPU with a
transfer engine that moves nothing (every copy lands at once), so the time is the cache's decisions and maps alone:
``ExpertCache`` at the Mixtral-8x7B layout by default (32 layers of 8 experts, top-2, ``--slots`` a layer;
Qwen3-30B-A3B: ``--layers 48 --experts 128 --top-k 8 --slots 40``), a seeded random routing and one guess a layer
(``prefetch_top_k`` 1), in the modes the offload runs:

- ``staged``: guesses staged (``stage_guesses``, the default on a GPU with a CPU tier);
- ``slots``: guesses loaded whole into a slot (the NVMe tier, or ``prefetch_chunk_mib`` 0).

    DS_ACCELERATOR=cpu python scripts/probe_cache_bookkeeping.py [--tokens 200] [--repeat 3]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_maximus.experts.expert_cache import ExpertCache  # noqa: E402
from ds_maximus.experts.expert_store import CpuExpertStore  # noqa: E402
from ds_maximus.experts.layout import ExpertLayout  # noqa: E402


class NoCopies:
    """A transfer engine whose copies land at once and move nothing (the cache's calls, without their work)."""

    def load(self, *args, **kwargs):
        return None

    def load_head(self, *args, **kwargs):
        return None

    def prefetch(self, *args, **kwargs):
        return None

    def done(self, ev) -> bool:
        return True

    def wait(self, ev) -> float:
        return 0.0

    def record_use(self):
        return None

    def cancel(self, handle) -> bool:
        return True

    def synchronize(self, ev) -> None:
        pass

    def close(self) -> None:
        pass


def us_per_layer(mode: str, layers: int, experts: int, slots: int, top_k: int, tokens: int, seed: int) -> float:
    lay = ExpertLayout.from_stacked({"w": torch.zeros(experts, 4, 4)}, num_experts=experts)
    store = CpuExpertStore(lay, num_uids=layers * experts, pin_memory=False)
    staged = mode == "staged"
    cache = ExpertCache(store, num_groups=layers, num_experts=experts, slots_per_group=slots, device="cpu",
                        transfer=NoCopies(), prefetch_chunk_bytes=16 if staged else None, stage_guesses=staged)
    rng = random.Random(seed)
    routes = [[sorted(rng.sample(range(experts), top_k)) for _ in range(layers)] for _ in range(tokens)]
    guesses = [[rng.sample(range(experts), top_k) for _ in range(layers)] for _ in range(tokens)]

    def decode(n: int) -> None:
        for t in range(n):
            for g in range(layers):
                ids = routes[t][g]
                got = cache.acquire(g, ids, ids)
                if g + 1 < layers:  # the next layer's guess (its first pick), keeping its predicted routing
                    cache.prefetch(g + 1, guesses[t][g + 1][:1], keep=guesses[t][g + 1])
                cache.release(g, got)

    decode(min(tokens, 20))  # warm-up
    t0 = time.perf_counter()
    decode(tokens)
    return (time.perf_counter() - t0) / (tokens * layers) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"| guesses | us a layer (min of {a.repeat}) | ms a token at {a.layers} layers |")
    print("|---|---|---|")
    for mode in ("staged", "slots"):
        us = min(us_per_layer(mode, a.layers, a.experts, a.slots, a.top_k, a.tokens, seed=r) for r in range(a.repeat))
        print(f"| {mode} | {us:.1f} | {us * a.layers / 1e3:.2f} |")


if __name__ == "__main__":
    main()
