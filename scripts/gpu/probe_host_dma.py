"""Does the link's copy slow the host's reads? (#37: the physical bound of host and link working at once.)

``moe.cpu_compute`` computes missed experts on the host while the link copies others to the GPU; both read host
memory. The 32-layer runs timed a host expert 2-3x slower inside the decode than alone, and bf16 + ``misses``
overlapped the two sides only in part. This probe measures, on pinned host memory as the CPU tier holds it:

* the host's read bandwidth (``sum()`` of a 2 GB fp32 tensor, every intra-op thread) and the host expert op
  (``expert_cpu.swiglu``, one token, cycling over ``--experts`` Mixtral-sized experts so each is read from memory),
  bf16 and int4 (group 64);
* the link's rate (pinned host-to-device copies of a 2 GB buffer on a side stream, timed by events);

each alone, then both at once (the copies queued for longer than the host work takes). The bound of a decode that
splits its host bytes between the two sides is their rates *while both run*, not their rates alone.

    python scripts/gpu/probe_host_dma.py [--experts 8] [--reps 3]
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


def experts(n: int, bits, gen: torch.Generator):
    """``n`` experts as ``(w1, w3, w2)`` in pinned memory: bf16, or quantized to ``bits`` (group 64)."""
    out = []
    for _ in range(n):
        ws = [torch.randn(FFN, HIDDEN, generator=gen).mul_(0.02).to(torch.bfloat16),
              torch.randn(FFN, HIDDEN, generator=gen).mul_(0.02).to(torch.bfloat16),
              torch.randn(HIDDEN, FFN, generator=gen).mul_(0.02).to(torch.bfloat16)]
        if bits:
            qs = [quant.quantize(w.float(), bits, 64) for w in ws]
            out.append(tuple(quant.QuantizedTensor(q.packed.pin_memory(), q.scales.pin_memory(), q.zeros.pin_memory(),
                                                   q.shape, q.bits, q.group_size) for q in qs))
        else:
            out.append(tuple(w.pin_memory() for w in ws))
    return out


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, quant.QuantizedTensor) else w.numel() * w.element_size()


def host_work(kind: str, data, reps: int):
    """Median ms of one unit of host work and the GB/s it read: ``sum`` of the 2 GB tensor, or one expert."""
    ms, read = [], 0
    x = torch.randn(1, HIDDEN).to(torch.bfloat16).float()
    for r in range(reps):
        if kind == "sum":
            t0 = time.perf_counter()
            data.sum()
            ms.append((time.perf_counter() - t0) * 1e3)
            read = data.numel() * data.element_size()
        else:
            for w in data:
                t0 = time.perf_counter()
                expert_cpu.swiglu(x, *w)
                ms.append((time.perf_counter() - t0) * 1e3)
                read = sum(nbytes(t) for t in w)
    med = statistics.median(ms)
    return med, read / med / 1e6


class Link:
    """Pinned host-to-device copies of one buffer on a side stream, an event after each (``rate`` reads the copies
    that ended inside a window of host time)."""

    def __init__(self, gb: float):
        self.src = torch.empty(int(gb * 1e9), dtype=torch.uint8).pin_memory()
        self.dst = torch.empty_like(self.src, device="cuda")
        self.stream = torch.cuda.Stream()

    def queue(self, n: int) -> None:
        torch.cuda.synchronize()
        self.start = torch.cuda.Event(enable_timing=True)
        self.ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        with torch.cuda.stream(self.stream):
            self.start.record()
            self.t0 = time.perf_counter()  # host time of the start event (the stream is idle: it runs at once)
            for e in self.ends:
                self.dst.copy_(self.src, non_blocking=True)
                e.record()

    def rate(self, lo: float = 0.0, hi: float = float("inf")) -> float:
        """GB/s of the copies that ended between host times ``lo`` and ``hi`` (``perf_counter`` seconds)."""
        self.ends[-1].synchronize()
        at = [self.t0 + self.start.elapsed_time(e) / 1e3 for e in self.ends]
        inside = [i for i, t in enumerate(at) if lo <= t <= hi]
        if len(inside) < 2:
            return float("nan")
        first, last = inside[0], inside[-1]
        return (last - first) * self.src.numel() / (at[last] - at[first]) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--link-gb", type=float, default=2.0)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    big = torch.ones(500_000_000, dtype=torch.float32).pin_memory()
    work = {"sum 2 GB": ("sum", big), "bf16 expert": ("op", experts(a.experts, None, gen)),
            "int4 expert": ("op", experts(a.experts, 4, gen))}
    link = Link(a.link_gb)
    link.queue(4)
    alone_link = link.rate()
    print(f"## {torch.cuda.get_device_name()}; host threads {torch.get_num_threads()}, "
          f"op ISA {expert_cpu.kernel_isa()}")
    print(f"link alone: {alone_link:.1f} GB/s ({a.link_gb:.1f} GB pinned copies)\n")
    print("| host work | alone: ms (median) | alone: host GB/s | with the link copying: ms | host GB/s | "
          "link GB/s meanwhile | host + link GB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, (kind, data) in work.items():
        host_work(kind, data, 1)  # warm-up
        ms0, bw0 = host_work(kind, data, a.reps)
        # enough copies to outlast the host work: its time alone at the link's rate alone, doubled
        est_s = ms0 / 1e3 * a.reps * (len(data) if kind == "op" else 1)
        link.queue(max(4, int(2 * est_s * alone_link / a.link_gb) + 2))
        time.sleep(0.005)  # the first copy under way
        t0 = time.perf_counter()
        ms1, bw1 = host_work(kind, data, a.reps)
        lg = link.rate(t0, time.perf_counter())
        print(f"| {name} | {ms0:.2f} | {bw0:.1f} | {ms1:.2f} | {bw1:.1f} | {lg:.1f} | {bw1 + lg:.1f} |", flush=True)


if __name__ == "__main__":
    main()
