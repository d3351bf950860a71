"""The one-row quantized gemv against the token-tile kernel it replaces at batch-1 decode, and against bf16.

A batch-1 decode step of a quantized MoE layer runs each projection of its (top-k) experts with one row each,
one launch for the round (:func:`ds_maximus.experts.quant_triton.quant_matmul_grouped`). At the Mixtral-8x7B
expert shape (``gate_up_proj`` [28672, 4096], ``down_proj`` [4096, 14336]; ``--experts`` experts a launch, default
2) this prints, for each width of ``--bits``:

* ``tile``: the token-tile kernel, which served one-row rounds before the one-row kernel;
* ``one-row``: the one-row kernel at :func:`~ds_maximus.experts.quant_triton.decode_config`, the decode path's;
* for the widths of ``--sweep`` (default 4), every launch in :data:`~ds_maximus.experts.quant_triton.GEMV_CONFIGS`
  (each as measured with ``--all``) and the best five;
* ``bf16 F.linear``: the same experts' exact bf16 weights through ``F.linear`` one expert at a time (the peer a
  quantized layer must beat per byte);

with ms a launch (median of ``--repeat`` after warm-up, CUDA events), the bytes it reads and the GB/s that makes.
Each launch reads from one of ``--tables`` slot tables in turn, so the weights come from HBM, not L2.

Then rounds of several rows an expert (``--round-rows``, rows an expert, default 2,4,16,128,512: a batch's decode, a
16-token prefill of 8 experts top-2, a 2,048-token prefill), all 8 experts of a Mixtral layer a launch: the
token-tile kernel, the tensor-core kernel at :data:`~ds_maximus.experts.quant_triton.MMA_CONFIG`, and bf16
``F.linear`` an expert at a time.

    python benchmarks/sweep_quant_gemv.py [--bits 4,2,8] [--sweep 4] [--experts 2] [--repeat 30] [--all]
                                          [--round-rows 2,4,16,128,512]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import time_fn  # noqa: E402
from ds_maximus.experts.layout import ExpertLayout  # noqa: E402
from ds_maximus.experts.quant import dequantize  # noqa: E402
from ds_maximus.experts.quant_layout import QuantizedExpertLayout  # noqa: E402

SHAPES = {"gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


def timed(fn, repeat: int) -> float:
    """Median ms of ``fn()`` (the harness's CUDA-event timing, after 3 warm-up calls)."""
    return statistics.median(time_fn(fn, warmup=3, repeat=repeat))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", default="4,2,8")
    ap.add_argument("--sweep", default="4", help="widths whose launches are all swept (the others: tile, default)")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--tables", type=int, default=3)
    ap.add_argument("--all", action="store_true", help="print every launch of GEMV_CONFIGS, not the best five")
    ap.add_argument("--round-rows", default="2,4,16,128,512", help="rows an expert, several-row rounds")
    ap.add_argument("--one-row", choices=("on", "off"), default="on", help="off: the several-row rounds only")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from ds_maximus.experts import quant_triton as qt
    dev = torch.device("cuda")
    n = a.experts
    sweep_bits = {int(b) for b in a.sweep.split(",") if b}
    print(f"# one-row gemv, Mixtral-8x7B expert shapes, {n} experts a launch, group {a.group_size}, "
          f"{torch.cuda.get_device_name()}")
    # the bf16 peer: n experts' exact weights, one F.linear each
    dense = {name: [torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
             for name, shape in SHAPES.items()}
    stacked = {name: torch.empty(n, *shape, dtype=torch.bfloat16) for name, shape in SHAPES.items()}  # shapes only
    for bits in [int(b) for b in a.bits.split(",")] if a.one_row == "on" else []:
        lay = QuantizedExpertLayout.from_layout(ExpertLayout.from_stacked(stacked, n), bits, a.group_size)
        tables = []
        for _ in range(a.tables):
            t = torch.empty(n, lay.numel, dtype=torch.uint8, device=dev)
            for e in range(n):
                lay.pack_(t[e], {name: ws[e] for name, ws in dense.items()})
            tables.append(t)
        meta = torch.tensor(list(range(n + 1)) + [e * lay.numel for e in range(n)], dtype=torch.long, device=dev)
        print(f"\n## {bits}-bit ({lay.numel / 2**20:.1f} MiB an expert)\n")
        print("| projection | launch | ms | MB read | GB/s | max rel err |")
        print("|---|---|---|---|---|---|")
        for name, (rows, cols) in SHAPES.items():
            x = torch.randn(n, cols, device=dev, dtype=torch.bfloat16)
            nbytes = n * rows * cols * (bits / 8 + 4 / a.group_size) + x.numel() * 2
            want = torch.cat([x[e:e + 1].float() @ dequantize(lay.view(tables[0][e], name)).t() for e in range(n)])
            state = {"i": 0}

            def launch(max_rows, config=None):
                t = tables[state["i"] % len(tables)]
                state["i"] += 1
                return qt.quant_matmul_grouped(x, t, lay.parts[name], (rows, cols), bits, a.group_size, meta, n,
                                               max_rows, config=config)

            def row(label, fn, check=None):
                ms = timed(fn, a.repeat)
                err = "" if check is None else f"{((check - want).abs().max() / want.abs().max()).item():.1e}"
                print(f"| {name} | {label} | {ms:.3f} | {nbytes / 1e6:.1f} | {nbytes / ms / 1e6:.0f} | {err} |",
                      flush=True)
                return ms

            state["i"] = 0
            row("tile", lambda: launch(1), launch(1))
            one = qt.decode_config(bits)
            row(f"one-row {one} (the decode path)", lambda: launch(1, one), launch(1, one))
            swept = []
            for c in (qt.GEMV_CONFIGS if bits in sweep_bits else []):
                try:
                    ms = timed(lambda: launch(1, c), max(5, a.repeat // 3))
                except Exception as e:  # a launch the GPU cannot run (registers, shared memory): say so
                    print(f"| {name} | {c} | failed: {type(e).__name__} | | | |", flush=True)
                    continue
                swept.append((ms, c))
                if a.all:  # as measured: a cut run keeps what it had
                    print(f"| {name} | {c} | {ms:.3f} | {nbytes / 1e6:.1f} | {nbytes / ms / 1e6:.0f} | |", flush=True)
            swept.sort(key=lambda m: m[0])
            for ms, c in swept[:5]:
                print(f"| {name} | best: {c} | {ms:.3f} | {nbytes / 1e6:.1f} | {nbytes / ms / 1e6:.0f} | |")
            ws = dense[name]
            xb = [x[e:e + 1] for e in range(n)]
            dense_bytes = n * rows * cols * 2
            ms = timed(lambda: [torch.nn.functional.linear(xb[e], ws[e]) for e in range(n)], a.repeat)
            print(f"| {name} | bf16 F.linear | {ms:.3f} | {dense_bytes / 1e6:.1f} | {dense_bytes / ms / 1e6:.0f} | |")
        tables.clear()
        torch.cuda.empty_cache()
    dense.clear()
    rounds = [int(r) for r in a.round_rows.split(",") if r]
    if rounds:
        several_rows(a, [int(b) for b in a.bits.split(",")], rounds, timed_fn=lambda fn: timed(fn, a.repeat))
    return 0


def several_rows(a, widths, rounds, timed_fn) -> None:
    """The rounds of several rows an expert: the 8 experts of a Mixtral layer in one launch, ``r`` rows each."""
    from ds_maximus.experts import quant_triton as qt
    dev, n = torch.device("cuda"), 8
    dense = {name: [torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
             for name, shape in SHAPES.items()}
    stacked = {name: torch.empty(n, *shape, dtype=torch.bfloat16) for name, shape in SHAPES.items()}
    print(f"\n# rounds of several rows an expert, {n} experts a launch, group {a.group_size}, {qt.MMA_CONFIG}\n")
    print("| bits | projection | rows an expert | tile ms | tensor-core ms | bf16 F.linear ms | speed-up over tile "
          "| tensor-core max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for bits in widths:
        lay = QuantizedExpertLayout.from_layout(ExpertLayout.from_stacked(stacked, n), bits, a.group_size)
        if not qt.mma_fits(bits, a.group_size, torch.bfloat16):
            print(f"| {bits} | | | | does not fit (group {a.group_size}) | | | |")
            continue
        table = torch.empty(n, lay.numel, dtype=torch.uint8, device=dev)
        for e in range(n):
            lay.pack_(table[e], {name: ws[e] for name, ws in dense.items()})
        for r in rounds:
            meta = torch.tensor([e * r for e in range(n + 1)] + [e * lay.numel for e in range(n)], dtype=torch.long,
                                device=dev)
            for name, (rows, cols) in SHAPES.items():
                x = torch.randn(n * r, cols, device=dev, dtype=torch.bfloat16)

                def launch(mma=None):
                    return qt.quant_matmul_grouped(x, table, lay.parts[name], (rows, cols), bits, a.group_size,
                                                   meta, n, r, mma=mma)
                y = launch(qt.MMA_CONFIG)
                want = torch.cat([x[e * r:(e + 1) * r].float() @ dequantize(lay.view(table[e], name)).t()
                                  for e in range(n)])
                err = ((y - want).abs().max() / want.abs().max()).item()
                del y, want
                tile = timed_fn(lambda: launch())
                mma = timed_fn(lambda: launch(qt.MMA_CONFIG))
                ws, xs = dense[name], [x[e * r:(e + 1) * r] for e in range(n)]
                lin = timed_fn(lambda: [torch.nn.functional.linear(xs[e], ws[e]) for e in range(n)])
                print(f"| {bits} | {name} | {r} | {tile:.3f} | {mma:.3f} | {lin:.3f} | {tile / mma:.1f}x | {err:.1e} |",
                      flush=True)
                for c in qt.MMA_CONFIGS[1:]:  # the other launches: ms only
                    print(f"| {bits} | {name} | {r} | | {timed_fn(lambda: launch(c)):.3f} ({c}) | | | |", flush=True)
        table = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
