"""One missed expert split between the host and the link, against either side alone (#37, ``moe.cpu_compute``).

``cpu_compute: misses`` computes a missed expert on the host (``expert_cpu.swiglu``, one token); the link alone
would copy the whole expert first. The split (tried in the product as ``HostExpertCompute.forward_split`` and
removed, slower: docs/bench/moe_offload.md) lets the host compute ``h = silu(x W1^T) * (x W3^T)`` (two thirds of
the expert's bytes) while the link copies ``W2`` (the other third) to the GPU, which computes ``h W2^T``. This
probe times one token through ``--experts`` Mixtral-8x7B experts in pinned host memory, cycling so each is read
from memory, bf16 and int4 (group 64), wall ms to the output on the GPU: the host's whole expert, the link's whole
copy, the split, and the split's host part alone. (Whether the host op keeps its speed while the link copies other
experts: ``probe_host_table.py``.)

    python scripts/gpu/probe_split_expert.py [--experts 6] [--reps 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds_maximus.experts import quant  # noqa: E402
from ds_maximus.ops import expert_cpu  # noqa: E402

HIDDEN, FFN = 4096, 14336  # Mixtral-8x7B's expert


def experts(n: int, bits, seed: int):
    """``n`` experts as ``(w1, w3, w2)`` in pinned memory: bf16, or quantized to ``bits`` (group 64); drawn and
    quantized on the GPU (where there is one), then copied to the host."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(seed)
    out = []
    for _ in range(n):
        ws = [torch.randn(FFN, HIDDEN, generator=gen, device=dev).mul_(0.02).to(torch.bfloat16),
              torch.randn(FFN, HIDDEN, generator=gen, device=dev).mul_(0.02).to(torch.bfloat16),
              torch.randn(HIDDEN, FFN, generator=gen, device=dev).mul_(0.02).to(torch.bfloat16)]
        if bits:
            qs = [quant.quantize(w, bits, 64) for w in ws]
            out.append(tuple(quant.QuantizedTensor(*(t.cpu().pin_memory() for t in (q.packed, q.scales, q.zeros)),
                                                   q.shape, q.bits, q.group_size) for q in qs))
        else:
            out.append(tuple(w.cpu().pin_memory() for w in ws))
    return out


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, quant.QuantizedTensor) else w.numel() * w.element_size()


def split_expert(x: torch.Tensor, w, w2_dev: torch.Tensor, stream) -> torch.Tensor:
    """One token through expert ``w``: gate/up on the host while ``stream`` copies ``W2`` into ``w2_dev``."""
    w1, w3, w2 = w
    src = w2.packed if isinstance(w2, quant.QuantizedTensor) else w2
    done = torch.cuda.Event()
    with torch.cuda.stream(stream):
        raw = src.reshape(-1).view(torch.uint8)
        w2_dev[:raw.numel()].copy_(raw, non_blocking=True)
        done.record()
    h = torch.nn.functional.silu(expert_cpu.linear(x, w1)) * expert_cpu.linear(x, w3)
    h_dev = h.pin_memory().to("cuda", non_blocking=True)
    torch.cuda.current_stream().wait_event(done)
    if isinstance(w2, quant.QuantizedTensor):  # a stand-in for the dequant-GEMM (the probe times the link, not it)
        q = quant.QuantizedTensor(w2_dev[:src.numel()].view(src.shape), w2.scales.to("cuda", non_blocking=True),
                                  w2.zeros.to("cuda", non_blocking=True), w2.shape, w2.bits, w2.group_size)
        wd = quant.dequantize(q, torch.bfloat16)
    else:
        wd = w2_dev[:src.numel() * src.element_size()].view(torch.bfloat16).view(w2.shape)
    return h_dev.to(torch.bfloat16) @ wd.t()


def split_table(work: dict, reps: int) -> None:
    print("| expert | host whole ms | link whole ms | split: host gate/up + link W2 ms | "
          "of which host gate/up ms |")
    print("|---|---|---|---|---|")
    stream = torch.cuda.Stream()
    for name in ("bf16 expert", "int4 expert"):
        data = work[name]
        whole = sum(nbytes(t) for t in data[0])
        flat = torch.empty(whole, dtype=torch.uint8).pin_memory()
        dev = torch.empty(whole, dtype=torch.uint8, device="cuda")
        w2_dev = torch.empty(nbytes(data[0][2]), dtype=torch.uint8, device="cuda")
        x = torch.randn(1, HIDDEN).to(torch.bfloat16).float()
        host_ms, link_ms, split_ms, gu_ms = [], [], [], []
        for r in range(reps + 1):
            for w in data:
                t0 = time.perf_counter()
                expert_cpu.swiglu(x, *w)
                host_ms.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dev.copy_(flat, non_blocking=True)
                torch.cuda.synchronize()
                link_ms.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                split_expert(x, w, w2_dev, stream)
                torch.cuda.synchronize()
                split_ms.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                torch.nn.functional.silu(expert_cpu.linear(x, w[0])) * expert_cpu.linear(x, w[1])
                gu_ms.append((time.perf_counter() - t0) * 1e3)
            if r == 0:  # warm-up round
                host_ms, link_ms, split_ms, gu_ms = [], [], [], []
        med = statistics.median
        print(f"| {name} | {med(host_ms):.2f} | {med(link_ms):.2f} | {med(split_ms):.2f} | {med(gu_ms):.2f} |",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    work = {"bf16 expert": experts(a.experts, None, 0), "int4 expert": experts(a.experts, 4, 1)}
    print(f"## {torch.cuda.get_device_name()}; host threads {torch.get_num_threads()}, "
          f"op ISA {expert_cpu.kernel_isa()}")
    split_table(work, a.reps)


if __name__ == "__main__":
    main()
