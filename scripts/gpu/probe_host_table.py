"""Is the host expert slower inside a 32-layer decode because of the table or because of the link? (#37)

Inside the 32-layer decode the host expert (``expert_cpu.swiglu``, one token) took over twice its time alone
(docs/bench/moe_offload.md), more than in an 8-layer decode. The
alone figure reads one expert over and over, while a decode reads a different expert of a 25 GB table each call,
with the link's DMA reading the same host memory beside it. This probe builds the CPU tier of ``--experts``
Mixtral-8x7B experts (the product's ``CpuExpertStore``: pinned, 2 MiB pages where the kernel allows) and times the
op, one token at a time:

* **same**: one expert over and over (the "alone" figure of the earlier probes);
* **cycle**: every call a different expert, in a shuffled order over the whole table;
* **cycle + link / GPU matmuls (queued)**: the same while a side CUDA stream copies other experts of the table to the
  GPU back to back (the link's reads of host memory), or runs matmuls, all queued from this thread before the calls
  (no other host thread runs);
* **cycle + a thread waiting on the link / GPU matmuls**: the same work queued and waited on in a loop by a Python
  thread: one more runnable host thread beside the op's team (a CUDA wait spins on its core).

Each way runs with the op's row blocks spread dynamically over the OpenMP team (the default), in static shares
(``expert_cpu.set_dynamic_rows(False)``: a call then lasts as long as its slowest thread), and dynamically with two
threads fewer than the host's cores.
It prints the host's NUMA layout and transparent-huge-page setting, and the pinned table's AnonHugePages.

    python scripts/gpu/probe_host_table.py [--modes int4,bf16] [--experts 256] [--calls 96]
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds_maximus.experts.cpu_compute import HostExpertCompute  # noqa: E402
from ds_maximus.experts.expert_store import CpuExpertStore  # noqa: E402
from ds_maximus.experts.layout import ExpertLayout  # noqa: E402
from ds_maximus.experts.quant_layout import QuantizedExpertLayout  # noqa: E402
from ds_maximus.ops import expert_cpu  # noqa: E402

H, F = 4096, 14336


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def build_store(mode: str, n: int, device) -> HostExpertCompute:
    """A CPU tier of ``n`` Mixtral experts (each the same random expert, quantized when ``mode`` is intN)."""
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = (torch.randn(2 * F, H, generator=g, device=device) * 0.02).to(torch.bfloat16)
    down = (torch.randn(H, F, generator=g, device=device) * 0.02).to(torch.bfloat16)
    lay = ExpertLayout.from_stacked({"gate_up_proj": gate_up[None], "down_proj": down[None]}, 1)
    if mode != "bf16":
        lay = QuantizedExpertLayout.from_layout(lay, int(mode.removeprefix("int")), 64)
        src = {"gate_up_proj": gate_up, "down_proj": down}
    else:
        src = {"gate_up_proj": gate_up.cpu(), "down_proj": down.cpu()}
    store = CpuExpertStore(lay, n, pin_memory=True)
    t0 = time.perf_counter()
    store.write(0, src)
    first = store.host_view(0)
    for uid in range(1, n):
        store.host_view(uid).copy_(first)
    print(f"- {mode}: {n} experts of {lay.nbytes / 1e6:.1f} MB, {n * lay.nbytes / 1e9:.1f} GB pinned, filled in "
          f"{time.perf_counter() - t0:.1f} s; {sh('grep AnonHugePages /proc/meminfo')}", flush=True)
    return HostExpertCompute(store, n, "misses")


def time_calls(host: HostExpertCompute, uids, x) -> list:
    ms = []
    for uid in uids:
        w = host.weights(uid)
        t0 = time.perf_counter()
        expert_cpu.swiglu(x, *w)
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


class Background:
    """Work beside the op on the GPU: ``link`` copies experts of the table to the device back to back on a side
    stream, ``gpu`` runs matmuls there. ``thread=False``: queued from this thread before the op's calls (no other
    host thread runs); ``thread=True``: a Python thread queues and waits on it in a loop (one more runnable host
    thread: a CUDA wait spins on its core)."""

    def __init__(self, host: HostExpertCompute, kind: str, n: int, thread: bool, seconds: float = 0.4):
        self.host, self.kind, self.n, self.thread_mode, self.seconds = host, kind, n, thread, seconds
        self.stop = threading.Event()
        self.stream = torch.cuda.Stream()
        self.bytes = 0
        self.busy_at_end = None
        self.dst = self.a = None  # the copies' destination, the matmuls' operand (made at the first queue)
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def queue(self, seconds: float) -> None:
        with torch.cuda.stream(self.stream):
            if self.kind == "link":
                if self.dst is None:
                    self.dst = torch.empty_like(self.host.store.host_view(0), device="cuda")
                uid = 0
                for _ in range(max(1, int(seconds * 50e9 / self.host.layout.nbytes))):
                    uid = (uid + 37) % self.n
                    src = self.host.store.host_view(uid)
                    self.dst.copy_(src, non_blocking=True)
                    self.bytes += src.numel() * src.element_size()
            else:
                if self.a is None:
                    self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
                for _ in range(max(1, int(seconds / 1.5e-3))):
                    self.a = (self.a @ self.a).clamp_(-1, 1)

    def loop(self):
        while not self.stop.is_set():
            self.queue(0.02)
            self.stream.synchronize()

    def __enter__(self):
        if self.thread_mode:
            self.thread.start()
            time.sleep(0.2)
        else:
            self.queue(self.seconds)
        return self

    def __exit__(self, *exc):
        if self.thread_mode:
            self.stop.set()
            self.thread.join()
        else:
            self.busy_at_end = not self.stream.query()
            self.stream.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="int4,bf16")
    p.add_argument("--experts", default="256,64", help="experts in the table, one per mode")
    p.add_argument("--calls", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="OpenMP team (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"## Host expert op, one token, {torch.cuda.get_device_name()}; torch threads {torch.get_num_threads()}, "
          f"op ISA {expert_cpu.kernel_isa()}")
    host = ("lscpu | grep -E 'NUMA node|Model name|Thread|Socket' | tr -s ' ' | paste -sd ';'",
            "cat /sys/kernel/mm/transparent_hugepage/enabled",
            "grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | paste -sd ';'")
    print("- " + " | ".join(sh(c) for c in host))
    rows = []
    for mode, n in zip(a.modes.split(","), (int(e) for e in a.experts.split(","))):
        host = build_store(mode, n, "cuda")
        x = torch.randn(1, H).to(torch.bfloat16).float()
        rng = random.Random(0)
        order = [rng.randrange(n) for _ in range(a.calls)]
        time_calls(host, [0] * 4, x)
        default_threads = torch.get_num_threads()
        for threads, dynamic in ((default_threads, True), (default_threads, False), (default_threads - 2, True)):
            torch.set_num_threads(threads)
            expert_cpu.set_dynamic_rows(dynamic)
            label = f"{threads}, {'dynamic' if dynamic else 'static'}"
            for name, kind, thread in (("same expert", None, False), ("cycle", None, False),
                                       ("cycle + link (queued)", "link", False),
                                       ("cycle + GPU matmuls (queued)", "gpu", False),
                                       ("cycle + a thread waiting on the link", "link", True),
                                       ("cycle + a thread waiting on GPU matmuls", "gpu", True)):
                uids = [0] * a.calls if name == "same expert" else order
                extra = ""
                if kind is None:
                    ms = time_calls(host, uids, x)
                else:
                    with Background(host, kind, n, thread) as bg:
                        ms = time_calls(host, uids, x)
                    if not thread:
                        extra = f"side stream still busy at the end: {bg.busy_at_end}"
                med = statistics.median(ms)
                gbps = host.layout.nbytes / 1e9 / med * 1e3
                rows.append(f"| {mode} | {n} | {label} | {name} | {min(ms):.2f} | {med:.2f} | "
                            f"{statistics.fmean(ms):.2f} | {max(ms):.2f} | {gbps:.1f} | {extra} |")
        torch.set_num_threads(default_threads)
        expert_cpu.set_dynamic_rows(True)
        host.store.close()
        del host
        torch.cuda.empty_cache()
    print("\n| weights | experts in table | threads, row blocks | calls | min ms | median ms | mean ms | max ms | "
          "GB/s (median) | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
