"""ShardedEmbedding vs. its peers: one training step of a big embedding (forward, backward, optimizer).

GPU (default sizes): V=262144, d=4096, 8 x 2048 tokens drawn Zipf(s) over a frequency-ordered vocab,
fp32 master + AdamW, cache = 10% of rows. Peers, measured in the same run: nn.Embedding + fused
AdamW, nn.Embedding(sparse=True) + SparseAdam, DeepSpeed ZeRO-2, ZeRO-2 + CPU optimizer offload.
CPU mode (no GPU, or --cpu): V=32768, d=256 against dense CPU AdamW and SparseAdam.

Time (H200, --budget-s 110 by default): each peer has a cost estimate; a peer that no longer fits in
what is left of the budget is a "skipped: over time budget" row. DeepSpeed's own optimizers are JIT
ops (fused_adam ~30 s, cpu_adam ~40-60 s to build): scripts/gpu/sharded_embedding.sh builds them in
the background while our CUDA op builds; ZeRO-2 falls back to torch's fused AdamW as a client
optimizer when fused_adam is not built, and ZeRO-Offload builds cpu_adam only when the budget allows.

    python -m benchmarks.bench_sharded_embedding            # GPU when present
    python -m benchmarks.bench_sharded_embedding --cpu --steps 10
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness import Bench, Budget, progress


def zipf_batches(vocab: int, tokens: int, n: int, s: float, seed: int = 0):
    """``n`` batches of ``tokens`` ids, id i drawn with probability ~ (i+1)^-s (frequency-ordered vocab)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s)
    cdf = torch.cumsum(p / p.sum(), 0)
    return [torch.searchsorted(cdf, torch.rand(tokens, generator=g, dtype=torch.float64)).clamp_(max=vocab - 1)
            for _ in range(n)]


# seconds each peer needs at full size on an H200, setup included (a peer starts only when it fits)
COST = {"ours": 30, "dense": 10, "sparse": 12, "zero2": 25, "zero2_offload": 30, "cpu_adam build": 55}


def ds_op_ready(builder_cls) -> bool:
    """Whether DeepSpeed's op is installed or already JIT-built (so loading it costs no compile)."""
    name = builder_cls.NAME
    try:
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get(name):
            return True
    except ImportError:
        pass
    from torch.utils.cpp_extension import _get_build_directory
    return os.path.exists(os.path.join(_get_build_directory(name, verbose=False), f"{name}.so"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="CPU mode (smaller default sizes)")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--cache-frac", type=float, default=0.10)
    ap.add_argument("--policy", default="lfu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cache-warmup", type=int, help="steps ours trains on fresh batches (another seed) before "
                    "it is timed, so its cache is at steady state as in a long run (default 200 GPU, 50 CPU)")
    ap.add_argument("--budget-s", type=float, default=110.0, help="wall-clock budget; peers that no longer fit "
                    "are skipped (rows say so)")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed ZeRO-2 peers")
    ap.add_argument("--out", help="also write the markdown table to this file")
    a = ap.parse_args(argv)
    budget = Budget(a.budget_s)
    cuda = torch.cuda.is_available() and not a.cpu
    dev = torch.device("cuda" if cuda else "cpu")
    V = a.vocab or (262144 if cuda else 32768)
    d = a.dim or (4096 if cuda else 256)
    if not cuda:
        a.batch, a.seq = min(a.batch, 4), min(a.seq, 1024)
    tokens = a.batch * a.seq
    cache_warmup = a.cache_warmup if a.cache_warmup is not None else (200 if cuda else 50)
    n_batches = a.warmup + a.repeat + 2
    batches = zipf_batches(V, tokens, n_batches, a.zipf)
    uniq = sum(torch.unique(b).numel() for b in batches) / len(batches)
    bench = Bench("sharded_embedding", dtype="fp32 master, AdamW",
                  sizes={"V": V, "d": d, "tokens": f"{a.batch}x{a.seq}", "zipf": a.zipf,
                         "cache rows": int(V * a.cache_frac), "unique ids/batch": int(uniq)},
                  notes="ms per training step (forward + backward + optimizer); ours prefetches batch t+1 "
                        f"during step t, and is timed after {cache_warmup} steps on other batches (cache at "
                        "steady state; hit rate and traffic are of the timed steps). Hit rate: of each batch's "
                        "unique rows, those already on the GPU when first asked for (by the prefetch)")
    dev_batches = [b.view(a.batch, a.seq).to(dev) for b in batches]
    grad_out = torch.randn(a.batch, a.seq, d, device=dev) * 1e-3
    lr = 1e-3
    state = {"i": 0}

    def next_ids():
        i = state["i"] % len(dev_batches)
        state["i"] += 1
        return i

    # -- ours ------------------------------------------------------------------------------------------
    def run_ours(mode: str = "exact"):
        from ds_maximus.config import EmbeddingConfig
        from ds_maximus.vocab import ShardedEmbedding
        cfg = EmbeddingConfig(gpu_cache_rows=int(V * a.cache_frac), cache_policy=a.policy,
                              optimizer={"lr": lr, "weight_decay": 0.01 if mode == "exact" else 0.0, "mode": mode})
        emb = ShardedEmbedding(V, d, config=cfg, device=dev)
        before = {}

        def warm_cache():  # a long run's steady state: train on other batches first (not timed)
            for k in range(cache_warmup):
                b = zipf_batches(V, tokens, 1, a.zipf, seed=1000 + k)[0]
                emb(b.view(a.batch, a.seq).to(dev)).backward(grad_out)
                emb.sparse_step(lr=lr)
            before.update(emb.stats())
            state["i"] = 0

        def step():
            i = next_ids()
            emb.prefetch(batches[(i + 1) % len(batches)])
            emb(dev_batches[i]).backward(grad_out)
            emb.sparse_step(lr=lr)
        name = ("maximus ShardedEmbedding (exact AdamW)" if mode == "exact" else
                "maximus ShardedEmbedding (lazy: SparseAdam semantics)")
        res = bench.measure(name, step, warmup=a.warmup, repeat=a.repeat, setup=warm_cache)
        s = emb.stats()
        steps = max(1, s["steps"] - before.get("steps", 0))
        per = {k: (s[k] - before.get(k, 0)) / steps for k in ("rows_fetched", "rows_evicted", "bytes_h2d",
                                                               "bytes_d2h", "stall_ms")}
        hits = s["hit_rate"] * s["lookups"] - before.get("hit_rate", 0) * before.get("lookups", 0)
        res.extra.update({"hit rate": round(hits / max(1, s["lookups"] - before.get("lookups", 0)), 3),
                          "stall ms/step": round(per["stall_ms"], 3),
                          "rows fetched/step": int(per["rows_fetched"]),
                          "rows evicted/step": int(per["rows_evicted"]),
                          "H2D MiB/step": round(per["bytes_h2d"] / 2 ** 20, 1),
                          "D2H MiB/step": round(per["bytes_d2h"] / 2 ** 20, 1),
                          "row sparsity": round(s["row_sparsity"], 4), "cache warm-up steps": cache_warmup})
        emb = None  # drops the module (the step closures refer to the variable, not the object)

    # -- dense peers -----------------------------------------------------------------------------------
    def run_dense(sparse: bool):
        emb = nn.Embedding(V, d, sparse=sparse, device=dev)
        if sparse:
            opt = torch.optim.SparseAdam(emb.parameters(), lr=lr)
        else:
            opt = torch.optim.AdamW(emb.parameters(), lr=lr, weight_decay=0.01, **({"fused": True} if cuda else {}))

        def step():
            opt.zero_grad(set_to_none=False if not sparse else True)
            emb(dev_batches[next_ids()]).backward(grad_out)
            opt.step()
        name = "nn.Embedding(sparse) + SparseAdam" if sparse else \
            ("nn.Embedding + fused AdamW" if cuda else "nn.Embedding + AdamW")
        bench.measure(name, step, warmup=a.warmup, repeat=a.repeat)
        emb = opt = None

    def run_deepspeed(offload: bool):
        import deepspeed
        from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
        ds_opt = ds_op_ready(CPUAdamBuilder if offload else FusedAdamBuilder)
        name = "DeepSpeed ZeRO-2" + (" + CPU optimizer offload" if offload else "")
        if not ds_opt and not offload:
            name += " (torch fused AdamW: fused_adam not built)"
        if not ds_opt and offload and not budget.allows(COST["cpu_adam build"] + COST["zero2_offload"],
                                                        "cpu_adam build + ZeRO-Offload"):
            bench.skip(name, reason="skipped: over time budget (cpu_adam not prebuilt)")
            return
        progress(f"{name}: building the engine (DeepSpeed optimizer op {'ready' if ds_opt else 'not built'})")
        emb = nn.Embedding(V, d, device=dev)
        cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": 2, **({"offload_optimizer": {"device": "cpu", "pin_memory": True}}
                                                    if offload else {})},
               "zero_allow_untested_optimizer": True}
        if ds_opt or offload:
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}}
            client = None
        else:  # no JIT build inside the timed run: ZeRO-2 partitions torch's fused AdamW instead
            client = torch.optim.AdamW(emb.parameters(), lr=lr, weight_decay=0.01, fused=True)
        engine, *_ = deepspeed.initialize(model=emb, model_parameters=emb.parameters(), optimizer=client,
                                          config=cfg)
        progress(f"{name}: engine ready, timing")

        def step():
            out = engine(dev_batches[next_ids()])
            engine.backward((out * grad_out).sum())
            engine.step()
        bench.measure(name, step, warmup=1 if offload else a.warmup, repeat=3 if offload else a.repeat)
        engine.destroy() if hasattr(engine, "destroy") else None
        engine = emb = None

    base = "nn.Embedding + fused AdamW" if cuda else "nn.Embedding + AdamW"
    runs = [("maximus ShardedEmbedding (exact AdamW)", "ours", run_ours),
            ("maximus ShardedEmbedding (lazy: SparseAdam semantics)", "ours", lambda: run_ours("lazy")),
            (base, "dense", lambda: run_dense(False)),
            ("nn.Embedding(sparse) + SparseAdam", "sparse", lambda: run_dense(True))]
    if cuda and not a.no_deepspeed:
        runs += [("DeepSpeed ZeRO-2", "zero2", lambda: run_deepspeed(False)),
                 ("DeepSpeed ZeRO-2 + CPU optimizer offload", "zero2_offload", lambda: run_deepspeed(True))]
    progress(f"setup done ({len(batches)} batches, {uniq:.0f} unique ids/batch); budget {a.budget_s:.0f} s")
    for name, key, r in runs:
        bench.run_budgeted(name, r, COST[key] * (1 if cuda else 0.1), budget, out=a.out, baseline=base)
    text = bench.report(baseline=base)
    ours = next(r for r in bench.results if r.name.startswith("maximus"))  # exact: the dense AdamW peer
    dense = next((r for r in bench.results if r.name == base), None)
    sparse = next((r for r in bench.results if r.name.startswith("nn.Embedding(sparse)")), None)
    lazy = next((r for r in bench.results if "lazy" in r.name and r.ms), None)
    if ours.ms and dense and dense.ms and sparse and sparse.ms:
        verdict = (f"\nvs dense: {dense.ms / ours.ms:.2f}x faster (target >= 4x), peak memory "
                   f"{(ours.peak_gib or 0) / max(dense.peak_gib or 1e-9, 1e-9):.1%} of dense (target <= 15%); "
                   f"vs SparseAdam: {sparse.ms / ours.ms:.2f}x faster (target >= 1.5x)"
                   + (f"; lazy mode (SparseAdam's own semantics) {sparse.ms / lazy.ms:.2f}x SparseAdam"
                      if lazy else ""))
        print(verdict)
        text += "\n" + verdict
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}.items():
        os.environ.setdefault(k, v)  # DeepSpeed peers in one process, no launcher
    main()
