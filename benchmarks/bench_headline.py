"""The headline: a 262K-vocabulary Llama trains in 16 GiB where plain DeepSpeed cannot.

    python -m benchmarks.bench_headline --out bench_out/headline.md          # H200, ~4-5 min
    python -m benchmarks.bench_headline --cpu                                 # tiny sizes, smoke test

Every configuration runs ``examples/train_llama.py`` in its own subprocess (an OOM or a DeepSpeed
engine must not poison the next), under a per-configuration time cap, with its output streamed here
line by line. The capped ones call ``torch.cuda.set_per_process_memory_fraction`` (``--cap-gib``):

1. plain DeepSpeed ZeRO-2, 16 GiB cap                      (expected: OOM)
2. maximus ZeRO-2 (ds_configs/llama_262k_16gib.json), 16 GiB cap
3. plain ZeRO-2 without a cap: the speed reference
4. plain ZeRO-2 + CPU optimizer offload, 16 GiB cap         (the logits alone: OOM or slow)
5. plain ZeRO-3 + CPU parameter/optimizer offload, 16 GiB cap
6. with ``--curve-steps N``: N steps of maximus (capped) and plain ZeRO-2 (uncapped) with the same
   seed and data, at ``--curve-*`` sizes; the loss curves are compared against the stated tolerance.

Data: 8 x 2048-token batches of Zipf ids (``--zipf``), the same for every peer. The table (one row per
configuration: ms per optimizer step, peak GiB, tokens/s, ratio to the uncapped reference) is
rewritten as each row completes.

Tolerance of the loss-curve match (exact mode, bf16): the peers differ only in rounding (the streamed
head accumulates the weight gradient in fp32 where plain DeepSpeed keeps bf16; the logits are never
rounded to bf16): per step ``|loss_maximus - loss_plain| <= 0.02 * loss_plain`` and the mean absolute
difference over the curve ``<= 0.005 * mean loss``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

from benchmarks.harness import Bench, Budget, free_port, progress

ROOT = Path(__file__).resolve().parent.parent
STEP_TOL, MEAN_TOL = 0.02, 0.005


def run_config(name: str, cli: List[str], timeout_s: float, env_extra: Optional[dict] = None) -> dict:
    """Run ``examples/train_llama.py cli`` in a subprocess; returns its JSON (or ``{"error": ...}``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-u", str(ROOT / "examples" / "train_llama.py"), *cli, "--json-out", out_json]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
               **(env_extra or {})}
        progress(f"{name}: {' '.join(cli)}")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, cwd=str(ROOT))
        timed_out = threading.Event()

        def _kill():
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        timer = threading.Timer(timeout_s, _kill)
        timer.start()
        tail: List[str] = []
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-6:]
            if any(k in line for k in ("step ", "done:", "OOM", "Error", "error", "maximus step", "stopping")):
                print(f"    | {line[:200]}", flush=True)
        rc = proc.wait()
        timer.cancel()
        wall = time.monotonic() - t0
        if os.path.exists(out_json):
            with open(out_json) as f:
                res = json.load(f)
        elif timed_out.is_set():
            res = {"error": f"timed out after {timeout_s:.0f} s"}
        else:
            last = next((l for l in reversed(tail) if l.strip()), "")
            res = {"error": f"rc={rc}: {last[:120]}"}
        res["wall_s"] = wall
        progress(f"{name}: {res.get('error') or 'ok'} ({wall:.0f} s)")
        return res


def _model_cli(a, sizes: dict) -> List[str]:
    cli = ["--deepspeed_config", a.config, "--vocab", str(sizes["vocab"]), "--hidden", str(sizes["hidden"]),
           "--layers", str(sizes["layers"]), "--heads", str(sizes["heads"]), "--ffn", str(sizes["ffn"]),
           "--seq", str(sizes["seq"]), "--micro-batch", str(sizes["micro"]), "--zipf", str(a.zipf),
           "--seed", str(a.seed), "--log-every", str(a.log_every)]
    if a.grad_checkpointing:
        cli.append("--grad-checkpointing")
    return cli


def _add_row(bench: Bench, name: str, res: dict, sizes: dict, ref_tps: Optional[float]):
    tps = res.get("tokens_per_s")
    tok_step = sizes["micro"] * sizes["seq"]
    if res.get("error") or tps is None or tps != tps:
        return bench.add(name, None, res.get("peak_gib"), error=res.get("error", "no figure"),
                         **{"tokens/s": "-", "vs uncapped plain": "-", "wall s": round(res.get("wall_s", 0))})
    ratio = f"{tps / ref_tps:.2f}x" if ref_tps else "-"
    return bench.add(name, 1e3 * tok_step / tps, res.get("peak_gib"),
                     **{"tokens/s": round(tps), "vs uncapped plain": ratio, "wall s": round(res.get("wall_s", 0))})


def compare_curves(a_losses: List[float], b_losses: List[float]) -> dict:
    """Per-step and mean deviation of curve ``a`` from reference ``b``, judged against the stated tolerance."""
    n = min(len(a_losses), len(b_losses))
    if n == 0:
        return {"steps": 0, "ok": False}
    diffs = [abs(x - y) for x, y in zip(a_losses[:n], b_losses[:n])]
    rel = [d / max(abs(y), 1e-6) for d, y in zip(diffs, b_losses[:n])]
    mean_ref = sum(abs(y) for y in b_losses[:n]) / n
    mean_abs = sum(diffs) / n
    return {"steps": n, "max_abs": max(diffs), "max_rel": max(rel), "mean_abs": mean_abs,
            "mean_rel": mean_abs / max(mean_ref, 1e-6), "first": (a_losses[0], b_losses[0]),
            "last": (a_losses[n - 1], b_losses[n - 1]),
            "ok": max(rel) <= STEP_TOL and mean_abs <= MEAN_TOL * mean_ref}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "ds_configs" / "llama_262k_16gib.json"))
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (smoke test; no caps, no offload)")
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per speed configuration")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    ap.add_argument("--cap-gib", type=float, default=16.0)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--no-grad-checkpointing", dest="grad_checkpointing", action="store_false")
    ap.add_argument("--config-timeout-s", type=float, default=100, help="time cap of one configuration")
    ap.add_argument("--offload-timeout-s", type=float, default=75, help="time cap of an offload configuration")
    ap.add_argument("--no-offload", action="store_true", help="leave out the CPU-offload peers")
    ap.add_argument("--tie", action="store_true", help="also run maximus with the head tied to the embedding")
    ap.add_argument("--maximus-variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="also run maximus with these maximus-section overrides (a row each; repeatable), "
                         "e.g. lm_head.grad_on_device=bf16")
    ap.add_argument("--curve-steps", type=int, default=0, help="loss-curve comparison over this many steps")
    ap.add_argument("--curve-hidden", type=int, default=1024)
    ap.add_argument("--curve-layers", type=int, default=4)
    ap.add_argument("--curve-ffn", type=int, default=2816)
    ap.add_argument("--curve-seq", type=int, default=512)
    ap.add_argument("--curve-maximus", action="append", default=[], metavar="KEY=VALUE",
                    help="maximus override for the loss curve's maximus run (as train_llama --maximus)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting configurations after this")
    ap.add_argument("--out", default=None, help="markdown table path (rewritten as rows complete)")
    a = ap.parse_args(argv)
    if a.cpu:
        a.vocab, a.hidden, a.layers, a.heads, a.ffn, a.seq, a.micro = 4096, 64, 2, 4, 128, 32, 2
        a.curve_hidden, a.curve_layers, a.curve_ffn, a.curve_seq = 64, 2, 128, 32
        a.no_offload = True
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    if not a.cpu and torch.cuda.is_available():  # our CUDA op before any time-limited configuration (~70 s cold)
        from ds_maximus.ops.row_ops import load_op
        load_op("cuda")
    budget = Budget(a.budget_s)
    sizes = dict(vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads, ffn=a.ffn, seq=a.seq, micro=a.micro)
    cap = [] if a.cpu else ["--cap-gib", str(a.cap_gib)]
    base = _model_cli(a, sizes) + ["--steps", str(a.steps), "--warmup-steps", str(a.warmup)]
    bench = Bench("headline", dtype="bf16", sizes={**sizes, "steps": a.steps, "cap_GiB": a.cap_gib},
                  notes=f"config {Path(a.config).name}; grad checkpointing {a.grad_checkpointing}; Zipf {a.zipf} ids; "
                        f"each configuration in its own process, capped ones via set_per_process_memory_fraction")
    tail: List[str] = []

    def save():
        bench.checkpoint(a.out, tail="\n".join(tail))

    plan = [("plain ZeRO-2, 16 GiB cap", base + cap + ["--plain"], a.config_timeout_s),
            ("maximus ZeRO-2, 16 GiB cap", base + cap, a.config_timeout_s)]
    for variant in a.maximus_variant:
        over = [x for item in variant.split(",") if item for x in ("--maximus", item)]
        plan.append((f"maximus ZeRO-2, 16 GiB cap, {variant}", base + cap + over, a.config_timeout_s))
    if a.tie:
        plan.append(("maximus ZeRO-2 tied head, 16 GiB cap", base + cap + ["--tie"], a.config_timeout_s))
    plan.append(("plain ZeRO-2, no cap (reference)", base + ["--plain"], a.config_timeout_s))
    if not a.no_offload:
        plan += [("plain ZeRO-2 + CPU optimizer offload, 16 GiB cap",
                  base + cap + ["--plain", "--offload-optimizer"], a.offload_timeout_s),
                 ("plain ZeRO-3 + CPU param/optimizer offload, 16 GiB cap",
                  base + cap + ["--plain", "--zero-stage", "3", "--offload-optimizer"], a.offload_timeout_s)]
    results = {}
    for name, cli, limit in plan:
        if not budget.allows(min(limit, 40), name):
            bench.skip(name)
            save()
            continue
        results[name] = run_config(name, cli, min(limit, max(30.0, budget.left())))
        save()
    ref = results.get("plain ZeRO-2, no cap (reference)", {}).get("tokens_per_s")
    bench.results.clear()
    for name, _, _ in plan:
        if name in results:
            _add_row(bench, name, results[name], sizes, ref if ref == ref else None)
        else:
            bench.skip(name)
    for name, mx in results.items():
        if not name.startswith("maximus ZeRO-2, 16 GiB cap") or not (ref and mx.get("tokens_per_s")):
            continue
        r = mx["tokens_per_s"] / ref
        label = "maximus under the cap" + name[len("maximus ZeRO-2, 16 GiB cap"):]
        tail.append(f"\n{label}: {r:.2f}x the tokens/s of uncapped plain ZeRO-2 (target >= 0.90x): "
                    f"{'MET' if r >= 0.9 else 'NOT MET'}")
    save()

    if a.curve_steps:
        csizes = dict(sizes, hidden=a.curve_hidden, layers=a.curve_layers, ffn=a.curve_ffn, seq=a.curve_seq,
                      heads=max(1, a.curve_hidden // 128) if not a.cpu else a.heads)
        ccli = _model_cli(a, csizes) + ["--steps", str(a.curve_steps), "--log-every", "50"]
        curves = {}
        mx_over = [x for item in a.curve_maximus for x in ("--maximus", item)]
        for name, extra in (("maximus", cap + mx_over), ("plain", ["--plain"])):
            if not budget.allows(30, f"loss curve ({name})"):
                break
            curves[name] = run_config(f"loss curve: {name}", ccli + extra, max(30.0, budget.left()))
        if len(curves) == 2 and "losses" in curves["maximus"] and "losses" in curves["plain"]:
            c = compare_curves(curves["maximus"]["losses"], curves["plain"]["losses"])
            tail.append(
                "\n### loss curve: maximus (capped) vs plain ZeRO-2 (uncapped), same seed and data\n"
                + (f"maximus overrides: {', '.join(a.curve_maximus)}\n" if a.curve_maximus else "")
                + f"sizes: vocab {a.vocab}, hidden {csizes['hidden']}, layers {csizes['layers']}, ffn {csizes['ffn']}, "
                f"{csizes['micro']} x {csizes['seq']} tokens, {c['steps']} steps\n\n"
                f"| first loss (maximus / plain) | last loss | max abs diff | max rel diff | mean abs diff | "
                f"mean rel diff | within tolerance |\n|---|---|---|---|---|---|---|\n"
                f"| {c['first'][0]:.4f} / {c['first'][1]:.4f} | {c['last'][0]:.4f} / {c['last'][1]:.4f} | "
                f"{c['max_abs']:.4f} | {c['max_rel']:.4f} | {c['mean_abs']:.4f} | {c['mean_rel']:.5f} | "
                f"{'yes' if c['ok'] else 'NO'} |\n\ntolerance: per step rel <= {STEP_TOL}, mean rel <= {MEAN_TOL}")
        else:
            tail.append("\nloss curve: not completed (" + "; ".join(
                f"{k}: {v.get('error', 'ok')}" for k, v in curves.items()) + ")")
        save()
    text = bench.checkpoint(a.out, tail="\n".join(tail))
    print(text, flush=True)
    return bench


if __name__ == "__main__":
    main()
