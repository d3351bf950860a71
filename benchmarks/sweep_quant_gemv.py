"""Every configuration of the quantized gemv kernel on decode shapes, the best beside bf16 ``F.linear``.

    python -m benchmarks.sweep_quant_gemv                      # the H200: 5 shapes x 8/4/2 bits x 1,2,4,8 tokens
    python -m benchmarks.sweep_quant_gemv --shapes 4096x14336 --bits 4 --tokens 1 --all

For each weight shape ``[N, K]`` (Mixtral-8x7B gate_up, w1/w3 and down; Qwen3-MoE's fine-grained gate_up and
down), width and token count, each of ``quant_triton.GEMV_CONFIGS`` (those that plan the same launch once) is
timed with CUDA events around the call alone (warm-up, then the median of ``--repeat`` runs, L2 flushed before
each run so the weight comes from HBM as a decode step's cold expert does). The table gives the best
configuration, its time and GB/s (packed codes + fp16 scales and offsets over the time; H200 HBM ~4.8 TB/s),
the first configuration's time (the tuner's fallback), and bf16 ``F.linear`` on the same shape measured the
same way. ``--all`` adds a row per configuration. Needs only torch and triton: the kernel modules are imported
without the ``ds_maximus`` package (no DeepSpeed, pydantic or transformers).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import types
from pathlib import Path

import torch

from benchmarks.harness import Budget, device_name, git_commit, progress

SHAPES = ((28672, 4096), (14336, 4096), (4096, 14336), (1536, 2048), (2048, 768))
L2_FLUSH_BYTES = 256 << 20


def _kernel_modules():
    """``ds_maximus.experts.quant`` and ``.quant_triton`` alone: stand-in packages so that the package
    ``__init__`` files (which import the engine's dependencies) do not run."""
    if "ds_maximus" not in sys.modules:
        root = Path(__file__).resolve().parent.parent / "ds_maximus"
        for name, path in (("ds_maximus", root), ("ds_maximus.experts", root / "experts")):
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
    from ds_maximus.experts import quant, quant_triton
    return quant, quant_triton


def qbytes(q) -> int:
    return q.packed.numel() + 2 * (q.scales.numel() + q.zeros.numel())


def time_ms(fn, flush: torch.Tensor, warmup: int, repeat: int) -> float:
    """Median ms of ``fn`` over ``repeat`` runs, CUDA events around each call, ``flush`` zeroed before each."""
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(repeat):
        if flush is not None:
            flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def unique_configs(qt, T, N, K, bits, group, sms):
    """``(name, config, plan)`` of the configurations that plan distinct launches for this product."""
    seen, out = set(), []
    for i, cfg in enumerate(qt.GEMV_CONFIGS):
        plan = cfg.plan(T, N, K, bits, group, sms)
        if (plan, cfg.num_warps, cfg.num_stages) not in seen:
            seen.add((plan, cfg.num_warps, cfg.num_stages))
            out.append((f"c{i}", cfg, plan))
    return out


def precompile(qt, cases, sms, threads: int) -> str:
    """Compile every launch of the sweep up front on a thread pool (Triton's ``AsyncCompileMode``, where this
    Triton has it), so that compiling, not timing, does not dominate the run; else they compile one by one as
    they are first timed. Returns a note for the header."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton import AsyncCompileMode
    except ImportError:
        return "compiled serially (no AsyncCompileMode in this triton)"
    try:
        with ThreadPoolExecutor(threads) as ex, AsyncCompileMode(ex):
            for x, q, N, K, b in cases:
                for _, cfg, _ in unique_configs(qt, x.shape[0], N, K, b, q.group_size, sms):
                    qt._launch_gemv(x, q, cfg, sms, compile_only=True)
    except Exception as e:  # noqa: BLE001 (an optimisation only: the timed calls compile what is missing)
        return f"parallel compile failed ({type(e).__name__}: {e}); compiled serially"
    return f"compiled in parallel ({threads} threads)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK weight shapes")
    p.add_argument("--bits", default="8,4,2")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-flush", action="store_true", help="leave L2 warm between runs")
    p.add_argument("--all", action="store_true", help="a row per configuration, not only the best")
    p.add_argument("--budget-s", type=float, default=115, help="skip what is left after this many seconds")
    p.add_argument("--compile-threads", type=int, default=16)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_quant_gemv needs a CUDA GPU", file=sys.stderr)
        return 1
    quant, qt = _kernel_modules()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    bits_list = [int(b) for b in a.bits.split(",") if b]
    tokens_list = [int(t) for t in a.tokens.split(",") if t]
    budget = Budget(a.budget_s)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = None if a.no_flush else torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {}
    for N, K in shapes:
        w = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        weights[N, K] = (w, {b: quant.quantize(w, b, a.group) for b in bits_list})
    xs = {(K, T): torch.randn(T, K, device=dev, generator=g).to(torch.bfloat16)
          for _, K in shapes for T in tokens_list}
    cases = [(xs[K, T], q, N, K, b) for (N, K), (_, qs) in weights.items() for T in tokens_list
             for b, q in qs.items()]
    note = precompile(qt, cases, sms, a.compile_threads)
    progress(f"{len(cases)} products, {note}")
    print(f"device: {device_name()} ({sms} SMs) | x bf16, fp32 accumulation | group {a.group} | "
          f"repeat {a.repeat}, L2 {'warm' if a.no_flush else 'flushed'} | {note} | commit: {git_commit()}\n")
    for i, c in enumerate(qt.GEMV_CONFIGS):
        print(f"- c{i}: block_n {c.block_n}, step_bytes {c.step_bytes}, warps {c.num_warps}, stages "
              f"{c.num_stages}, programs/SM {c.programs_per_sm}")
    print("\n| N x K | bits | T | config | plan (block_t, block_n, groups/step, split) | us | GB/s | c0 us "
          "| bf16 F.linear us | bf16 GB/s | bf16 / config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    wins = collections.Counter()
    skipped = 0
    for (N, K), (w, quants) in weights.items():
        for T in tokens_list:
            x = xs[K, T]
            dense_ms = time_ms(lambda: torch.nn.functional.linear(x, w), flush, a.warmup, a.repeat)
            dense_gbs = w.numel() * 2 / dense_ms / 1e6
            for b in bits_list:
                if not budget.allows(2, f"{N}x{K} int{b} T={T}"):
                    skipped += 1
                    continue
                q = quants[b]
                want = x.float() @ quant.dequantize(q).t()
                rows = []
                for name, cfg, plan in unique_configs(qt, T, N, K, b, a.group, sms):
                    y = qt.quant_matmul(x, q, config=cfg)
                    err = (y - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                    if err > 1e-4:
                        progress(f"WRONG {N}x{K} int{b} T={T} {name}: rel err {err:.2e}")
                        continue
                    ms = time_ms(lambda: qt.quant_matmul(x, q, config=cfg), flush, a.warmup, a.repeat)
                    rows.append((ms, name, plan))
                if not rows:
                    continue
                rows.sort(key=lambda r: r[0])
                c0 = next((r[0] for r in rows if r[1] == "c0"), float("nan"))
                for i, (ms, name, plan) in enumerate(rows if a.all else rows[:1]):
                    gbs = qbytes(q) / ms / 1e6
                    print(f"| {N} x {K} | {b} | {T} | {name}{'' if i else ' (best)'} | {plan.block_t}, "
                          f"{plan.block_n}, {plan.groups_per_step}, {plan.split} | {ms * 1e3:.1f} | {gbs:.0f} | "
                          f"{c0 * 1e3:.1f} | {dense_ms * 1e3:.1f} | {dense_gbs:.0f} | {dense_ms / ms:.2f} |",
                          flush=True)
                wins[rows[0][1]] += 1
    print(f"\nbest-config counts: {dict(wins.most_common())}" + (f"; {skipped} cases skipped (budget)"
                                                                  if skipped else ""))
    progress("sweep done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
