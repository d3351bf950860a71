"""How fast the one-row int4 gemv reads an expert straight from pinned host memory (zero-copy over PCIe), against
the same expert read from GPU memory and against copying it over first.

The quantized decode kernel (``quant_matmul_grouped`` with the decode launch) finds each expert at a byte offset from
the slot table it is given; an offset that points into page-locked host memory (its mapped address less the table's
address) makes the kernel read that expert over the link, with no copy and no host decision. This probe times a
Mixtral-8x7B expert's two projections (int4, group 128) three ways, with CUDA events, ``--reps`` times each:
  resident   both experts of a top-2 decode in GPU memory;
  direct     both read from pinned host memory (``host_tensor``'s ``cudaHostRegister`` memory, as the CPU expert tier
             holds them, and ``torch.empty(pin_memory=True)`` memory);
  copy       one ``copy_(non_blocking=True)`` of the two experts into GPU memory, then the resident kernel;
and a plain pinned H2D copy of the same bytes. Prints GB/s of expert bytes for each, for every gemv launch in
``--configs``. Run on the GPU machine: ``python scripts/gpu/probe_zero_copy.py``.
"""
from __future__ import annotations

import argparse

import torch

from ds_maximus.experts.quant_triton import GemvConfig, decode_config, quant_matmul_grouped
from ds_maximus.partition.host_memory import host_tensor


def expert_layout(hidden: int, ffn: int, bits: int, group: int):
    """Byte offsets (codes, scales, zeros) of gate_up [2F, H] and down [H, F] in one flat expert, and its bytes."""
    parts, off = {}, 0
    for name, (rows, cols) in {"gate_up_proj": (2 * ffn, hidden), "down_proj": (hidden, ffn)}.items():
        codes = rows * cols * bits // 8
        halves = rows * cols // group * 2
        parts[name] = ((off, off + codes, off + codes + halves), (rows, cols))
        off += codes + 2 * halves
    return parts, (off + 255) // 256 * 256


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--configs", default="decode,64:128:4:3:2,64:256:8:3:2,128:256:8:2:2,32:128:4:3:4")
    args = p.parse_args()
    dev = torch.device("cuda")
    parts, numel = expert_layout(args.hidden, args.ffn, args.bits, args.group)
    k = 2

    def fill(t):
        t.view(torch.uint8).random_(0, 256)
        for (p_off, s_off, z_off), (rows, cols) in parts.values():  # finite fp16 scales and offsets
            n = rows * cols // args.group
            for row in t.view(-1, numel):
                for o in (s_off, z_off):
                    row[o:o + 2 * n].view(torch.float16).uniform_(-0.01, 0.01)

    slots = torch.empty((k, numel), dtype=torch.uint8, device=dev)
    host_reg = host_tensor((k, numel), torch.uint8, pin=True, init=fill)
    host_alloc = torch.empty((k, numel), dtype=torch.uint8, pin_memory=True)
    host_alloc.copy_(host_reg)
    slots.copy_(host_reg)
    x = torch.randn(k, args.hidden, dtype=torch.bfloat16, device=dev) * 0.1
    xd = torch.randn(k, args.ffn, dtype=torch.bfloat16, device=dev) * 0.1
    starts = list(range(k + 1))
    base = slots.data_ptr()

    def meta(ptrs):
        return torch.tensor(starts + [q - base for q in ptrs], dtype=torch.long, device=dev)

    m_res = meta([base + i * numel for i in range(k)])
    m_reg = meta([host_reg[i].data_ptr() for i in range(k)])
    m_alloc = meta([host_alloc[i].data_ptr() for i in range(k)])
    configs = []
    for c in args.configs.split(","):
        configs.append((c, decode_config(args.bits) if c == "decode" else GemvConfig(*map(int, c.split(":")))))
    gb = k * numel / 1e9

    def both(m, cfg):
        outs = []
        for (offs, shape), inp in ((parts["gate_up_proj"], x), (parts["down_proj"], xd)):
            outs.append(quant_matmul_grouped(inp, slots, offs, shape, args.bits, args.group, m, k, 1, config=cfg))
        return outs

    for name, cfg in configs:
        ref = both(m_res, cfg)
        for tag, m in (("direct(registered)", m_reg), ("direct(pin_memory)", m_alloc)):
            got = both(m, cfg)
            same = all(torch.equal(a, b) for a, b in zip(ref, got))
            print(f"{name:>16} {tag:>20}: equal to resident {same}")
        t_res = timed(lambda: both(m_res, cfg), args.reps)
        t_reg = timed(lambda: both(m_reg, cfg), args.reps)
        t_alloc = timed(lambda: both(m_alloc, cfg), args.reps)
        t_copy = timed(lambda: (slots.copy_(host_reg, non_blocking=True), both(m_res, cfg)), args.reps)
        print(f"{name:>16}: resident {t_res:.3f} ms ({gb / t_res * 1e3:.0f} GB/s) | direct registered {t_reg:.3f} "
              f"ms ({gb / t_reg * 1e3:.1f} GB/s) | direct pin_memory {t_alloc:.3f} ms ({gb / t_alloc * 1e3:.1f} "
              f"GB/s) | copy+resident {t_copy:.3f} ms ({gb / t_copy * 1e3:.1f} GB/s)  [{k} experts, {gb:.3f} GB]")
    t_h2d = timed(lambda: slots.copy_(host_reg, non_blocking=True), args.reps)
    print(f"pinned H2D copy alone: {t_h2d:.3f} ms ({gb / t_h2d * 1e3:.1f} GB/s)")


if __name__ == "__main__":
    main()
