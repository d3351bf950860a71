"""One Mixtral-8x7B expert's kernels at decode sizes, beside their peers and their memory bounds.

    python -m benchmarks.bench_expert_kernels                 # the H200: GPU and host kernels
    python -m benchmarks.bench_expert_kernels --small         # CPU smoke run (a scaled-down expert)
    MAXIMUS_EXPERT_CPU_FP32=1 python -m benchmarks.bench_expert_kernels   # the host rows on the fp32 path

Rows, each at 1 and 8 tokens:

- GPU, one projection (``gate_up`` ``[2F, H]`` and ``down`` ``[H, F]``): ``torch.nn.functional.linear`` on the
  bf16 weight (the peer: what an exact expert costs once it is on the GPU), and ours, ``quant_matmul`` with the
  gemv kernel and with the loop kernel, per width (8, 4, 3, 2 bits, group 64). GB/s = the weight's bytes (packed,
  with scales and offsets) over the time: the HBM bound is ~4.8 TB/s.
- Host, one whole SwiGLU expert (the three matrices): ours, ``ds_maximus.ops.expert_cpu.swiglu`` (bf16 and each
  width; x exactly bf16, as a bf16 model's hidden state), beside torch's own bf16 ``linear`` (oneDNN) on the same
  cores. GB/s against the host bandwidth measured
  in the same run (``sum()`` of a 2 GB fp32 tensor).

What a decode step of ``moe.cpu_compute`` costs per missed expert is the host row; what ``moe.quant`` costs per
resident expert is the GPU rows. Figures go to ``docs/bench/``.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_moe_offload import host_bandwidth_gbps
from benchmarks.harness import Bench, progress
from ds_maximus.experts.quant import quantize
from ds_maximus.ops import expert_cpu


def qbytes(q) -> int:
    return q.packed.numel() + 2 * (q.scales.numel() + q.zeros.numel())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a scaled-down expert (CPU smoke run)")
    p.add_argument("--bits", default="8,4,3,2")
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--host-repeat", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    a = p.parse_args(argv)
    H, F = (256, 896) if a.small else (4096, 14336)
    bits_list = [int(b) for b in a.bits.split(",") if b]
    tokens_list = [int(t) for t in a.tokens.split(",") if t]
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(2 * F, H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(H, F, generator=g) * 0.02).to(torch.bfloat16)
    quants = {b: (quantize(w13, b, 64), quantize(w2, b, 64)) for b in bits_list}
    progress(f"expert H={H} F={F} quantized at {bits_list}")
    hbw = host_bandwidth_gbps(int(0.2e9 if a.small else 2e9))
    bench = Bench("expert_kernels", dtype="bfloat16 weights, fp32 accumulation",
                  sizes={"H": H, "F": F, "group": 64, "host threads": expert_cpu.max_threads(),
                         "host path": expert_cpu.kernel_isa(),
                         "host GB/s": round(hbw, 1)},
                  notes="GPU rows: one projection (gate_up [2F, H], down [H, F]); host rows: the whole SwiGLU expert. "
                        "GB/s = the weight's bytes (packed + fp16 scales and offsets) / time")
    cuda = torch.cuda.is_available()
    if cuda:
        from ds_maximus.experts.quant_triton import _gemv_fits, quant_matmul
        dev = torch.device("cuda")
        dense = {"gate_up": w13.to(dev), "down": w2.to(dev)}
        for T in tokens_list:
            for proj, w in dense.items():
                x = torch.randn(T, w.shape[1], device=dev, dtype=torch.bfloat16)
                r = bench.measure(f"GPU {proj} bf16 F.linear, {T} tok",
                                  lambda: torch.nn.functional.linear(x, w), repeat=a.repeat)
                if r.ms:
                    r.extra["GB/s"] = round(w.numel() * 2 / r.ms / 1e6, 1)
                for b in bits_list:
                    q = (quants[b][0] if proj == "gate_up" else quants[b][1]).to(dev)
                    for kernel in ("gemv", "loop"):
                        if kernel == "gemv" and not _gemv_fits(q):
                            continue
                        r = bench.measure(f"GPU {proj} int{b} quant_matmul {kernel}, {T} tok",
                                          lambda: quant_matmul(x, q, kernel=kernel), repeat=a.repeat)
                        if r.ms:
                            r.extra["GB/s"] = round(qbytes(q) / r.ms / 1e6, 1)
            progress(f"GPU rows at {T} tokens done")
        del dense
    exact_bytes = (w13.numel() + w2.numel()) * 2
    for T in tokens_list:
        # a bf16 model's hidden state: x exactly bf16 (as torch's rows get it); the intermediate fed to w2 is fp32
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).float()
        r = bench.measure(f"host expert bf16 ours, {T} tok",
                          lambda: expert_cpu.swiglu(x, w13[:F], w13[F:], w2), warmup=1, repeat=a.host_repeat)
        if r.ms:
            r.extra["GB/s"] = round(exact_bytes / r.ms / 1e6, 1)
        xb = x.to(torch.bfloat16)  # exact

        def torch_expert():
            h = torch.nn.functional.linear(xb, w13)
            return torch.nn.functional.linear(torch.nn.functional.silu(h[:, :F]) * h[:, F:], w2)
        r = bench.measure(f"host expert bf16 torch linear, {T} tok", torch_expert, warmup=1, repeat=a.host_repeat)
        if r.ms:
            r.extra["GB/s"] = round(exact_bytes / r.ms / 1e6, 1)
        for b in bits_list:
            q13, q2 = quants[b]
            q1, q3 = q13.rows(0, F), q13.rows(F, 2 * F)
            r = bench.measure(f"host expert int{b} ours, {T} tok", lambda: expert_cpu.swiglu(x, q1, q3, q2),
                              warmup=1, repeat=a.host_repeat)
            if r.ms:
                r.extra["GB/s"] = round((qbytes(q13) + qbytes(q2)) / r.ms / 1e6, 1)
                r.extra["config"] = f"decode {expert_cpu.quant_decode(b, q2.group_size)}"
        progress(f"host rows at {T} tokens done")
    text = bench.checkpoint(a.out)
    print(text, flush=True)


if __name__ == "__main__":
    main()
