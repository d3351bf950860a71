"""Where a ShardedEmbedding training step spends its time (GPU): link bandwidth of the cache's copy
kernels, and a torch.profiler breakdown of host and device time per step.

    python -m benchmarks.profile_sharded_embedding                  # bench_sharded_embedding's sizes
    python -m benchmarks.profile_sharded_embedding --steps 6 --out prof.txt

Prints (1) the bandwidth of the UVA ``copy_rows`` kernel host->device, device->host and both at once
(the fill and write-back paths of the cache) against a pinned ``copy_``; (2) ms per step with and
without the profiler; (3) the profiler's top host ops and device kernels.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bench_sharded_embedding import zipf_batches


def _bw(fn, nbytes: int, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return nbytes * repeat / (time.perf_counter() - t0) / 1e9


def link_table(d: int, rows: int, table_rows: int) -> str:
    from ds_maximus.ops.row_ops import load_op
    op = load_op("cuda")
    host = torch.empty(table_rows, d, pin_memory=True).normal_()
    dev = torch.empty(rows, d, device="cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(table_rows, generator=g)[:rows].cuda()
    slots = torch.arange(rows, device="cuda")
    nbytes = rows * d * 4
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    dev2 = torch.empty_like(dev)
    host_flat = torch.empty(rows, d, pin_memory=True)

    def both():
        with torch.cuda.stream(s1):
            op.copy_rows(host, ids, dev, slots)
        with torch.cuda.stream(s2):
            op.copy_rows(dev2, slots, host, ids)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    def uva_h2d_dma_d2h():
        with torch.cuda.stream(s1):
            op.copy_rows(host, ids, dev, slots)
        with torch.cuda.stream(s2):
            host_flat.copy_(dev2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    def h2d():
        op.copy_rows(host, ids, dev, slots)

    def d2h():
        op.copy_rows(dev2, slots, host, ids)

    def flat_d2h():
        host_flat.copy_(dev2, non_blocking=True)

    def flat_h2d():
        dev.copy_(host_flat, non_blocking=True)

    lines = [f"link: {rows} rows x {d} fp32 ({nbytes / 2**20:.0f} MiB) per copy",
             f"  copy_rows H2D (UVA gather from pinned)  {_bw(h2d, nbytes):6.1f} GB/s",
             f"  copy_rows D2H (UVA scatter to pinned)   {_bw(d2h, nbytes):6.1f} GB/s",
             f"  copy_rows both directions at once       {_bw(both, 2 * nbytes):6.1f} GB/s (sum)",
             f"  copy_rows H2D + DMA copy_ D2H at once   {_bw(uva_h2d_dma_d2h, 2 * nbytes):6.1f} GB/s (sum)",
             f"  pinned contiguous copy_ D2H             {_bw(flat_d2h, nbytes):6.1f} GB/s",
             f"  pinned contiguous copy_ H2D             {_bw(flat_h2d, nbytes):6.1f} GB/s"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for blocks in (8, 16, max(8, sms // 4), sms, 8 * sms):  # the default cap is a quarter of the SMs
        lines.append(f"  copy_rows H2D, {blocks:4d} blocks            "
                     f"{_bw(lambda: op.copy_rows(host, ids, dev, slots, max_blocks=blocks), nbytes):6.1f} GB/s")
    lines += contention_lines(op, host, dev, dev2, host_flat, ids, slots, sms)
    host = dev = dev2 = host_flat = None
    return "\n".join(lines)


def contention_lines(op, host, dev, dev2, host_flat, ids, slots, sms) -> list:
    """How much the cache's copies slow the compute stream: the lookup's host sync (its 16K ids to the host)
    and a 5000-row gather, alone and while fills and write-backs run on two other streams (per copy grid)."""
    from ds_maximus.vocab.function import ids_on_host
    g = torch.Generator().manual_seed(1)
    flat = torch.randint(0, host.shape[0], (16384,), generator=g).cuda()
    rows = torch.randint(0, dev.shape[0], (5000,), generator=g).cuda()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def compute():
        t0 = time.perf_counter()
        ids_on_host(flat)
        t1 = time.perf_counter()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(4):
            dev.index_select(0, rows)
        e1.record()
        e1.synchronize()
        return (t1 - t0) * 1e3, e0.elapsed_time(e1) / 4

    def under(copies) -> str:
        res = []
        for _ in range(7):
            torch.cuda.synchronize()
            copies()
            res.append(compute())
            torch.cuda.synchronize()
        res.sort()
        su = sorted(r[0] for r in res)[3]
        ga = sorted(r[1] for r in res)[3]
        return f"ids to host {su:6.3f} ms, 5000-row gather {ga:6.3f} ms"

    def uva(blocks):
        def go():
            for _ in range(3):
                with torch.cuda.stream(s1):
                    op.copy_rows(host, ids, dev2, slots, max_blocks=blocks)
                with torch.cuda.stream(s2):
                    op.copy_rows(dev2, slots, host, ids, max_blocks=blocks)
        return go

    def dma():
        for _ in range(3):
            with torch.cuda.stream(s1):
                dev2.copy_(host_flat, non_blocking=True)
            with torch.cuda.stream(s2):
                host_flat.copy_(dev2, non_blocking=True)

    out = [f"compute beside the copies (median of 7; copies = 3 x {ids.numel()} rows each way):",
           f"  alone                                   {under(lambda: None)}"]
    for b in (2, 4, 8, 16, max(8, sms // 4)):
        out.append(f"  copy_rows both ways, {b:3d} blocks each    {under(uva(b))}")
    out.append(f"  DMA copy_ both ways                     {under(dma)}")
    return out


def phase_table(emb, batches, dev_batches, grad, steps: int) -> str:
    """Host time of each phase of a step, with a sync after every step (the benchmark's timing): where the
    host spends the step, and how long it then waits for the GPU."""
    names = ("prefetch", "forward", "backward", "sparse_step", "sync wait")
    tot = dict.fromkeys(names, 0.0)
    for k in range(steps):
        t = [time.perf_counter()]
        emb.prefetch(batches[k + 1])
        t.append(time.perf_counter())
        out = emb(dev_batches[k])
        t.append(time.perf_counter())
        out.backward(grad)
        t.append(time.perf_counter())
        emb.sparse_step(lr=1e-3)
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        for n, a, b in zip(names, t, t[1:]):
            tot[n] += (b - a) * 1e3
    all_ms = sum(tot.values()) / steps
    return (f"host phases, sync after each step ({steps} steps, ms/step; total {all_ms:.2f}): "
            + ", ".join(f"{n} {v / steps:.2f}" for n, v in tot.items()))


def copy_grid_table(emb, batches, dev_batches, grad, steps: int) -> str:
    """ms per step, timed as the benchmark times it (events on the compute stream, a sync after each step),
    for several grids of the cache's copy kernels (``PartitionCache.copy_blocks``)."""
    out = []
    default = emb.cache.copy_blocks
    for i, blocks in enumerate((8, 16, 33)):  # each on batches of its own (a batch seen before would hit)
        emb.cache.copy_blocks = blocks
        times = []
        for k in range(2 * steps * i, 2 * steps * (i + 1)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            emb.prefetch(batches[k + 1])
            emb(dev_batches[k]).backward(grad)
            emb.sparse_step(lr=1e-3)
            end.record()
            end.synchronize()
            if k >= 2 * steps * i + steps:
                times.append(start.elapsed_time(end))
        out.append(f"{blocks}: {sorted(times)[len(times) // 2]:.2f}")
    emb.cache.copy_blocks = default
    return f"copy kernel blocks -> ms per step (median of {steps}, sync after each): " + ", ".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--cache-frac", type=float, default=0.10)
    ap.add_argument("--policy", default="lfu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cache-warmup", type=int, default=200, help="steps on other batches first (steady-state cache)")
    ap.add_argument("--trace", help="also write a chrome trace of the profiled steps here")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.vocab import ShardedEmbedding
    V, d = a.vocab, a.dim
    out = [link_table(d, 3500, V)]
    batches = zipf_batches(V, a.batch * a.seq, 4 * a.steps + 2, a.zipf)
    dev_batches = [b.view(a.batch, a.seq).cuda() for b in batches]
    grad = torch.randn(a.batch, a.seq, d, device="cuda") * 1e-3
    emb = ShardedEmbedding(V, d, config=EmbeddingConfig(gpu_cache_rows=int(V * a.cache_frac), cache_policy=a.policy,
                                                        optimizer={"lr": 1e-3, "weight_decay": 0.01}), device="cuda")
    i = [0]

    def step():
        k = i[0]
        i[0] += 1
        emb.prefetch(batches[k + 1])
        emb(dev_batches[k]).backward(grad)
        emb.sparse_step(lr=1e-3)

    for k in range(a.cache_warmup):
        b = zipf_batches(V, a.batch * a.seq, 1, a.zipf, seed=1000 + k)[0]
        emb(b.view(a.batch, a.seq).cuda()).backward(grad)
        emb.sparse_step(lr=1e-3)
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    out.append(phase_table(emb, batches[3 * a.steps:], dev_batches[3 * a.steps:], grad, a.steps))
    extra = zipf_batches(V, a.batch * a.seq, 6 * a.steps + 1, a.zipf, seed=7)
    out.append(copy_grid_table(emb, extra, [b.view(a.batch, a.seq).cuda() for b in extra], grad, a.steps))
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / a.steps
    s = emb.stats()["last_step"]
    out.append(f"step: {ms:.2f} ms (no profiler); last step fetched {s['rows_fetched']} evicted {s['rows_evicted']} "
               f"rows, H2D {s['bytes_h2d'] / 2**20:.0f} MiB, D2H {s['bytes_d2h'] / 2**20:.0f} MiB, "
               f"stall {s['stall_ms']:.2f} ms")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    if a.trace:
        prof.export_chrome_trace(a.trace)
    ka = prof.key_averages()
    out.append(f"profiler, {a.steps} steps (times are totals over them):")
    out.append(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    out.append(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    text = "\n".join(out)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
