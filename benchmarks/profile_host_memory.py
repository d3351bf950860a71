"""The CPU AdamW op on one Mixtral expert (176M fp32 elements) by OpenMP thread count, alone and beside a
thread that keeps the PCIe link busy both ways (pinned copies and a CUDA sync, as the GPU side of the MoE
``split`` step does): how much the CPU side of that step loses to the copies' host-memory traffic and to a
core taken by the driving thread.

    python -m benchmarks.profile_host_memory                      # on the GPU machine
    python -m benchmarks.profile_host_memory --elems 32M --threads 2,1 # anywhere (no GPU: alone only)
    python -m benchmarks.profile_host_memory --stream                 # the host memory's own ceiling
    python -m benchmarks.profile_host_memory --duplex                 # the link: each way alone and both at once

``--duplex`` times 1 GiB pinned copies host-to-device alone, device-to-host alone and both at once on two streams,
also beside a CPU triad pass on all threads (the CPU side of a split step): whether the link's two directions add up.

``--stream`` times plain copy and triad passes (``torch``'s vectorised OpenMP kernels, 1 GiB arrays) in the same
way, alone and beside the copies: what host memory gives any op at that thread count, the figure the op's rate is
held against. GB/s counts the bytes the pass reads and writes (copy 8, triad 12 a float; a store's
read-for-ownership is not counted).

Prints one line per (beside copies, threads): median ms per expert of 3 calls run in a worker thread (as
``ds_maximus.experts.training.step.SplitStep._cpu_side`` runs them), and G elements/s.
"""
from __future__ import annotations

import argparse
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.bench_cpu_optimizer import _elems


def _busy_link(stop: threading.Event, mib: int = 1024) -> None:
    n = mib << 18  # fp32 elements
    h_in, h_out = torch.empty(n, pin_memory=True), torch.empty(n, pin_memory=True)
    d_in, d_out = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    while not stop.is_set():
        with torch.cuda.stream(s1):
            d_in.copy_(h_in, non_blocking=True)
        with torch.cuda.stream(s2):
            h_out.copy_(d_out, non_blocking=True)
        torch.cuda.synchronize()


@contextlib.contextmanager
def _link(beside: bool):
    """While inside: a thread keeps the link busy both ways (``beside``), or nothing."""
    stop = threading.Event()
    th = threading.Thread(target=_busy_link, args=(stop,)) if beside else None
    if th is not None:
        th.start()
    try:
        yield
    finally:
        stop.set()
        if th is not None:
            th.join()


def _timed(n_threads: int, fn, repeat: int) -> float:
    """Median seconds of ``fn`` with ``n_threads`` OpenMP threads, run in a worker thread (as
    ``ds_maximus.experts.training.step.SplitStep._cpu_side`` runs the op), after one untimed call."""
    def once() -> float:
        torch.set_num_threads(n_threads)  # this worker thread's OpenMP team
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    with ThreadPoolExecutor(1) as ex:
        ex.submit(once).result()
        return sorted(ex.submit(once).result() for _ in range(repeat))[repeat // 2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elems", default="176M", help="elements of the expert (K/M/G suffixes)")
    ap.add_argument("--threads", default="16,15,14,12,8", help="OpenMP thread counts to time")
    ap.add_argument("--stream", action="store_true", help="time plain copy/triad passes instead of the op")
    ap.add_argument("--duplex", action="store_true", help="time the link's directions alone and together")
    a = ap.parse_args(argv)
    if a.duplex:
        return _duplex()
    if a.stream:
        return _stream(a)
    from ds_maximus.ops.row_ops import row_update
    d = 4096
    rows = _elems(a.elems) // d
    w, m, v, g = (torch.randn(rows, d) * 1e-2 for _ in range(4))
    v.abs_()
    shadow = torch.empty(rows, d, dtype=torch.bfloat16)
    slots, last = torch.arange(rows), torch.full((rows,), 9, dtype=torch.long)
    lr_hist, wd_hist = torch.full((12,), 1e-3, dtype=torch.float64), torch.zeros(12, dtype=torch.float64)

    def op() -> None:
        row_update(w, [m, v], slots, g, last, step=10, lr_hist=lr_hist, wd_hist=wd_hist, lr=1e-3, weight_decay=0.0,
                   beta1=0.9, beta2=0.999, eps=1e-8, grad_scale=0.5, shadow=shadow)

    n0 = torch.get_num_threads()
    for beside in (False, True) if torch.cuda.is_available() else (False,):
        for n in (int(x) for x in a.threads.split(",")):
            with _link(beside):
                t = _timed(n, op, 3)
            print(f"beside copies={beside} threads={n}: {t * 1e3:.1f} ms/expert, {rows * d / t / 1e9:.2f} G elem/s",
                  flush=True)
    torch.set_num_threads(n0)


def _duplex(reps: int = 5) -> None:
    n = 1 << 28  # 1 GiB of fp32
    h_in, h_out = torch.empty(n, pin_memory=True), torch.empty(n, pin_memory=True)
    d_in, d_out = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def copies(h2d: bool, d2h: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            if h2d:
                with torch.cuda.stream(s1):
                    d_in.copy_(h_in, non_blocking=True)
            if d2h:
                with torch.cuda.stream(s2):
                    h_out.copy_(d_out, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    x, y, z = torch.rand(n), torch.rand(n), torch.empty(n)
    stop = threading.Event()

    def triad() -> None:
        while not stop.is_set():
            torch.add(x, y, alpha=0.5, out=z)
    for beside in (False, True):
        th = threading.Thread(target=triad) if beside else None
        if th is not None:
            th.start()
        try:
            copies(True, True)  # warm
            row = []
            for name, h2d, d2h in (("H2D", True, False), ("D2H", False, True), ("both", True, True)):
                t = copies(h2d, d2h)
                row.append(f"{name} {(h2d + d2h) * reps * 4 * n / t / 1e9:.1f} GB/s")
        finally:
            stop.set()
            if th is not None:
                th.join()
            stop.clear()
        print(f"duplex beside CPU triad={beside}: " + ", ".join(row) + " (both: the two directions' sum)", flush=True)


def _stream(a) -> None:
    n = 1 << 28  # 1 GiB of fp32 per array
    x, y, z = torch.rand(n), torch.rand(n), torch.empty(n)
    passes = {"copy": (lambda: z.copy_(x), 8), "triad": (lambda: torch.add(x, y, alpha=0.5, out=z), 12)}
    n0 = torch.get_num_threads()
    for beside in (False, True) if torch.cuda.is_available() else (False,):
        for nt in (int(t) for t in a.threads.split(",")):
            with _link(beside):
                row = [f"{name} {n * bpe / _timed(nt, fn, 5) / 1e9:.1f} GB/s" for name, (fn, bpe) in passes.items()]
            print(f"stream beside copies={beside} threads={nt}: " + ", ".join(row), flush=True)
    torch.set_num_threads(n0)


if __name__ == "__main__":
    main()
