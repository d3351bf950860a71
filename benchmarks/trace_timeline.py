"""Per-stream busy time and a bucketed timeline of a torch.profiler chrome trace (plain or .gz).

    python -m benchmarks.trace_timeline trace_rank0.json.gz --bucket-ms 20
    python -m benchmarks.trace_timeline trace.json --window 500 660 --min-ms 0.3   # host ops in a window
    python -m benchmarks.trace_timeline trace.json --gaps --min-ms 0.5               # the compute stream's gaps
    python -m benchmarks.trace_timeline trace.json --phases --min-ms 1               # host ranges and waits
    python -m benchmarks.trace_timeline trace.json.gz --slim slim.json.gz            # a smaller trace to take away

The first form prints, for each CUDA stream, its busy milliseconds split by kind (kernels, each memcpy
direction, memsets), then one line per bucket with each stream's occupancy: where the compute stream
idles and what the copy streams do meanwhile. The second prints the host-side ops and CUDA runtime calls
longer than ``--min-ms`` that overlap the window (ms from the first GPU event), e.g. the synchronize that
holds the host. Written to read the headline's profile (``scripts/gpu/headline_profile.sh``) without
bringing a 30 MB trace back from the GPU machine.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
from typing import List

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")


def load(path: str) -> List[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)["traceEvents"]


def _kind(e: dict) -> str:
    return e["name"][:20] if e["cat"] == "gpu_memcpy" else e["cat"]


def _copied(events: List[dict]) -> str:
    """``"; <GB> GB at <GB/s> GB/s while copying"`` per copy direction of a stream (kineto's ``bytes``)."""
    out = []
    for kind in sorted({_kind(e) for e in events if e["cat"] == "gpu_memcpy"}):
        sel = [e for e in events if e["cat"] == "gpu_memcpy" and _kind(e) == kind]
        nbytes, busy = sum(e.get("args", {}).get("bytes", 0) for e in sel), sum(e["dur"] for e in sel)
        if nbytes:
            out.append(f"{kind} {nbytes / 1e9:.2f} GB at {nbytes / 1e3 / max(busy, 1):.1f} GB/s")
    return "; " + "; ".join(out) if out else ""


def _merged(events: List[dict]) -> List[tuple]:
    out: List[list] = []
    for s, f in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], f)
        else:
            out.append([s, f])
    return [tuple(x) for x in out]


def _overlaps(by: dict, tids: List) -> List[str]:
    """Per pair of copying streams, the ms both were busy at once: whether copies of the two ran side by side."""
    lines = []
    spans = {t: _merged(by[t]) for t in tids}
    for i, a in enumerate(tids):
        for b in tids[i + 1:]:
            both, j = 0.0, 0
            for s, f in spans[a]:
                while j < len(spans[b]) and spans[b][j][1] <= s:
                    j += 1
                k = j
                while k < len(spans[b]) and spans[b][k][0] < f:
                    both += min(f, spans[b][k][1]) - max(s, spans[b][k][0])
                    k += 1
            lines.append(f"streams {a} and {b}: both busy {both / 1e3:.1f} ms")
    return lines


def timeline(events: List[dict], bucket_ms: float = 20.0, streams: int = 6) -> str:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        return "no GPU events in the trace"
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    by = collections.defaultdict(list)
    for e in gpu:
        by[e["tid"]].append(e)
    order = sorted(by, key=lambda t: -sum(e["dur"] for e in by[t]))[:streams]
    lines = [f"span {(t1 - t0) / 1e3:.1f} ms, {len(gpu)} GPU events"]
    for tid in order:
        kinds = collections.Counter()
        for e in by[tid]:
            kinds[_kind(e)] += e["dur"] / 1e3
        split = ", ".join(f"{k} {v:.1f}" for k, v in kinds.most_common())
        lines.append(f"stream {tid}: busy {sum(kinds.values()):.1f} ms ({split}){_copied(by[tid])}")
    lines += _overlaps(by, [t for t in order if any(e["cat"] == "gpu_memcpy" for e in by[t])])
    nb = int((t1 - t0) / 1e3 / bucket_ms) + 1
    occ = {t: [0.0] * nb for t in order}
    for t in order:
        for e in by[t]:
            s, f = (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3
            while s < f:
                b = int(s / bucket_ms)
                end = min(f, (b + 1) * bucket_ms)
                occ[t][b] += end - s
                s = end
    lines.append("ms      " + " ".join(f"{str(t):>8}" for t in order))
    for b in range(nb):
        lines.append(f"{b * bucket_ms:6.0f}  " + " ".join(f"{100 * occ[t][b] / bucket_ms:7.0f}%" for t in order))
    return "\n".join(lines)


def _streams(events: List[dict]):
    """``(t0, {stream: its GPU events}, the compute stream)``, the compute stream being the one with the most kernel
    time; None without GPU events."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not gpu:
        return None
    by = collections.defaultdict(list)
    for e in gpu:
        by[e["tid"]].append(e)
    compute = max(by, key=lambda t: sum(e["dur"] for e in by[t] if e["cat"] == "kernel"))
    return min(e["ts"] for e in gpu), by, compute


def stream_gaps(ops: List[dict], min_ms: float = 0.0) -> List[tuple]:
    """The idle gaps longer than ``min_ms`` between one stream's ``ops`` (sorted by start): ``(start us, end us, the
    op before, the op after)``."""
    found, end, last = [], None, None
    for e in ops:
        if end is not None and e["ts"] - end > min_ms * 1e3:
            found.append((end, e["ts"], last, e))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return found


def gaps(events: List[dict], min_ms: float = 0.5, top: int = 25) -> str:
    """The compute stream's (the stream with the most kernel time) idle gaps longer than ``min_ms``: their total, and
    the ``top`` longest with the kernels either side and what the other streams did meanwhile, i.e. what the compute
    stream waited for."""
    found_streams = _streams(events)
    if found_streams is None:
        return "no GPU events in the trace"
    t0, by, compute = found_streams
    ops = sorted(by[compute], key=lambda e: e["ts"])
    spans = {t: _merged(by[t]) for t in by if t != compute}
    found = stream_gaps(ops, min_ms)
    idle = sum(f - s for s, f, _, _ in found) / 1e3
    span = (max(e["ts"] + e["dur"] for e in ops) - ops[0]["ts"]) / 1e3
    lines = [f"compute stream {compute}: {span:.1f} ms from its first to its last op, {len(found)} gaps over "
             f"{min_ms} ms, {idle:.1f} ms idle in them"]
    for s, f, before, after in sorted(found, key=lambda g: g[0] - g[1])[:top]:
        other = []
        for t, sp in spans.items():
            busy = sum(max(0, min(f, b) - max(s, a)) for a, b in sp) / 1e3
            if busy > 0.05:
                other.append(f"{t}:{busy:.1f}")
        lines.append(f"{(s - t0) / 1e3:8.1f} +{(f - s) / 1e3:6.1f} ms  after {before['name'][:45]!r} before "
                     f"{after['name'][:45]!r}  others busy ms {' '.join(other) or '-'}")
    return "\n".join(lines)


def phases(events: List[dict], min_ms: float = 1.0, top: int = 400) -> str:
    """The host's ranges (``record_function`` annotations: the bench's ``bench.*`` phases and ours' ``maximus.*``)
    and the CUDA runtime calls longer than ``min_ms`` (host waits: ``cudaStreamSynchronize``,
    ``cudaEventSynchronize``, ...), in time order, each with how busy the compute stream was meanwhile: where the
    host held the GPU back."""
    found_streams = _streams(events)
    if found_streams is None:
        return "no GPU events in the trace"
    t0, by, compute = found_streams
    busy = _merged(by[compute])
    sel = [e for e in events if e.get("ph") == "X" and e.get("dur", 0) > 0
           and (e.get("cat") == "user_annotation" or (e.get("cat") in ("cuda_runtime", "cuda_driver")
                                                      and e["dur"] > min_ms * 1e3))]
    sel.sort(key=lambda e: e["ts"])
    lines = [f"host ranges and runtime calls over {min_ms} ms; 'gpu' = compute stream {compute} busy meanwhile"]
    for e in sel[:top]:
        s, f = e["ts"], e["ts"] + e["dur"]
        on = sum(max(0, min(f, b) - max(s, a)) for a, b in busy)
        lines.append(f"{(s - t0) / 1e3:8.1f} {e['dur'] / 1e3:8.1f} ms  gpu {100 * on / e['dur']:3.0f}%  "
                     f"{e['cat'][:12]:12} {e['name'][:80]}")
    return "\n".join(lines)


def window(events: List[dict], lo: float, hi: float, min_ms: float = 0.3) -> str:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    t0 = min(e["ts"] for e in gpu)
    sel = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS and e["dur"] > min_ms * 1e3
           and (e["ts"] - t0) / 1e3 < hi and (e["ts"] + e["dur"] - t0) / 1e3 > lo]
    sel.sort(key=lambda e: e["ts"])
    return "\n".join(f"{(e['ts'] - t0) / 1e3:8.1f} {e['dur'] / 1e3:8.1f} ms  {e['cat'][:12]:12} {e['name'][:100]}"
                     for e in sel)


def slim(events: List[dict], path: str, min_ms: float = 0.05) -> int:
    """Write a smaller chrome trace to ``path`` (gzip): every GPU event, the host's annotated ranges, and the host ops
    and CUDA runtime calls longer than ``min_ms``; returns the number of events kept. A two-step trace of the
    Gemma-3-4B bench is too large to bring back from the GPU machine whole; this one can be read here with the other
    forms."""
    keep = [e for e in events if e.get("ph") == "X" and (
        e.get("cat") in GPU_CATS or e.get("cat") == "user_annotation"
        or (e.get("cat") in HOST_CATS and e.get("dur", 0) > min_ms * 1e3))]
    for e in keep:
        if e.get("cat") not in GPU_CATS:  # the GPU events' args hold the copies' bytes (_copied)
            e.pop("args", None)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": keep}, f)
    return len(keep)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--bucket-ms", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--window", type=float, nargs=2, metavar=("FROM_MS", "TO_MS"))
    ap.add_argument("--min-ms", type=float, default=0.3)
    ap.add_argument("--gaps", action="store_true", help="the compute stream's idle gaps longer than --min-ms")
    ap.add_argument("--phases", action="store_true",
                    help="the host's annotated ranges and runtime calls over --min-ms, with the compute stream's use")
    ap.add_argument("--slim", metavar="OUT", help="write a smaller trace (gzip) to OUT: see slim()")
    a = ap.parse_args(argv)
    ev = load(a.trace)
    if a.slim:
        print(f"{slim(ev, a.slim)} events written to {a.slim}")
    elif a.gaps:
        print(gaps(ev, a.min_ms))
    elif a.phases:
        print(phases(ev, a.min_ms))
    else:
        print(window(ev, *a.window, a.min_ms) if a.window else timeline(ev, a.bucket_ms, a.streams))


if __name__ == "__main__":
    main()
