"""Benchmark of the async NVMe loader against its peers, all in one run, on the same files.

    python -m benchmarks.bench_nvme_loader                       # CPU: 128 MiB in 4 files
    python -m benchmarks.bench_nvme_loader --total-mib 1024 --files 8 --repeat 2 --out $OUT/nvme_loader.md

Rows (cold page cache before every timed pass where the machine lets us drop it; else "warm cache"):
raw ceiling (O_DIRECT multi-threaded ``os.preadv`` from Python), ours (O_DIRECT and buffered),
``safetensors.torch.load_file`` (+ ``.to(cuda)`` on GPU), DeepSpeed's aio op where compatible; on GPU
also the pinned H2D copy rate (PCIe ceiling), ours disk -> GPU (``read_to_device``) and the slowdown of a
bf16 matmul loop on the compute stream while ``read_to_device`` streams beside it.
Sizes also come from env: MAXIMUS_BENCH_NVME_MIB, MAXIMUS_BENCH_NVME_FILES, MAXIMUS_BENCH_NVME_DIR.
Under ``--budget-s`` (70 s): 1 GiB, 2 passes per row (~1 s each at ~1.2 GB/s); a row that no longer
fits is a "skipped: over time budget" row; DeepSpeed's aio (a JIT op) runs last.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

from benchmarks.harness import SKIPPED, Bench, Budget, progress
from ds_maximus.ops.nvme_loader import ALIGN_BYTES, NVMeLoader, aligned_empty

MIB = 1 << 20
CUDA = torch.cuda.is_available()
TARGETS = {"ours (O_DIRECT)": ">= 90% of raw, >= 2x safetensors", "ours read_to_device (disk->GPU)":
           ">= 90% of min(raw, PCIe)", "matmul loop during read_to_device": "slowdown < 5%"}


def make_files(folder: Path, total_mib: int, n_files: int) -> List[Tuple[str, int]]:
    """safetensors files of one random uint8 tensor each; reused when already there at the right size."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    per = max(1, total_mib * MIB // n_files)
    out = []
    for i in range(n_files):
        path = folder / f"shard_{i:03d}_{per}.safetensors"
        if not path.exists():
            save_file({"w": torch.randint(0, 256, (per,), dtype=torch.uint8)}, str(path))
        out.append((str(path), path.stat().st_size))
    os.sync()
    return out


def drop_page_cache(files) -> str:
    """Evict the files from the page cache; says how (or "warm cache" when the machine refuses)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "cold (drop_caches)"
    except OSError:
        pass
    try:
        for path, _ in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "cold (fadvise DONTNEED)"
    except (OSError, AttributeError):
        return "warm cache"


def timed(fn: Callable[[], object], files, repeat: int, cold: bool = True) -> Tuple[float, str]:
    """Median ms of ``repeat`` passes, the cache dropped before each."""
    ms, mode = [], "warm cache"
    for _ in range(repeat):
        if cold:
            mode = drop_page_cache(files)
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if CUDA:
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms), mode


class RawPread:
    """The ceiling: O_DIRECT ``os.preadv`` of ``block_bytes`` pieces from a Python thread pool."""

    def __init__(self, files, threads: int, block_bytes: int):
        self.files, self.block = files, block_bytes
        self.pool = ThreadPoolExecutor(threads)
        self.bufs = [mmap.mmap(-1, -(-n // ALIGN_BYTES) * ALIGN_BYTES) for _, n in files]  # page-aligned

    def __call__(self):
        fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p, _ in self.files]
        try:
            jobs = []
            for fd, buf, (_, n) in zip(fds, self.bufs, self.files):
                mv = memoryview(buf)
                for off in range(0, n, self.block):
                    length = -(-min(self.block, n - off) // ALIGN_BYTES) * ALIGN_BYTES
                    jobs.append(self.pool.submit(os.preadv, fd, [mv[off:off + length]], off))
            got = sum(j.result() for j in jobs)
            assert got == sum(n for _, n in self.files), got
        finally:
            for fd in fds:
                os.close(fd)


def ours_cpu(loader: NVMeLoader, files):
    bufs = [aligned_empty(n) for _, n in files]

    def run():
        for h in [loader.read_into(p, 0, b) for (p, _), b in zip(files, bufs)]:
            h.wait()
    return run


def safetensors_load(files):
    from safetensors.torch import load_file

    def run():
        for p, _ in files:
            t = load_file(p)["w"]  # safetensors >= 0.4 maps the file: nothing is read yet
            if CUDA:
                t.to("cuda")
            else:
                int(t[::4096].sum())  # touch every page, which reads the file
    return run


def deepspeed_aio(files, threads: int, block_bytes: int, queue_depth: int):
    """DeepSpeed's aio op (needs libaio); raises with the reason where it cannot run."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
    b = AsyncIOBuilder()
    if not b.is_compatible(verbose=False):
        raise RuntimeError("incompatible: libaio-dev not installed (DeepSpeed's AsyncIOBuilder)")
    h = b.load(verbose=False).aio_handle(block_bytes, queue_depth, False, False, threads)
    bufs = [aligned_empty(n) for _, n in files]

    def run():
        for (p, _), buf in zip(files, bufs):
            h.async_pread(buf, p)
        h.wait()
    return run


def device_rows(bench_rows, loader, files, repeat, raw_gbps):
    total = sum(n for _, n in files)
    outs = [torch.empty(n, dtype=torch.uint8, device="cuda") for _, n in files]
    src = [aligned_empty(n, pin=True) for _, n in files]

    def h2d():
        for s, o in zip(src, outs):
            o.copy_(s, non_blocking=True)
    ms, _ = timed(h2d, files, repeat, cold=False)
    pcie = total / ms / 1e6
    bench_rows.append(("pinned H2D copy (PCIe ceiling, warm)", ms, {"GB/s": pcie}))

    def to_dev():
        evs = [loader.read_to_device(p, 0, n, o) for (p, n), o in zip(files, outs)]
        for ev in evs:
            torch.cuda.current_stream().wait_event(ev)
    ms, mode = timed(to_dev, files, repeat)
    gbps = total / ms / 1e6
    ceiling = min(raw_gbps, pcie)
    bench_rows.append(("ours read_to_device (disk->GPU)", ms,
                       {"GB/s": gbps, "% of raw": f"{100 * gbps / ceiling:.0f}% of min(raw, PCIe)", "cache": mode}))

    # matmul loop on the compute stream, alone and while read_to_device streams from another thread
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def loop(n=60):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            a @ a
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    loop(5)
    alone = statistics.median([loop() for _ in range(3)])
    stop, streamed = threading.Event(), [0]

    def streamer():
        while not stop.is_set():
            for (p, n), o in zip(files, outs):
                if stop.is_set():
                    break
                loader.read_to_device(p, 0, n, o).synchronize()
                streamed[0] += n
    th = threading.Thread(target=streamer)
    t0 = time.perf_counter()
    th.start()
    time.sleep(0.05)
    together = statistics.median([loop() for _ in range(3)])
    stop.set()
    th.join()
    secs = time.perf_counter() - t0
    alone2 = statistics.median([loop() for _ in range(3)])
    base = (alone + alone2) / 2
    bench_rows.append(("matmul loop alone (60 x bf16 8192^3)", base, {}))
    bench_rows.append(("matmul loop during read_to_device", together,
                       {"slowdown": f"{100 * (together / base - 1):.1f}%",
                        "GB/s": streamed[0] / secs / 1e9}))


def _aio_ready() -> bool:
    """Whether DeepSpeed's async_io op is installed or already JIT-built (loading it compiles nothing)."""
    try:
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get("async_io"):
            return True
    except ImportError:
        pass
    from torch.utils.cpp_extension import _get_build_directory
    return os.path.exists(os.path.join(_get_build_directory("async_io", verbose=False), "async_io.so"))


def render(rows, errors, modes, files, args) -> Bench:
    """The table from the rows measured so far (called after every row: a kill leaves a partial table)."""
    total = sum(n for _, n in files)
    raw = next((r for r in rows if r[0].startswith("raw")), None)
    st = next((r for r in rows if r[0].startswith("safetensors")), None)
    cache = " / ".join(sorted(modes)) or "n/a"
    bench = Bench("nvme_loader", dtype="bytes", sizes={"total_MiB": total // MIB, "files": len(files),
                                                        "threads": args.threads, "block_bytes": args.block_bytes,
                                                        "queue_depth": args.queue_depth},
                  notes=f"page cache: {cache}; files in {args.dir}; median of {args.repeat} passes")
    for name, ms, extra in rows:
        extra = dict(extra)
        if raw and name.startswith("ours (") and "% of raw" not in extra:
            extra["% of raw"] = f"{100 * extra['GB/s'] / raw[2]['GB/s']:.0f}%"
        if st and "GB/s" in extra and not name.startswith("matmul") and not name.startswith("pinned"):
            extra["vs safetensors"] = f"{extra['GB/s'] / st[2]['GB/s']:.2f}x"
        if name in TARGETS:
            extra["target"] = TARGETS[name]
        bench.add(name, ms, **extra)
    for name, err in errors:
        bench.add(name, None, error=err)
    return bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=int(os.environ.get("MAXIMUS_BENCH_NVME_MIB",
                                                                        1024 if CUDA else 128)))
    ap.add_argument("--files", type=int, default=int(os.environ.get("MAXIMUS_BENCH_NVME_FILES", 8 if CUDA else 4)))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--block-bytes", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    default_dir = str(Path(__file__).resolve().parent.parent / "build" / "bench_nvme")
    ap.add_argument("--dir", default=os.environ.get("MAXIMUS_BENCH_NVME_DIR", default_dir))
    ap.add_argument("--budget-s", type=float, default=70.0, help="wall-clock budget; rows that no longer fit "
                    "are rows that say so")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)

    progress(f"writing {args.total_mib} MiB in {args.files} files to {args.dir}")
    files = make_files(Path(args.dir), args.total_mib, args.files)
    total = sum(n for _, n in files)
    rows: List[Tuple[str, float, Dict[str, object]]] = []
    errors: List[Tuple[str, str]] = []
    modes = set()
    # one pass at a pessimistic 0.5 GB/s plus a cache drop, times the passes: a row's cost estimate
    row_s = args.repeat * (total / 0.5e9 + 1.0)
    progress(f"files ready ({total / MIB:.0f} MiB); a row costs ~{row_s:.0f} s; {budget.left():.0f} s left")

    def checkpoint():
        render(rows, errors, modes, files, args).checkpoint(args.out)

    def add(name, make_fn, need_s=row_s):
        if not budget.allows(need_s, name):
            errors.append((name, SKIPPED))
        else:
            try:
                fn = make_fn()
                ms, mode = timed(fn, files, args.repeat)
                modes.add(mode)
                rows.append((name, ms, {"GB/s": total / ms / 1e6, "cache": mode}))
                progress(f"{name}: {ms:.1f} ms, {total / ms / 1e6:.2f} GB/s ({mode})")
            except Exception as e:  # a peer that cannot run here is a row, not a crash
                errors.append((name, f"{type(e).__name__}: {e}".splitlines()[0][:160]))
                progress(f"{name}: {errors[-1][1]}")
        checkpoint()

    kw = dict(threads=args.threads, block_bytes=args.block_bytes, queue_depth=args.queue_depth)
    with NVMeLoader(**kw) as ours, NVMeLoader(**kw, o_direct=False) as ours_buf:
        add("raw ceiling (O_DIRECT os.preadv, Python threads)", lambda: RawPread(files, args.threads, args.block_bytes))
        add("ours (O_DIRECT)", lambda: ours_cpu(ours, files))
        add("ours (buffered)", lambda: ours_cpu(ours_buf, files))
        add("safetensors load_file" + (" + .to(cuda)" if CUDA else ""), lambda: safetensors_load(files))
        raw = next((r for r in rows if r[0].startswith("raw")), None)
        if CUDA and raw:
            # the device rows: two timed passes (H2D, disk->GPU) and the matmul loop, a few seconds more
            if budget.allows(row_s + 5, "device rows"):
                progress("device rows: start")
                try:
                    device_rows(rows, ours, files, args.repeat, raw[2]["GB/s"])
                except Exception as e:
                    errors.append(("ours read_to_device (disk->GPU)", f"{type(e).__name__}: {e}"[:160]))
                progress("device rows: done")
            else:
                errors.append(("ours read_to_device (disk->GPU)", SKIPPED))
            checkpoint()
        # last: DeepSpeed's aio is a JIT op (~30-40 s to build when scripts/gpu/nvme_loader.sh has not
        # built it already), so it runs only when built or when the build still fits
        aio_ready = _aio_ready()
        progress(f"DeepSpeed aio op {'built' if aio_ready else 'not built yet (JIT build on load)'}")
        add("DeepSpeed aio (libaio)",
            lambda: deepspeed_aio(files, args.threads, args.block_bytes, args.queue_depth),
            need_s=row_s + (0 if aio_ready else 40))

    text = render(rows, errors, modes, files, args).report()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
