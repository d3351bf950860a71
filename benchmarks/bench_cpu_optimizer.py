"""The CPU AdamW step of our op (``row_update``: exact mode, the step the CPU tier runs for embedding rows,
LM-head rows and MoE experts) against DeepSpeed's CPU Adam op and torch's AdamW on the same fp32 tensors.

    python -m benchmarks.bench_cpu_optimizer                # 32M elements, all cores torch sees
    python -m benchmarks.bench_cpu_optimizer --elems 8M --threads 1

Each provider updates master, exp_avg and exp_avg_sq in place from a gradient: 28 B of memory traffic per
element (4 read each + 4 written each for the three states, and 4 read for the gradient), reported as GB/s
(the rows with a scaled gradient and a bf16 copy move more: GB/s counts the 28 B only).
Our op and DeepSpeed's are memory-bound on the same data; torch's foreach AdamW allocates temporaries.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.harness import Bench, progress

TRAFFIC = 28  # bytes per element and step


def _elems(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def main(argv=None) -> Bench:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elems", default="32M", help="elements of the tensor (K/M/G suffixes)")
    ap.add_argument("--row", type=int, default=4096, help="row length of our op's [rows, row] view")
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    n = _elems(a.elems) // a.row * a.row
    rows = n // a.row
    bench = Bench("cpu_optimizer", dtype="fp32", sizes={"elements": n, "threads": torch.get_num_threads()},
                  notes="one AdamW step in place (lr 1e-3, betas 0.9/0.95, wd 0.1); GB/s at 28 B/element")
    g = torch.Generator().manual_seed(0)
    w, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    kw = dict(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)

    def gbs(res):
        if res.ms:
            res.extra["GB/s"] = round(n * TRAFFIC / (res.ms * 1e-3) / 1e9, 1)

    from ds_maximus.ops import row_ops as se
    if se.load_op("cpu") is not None:
        step = [0]
        slots = torch.arange(rows)

        def ours(**extra):
            step[0] += 1
            k = step[0]
            hist = torch.full((k + 1,), 1e-3, dtype=torch.float64)
            se.row_update(w.view(rows, a.row), [m.view(rows, a.row), v.view(rows, a.row)], slots,
                          grad.view(rows, a.row), torch.full((rows,), k - 1, dtype=torch.long), step=k,
                          lr_hist=hist, wd_hist=torch.full_like(hist, 0.1), **kw, **extra)
        gbs(bench.measure("ours: row_update (CPU op, exact mode)", ours, warmup=1, repeat=a.repeat))
        # an expert stepped on the CPU tier: clip factor and bf16 compute copy, as three passes and as one
        shadow = torch.empty(rows, a.row, dtype=torch.bfloat16)

        def ours_then_scale_and_cast():
            grad.mul_(1.0)
            ours()
            shadow.copy_(w.view(rows, a.row))

        def ours_fused():
            ours(grad_scale=0.5, shadow=shadow)
        gbs(bench.measure("ours, + grad.mul_ + bf16 copy_ (3 passes)", ours_then_scale_and_cast, warmup=1,
                          repeat=a.repeat))
        gbs(bench.measure("ours, grad_scale + bf16 shadow in the op (1 pass)", ours_fused, warmup=1,
                          repeat=a.repeat))
    else:
        bench.skip("ours: row_update (CPU op, exact mode)", "op not built")
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        ds = CPUAdamBuilder().load()
        ds.create_adam(0, kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"], True, False)
        dstep = [0]

        def deepspeed_cpu_adam():
            dstep[0] += 1
            ds.adam_update(0, dstep[0], kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"], True,
                           w, grad, m, v)
        gbs(bench.measure("DeepSpeed CPU Adam (cpu_adam op)", deepspeed_cpu_adam, warmup=1, repeat=a.repeat))
    except Exception as e:  # noqa: BLE001 - a peer that cannot build is a row
        bench.skip("DeepSpeed CPU Adam (cpu_adam op)", f"{type(e).__name__}: {str(e)[:60]}")
    p = torch.nn.Parameter(w)
    for label, opts in (("torch.optim.AdamW (fused)", {"fused": True}),
                        ("torch.optim.AdamW (foreach)", {"foreach": True})):
        opt = torch.optim.AdamW([p], lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]), eps=kw["eps"],
                                weight_decay=kw["weight_decay"], **opts)
        p.grad = grad
        gbs(bench.measure(label, opt.step, warmup=1, repeat=a.repeat))
        del opt
    progress("done")
    bench.report(baseline="DeepSpeed CPU Adam (cpu_adam op)")
    if a.out:
        bench.checkpoint(a.out, baseline="DeepSpeed CPU Adam (cpu_adam op)")
    return bench


if __name__ == "__main__":
    main()
