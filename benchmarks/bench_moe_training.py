"""Training tokens/s of MoE layers whose experts (with their optimizer state) do not fit on the GPU.

    python -m benchmarks.bench_moe_training                      # Mixtral-shaped: H=4096, F=14336, 8 experts, top-2
    python -m benchmarks.bench_moe_training --fine-grained       # 64 experts, top-4 (F=1792: the same expert bytes)
    python -m benchmarks.bench_moe_training --tiny               # a CPU-sized smoke run of every peer

The model is a stack of ``--layers`` Mixtral decoder layers (small vocabulary, bf16 on GPU), built on
the CPU without HF's weight init and filled once with random weights on every core. Every peer runs in
its own subprocess (its own memory cap, a clean DeepSpeed, an OOM is a row), under one ``--budget-s``
and at most ``--slot-s`` each; the table is written after every peer. A peer's output streams into
this log, prefixed with its key and seconds, with ``PHASE`` lines (imports, model build, initialize,
warm-up / timed steps) and ds_maximus's set-up lines; a timeout or OOM row names the phase it hit.

Peers, same model, same batches:
  * all on GPU: plain DeepSpeed ZeRO-2, no memory cap (the ceiling, when it fits);
  * DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on CPU, GPU capped at ``--cap-gib``;
  * the same without a cap (``zero3_offload_nocap``): where ZeRO-3 offload runs out of memory under the
    cap, its speed with all the memory it wants, and the peak it needed (a ratio against it is the
    conservative one: the peer had more memory than ours);
  * ours (``ds_maximus.initialize`` with ``"moe": {"train": true}``), ZeRO-2 for the dense part, capped
    the same: the optimizer step on the GPU (``optimizer_device: compute``), on the CPU (``cpu``), and on
    both at once (``split``: the share of each follows their measured speeds; ``ours_split`` with
    ``overlap_step: true``, the step running on into the next forward layer by layer, ``ours_split_sync``
    without).
The cap (``torch.cuda.set_per_process_memory_fraction``, default 2 x the experts' bf16 bytes: 15.8 GiB
for 3 Mixtral-shaped layers) holds the experts' bf16 weights but not with their fp32 masters, gradients
and AdamW moments (16 B per parameter: 63 GiB; all on GPU peaks at 90 GiB). Smaller caps, 0.9 x (7.1 GiB)
and 1.5 x (11.8 GiB), leave ZeRO-3 offload out of memory in its first step (it gathers whole fused expert
stacks, 1.75 GiB each, and keeps the activations), so no ratio can be formed (docs/bench/moe_training.md).
Every peer reports its peak GPU memory, so "at no more GPU memory" is visible. ZeRO-3 builds its model under
``deepspeed.zero.Init`` (parameters offloaded as made; DeepSpeed would otherwise move the whole model to the
GPU in ``initialize``). Host RAM: ~14 B per expert parameter for ours (fp32
master + moments, bf16 copy; the model's own bf16 copy is freed once copied), more for ZeRO-3 offload
(+ fp32 gradients): 3 Mixtral-shaped layers (4.2B expert parameters) need ~60-90 GB.
Set-up on a 16-core GPU host, estimated: ~25-35 s to the first step for ours with 3 layers (imports
~6 s, random init ~3 s, the 51 GB tier + 8.5 GB bf16 copy faulted in and pinned ~10-20 s, copies ~1 s,
DeepSpeed ~5 s), then steps of a few seconds; scripts/gpu/moe_training.sh sets the per-peer slots.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.harness import Bench, Budget, cuda_memory_report, free_port, observed
from benchmarks.moe_model import build_model

PEERS = {  # in run order: the baseline and ours first, so a short budget still gives the ratio
    "DeepSpeed ZeRO-3 + offload_param/offload_optimizer cpu": "zero3_offload",
    "ours (experts in CPU tier, AdamW on GPU)": "ours_compute",
    "ours (experts in CPU tier, AdamW split GPU/CPU, step overlapping the next forward)": "ours_split",
    "ours (experts in CPU tier, AdamW split GPU/CPU, step not overlapped)": "ours_split_sync",
    "all on GPU (DeepSpeed ZeRO-2, no cap)": "gpu",
    "ours (experts in CPU tier, AdamW on CPU)": "ours_cpu",
    "DeepSpeed ZeRO-3 + offload_param/offload_optimizer cpu, no cap": "zero3_offload_nocap",
}
UNCAPPED = {"gpu", "zero3_offload_nocap"}  # the peers that run without --cap-gib (the ceiling, and where ZeRO-3 fits)
BASELINE = "DeepSpeed ZeRO-3 + offload_param/offload_optimizer cpu"
BASELINE_NOCAP = BASELINE + ", no cap"


def _baseline(bench) -> str:
    """The ratio column's reference: ZeRO-3 offload under the cap, or without it when the capped run failed."""
    ok = {r.name for r in bench.results if r.ms}
    return BASELINE if BASELINE in ok or BASELINE_NOCAP not in ok else BASELINE_NOCAP


def ds_config(a, kind, bf16):
    cfg = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": a.gas,
           "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 2}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if kind.startswith("zero3_offload"):
        cfg["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    elif not torch.cuda.is_available():
        cfg["optimizer"]["params"]["torch_adam"] = True  # no fused-Adam JIT on a CPU smoke run
    if kind.startswith("ours"):
        cfg["maximus"] = {"embedding": {"enabled": False}, "logging": {"interval_steps": 10**6},
                          "moe": {"enabled": True, "train": True, "gpu_experts_per_layer": a.slots,
                                  "gpu_grad_experts": a.grad_experts or _grad_experts(a),
                                  "step_chunk_bytes": 256 << 20,
                                  "optimizer_device": {"ours_cpu": "cpu", "ours_split": "split",
                                                       "ours_split_sync": "split"}.get(kind, "compute"),
                                  "overlap_step": kind != "ours_split_sync",
                                  "speculative_prefetch": True}}
        if a.state_experts and kind.startswith("ours_split"):
            cfg["maximus"]["moe"]["gpu_state_experts"] = a.state_experts
        if a.cpu_share is not None:
            cfg["maximus"]["moe"]["cpu_step_share"] = a.cpu_share
    return cfg


GRAD_SHARE_OF_CAP = 0.25
# host-memory bytes an element of the CPU side's fused AdamW pass: fp32 master and moments read and written (24), the
# bf16 gradient read (2) and the bf16 compute copy written with streaming stores (2); 2 more with an fp32 gradient
CPU_OP_BYTES = 28


def _grad_experts(a) -> int:
    """Ours' default ``gpu_grad_experts``: the fp32 expert gradients that fit in a quarter of the cap (a
    gradient kept on the GPU crosses PCIe neither to the host nor back for the step). Counted at the fp32 size;
    one micro-batch's gradient stays bf16 through the clip scaling (ExpertGrads), so they take half that, which
    leaves room for more (the measured peaks and step times per count: docs/bench/moe_training.md)."""
    grad_bytes = 3 * a.hidden * a.ffn * 4
    return max(1, int(GRAD_SHARE_OF_CAP * a.cap_gib * 2**30 // grad_bytes))


T0 = time.perf_counter()


def phase(name: str) -> None:
    """A child's phase begins: one ``PHASE`` line the parent echoes to its log and names on a timeout."""
    print(f"PHASE {time.perf_counter() - T0:.1f} {name}", flush=True)


def _log_to_stdout() -> None:
    """ds_maximus's INFO lines (the expert tier's allocation and copies) into the child's output, timed."""
    import logging
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(relativeCreated)8.0f ms %(name)s: %(message)s"))
    lg = logging.getLogger("ds_maximus")
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    lg.propagate = False


def run_peer(a, kind) -> dict:
    """One peer in this process: build, train ``--warmup`` + ``--steps`` steps, return its figures."""
    phase("imports")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)  # the parent gives each child a free port (_child); a hand-run --peer takes one
    import deepspeed
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401  (seconds of import: not the model build)

    import ds_maximus
    _log_to_stdout()
    cuda = torch.cuda.is_available()
    if cuda and kind not in UNCAPPED and a.cap_gib:  # the same cap for every offloading peer
        from benchmarks.harness import cap_gpu
        fraction = cap_gpu(a.cap_gib)
        print(f"GPU cap {a.cap_gib} GiB ({fraction:.3f} of the device)", flush=True)
    dtype = torch.bfloat16 if cuda else torch.float32
    phase("model build")
    cfg = ds_config(a, kind, cuda)
    zero3 = kind.startswith("zero3_offload")
    if zero3:
        deepspeed.init_distributed()
    model = build_model(a, dtype, cfg if zero3 else None)
    phase("ds_maximus.initialize (experts into the CPU tier)" if kind.startswith("ours") else "deepspeed.initialize")
    fn = ds_maximus.initialize if kind.startswith("ours") else deepspeed.initialize
    engine, *_ = fn(model=model, model_parameters=model.parameters(), config=cfg)
    if kind.startswith("ours"):
        _LIVE["moe"] = engine.maximus.modules["moe"]
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=g) for _ in range(4)]
    dev = engine.device

    def step(i):
        for j in range(a.gas):
            ids = data[(i * a.gas + j) % len(data)].to(dev)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        return float(loss.detach().float())

    for i in range(a.warmup):
        phase(f"warm-up step {i + 1}/{a.warmup}")
        step(i)
    moe = engine.maximus.modules["moe"] if kind.startswith("ours") else None
    if moe is not None and cuda:  # where the cap goes: ours' own buffers beside everything torch holds
        use = {k: round(v / 2**30, 2) for k, v in moe.device_bytes().items()}
        print(f"DEVICE GiB after warm-up: {use}, all allocated {torch.cuda.memory_allocated() / 2**30:.2f}, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)
    if moe is not None:  # the window starts as a synchronous step's would: no warm-up step still running
        moe.finish_step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # the timed steps, traced on the GPU (--trace) and profiled on the host (--profile: where a step's seconds go)
    with observed(f"{a.trace}_{kind}.json" if a.trace else None, a.profile):
        t0 = time.perf_counter()
        for i in range(a.steps):
            phase(f"timed step {i + 1}/{a.steps}")
            loss = step(i)
        if moe is not None:  # a split step runs on into the next forward: the last one's tail is timed too
            last = dict(moe.stats()["last_step"])
            moe.finish_step()
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / a.steps
    phase("done")
    out = {"ms": dt * 1e3, "tokens/s": a.micro_batch * a.seq * a.gas / dt, "loss": round(loss, 4),
           "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
    if moe is not None:
        s = last
        if "cpu_step_share" in s:
            out["CPU share"] = round(s["cpu_step_share"], 2)
        if "split_sides" in s:  # the last finished step's two sides: where a split step's time goes
            sd = s["split_sides"]
            out["sides ms: CPU/device (experts)"] = (f"{sd['cpu_ms']:.0f}/{sd['device_ms']:.0f} "
                                                      f"({sd['cpu_experts']}/{sd['device_experts']})")
            # host memory: the link's bytes (each lands in or leaves it) and the CPU op's pass
            host = s["bytes_moved"] + sd["cpu_experts"] * 3 * a.hidden * a.ffn * CPU_OP_BYTES
            out["host GB/step (est.)"] = f"{host / 1e9:.1f} ({host / dt / 1e9:.0f} GB/s)"
        out.update({"experts moved/step": s["experts_loaded"], "MB moved/step": round(s["bytes_moved"] / 1e6, 1),
                    "hit rate": round(s["hit_rate"], 3), "stall ms": round(s["stall_ms"], 1),
                    "step ms": round(s["step_ms"], 1), "wait ms": round(s["step_wait_ms"], 1)})
        if "step_parts_ms" in s:  # the step's host time: the last step's finish, the cache's sync, this one's issue
            out["step ms: finish/sync/issue"] = "/".join(f"{v:.1f}" for v in s["step_parts_ms"].values())
    return out


_LIVE: dict = {}  # ours' MoE module while a peer runs: what an out-of-memory report names


def _child(a, kind, timeout_s):
    """Run peer ``kind`` in a subprocess; its output goes to this log as it comes (prefixed with the peer
    and the seconds since its start), and a timeout names the phase it was in."""
    import collections
    import signal
    import threading
    cmd = [sys.executable, "-u", "-m", "benchmarks.bench_moe_training", "--peer", kind] + a.passthrough
    start = time.perf_counter()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1"}  # its own process group, whatever this process's environment holds
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         start_new_session=True, env=env)
    seen = {"phase": "start-up", "since": start, "result": None, "oom": False}
    tail = collections.deque(maxlen=40)

    def pump():
        for line in p.stdout:
            line = line.rstrip("\n")
            print(f"  [{kind} {time.perf_counter() - start:6.1f}s] {line}", flush=True)
            if line.startswith("PHASE "):
                seen["phase"], seen["since"] = line.split(" ", 2)[2], time.perf_counter()
            elif line.startswith("RESULT "):
                seen["result"] = json.loads(line[7:])
            else:
                tail.append(line)
                seen["oom"] |= "out of memory" in line.lower()
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        p.wait(timeout=max(5.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        reader.join(5)
        now = time.perf_counter()
        return {"error": f"timeout after {now - start:.0f} s in {seen['phase']} ({now - seen['since']:.0f} s)"}
    reader.join(10)
    where = f" in {seen['phase']}"
    res = seen["result"]
    if res is not None:
        if "error" in res:
            res["error"] += where
        return res
    if seen["oom"]:
        return {"error": f"OOM{where}"}
    lines = [ln for ln in tail if ln.strip()]
    msg = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return {"error": f"rc={p.returncode}{where}: {msg.strip()[-100:]}"}


def prebuild_ops(keys) -> None:
    """JIT-build the peers' ops here, before any time slot starts (a cold build inside a peer's slot took
    the slot: ~70 s for our CUDA op, 40-90 s for DeepSpeed's Adam ops): ours' row-update op, DeepSpeed's
    fused Adam (the dense part's optimizer on a GPU) and CPU Adam (ZeRO-3 offload). Never under a timeout:
    a killed build leaves its lock."""
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if any(k.startswith("ours") for k in keys):
        from ds_maximus.ops.row_ops import load_op
        load_op("cuda" if cuda else "cpu")
        if cuda and any(k in keys for k in ("ours_cpu", "ours_split", "ours_split_sync")):
            load_op("cpu")
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    if any(k.startswith("zero3_offload") for k in keys):
        CPUAdamBuilder().load()
    if cuda and any(not k.startswith("zero3_offload") for k in keys):
        FusedAdamBuilder().load()
    print(f"ops ready in {time.perf_counter() - t0:.0f} s", flush=True)


def _slots(spec: str, keys) -> dict:
    """``--slot-s``: ``"90"`` -> every peer 90 s; ``"zero3_offload=120,ours_compute=80"`` -> those two only."""
    if "=" not in spec:
        return {k: float(spec) for k in keys}
    out = dict((k.strip(), float(v)) for k, v in (item.split("=", 1) for item in spec.split(",") if item))
    unknown = sorted(set(out) - set(PEERS.values()))
    if unknown:
        raise SystemExit(f"--slot-s names unknown peers {unknown}; peers are {sorted(PEERS.values())}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--slots", type=int, default=2, help="GPU expert slots per layer (ours; scripts/gpu/moe_training.sh "
                   "gives 4 to the Mixtral shape: 14.5 GiB peak under the 15.8 GiB cap, fewer loads)")
    p.add_argument("--grad-experts", type=int, default=None, help="expert gradients kept on the GPU (ours; "
                   "default: as many fp32 gradients as fit in a quarter of --cap-gib)")
    p.add_argument("--state-experts", type=int, default=0, help="ours_split*: moe.gpu_state_experts, experts whose "
                   "fp32 master and moments stay on the GPU (12 B a parameter each)")
    p.add_argument("--cpu-share", type=float, default=None, help="ours_split*: a fixed moe.cpu_step_share "
                   "(default: measured, so that both sides finish together)")
    p.add_argument("--cap-gib", type=float, default=None, help="GPU memory cap of the offloading peers "
                   "(default: 2 x the experts' bf16 bytes: their weights fit, their training state does not)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fine-grained", action="store_true", help="64 experts, top-4, F=1792")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized smoke run")
    p.add_argument("--peers", default=",".join(PEERS.values()), help="comma-separated peer keys")
    p.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget of the whole run (every peer)")
    p.add_argument("--slot-s", default="100", help="most seconds a peer may take (it is killed after and its row "
                   "names the phase it was in), so a slow baseline leaves time to the others: one number for every "
                   "peer, or 'key=s,key=s' (peers not named get the rest of the budget)")
    p.add_argument("--out", default=None)
    p.add_argument("--trace", default=None, metavar="PREFIX", help="write a torch.profiler chrome trace (CUDA only) "
                   "of the timed steps of each peer to PREFIX_<peer>.json (read it with benchmarks.trace_timeline)")
    p.add_argument("--profile", action="store_true", help="cProfile the timed steps of each peer (PROFILE lines)")
    p.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.passthrough = [x for x in (argv if argv is not None else sys.argv[1:])]
    if a.tiny:
        a.hidden, a.ffn, a.vocab, a.seq, a.micro_batch, a.warmup, a.steps = 64, 96, 128, 32, 2, 1, 2
    if a.fine_grained:
        a.experts, a.top_k, a.ffn = 64, 4, a.ffn // 8
    expert_gib = 3 * a.hidden * a.ffn * a.experts * a.layers * 2 / 2**30
    if a.cap_gib is None:
        a.cap_gib = max(1.0, round(2.0 * expert_gib, 1))
    if a.peer is not None:
        try:
            res = run_peer(a, a.peer)
        except torch.cuda.OutOfMemoryError as e:
            print(str(e).splitlines()[0] if str(e) else "CUDA out of memory", flush=True)
            moe = _LIVE.get("moe")
            cuda_memory_report("OOM MEMORY", {"ours": moe.device_bytes()} if moe is not None else None)
            res = {"error": "OOM"}
        print("RESULT " + json.dumps(res), flush=True)
        sys.stderr.flush()
        os._exit(0)  # the figures are out: skip tearing down tens of GB of pinned tiers and DeepSpeed's state
    keys = [k for k in a.peers.split(",") if k]
    prebuild_ops(keys)
    budget = Budget(a.budget_s)
    bench = Bench("moe_training", dtype="bf16" if torch.cuda.is_available() else "fp32",
                  sizes={"layers": a.layers, "H": a.hidden, "F": a.ffn, "E": a.experts, "top_k": a.top_k,
                         "tokens/step": a.micro_batch * a.seq * a.gas, "expert GiB (bf16)": round(expert_gib, 2),
                         "cap GiB": a.cap_gib if set(keys) - UNCAPPED else "none", "slots/layer": a.slots,
                         **({"state experts": a.state_experts} if a.state_experts else {})},
                  notes="ms = one optimizer step (a split step that overlaps the next forward: none runs when the "
                        "clock starts, the last one's tail is timed; "
                        "step ms: host time in the expert step (finish/sync/issue: the last step's finish, the expert "
                        "cache's copies in flight, issuing this one), wait ms: the forward's waits for the last step's "
                        "updates); offloading peers capped with set_per_process_memory_fraction")
    slots = _slots(a.slot_s, keys)
    names = {v: k for k, v in PEERS.items()}
    for i, key in enumerate(keys):
        name = names[key]

        def peer(name=name, key=key):
            res = _child(a, key, min(slots.get(key, float("inf")), budget.left() - 5))
            if "error" in res:
                bench.add(name, None, error=res["error"])
                return
            ms = res.pop("ms")
            peak = res.pop("peak GiB")
            bench.add(name, ms, peak, **res)
        bench.run_budgeted(name, peer, need_s=20 if a.tiny else 40, budget=budget)
        bench.checkpoint(a.out, baseline=_baseline(bench))
    bench.report(baseline=_baseline(bench))
    if a.out:
        bench.checkpoint(a.out, baseline=_baseline(bench))


if __name__ == "__main__":
    main()
