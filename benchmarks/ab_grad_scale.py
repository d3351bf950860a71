"""What the clip factor costs the CPU row op: one AdamW step with a bf16 shadow written in the same pass, over
32M elements, with ``grad_scale`` 1.0 and 0.5 alternating (fp32 and bf16 gradients; bf16 is the MoE split step's CPU
side). Median ms of 12 calls each, one process. ``python -m benchmarks.ab_grad_scale [--elems 32M]``"""
import argparse
import statistics
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--elems", type=int, default=32 << 20)
    ap.add_argument("--row", type=int, default=4096)
    a = ap.parse_args(argv)
    from ds_maximus.ops import row_ops as se
    if se.load_op("cpu") is None:
        raise SystemExit("the CPU op is not built")
    rows = a.elems // a.row
    n = rows * a.row
    g = torch.Generator().manual_seed(0)
    w, m, v = torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.randn(n, generator=g).to(dtype)
        shadow = torch.empty(rows, a.row, dtype=torch.bfloat16)
        for k in range(1, 26):
            scale = 0.5 if k % 2 else 1.0
            hist = torch.full((k + 1,), 1e-3, dtype=torch.float64)
            t0 = time.perf_counter()
            se.row_update(w.view(rows, a.row), [m.view(rows, a.row), v.view(rows, a.row)], torch.arange(rows),
                          grad.view(rows, a.row), torch.full((rows,), k - 1, dtype=torch.long), step=k, lr_hist=hist,
                          wd_hist=torch.full_like(hist, 0.1), lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95,
                          eps=1e-8, grad_scale=scale, shadow=shadow)
            if k > 1:  # the first call pages the tensors in
                times.setdefault((str(dtype).replace("torch.", ""), scale), []).append((time.perf_counter() - t0) * 1e3)
    threads = torch.get_num_threads()
    print(f"| gradient | grad_scale | ms (median of 12), {n / 2**20:.0f}M elements, {threads} threads |")
    print("|---|---|---|")
    for (dtype, scale), t in times.items():
        print(f"| {dtype} | {scale} | {statistics.median(t):.2f} |")


if __name__ == "__main__":
    main()
