"""The shared benchmark harness: timing, peak memory, and one markdown table per run.

Every benchmark measures its peers in the same run and prints ratios beside absolute figures::

    from benchmarks.harness import Bench
    bench = Bench("sharded_embedding", dtype="fp32", sizes={"V": 262144, "d": 4096})
    bench.measure("ours", step_fn, warmup=3, repeat=10)
    bench.measure("nn.Embedding + AdamW", dense_fn)
    bench.report(baseline="nn.Embedding + AdamW")   # prints the table, writes CSV under bench_out/

A run under a hard wall-clock limit keeps a ``Budget`` and checkpoints the table after every peer, so
that a kill still leaves a partial table::

    budget = Budget(110)                                # seconds, from now
    if budget.allows(30, "DeepSpeed ZeRO-2"):           # else prints why
        ...measure...
    else:
        bench.skip("DeepSpeed ZeRO-2")                  # a row: "skipped: over time budget"
    bench.checkpoint("out.md", baseline=...)            # markdown + CSV, written now

On GPU, time is taken with CUDA events and peak memory with ``torch.cuda.max_memory_allocated``;
on CPU with ``time.perf_counter`` and the process's peak RSS delta (``ru_maxrss``).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import gc
import os
import platform
import resource
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

OUT_DIR = Path(os.environ.get("MAXIMUS_BENCH_OUT", Path(__file__).resolve().parent.parent / "bench_out"))
GIB = float(1 << 30)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: one per child process that starts its own process group."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def observed(trace_path: Optional[str] = None, profile: bool = False):
    """Instrument a timed window: a CUDA-only ``torch.profiler`` chrome trace written to ``trace_path`` (read it
    with ``benchmarks.trace_timeline``) and/or a cProfile of the host, printed as ``PROFILE`` lines at the end."""
    trace = None
    if trace_path and torch.cuda.is_available():
        trace = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        trace.__enter__()
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    try:
        yield
    finally:
        if trace is not None:
            trace.__exit__(None, None, None)
            trace.export_chrome_trace(trace_path)
        if prof is not None:
            import io
            import pstats
            prof.disable()
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf)
            st.sort_stats("cumulative").print_stats(30)
            st.sort_stats("tottime").print_stats(20)
            st.print_callers(r"built-in method torch.empty|_cuda_synchronize|method 'cpu'|Event.synchronize")
            print("\n".join("PROFILE " + ln for ln in buf.getvalue().splitlines() if ln.strip()), flush=True)


def cuda_memory_report(prefix: str = "OOM MEMORY", extra: Optional[Dict[str, Dict[str, int]]] = None,
                       top: int = 10) -> None:
    """What holds the GPU (after an out-of-memory error): the allocator's totals, ``extra``'s named byte counts
    (a module's own buffers), and the live CUDA tensors by dtype and shape, largest first; tensors only autograd
    holds (saved activations) are the rest of 'allocated'."""
    import collections
    gib = 2**30
    sizes, counts, seen = collections.Counter(), collections.Counter(), set()
    for o in gc.get_objects():
        try:
            if not (torch.is_tensor(o) and o.is_cuda):
                continue
            st = o.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            k = f"{o.dtype} {tuple(o.shape)}"
            sizes[k] += st.nbytes()
            counts[k] += 1
        except Exception:  # noqa: BLE001 (any object gc holds; a report must not fail)
            continue
    print(f"{prefix} allocated {torch.cuda.memory_allocated() / gib:.2f} GiB, reserved "
          f"{torch.cuda.memory_reserved() / gib:.2f}, peak {torch.cuda.max_memory_allocated() / gib:.2f}; "
          f"tensors seen {sum(sizes.values()) / gib:.2f}", flush=True)
    for name, parts in (extra or {}).items():
        print(f"{prefix} {name}: {({k: round(v / gib, 2) for k, v in parts.items()})}", flush=True)
    for k, b in sizes.most_common(top):
        print(f"{prefix} {b / gib:.2f} GiB in {counts[k]} x {k}", flush=True)


def git_commit() -> str:
    """``MAXIMUS_COMMIT`` when set (device runs: pass it in, their copy of .git is stale), else git's HEAD."""
    if os.environ.get("MAXIMUS_COMMIT"):
        return os.environ["MAXIMUS_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return os.environ.get("MAXIMUS_COMMIT", "unknown")


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


@dataclasses.dataclass
class Result:
    name: str
    ms: Optional[float]             # median ms per call; None when it failed (OOM, ...)
    peak_gib: Optional[float]       # peak memory during the timed calls
    extra: Dict[str, object] = dataclasses.field(default_factory=dict)
    error: str = ""


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], warmup: int = 3, repeat: int = 10) -> List[float]:
    """Milliseconds of each of ``repeat`` calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    if torch.cuda.is_available():
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


_T0 = time.monotonic()  # about when the benchmark process started (it imports the harness first)


class Budget:
    """A wall-clock budget in seconds, counted from when the harness was imported (``time.monotonic``),
    so that the imports and model construction of a benchmark count too."""

    def __init__(self, seconds: float, from_now: bool = False):
        self.seconds = float(seconds)
        self.t0 = time.monotonic() if from_now else _T0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, need_s: float, what: str = "") -> bool:
        """True when ``need_s`` more seconds fit; prints a line when they do not."""
        ok = self.left() >= need_s
        if not ok and what:
            progress(f"skip {what}: needs ~{need_s:.0f} s, {self.left():.0f} s of {self.seconds:.0f} s left")
        return ok


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """``torch.get_default_dtype()`` is ``dtype`` inside the block: a model made there allocates its floating
    parameters in it (no fp32 copy first, which at full size would not fit)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _cuda_index(device) -> int:
    """The index of ``device`` (``None`` or a plain ``cuda``: the current device's; torch's memory calls want one)."""
    device = torch.device("cuda" if device is None else device)
    return torch.cuda.current_device() if device.index is None else device.index


def gpu_fraction(fraction: float, device=None) -> None:
    """``torch.cuda.set_per_process_memory_fraction`` for ``device``; ``1.0`` lifts a cap."""
    torch.cuda.set_per_process_memory_fraction(fraction, _cuda_index(device))


def cap_gpu(cap_gib: float, device=None) -> float:
    """Cap this process's CUDA allocations on ``device`` at ``cap_gib`` GiB (:func:`gpu_fraction`, what the
    benchmarks' "capped" rows mean); returns the fraction of the device's memory set."""
    index = _cuda_index(device)
    fraction = min(1.0, cap_gib * GIB / torch.cuda.get_device_properties(index).total_memory)
    gpu_fraction(fraction, device)
    return fraction


def progress(msg: str) -> None:
    """A flushed progress line with the seconds since the process imported the harness."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


SKIPPED = "skipped: over time budget"


class Bench:
    """One benchmark run: a title, its conditions, and the measured providers."""

    def __init__(self, feature: str, dtype: str = "", sizes: Optional[Dict[str, object]] = None, notes: str = ""):
        self.feature = feature
        self.dtype = dtype
        self.sizes = sizes or {}
        self.notes = notes
        self.results: List[Result] = []

    def measure(self, name: str, fn: Callable[[], object], warmup: int = 3, repeat: int = 10,
                setup: Optional[Callable[[], object]] = None, **extra) -> Result:
        """Time ``fn``; an exception (OOM included) is recorded, not raised."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            if setup is not None:
                setup()
            times = time_fn(fn, warmup, repeat)
            ms = statistics.median(times)
            if torch.cuda.is_available():
                peak = torch.cuda.max_memory_allocated() / GIB
            else:
                peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024 / GIB
            res = Result(name, ms, peak, dict(extra))
        except torch.cuda.OutOfMemoryError as e:
            res = Result(name, None, None, dict(extra), error="OOM")
            del e
        except Exception as e:  # a peer that cannot run here is a row, not a crash
            res = Result(name, None, None, dict(extra), error=f"{type(e).__name__}: {str(e)[:80]}")
        if torch.cuda.is_available():
            res.extra.setdefault("base_gib", round(base / GIB, 3))
        self.results.append(res)
        return res

    def add(self, name: str, ms: Optional[float], peak_gib: Optional[float] = None, error: str = "", **extra):
        """Record a figure measured elsewhere (a subprocess, a training loop)."""
        res = Result(name, ms, peak_gib, dict(extra), error)
        self.results.append(res)
        return res

    def skip(self, name: str, reason: str = SKIPPED, **extra) -> Result:
        """A peer left out (time budget, missing package): still a row of the table."""
        return self.add(name, None, error=reason, **extra)

    def run_budgeted(self, name: str, fn: Callable[[], object], need_s: float, budget: "Budget",
                     out=None, baseline: Optional[str] = None) -> None:
        """Run one provider ``fn`` (which adds its row) if ``need_s`` seconds fit in ``budget``, else add a
        "skipped" row; an exception becomes an error row. Then free memory and write the partial table."""
        if not budget.allows(need_s, name):
            self.skip(name)
        else:
            progress(f"{name}: start ({budget.left():.0f} s left)")
            try:
                fn()
            except Exception as e:  # a peer that cannot run is a row, not a crash
                self.add(name, None, error=f"{type(e).__name__}: {str(e)[:80]}")
            last = self.results[-1]
            progress(f"{last.name}: {f'{last.ms:.2f} ms' if last.ms else last.error}")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.checkpoint(out, baseline=baseline)  # a kill still leaves the rows measured so far

    def checkpoint(self, path=None, baseline: Optional[str] = None, tail: str = "") -> str:
        """Write the table so far (markdown to ``path`` when given, CSV under the output folder) without
        printing it; a benchmark calls this after every peer so a kill leaves a partial table."""
        text = self.table(baseline) + (("\n" + tail) if tail else "")
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text + "\n")
        try:
            self.write_csv()
        except OSError as e:
            progress(f"CSV not written: {e}")
        return text

    def table(self, baseline: Optional[str] = None) -> str:
        base = next((r for r in self.results if r.name == baseline and r.ms), None)
        extra_keys: List[str] = []
        for r in self.results:
            for k in r.extra:
                if k not in extra_keys and k != "base_gib":
                    extra_keys.append(k)
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        lines = [f"### {self.feature}",
                 f"device: {device_name()} | dtype: {self.dtype} | {sizes} | commit: {git_commit()} | "
                 f"torch {torch.__version__}"]
        if self.notes:
            lines.append(self.notes)
        lines.append("")
        head = ["provider", "ms", "peak GiB"] + ([f"speed-up vs {baseline}"] if base else []) + extra_keys
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in self.results:
            cells = [r.name, f"{r.ms:.2f}" if r.ms else (r.error or "-"),
                     f"{r.peak_gib:.2f}" if r.peak_gib is not None else "-"]
            if base:
                cells.append(f"{base.ms / r.ms:.2f}x" if r.ms else "-")
            cells += [_fmt(r.extra.get(k, "")) for k in extra_keys]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def report(self, baseline: Optional[str] = None) -> str:
        text = self.table(baseline)
        print(text, flush=True)
        self.write_csv()
        return text

    def write_csv(self, out_dir: Optional[Path] = None) -> Path:
        out_dir = Path(out_dir or OUT_DIR)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.feature}.csv"
        keys = sorted({k for r in self.results for k in r.extra})
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["feature", "provider", "ms", "peak_gib", "error", "device", "dtype", "sizes", "commit", *keys])
            for r in self.results:
                w.writerow([self.feature, r.name, r.ms, r.peak_gib, r.error, device_name(), self.dtype,
                            ";".join(f"{k}={v}" for k, v in self.sizes.items()), git_commit(),
                            *[r.extra.get(k, "") for k in keys]])
        return path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
