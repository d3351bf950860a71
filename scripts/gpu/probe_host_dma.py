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

Then one split of a missed expert, timed whole (one token, wall ms to its output on the GPU): the host computes
``h = silu(x W1^T) * (x W3^T)`` (two thirds of the expert's bytes) while the link copies ``W2`` (the other third) to
the GPU, which computes ``h W2^T``; beside the host computing the whole expert and the link copying it whole.

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
    big = torch.ones(500_000_000, dtype=torch.float32).pin_memory()
    work = {"sum 2 GB": ("sum", big), "bf16 expert": ("op", experts(a.experts, None, 0)),
            "int4 expert": ("op", experts(a.experts, 4, 1))}
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
    split_table(work, a.reps)


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
    print("\n| expert | host whole ms | link whole ms | split: host gate/up + link W2 ms | "
          "of which host gate/up ms |")
    print("|---|---|---|---|---|")
    stream = torch.cuda.Stream()
    for name in ("bf16 expert", "int4 expert"):
        data = work[name][1]
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


if __name__ == "__main__":
    main()
