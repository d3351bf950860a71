"""The host expert op on the H200 host: why a C++ argument error crashed the test process there, and how its time
scales with the thread count (the kernel table's 1-token rows did not scale past the 2-core VM's figures).

    python scripts/gpu/probe_expert_cpu.py [--repeat 15]

1. the host: logical CPUs, threads per core, NUMA nodes (lscpu);
2. the op's build flags (its build.ninja under TORCH_EXTENSIONS_DIR);
3. a C++ argument error (expert shapes that disagree) raised in a child process, for the expert op and for the row
   op's CPU build: the child's exit code and the last lines of its stderr (a crash shows as a negative code);
4. one Mixtral expert (H 4096, F 14336) at 1, 2 and 8 tokens, bf16, int4 and int2 (group 64, with the decode each
   call takes: ``expert_cpu.quant_decode``), ours and torch's bf16 ``linear``, at each thread count: min and median
   ms of ``--repeat`` runs after 3 warm-ups.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

THROW = {
    "expert_cpu": "import torch; from ds_maximus.ops import expert_cpu as e; w = torch.randn(8, 4).bfloat16(); "
                  "e.swiglu(torch.randn(1, 4), w, w, w)",
    "expert_cpu_features": "import torch; from ds_maximus.ops import expert_cpu as e; "
                           "w = torch.randn(8, 4).bfloat16(); e.linear(torch.randn(1, 5), w)",
    # the op itself (the Python face refuses these first): does a C++ argument error reach Python on this host?
    "op_direct": "import torch; from ds_maximus.ops import expert_cpu as e; w = torch.randn(8, 4).bfloat16(); "
                 "e.load_op().linear_dense(torch.randn(1, 5), w)",
    "python_check": "import torch; torch.ones(2) @ torch.ones(3)",
}


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout


def timed(fn, repeat: int):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return min(ts), statistics.median(ts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", default="16,8,4")
    a = p.parse_args()
    print("## host\n" + sh("lscpu | grep -E 'Model name|^CPU\\(s\\)|Thread|Core|Socket|NUMA|L3|Flags' | cut -c1-200"))
    from ds_maximus.ops import expert_cpu
    expert_cpu.load_op()
    ext = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "")) / "maximus_expert_cpu" / "build.ninja"
    if ext.is_file():
        print("## build.ninja\n" + "\n".join(ln[:600] for ln in ext.read_text().splitlines()
                                             if ln.startswith(("cflags", "ldflags", "cxx", "post_cflags"))))
    print("## C++ argument errors in a child process")
    gdb = sh("command -v gdb").strip()
    for name, code in THROW.items():
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"))
        print(f"- {name}: rc {r.returncode}: {' | '.join(r.stderr.strip().splitlines()[-3:])[:400]}")
        if r.returncode < 0 and gdb:
            bt = subprocess.run([gdb, "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c", code],
                                capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"))
            print("  gdb:\n" + "\n".join("    " + ln for ln in bt.stdout.splitlines()[-30:]))
    if not gdb:
        print("(no gdb on this host)")

    from ds_maximus.experts.quant import quantize
    H, F = 4096, 14336
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(2 * F, H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(H, F, generator=g) * 0.02).to(torch.bfloat16)
    q13, q2 = quantize(w13, 4, 64), quantize(w2, 4, 64)
    q1, q3 = q13.rows(0, F), q13.rows(F, 2 * F)
    p13, p2 = quantize(w13, 2, 64), quantize(w2, 2, 64)
    p1, p3 = p13.rows(0, F), p13.rows(F, 2 * F)
    print("\n## one Mixtral expert on the host: min / median ms")
    print("| threads | tokens | ours bf16 | ours int4 | ours int2 | torch bf16 linear | int4 / int2 decode |\n"
          "|---|---|---|---|---|---|---|")
    for n in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(n)
        for T in (1, 2, 8):
            x = torch.randn(T, H, generator=g).to(torch.bfloat16).float()
            xb = x.to(torch.bfloat16)

            def torch_expert():
                h = torch.nn.functional.linear(xb, w13)
                return torch.nn.functional.linear(torch.nn.functional.silu(h[:, :F]) * h[:, F:], w2)
            cells = [timed(lambda: expert_cpu.swiglu(x, w13[:F], w13[F:], w2), a.repeat),
                     timed(lambda: expert_cpu.swiglu(x, q1, q3, q2), a.repeat),
                     timed(lambda: expert_cpu.swiglu(x, p1, p3, p2), a.repeat), timed(torch_expert, a.repeat)]
            decode = f"{expert_cpu.quant_decode(4, 64)} / {expert_cpu.quant_decode(2, 64)}"
            print(f"| {n} | {T} | " + " | ".join(f"{lo:.2f} / {med:.2f}" for lo, med in cells) + f" | {decode} |",
                  flush=True)


if __name__ == "__main__":
    main()
