"""Output error of one quantized SwiGLU expert, per bit width, beside hqq's quantizer at the same bits and group size.

    python -m benchmarks.bench_moe_quant_error            # one Mixtral-8x7B expert: hidden 4096, ffn 14336
    python -m benchmarks.bench_moe_quant_error --small    # hidden 256, ffn 512 (CPU; CI runs it)

For each width (8, 4, 3, 2 bits; ``--group-size``, default 64) the table gives the relative output error
``||y_q - y|| / ||y||`` of the expert ``y = (silu(x w1^T) * (x w3^T)) w2^T`` (fp32 math from the bf16 weights;
``y_q`` from the dequantized weights) on two kinds of activations: random (standard normal) and real-text-like
(heavy-tailed, Student-t with 3 degrees of freedom, plus a few outlier channels 20x larger, as the residual stream
of trained LLMs has), and the bytes a weight takes in the packed form. ``ms`` is the time to quantize the expert's
three weights. The peer is ``hqq``'s quantizer (HQQ's optimised zero points; ``pip install hqq``); where it is not
importable the script prints "hqq not installed" and its rows say so.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import Bench
from ds_maximus.experts.quant import SUPPORTED_BITS, dequantize, quantize, swiglu_reference

OUTLIER_CHANNELS = 4
OUTLIER_SCALE = 20.0


def activations(kind: str, tokens: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """``tokens x hidden`` activations: ``random`` (normal) or ``text`` (heavy-tailed with outlier channels)."""
    if kind == "random":
        return torch.randn(tokens, hidden, generator=gen)
    t = torch.distributions.StudentT(3.0).sample((tokens, hidden))
    channels = torch.randperm(hidden, generator=gen)[:OUTLIER_CHANNELS]
    t[:, channels] *= OUTLIER_SCALE
    return t


def rel_err(y_q: torch.Tensor, y: torch.Tensor) -> float:
    return float((y_q - y).norm() / y.norm())


def hqq_dequantized(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``w`` through hqq's quantizer (optimised zero points) and back, in fp32."""
    from hqq.core.quantize import Quantizer
    w_q, meta = Quantizer.quantize(w, nbits=bits, group_size=group_size, optimize=True, axis=1,
                                   compute_dtype=w.dtype, device=str(w.device))
    return Quantizer.dequantize(w_q, meta).reshape(w.shape).float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="hidden 256, ffn 512 (CPU)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    a = ap.parse_args(argv)
    if a.small:
        a.hidden, a.ffn, a.tokens = 256, 512, 8
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    w1, w3 = ((torch.randn(a.ffn, a.hidden, generator=gen) * 0.02).to(torch.bfloat16).to(device) for _ in range(2))
    w2 = (torch.randn(a.hidden, a.ffn, generator=gen) * 0.02).to(torch.bfloat16).to(device)
    xs = {k: activations(k, a.tokens, a.hidden, gen).to(device) for k in ("random", "text")}
    ys = {k: swiglu_reference(x, w1, w3, w2) for k, x in xs.items()}

    try:
        import hqq  # noqa: F401
        have_hqq = True
    except ImportError:
        have_hqq = False
        print("hqq not installed")

    bench = Bench("moe_quant_error", dtype="bf16 weights, fp32 math",
                  sizes={"hidden": a.hidden, "ffn": a.ffn, "tokens": a.tokens, "group_size": a.group_size},
                  notes="rel err = ||y_q - y|| / ||y|| of one SwiGLU expert; text = Student-t(3) activations "
                        f"with {OUTLIER_CHANNELS} outlier channels x{OUTLIER_SCALE:g}")
    for bits in SUPPORTED_BITS:
        t0 = time.perf_counter()
        qs = [quantize(w, bits, a.group_size) for w in (w1, w3, w2)]
        if device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        deq = [dequantize(q) for q in qs]
        nbytes = sum(q.nbytes for q in qs)
        errs = {k: rel_err(swiglu_reference(x, *deq), ys[k]) for k, x in xs.items()}
        bench.add(f"ours int{bits}", ms, rel_err_random=errs["random"], rel_err_text=errs["text"],
                  bits_per_weight=8 * nbytes / sum(w.numel() for w in (w1, w3, w2)))
        del qs, deq
        if not have_hqq:
            bench.skip(f"hqq int{bits}", "hqq not installed")
            continue
        try:
            t0 = time.perf_counter()
            deq = [hqq_dequantized(w, bits, a.group_size) for w in (w1, w3, w2)]
            ms = (time.perf_counter() - t0) * 1e3
            errs = {k: rel_err(swiglu_reference(x, *deq), ys[k]) for k, x in xs.items()}
            bench.add(f"hqq int{bits}", ms, rel_err_random=errs["random"], rel_err_text=errs["text"])
        except Exception as e:  # a peer that cannot run is a row, not a crash
            bench.add(f"hqq int{bits}", None, error=f"{type(e).__name__}: {str(e)[:80]}")
    text = bench.report()
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
