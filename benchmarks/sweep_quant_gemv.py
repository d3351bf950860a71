"""Time the grouped dequant-GEMM kernel's one-token launches (decode) against bf16 ``F.linear`` (CUDA).

For each expert shape (Mixtral-8x7B's ``gate_up`` [28672, 4096] and ``down`` [4096, 14336], Qwen3-30B-A3B's
``gate_up`` [1536, 2048] and ``down`` [2048, 768]), each round size (experts in one launch, one token each: a
batch-1 decode step) and each width, every :data:`ds_maximus.experts.quant_triton.GEMV_CONFIGS` entry, the launch
before the one-token path (a 2-row tile, one group a step: ``max_rows=2``), and the same experts in bf16 through
``F.linear`` one after another (the model's own eager loop). ms = median of ``triton.testing.do_bench`` (L2 flushed
between runs); GB/s = the packed bytes (codes, fp16 scales and offsets) read / time. The first row of each shape
is the default (:data:`~ds_maximus.experts.quant_triton.DECODE_CONFIG`). Then a prefill's round (every expert many
rows: Mixtral 8 x 256, Qwen3 32 x 128): the tensor-core kernel (the default there) against the gemv kernel and bf16.

    python -m benchmarks.sweep_quant_gemv [--bits 4,2] [--shapes mixtral,qwen3] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys

import torch

from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.quant_layout import QuantizedExpertLayout

SHAPES = {"mixtral": (4096, 14336, (1, 2)), "qwen3": (2048, 768, (8,))}
PREFILL = {"mixtral": (8, 256), "qwen3": (32, 128)}  # (experts, rows each): a prefill's round, top-k rows spread


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", default="4,2")
    p.add_argument("--shapes", default="mixtral,qwen3")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_quant_gemv needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from ds_maximus.experts import quant_triton as qt
    lines = [f"device: {torch.cuda.get_device_name()} | group {a.group_size} | one token an expert",
             "", "| shape | experts | bits | launch | ms | GB/s |", "|---|---|---|---|---|---|"]

    def emit(line):
        lines.append(line)
        print(line, flush=True)

    for line in lines:
        print(line)
    for shape in a.shapes.split(","):
        H, F, rounds = SHAPES[shape]
        for n in rounds:
            g = torch.Generator(device="cuda").manual_seed(n)
            t = {"gate_up_proj": torch.randn(n, 2 * F, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
                 "down_proj": torch.randn(n, H, F, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02}
            base = ExpertLayout.from_stacked(t, n)
            for name, cols in (("gate_up_proj", H), ("down_proj", F)):
                x = torch.randn(n, cols, device="cuda", generator=g, dtype=torch.bfloat16)
                ws = [t[name][e] for e in range(n)]
                ms = do_bench(lambda: [torch.nn.functional.linear(x[e:e + 1], ws[e]) for e in range(n)],
                              return_mode="median")
                nbytes = sum(w.numel() * 2 for w in ws)
                emit(f"| {shape} {name} | {n} | bf16 | F.linear, one expert after another | {ms:.4f} | "
                     f"{nbytes / ms / 1e6:.0f} |")
                for bits in (int(b) for b in a.bits.split(",")):
                    lay = QuantizedExpertLayout.from_layout(base, bits, a.group_size)
                    table = torch.empty(n, lay.numel, dtype=torch.uint8, device="cuda")
                    for e in range(n):
                        lay.pack_(table[e], {k: v[e] for k, v in t.items()})
                    meta = torch.tensor(list(range(n + 1)) + [e * lay.numel for e in range(n)], device="cuda")
                    shp = lay.base.shapes[name]
                    part = lay.view(table[0], name)
                    nbytes = n * (part.packed.numel() + 2 * part.scales.numel() + 2 * part.zeros.numel())
                    want = qt.quant_matmul_grouped(x, table, lay.parts[name], shp, bits, a.group_size, meta, n, 2)
                    launches = [(f"config {i}: {c}", dict(config=c, max_rows=1))
                                for i, c in enumerate(qt.GEMV_CONFIGS)]
                    launches.append(("before: 2-row tile, a group a step", dict(max_rows=2)))
                    for label, kw in launches:
                        def call():
                            return qt.quant_matmul_grouped(x, table, lay.parts[name], shp, bits, a.group_size, meta,
                                                           n, kw["max_rows"], config=kw.get("config"))
                        try:
                            y = call()
                            err = ((y - want).abs().max() / want.abs().max()).item()
                            if err > 1e-4:
                                raise AssertionError(f"differs from the 2-row launch by {err:.2e}")
                            ms = do_bench(call, return_mode="median")
                            emit(f"| {shape} {name} | {n} | int{bits} | {label} | {ms:.4f} | "
                                 f"{nbytes / ms / 1e6:.0f} |")
                        except Exception as exc:  # noqa: BLE001 (a launch that fails is a row that says why)
                            emit(f"| {shape} {name} | {n} | int{bits} | {label} | failed: "
                                 f"{type(exc).__name__}: {str(exc)[:80]} | |")
            del t
            torch.cuda.empty_cache()
        # a prefill's round: every expert many rows (tensor-core kernel against the gemv kernel and bf16 F.linear)
        n, rows_each = PREFILL[shape]
        g = torch.Generator(device="cuda").manual_seed(7)
        t = {"gate_up_proj": torch.randn(n, 2 * F, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
             "down_proj": torch.randn(n, H, F, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02}
        base = ExpertLayout.from_stacked(t, n)
        R = n * rows_each
        for name, cols in (("gate_up_proj", H), ("down_proj", F)):
            x = torch.randn(R, cols, device="cuda", generator=g, dtype=torch.bfloat16)
            ws = [t[name][e] for e in range(n)]
            ms = do_bench(lambda: [torch.nn.functional.linear(x[e * rows_each:(e + 1) * rows_each], ws[e])
                                   for e in range(n)], return_mode="median")
            emit(f"| {shape} {name} | {n} x {rows_each} rows | bf16 | F.linear, one expert after another | {ms:.4f} | "
                 f"{sum(w.numel() * 2 for w in ws) / ms / 1e6:.0f} |")
            for bits in (int(b) for b in a.bits.split(",")):
                lay = QuantizedExpertLayout.from_layout(base, bits, a.group_size)
                table = torch.empty(n, lay.numel, dtype=torch.uint8, device="cuda")
                for e in range(n):
                    lay.pack_(table[e], {k: v[e] for k, v in t.items()})
                meta = torch.tensor([e * rows_each for e in range(n + 1)] + [e * lay.numel for e in range(n)],
                                    device="cuda")
                shp = lay.base.shapes[name]
                part = lay.view(table[0], name)
                nbytes = n * (part.packed.numel() + 2 * part.scales.numel() + 2 * part.zeros.numel())
                want = None
                for label, dot in (("tensor-core kernel", True), ("gemv kernel", False)):
                    def call():
                        return qt.quant_matmul_grouped(x, table, lay.parts[name], shp, bits, a.group_size, meta, n,
                                                       rows_each, dot=dot)
                    try:
                        y = call()
                        if want is None:
                            want = y
                        err = ((y - want).abs().max() / want.abs().max()).item()
                        if err > 1e-4:
                            raise AssertionError(f"differs from the tensor-core kernel by {err:.2e}")
                        ms = do_bench(call, return_mode="median")
                        emit(f"| {shape} {name} | {n} x {rows_each} rows | int{bits} | {label} | {ms:.4f} | "
                             f"{nbytes / ms / 1e6:.0f} |")
                    except Exception as exc:  # noqa: BLE001 (a launch that fails is a row that says why)
                        emit(f"| {shape} {name} | {n} x {rows_each} rows | int{bits} | {label} | failed: "
                             f"{type(exc).__name__}: {str(exc)[:80]} | |")
        del t
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
