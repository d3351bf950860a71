"""#38: which allocation makes the capped CUDA allocator free its cache (a "retry": it waits for every stream, the
step's copies included, then unmaps) inside a training step of bench_peft_vocab's ``--peer`` (Gemma-3-4B shape).

The last ``--watched`` steps run under ``torch.cuda.memory._record_memory_history``; for every run of segment
unmaps/frees in them (what a retry does), the allocation that follows is printed with its size, stream, the memory
reserved and allocated then, and its Python stack, beside the allocator's retry counter per phase. On the GPU machine,
after ``. .device/env.sh`` and ``. scripts/gpu/common.sh``::

    python scripts/gpu/peft_alloc_retries.py --peer ours_capped --steps 8 --watched 2
"""
import argparse
import collections
import contextlib

import torch
from step_watch import run_watched, stack_text

GIB = 2 ** 30


def _frames(entry, depth: int) -> str:
    return stack_text([(f.get("filename", ""), f.get("line"), f.get("name")) for f in entry.get("frames", [])], depth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", default="ours_capped")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--watched", type=int, default=2)
    ap.add_argument("--depth", type=int, default=9)
    a, rest = ap.parse_known_args()
    retries = collections.Counter()
    base = {}

    @contextlib.contextmanager
    def watching():
        if not base:   # the first watched step: the history starts here
            torch.cuda.synchronize()
            base.update(reserved=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated())
            torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        yield

    @contextlib.contextmanager
    def phase(name):
        r0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        yield
        retries[name] += torch.cuda.memory_stats().get("num_alloc_retries", 0) - r0
    run_watched(a.peer, a.steps, a.watched, rest, around=watching, phase=phase)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"# {a.peer}: allocator retries in the last {a.watched} of {a.steps} steps, by phase: {dict(retries)}")
    trace = snap["device_traces"][torch.cuda.current_device()]
    reserved, allocated = base["reserved"], base["allocated"]
    pending, shown = [], 0
    for e in trace:
        act, size = e["action"], e.get("size", 0)
        if act in ("segment_alloc", "segment_map"):
            reserved += size
        elif act in ("segment_free", "segment_unmap"):
            reserved -= size
            pending.append(size)
            continue
        elif act == "alloc":
            allocated += size
        elif act == "free_completed":
            allocated -= size
        if pending and act == "alloc":
            shown += 1
            print(f"\n{len(pending)} segments ({sum(pending) / GIB:.2f} GiB) given back, then an allocation of "
                  f"{size / 2 ** 20:.1f} MiB on stream {e.get('stream')} (reserved {reserved / GIB:.2f} GiB, "
                  f"allocated {allocated / GIB:.2f} GiB)\n  {_frames(e, a.depth)}")
            pending = []
    print(f"\n{shown} such allocations; {len(trace)} allocator events recorded")
    big = collections.Counter()
    for e in trace:
        if e["action"] == "alloc" and e.get("size", 0) >= 256 * 2 ** 20:
            big[(e["size"] // 2 ** 20, e.get("stream"), _frames(e, 4))] += 1
    print("\nallocations of 256 MiB and more (MiB, stream, where: count):")
    for (mib, stream, where), n in sorted(big.items(), key=lambda kv: -kv[0][0]):
        print(f"  {mib:7d} MiB  stream {stream}  x{n}  {where}")


if __name__ == "__main__":
    main()
