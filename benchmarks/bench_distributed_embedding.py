"""Partitioned, broadcast and replicated embeddings over N ranks: per-step time, bytes moved, scaling efficiency.

    python -m benchmarks.bench_distributed_embedding --ranks 1,2 --vocab 65536 --dim 256 --tokens 4096
    python -m benchmarks.bench_distributed_embedding --quick             # small sizes, a few seconds
    python -m benchmarks.bench_distributed_embedding --ranks 1 --vocab 262144 --dim 4096 --tokens 16384 \
        --modes replicated,partitioned                                   # one GPU: partitioned x1 vs one plain table

Weak scaling: every rank looks up ``--tokens`` Zipf ids per step (a frequency-ordered vocabulary), so
efficiency = step time on 1 rank / step time on N ranks of the same mode (1.0 = perfect); ``vs_one_gpu``
divides one plain ``ShardedEmbedding`` (``replicated x1``) by the row's time. A step is forward, backward
and the sparse AdamW update; ``replicated`` also all-gathers the sparse grads
(``allreduce_sparse_rows``), ``partitioned`` and ``broadcast`` do their all-to-alls (broadcast: every row is the
master's). Each rank's GPU cache is ``--cache-frac`` of the rows it holds (partitioned: 1/N of them; broadcast:
the master's, of all). The last line prints ``partitioned x1`` over one plain ``ShardedEmbedding`` (on one rank
the partitioned table takes the plain table's path: the ratio is its own overhead). Ranks are processes on this host:
NCCL on GPUs when there are enough, else gloo on CPU; they share the host's cores as launched ranks do
(``ds_maximus/distributed/cores.py``). Each world size runs in fresh processes. The H200 runs:
``scripts/gpu/distributed.sh``, ``docs/bench/distributed.md``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness import Bench


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(step, rank, tokens, vocab):
    g = torch.Generator().manual_seed(1000 * step + rank)
    # Zipf-like over a frequency-ordered vocabulary, drawn by inverse transform (no V-sized multinomial)
    u = torch.rand(tokens, generator=g, dtype=torch.float64)
    return (vocab ** u - 1).long().clamp_(0, vocab - 1)


def _worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    from ds_maximus.distributed.cores import share_host_cores
    share_host_cores()  # what ds_maximus.initialize does for launched ranks
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.distributed import PartitionedEmbedding, allreduce_sparse_rows
    from ds_maximus.distributed.broadcast import BroadcastEmbedding
    from ds_maximus.vocab import ShardedEmbedding
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    rows, round_ms = {}, {}
    # --rounds R runs every mode R times, interleaved (A B A B ...): the order a mode runs in (allocator state, host
    # page cache, clocks) then weighs on every mode alike; a mode's time is the median of its rounds' medians
    for mode in [m for _ in range(args.rounds) for m in args.modes.split(",")]:
        # the GPU cache holds --cache-frac of the rows this rank keeps: partitioned keeps 1/world of them
        held = args.vocab // world if mode == "partitioned" else args.vocab  # broadcast: the master's rows
        cache = args.cache_rows or max(1, int(args.cache_frac * held))
        cfg = EmbeddingConfig(gpu_cache_rows=cache, optimizer={"lr": 1e-3, "weight_decay": 0.0})
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        if mode == "partitioned":
            emb = PartitionedEmbedding(args.vocab, args.dim, config=cfg, device=dev)
        elif mode == "broadcast":
            emb = BroadcastEmbedding(args.vocab, args.dim, config=cfg, device=dev, master_rank=0)
        else:
            emb = ShardedEmbedding(args.vocab, args.dim, config=cfg, device=dev)
        times, sent, phases, ph = [], [], [], []

        def mark():  # --phases: a device sync, then a timestamp
            if args.phases:
                if cuda:
                    torch.cuda.synchronize()
                ph.append(time.perf_counter())
        for step in range(args.warmup + args.steps):
            ids = _ids(step, rank, args.tokens, args.vocab).to(dev)
            exchanges = mode in ("partitioned", "broadcast")
            before = emb.comm.stats()["bytes_sent"] if exchanges else 0
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            ph[:] = [t0]
            y = emb(ids)
            mark()
            y.float().pow(2).mean().backward()
            mark()
            if not exchanges and world > 1:
                g_ids, g_rows = emb.sparse_grads()
                g_ids, g_rows = allreduce_sparse_rows(g_ids, g_rows)
                emb.set_sparse_grads_(g_ids, g_rows)
                moved = (world - 1) * g_ids.numel() * (8 + 4 * args.dim)  # lower bound: the padding not counted
            else:
                moved = emb.comm.stats()["bytes_sent"] - before if exchanges else 0
            mark()
            emb.sparse_step()
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
                sent.append(moved)
                if args.phases:
                    mark()
                    phases.append([(b - a) * 1e3 for a, b in zip(ph, ph[1:])])
        round_ms.setdefault(mode, []).append(statistics.median(times))
        t = torch.tensor([statistics.median(round_ms[mode])], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        peak = torch.tensor([torch.cuda.max_memory_allocated(dev) if cuda else 0], dtype=torch.float64, device=dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        held_bytes = torch.tensor([float(emb.table_bytes()) if hasattr(emb, "table_bytes") else -1.0],
                                  dtype=torch.float64, device=dev)
        every = [torch.zeros_like(held_bytes) for _ in range(world)]
        dist.all_gather(every, held_bytes)  # bytes each rank holds for the table (tier, cache, counters)
        table = emb.tier_bytes() if hasattr(emb, "tier_bytes") else args.vocab * args.dim * 12
        st = emb.stats()
        last = st.get("last_step", {})
        rows[mode] = {"ms": float(t), "round_ms": round_ms[mode], "bytes_sent_per_step": statistics.mean(sent),
                      "tier_bytes": table,
                      "held_bytes": [float(b) for b in every],
                      "comm_ms": emb.comm.stats()["comm_ms"] / (args.warmup + args.steps)
                      if exchanges else None, "collectives": last.get("collectives"), "cache_rows": cache,
                      "peak_gib": float(peak) / 2**30,
                      "hit_rate": st.get("last_step", {}).get("hit_rate", st.get("hit_rate")),
                      "phases": [statistics.median(c) for c in zip(*phases)] if phases else None}
        del emb, y  # the last output's graph holds the module: free both before the next mode is built
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1,2", help="world sizes to run, comma-separated (1 is the baseline)")
    ap.add_argument("--modes", default="replicated,partitioned,broadcast",
                    help="replicated (on 1 rank: one plain ShardedEmbedding, the baseline), partitioned, broadcast")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048, help="ids per rank per step")
    ap.add_argument("--cache-rows", type=int, default=0, help="GPU cache rows per rank (0: --cache-frac)")
    ap.add_argument("--cache-frac", type=float, default=0.1, help="GPU cache as a fraction of the rows a rank holds")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="run every mode this many times, interleaved; a mode's "
                    "time is the median of its rounds' medians")
    ap.add_argument("--phases", action="store_true", help="also time forward, backward, the replicated mode's "
                    "reduction and the step apart (a device sync between them)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--quick", action="store_true", help="small sizes for a quick run: --vocab 8192 --dim 64 "
                    "--tokens 1024 --steps 4 --warmup 1 (given values of these options are overridden)")
    args = ap.parse_args()
    if args.quick:
        args.vocab, args.dim, args.tokens, args.steps, args.warmup = 8192, 64, 1024, 4, 1
    worlds = sorted({int(x) for x in args.ranks.split(",")} | {1})
    bench = Bench("distributed_embedding", dtype="fp32",
                  sizes={"V": args.vocab, "d": args.dim, "tokens/rank": args.tokens},
                  notes="weak scaling; efficiency = ms(1 rank) / ms(N ranks) of the same mode; vs 1 GPU = "
                        "ms(one ShardedEmbedding, replicated x1) / ms(N ranks); bytes = sent per rank per step")
    base = {}
    for world in worlds:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            mp.start_processes(_worker, args=(world, _free_port(), args, f.name), nprocs=world,
                               start_method="spawn")
            res = json.load(open(f.name))
        for mode, r in res.items():
            base.setdefault(mode, r["ms"])
            one = base.get("replicated", base[mode])  # replicated on one rank is one plain ShardedEmbedding
            bench.add(f"{mode} x{world}", r["ms"], rounds_ms="/".join(f"{x:.2f}" for x in r["round_ms"]),
                      efficiency=round(base[mode] / r["ms"], 3),
                      vs_one_gpu=round(one / r["ms"], 3),
                      MiB_sent_per_step=r["bytes_sent_per_step"] / 2**20,
                      comm_ms_per_step=r["comm_ms"] if r["comm_ms"] is not None else "-",
                      collectives_per_step=r["collectives"] if r["collectives"] is not None else "-",
                      table_MiB_per_rank=r["tier_bytes"] / 2**20,
                      held_MiB_max_min=("/".join(f"{b / 2**20:.1f}" for b in (max(r["held_bytes"]),
                                                                              min(r["held_bytes"])))
                                        if min(r["held_bytes"]) >= 0 else "-"),
                      cache_rows_per_rank=r["cache_rows"],
                      peak_GiB_per_rank=round(r["peak_gib"], 2),
                      hit_rate=round(r["hit_rate"], 3) if r["hit_rate"] is not None else "-",
                      **({"fwd/bwd/reduce/step_ms": "/".join(f"{x:.1f}" for x in r["phases"])}
                         if r.get("phases") else {}))
        bench.checkpoint(args.out)
    bench.report()
    if args.out:
        bench.checkpoint(args.out)
    if "replicated" in base and "partitioned" in base:  # base: each mode's time on one rank
        ratio = base["partitioned"] / base["replicated"]
        print(f"partitioned x1 / one plain ShardedEmbedding: {base['partitioned']:.2f} / {base['replicated']:.2f} ms "
              f"= {ratio:.3f} (target <= 1.2)")


if __name__ == "__main__":
    main()
