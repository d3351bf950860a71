"""Start N ranks of a worker script, or N ranks under the ``deepspeed`` launcher.

Ranks are CPU processes with gloo by default. With ``MAXIMUS_TEST_RANKS=cuda`` (the multi-GPU machine:
``scripts/gpu/distributed.sh``) every rank gets its own GPU and the ranks talk NCCL, so the same tests
check the multi-GPU runs.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

ROOT = Path(__file__).resolve().parents[2]


def end_rank(barrier: bool = False) -> None:
    """The end of a rank's worker script, once every result is saved: the process group torn down (after a barrier,
    so that no rank tears it down while another, rank 0 saving, still uses it), the exit handlers run (ds_maximus's
    shared-memory buffers are removed there), then ``os._exit(0)``, without the rest of the interpreter's teardown,
    in which gloo's threads have aborted a rank now and then after a clean run (rc -6, "terminate called without an
    active exception")."""
    import atexit

    import torch
    if torch.distributed.is_initialized():
        if barrier:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_gpus() -> bool:
    """Whether the ranks run on GPUs with NCCL (``MAXIMUS_TEST_RANKS=cuda``) rather than on CPU with gloo."""
    return os.environ.get("MAXIMUS_TEST_RANKS", "cpu") == "cuda"


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                             "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    env["DS_ACCELERATOR"] = "cuda" if on_gpus() else "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def prebuild_ops() -> None:
    """JIT-build the CPU op here, once, before ranks start: N ranks racing to build it (45-90 s on 2 cores)
    inside a rank timeout got killed mid-build and left its lock behind (a CI run did)."""
    from ds_maximus.ops.row_ops import load_op
    load_op("cpu")
    if on_gpus():
        load_op("cuda")


def wait_all(procs: List[subprocess.Popen], deadline: float) -> Tuple[List[int], List[str]]:
    """Wait for ``procs`` (text stdout, stderr merged in) until ``deadline`` (``time.time()``), killing those still
    running then; returns ([returncode per process], [output per process])."""
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n<killed by the test: timeout>"
        outs.append(out)
    return [p.returncode for p in procs], outs


def run_ranks(n: int, script: Path, *args, timeout: float = 120):
    """Run ``script`` as ``n`` ranks; returns ([returncode per rank], [output per rank], seconds)."""
    prebuild_ops()
    port = free_port()
    procs = []
    t0 = time.time()
    for r in range(n):
        env = clean_env()
        env.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    rcs, outs = wait_all(procs, t0 + timeout)
    return rcs, outs, time.time() - t0


def launch(n: int, script: Path, *args, timeout: float = 600):
    """``python -m deepspeed.launcher.runner --num_gpus n script args``; returns its stdout (asserts rc 0)."""
    prebuild_ops()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(n), "--master_port",
           str(free_port()), str(script), *map(str, args)]
    res = subprocess.run(cmd, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout


def launch_nodes(nodes: int, per_node: int, script: Path, *args, timeout: float = 600):
    """Simulate ``deepspeed --hostfile`` with ``nodes`` hosts of ``per_node`` ranks on this machine; returns node 0's
    stdout (asserts every node's rc is 0).

    The multi-node runner logs into each host (pdsh/ssh) and starts ``deepspeed.launcher.launch --world_info=...
    --node_rank=N --master_addr=... --master_port=...`` there; this starts those per-node launchers as local
    processes instead, so every rank gets the environment a real multi-node launch gives it (``RANK`` and
    ``WORLD_SIZE`` over all nodes, ``LOCAL_RANK``/``LOCAL_SIZE`` within its node, ``CROSS_RANK``/``CROSS_SIZE``;
    DeepSpeed's one-host shared-memory allreduce is off since ``LOCAL_SIZE`` < ``WORLD_SIZE``). What it does not
    simulate: the ssh start-up and a network between hosts (the ranks still meet over 127.0.0.1)."""
    import base64
    import json
    prebuild_ops()
    info = {f"node{i}": list(range(per_node)) for i in range(nodes)}
    world_info = base64.urlsafe_b64encode(json.dumps(info).encode()).decode()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                               f"--node_rank={n}", "--master_addr=127.0.0.1", f"--master_port={port}", str(script),
                               *map(str, args)], env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in range(nodes)]
    rcs, outs = wait_all(procs, time.time() + timeout)
    assert rcs == [0] * nodes, "\n".join(o[-4000:] for o in outs)
    return outs[0]
