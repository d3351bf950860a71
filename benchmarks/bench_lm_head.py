"""LM-head loss, forward + backward: streamed cross-entropy vs. its peers, in one run.

    python -m benchmarks.bench_lm_head                      # V=262144, d=4096, N=16384, bf16 (GPU)
    python -m benchmarks.bench_lm_head --small              # a CPU-sized smoke run

Providers: ours (resident weight, 3 GEMMs), ours streamed from the CPU tier (``placement: cpu``),
the cuBLAS GEMMs of our tiling alone (the floor), torch linear + F.cross_entropy, Liger-Kernel's
FusedLinearCrossEntropy and Apple's Cut Cross-Entropy (rows say "not installed" when absent), ours with
the tile math uncompiled. Under ``--budget-s`` (100 s): the most important first, each only when its
estimated cost (compiles and autotuning included) still fits; the rest are "skipped" rows.
"extra GiB" is the peak allocated memory during the calls minus what was allocated before (inputs),
so it includes the returned gradients (grad_W is V*d*2 bytes = 2 GiB at full size).
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

from benchmarks.harness import GIB, Bench, Budget, progress
from ds_maximus.vocab import ShardedLMHead, linear_cross_entropy
from ds_maximus.vocab.linear_cross_entropy import LCEOptions, token_block_for


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--chunk-rows", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--small", action="store_true", help="V=8192, d=256, N=1024 (CPU smoke run)")
    p.add_argument("--skip", default="", help="comma-separated providers to skip "
                   "(torch,liger,cce,streamed,floor,big,eager)")
    p.add_argument("--budget-s", type=float, default=100.0, help="wall-clock budget; providers that no longer "
                   "fit are rows that say so")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    return p.parse_args()


def main():
    a = _args()
    budget = Budget(a.budget_s)
    if a.small:
        a.vocab, a.dim, a.tokens = 8192, 256, 1024
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    skip = set(filter(None, a.skip.split(",")))
    torch.manual_seed(0)
    h = (torch.randn(a.tokens, a.dim, device=dev) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(a.vocab, a.dim, device=dev) / math.sqrt(a.dim)).to(dtype).requires_grad_()
    y = torch.randint(0, a.vocab, (a.tokens,), device=dev)
    y[:: 17] = -100
    tb = token_block_for(a.tokens, a.vocab, h.element_size(), LCEOptions())
    flops = 3 * 2 * a.tokens * a.vocab * a.dim
    bench = Bench("lm_head", dtype=a.dtype, sizes={"V": a.vocab, "d": a.dim, "N": a.tokens, "chunk_rows": a.chunk_rows,
                                                  "token_block": tb},
                  notes="forward + backward of the mean CE loss (1/17 of labels ignored); extra GiB = peak - inputs; "
                        "TFLOP/s counts 3 GEMMs")

    def clear():
        h.grad = None
        w.grad = None

    def step(loss_fn):
        def run():
            clear()
            loss_fn().backward()
        return run

    def add(name, fn, **extra):
        try:   # one call outside the harness (compiles, autotunes) so that a failure prints its traceback
            step(fn)()
        except Exception:
            import traceback
            traceback.print_exc()
        res = bench.measure(name, step(fn), warmup=max(0, a.warmup - 1), repeat=a.repeat, **extra)
        if res.ms:
            res.extra["extra GiB"] = round(res.peak_gib - res.extra.get("base_gib", 0.0), 2)
            res.extra["TFLOP/s"] = round(flops / (res.ms * 1e-3) / 1e12, 2)
        clear()
        return res

    base = "torch linear + F.cross_entropy"

    def ours_row():
        add("ours (resident, 3 GEMMs)", lambda: linear_cross_entropy(h, w, y, chunk_rows=a.chunk_rows))

    def torch_row():
        add(base, lambda: F.cross_entropy((h @ w.t()).float(), y))

    def liger_row():
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        except ImportError as e:
            bench.add("Liger FusedLinearCrossEntropy", None, error=f"not installed ({e.name})")
            return
        liger = LigerFusedLinearCrossEntropyLoss()
        add("Liger FusedLinearCrossEntropy", lambda: liger(w, h, y))

    def cce_row():
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except ImportError as e:
            bench.add("Cut Cross-Entropy", None, error=f"not installed ({e.name})")
            return
        add("Cut Cross-Entropy", lambda: cce(h, w, y))

    def streamed_row():
        head = ShardedLMHead(config={"chunk_rows": a.chunk_rows, "placement": "cpu"}, weight=w.detach())

        def streamed():
            head.zero_sparse_grads()    # each step starts from no gradient (as after an optimizer step)
            return head(h, y)
        add("ours streamed from CPU tier", streamed)
        head.flush()
        c = head.stats()
        bench.results[-1].extra["H2D GiB/step"] = round(c["bytes_h2d"] / GIB / max(1, a.warmup + a.repeat), 2)
        head = None

    def floor_row():
        buf = torch.empty(tb, a.vocab, dtype=dtype, device=dev)

        def gemms():   # our tiling's three GEMMs alone, on garbage data: the cuBLAS floor
            gw = torch.empty_like(w)
            gh = torch.empty_like(h)
            with torch.no_grad():
                for b0 in range(0, a.tokens, tb):
                    hb = h[b0:b0 + tb]
                    zb = buf[: hb.shape[0]]
                    torch.mm(hb, w.t(), out=zb)
                    torch.mm(zb, w, out=gh[b0:b0 + tb])
                    if b0 == 0:
                        torch.mm(zb.t(), hb, out=gw)
                    else:
                        gw.addmm_(zb.t(), hb)
        res = bench.measure("GEMMs of our tiling only (floor)", gemms, warmup=a.warmup, repeat=a.repeat)
        if res.ms:
            res.extra["TFLOP/s"] = round(flops / (res.ms * 1e-3) / 1e12, 2)
        buf = None

    def untiled_row():
        if dev.type != "cuda" or torch.cuda.mem_get_info()[0] <= 3 * a.tokens * a.vocab * h.element_size():
            bench.add("3 GEMMs untiled ([N, V] in memory)", None, error="skipped: no CUDA or not enough memory")
            return
        big = {}

        def alloc():
            big["z"] = torch.empty(a.tokens, a.vocab, dtype=dtype, device=dev)

        def gemms_untiled():   # three whole GEMMs with the [N, V] logits materialised: cuBLAS at its best
            z = big["z"]
            with torch.no_grad():
                torch.mm(h, w.t(), out=z)
                torch.mm(z, w)
                torch.mm(z.t(), h)
        res = bench.measure("3 GEMMs untiled ([N, V] in memory)", gemms_untiled, warmup=a.warmup,
                            repeat=a.repeat, setup=alloc)
        if res.ms:
            res.extra["TFLOP/s"] = round(flops / (res.ms * 1e-3) / 1e12, 2)
        big.clear()

    def big_row():
        add("ours (block_bytes=256 MiB)", lambda: linear_cross_entropy(h, w, y, chunk_rows=a.chunk_rows,
                                                                       block_bytes=256 << 20))

    def eager_row():   # the tile math uncompiled (the switch is read on every call)
        old = os.environ.get("DS_MAXIMUS_LCE_COMPILE")
        os.environ["DS_MAXIMUS_LCE_COMPILE"] = "0"
        try:
            add("ours (eager tile math, uncompiled)", lambda: linear_cross_entropy(h, w, y, chunk_rows=a.chunk_rows))
        finally:
            if old is None:
                os.environ.pop("DS_MAXIMUS_LCE_COMPILE", None)
            else:
                os.environ["DS_MAXIMUS_LCE_COMPILE"] = old

    # most important first; each starts only when its estimated cost (s, on an H200, compiles and
    # Triton autotuning included) fits in what is left of the budget
    providers = [("ours", "ours (resident, 3 GEMMs)", ours_row, 30), ("torch", base, torch_row, 8),
                 ("streamed", "ours streamed from CPU tier", streamed_row, 12),
                 ("liger", "Liger FusedLinearCrossEntropy", liger_row, 20),
                 ("cce", "Cut Cross-Entropy", cce_row, 25),
                 ("floor", "GEMMs of our tiling only (floor)", floor_row, 4),
                 ("floor", "3 GEMMs untiled ([N, V] in memory)", untiled_row, 5),
                 ("big", "ours (block_bytes=256 MiB)", big_row, 10),
                 ("eager", "ours (eager tile math, uncompiled)", eager_row, 8)]
    progress(f"inputs ready on {dev}; budget {a.budget_s:.0f} s")
    for key, name, fn, cost in providers:
        if key in skip:
            continue
        bench.run_budgeted(name, fn, cost * (1 if dev.type == "cuda" else 0.05), budget, out=a.out, baseline=base)
        clear()

    text = bench.report(baseline=base)
    ours = next((r for r in bench.results if r.name.startswith("ours (resident") and r.ms), None)
    if ours:
        streamed_res = next((r for r in bench.results if r.name.startswith("ours streamed") and r.ms), None)
        lines = [f"\nours: {ours.ms:.1f} ms (target <= 180 ms at full size)"]
        if streamed_res:
            lines.append(f"streamed / resident: {streamed_res.ms / ours.ms:.2f}x (target <= 1.3x)")
        print("\n".join(lines), flush=True)
        text += "\n" + "\n".join(lines) + "\n"
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
