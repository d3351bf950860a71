"""One soak run: a small model whose embedding lives in an NVMe shard store behind a small row cache, trained
by ``ds_maximus.initialize`` (ZeRO 2, fp32) for ``--steps`` steps on batches whose distinct-row count swings
from 10% to 300% of the cache, with a checkpoint every ``--ckpt-every`` steps (the last ``--keep`` kept).

``--resume`` loads the latest checkpoint of ``--dir`` first. Every batch is a function of its step number
alone, so a resumed run sees the batches the uninterrupted run saw. Prints ``step N`` after each step (the
driver kills the process at a random one); at the end writes ``final.pt`` (the embedding table and the
dense weights) and ``report.json`` (steps, overflow counts, RSS samples, disk use).

    python -m tests.soak.soak_worker --dir /tmp/soak/a --steps 2000
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

import torch
from torch import nn

TOKENS = 256             # tokens a step (4 sequences of 64): room for 300% of a 64-row cache
CLASSES = 64


class SoakModel(nn.Module):
    """Embedding -> tanh(Linear) -> Linear over ``CLASSES`` classes; the loss is cross-entropy."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, CLASSES)

    def forward(self, input_ids, labels):
        h = torch.tanh(self.proj(self.embed(input_ids)))
        return nn.functional.cross_entropy(self.out(h).view(-1, CLASSES), labels.view(-1))


def distinct_fraction(step: int) -> float:
    """The batch's distinct rows as a fraction of the cache: a slow swing between 0.1 and 3.0."""
    return 0.1 + 2.9 * (0.5 - 0.5 * math.cos(2 * math.pi * step / 97))


def batch(step: int, vocab: int, cache_rows: int, seed: int):
    """``(ids [4, 64], labels)`` of ``step``: exactly ``round(distinct_fraction * cache_rows)`` distinct ids,
    Zipf-biased (hot ids small, as after a TokenMap), each at least once."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    n = max(1, min(TOKENS, vocab, round(distinct_fraction(step) * cache_rows)))
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.05
    uniq = torch.multinomial(p, n, replacement=False, generator=g)
    ids = torch.cat([uniq, uniq[torch.randint(0, n, (TOKENS - n,), generator=g)]])
    ids = ids[torch.randperm(TOKENS, generator=g)].view(4, TOKENS // 4)
    return ids, (ids * 7 + 3) % CLASSES


def ds_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 50}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "maximus": {
            "embedding": {"modules": ["embed"], "gpu_cache_rows": args.cache_rows, "rows_per_shard": 256,
                          "cache_policy": "lfu", "optimizer": {"mode": args.mode},
                          "offload": {"device": "nvme", "nvme_path": os.path.join(args.dir, "store"),
                                      "cpu_cache_shards": args.cpu_cache_shards}},
            "logging": {"interval_steps": 10**9}},
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def disk_use(path: str) -> dict:
    files, size = 0, 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                size += os.path.getsize(os.path.join(root, n))
                files += 1
            except OSError:
                pass
    return {"files": files, "bytes": size}


def keep_latest(ckpt: str, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoint tags (as a job's save limit would)."""
    tags = sorted((int(t[4:]), t) for t in os.listdir(ckpt) if t.startswith("step") and t[4:].isdigit())
    for _, t in tags[:-keep]:
        shutil.rmtree(os.path.join(ckpt, t), ignore_errors=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--cache-rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--cpu-cache-shards", type=int, default=6)
    ap.add_argument("--mode", default="exact", choices=["exact", "lazy"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    import ds_maximus
    ckpt = os.path.join(args.dir, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    torch.manual_seed(args.seed)
    model = SoakModel(args.vocab, args.dim)
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    start = 0
    if args.resume and os.path.exists(os.path.join(ckpt, "latest")):
        path, _ = engine.load_checkpoint(ckpt)
        start = engine.global_steps
        print(f"resumed {path} at step {start}", flush=True)
    emb = engine.module.embed
    t0 = time.perf_counter()
    rss, overflow_steps = [], 0
    for step in range(start, args.steps):
        ids, labels = batch(step, args.vocab, args.cache_rows, args.seed)
        before = emb.stats()["overflow_batches"]
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        overflow_steps += emb.stats()["overflow_batches"] > before
        done = step + 1
        if done % args.ckpt_every == 0:
            engine.save_checkpoint(ckpt, tag=f"step{done}")
            keep_latest(ckpt, args.keep)
        if done % 10 == 0:
            rss.append((done, rss_bytes()))
        print(f"step {done} loss {float(loss):.6f}", flush=True)
    wall = time.perf_counter() - t0
    torch.save({"embed": emb.full_weight(), "dense": {k: v.detach().clone() for k, v in
                                                      engine.module.named_parameters()}},
               os.path.join(args.dir, "final.pt"))
    s = emb.stats()
    report = {"start_step": start, "steps": args.steps - start, "wall_s": wall,
              "overflow_steps": int(overflow_steps), "overflow_rows": s["overflow_rows"],
              "hit_rate": s["hit_rate"], "shard_reads": emb.tier.shard_reads, "shard_writes": emb.tier.shard_writes,
              "rss": rss, "peak_rss_bytes": max((r for _, r in rss), default=0),
              "store": disk_use(os.path.join(args.dir, "store")), "ckpt": disk_use(ckpt)}
    with open(os.path.join(args.dir, "report.json"), "w") as f:
        json.dump(report, f)
    print("done", json.dumps({k: v for k, v in report.items() if k != "rss"}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
