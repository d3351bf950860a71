"""LoRA on the blocks + the full 262K vocabulary trained, under 16 GiB: ours against plain PEFT's ways of doing it.

    python -m benchmarks.bench_peft_vocab --out bench_out/peft_vocab.md            # H200, real shapes, every peer
    python -m benchmarks.bench_peft_vocab --small                                  # CPU, tiny shapes, < 1 min

Commands for one GPU call of 600 s (each peer its own process, the run held to ``--budget-s``):

    python -m benchmarks.bench_peft_vocab --preset gpu600 --out bench_out/peft_vocab.md     # all of the below
    python -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts --batch 4 --steps 6 --warmup 2 --budget-s 560
    python -m benchmarks.bench_peft_vocab --peers curve_ref curve_ours --curve-steps 200 --curve-layers 2 \\
        --curve-vocab 32768 --curve-batch 1 --curve-seq 512 --budget-s 560
    python -m benchmarks.bench_peft_vocab --peers qlora_ours_capped --batch 4 --steps 6 --warmup 2 --budget-s 560

``--preset gpu600`` runs those three in that order: Gemma-3-4B ours capped and plain PEFT uncapped at 4 x 2048
tokens for 6 steps, the 200-step curve on a 2-layer Gemma-3-4B shape with a 32K vocabulary, and ours' Llama-3-8B
QLoRA row (skipped, with the reason, where bitsandbytes does not import); a peer that has under 30 s of the
budget left is a skipped row. The full curve: ``--peers curve_ref curve_ours`` with no ``--curve-*`` sizes.

Every peer runs in its own subprocess (an OOM or a DeepSpeed engine must not poison the next) under a time limit
(``--peer-timeout-s``, and what is left of ``--budget-s``) on the same data (``--batch`` x ``--seq`` Zipf ids a
step, the same seed), bf16 (fp32 in ``--small``), gradient checkpointing, LoRA r=16 on every projection,
DeepSpeed ZeRO-2 with fp32 masters of the trained parameters and torch AdamW. ``--peers`` picks the peers.
The capped peers call ``torch.cuda.set_per_process_memory_fraction`` for ``--cap-gib`` (no cap on the CPU).

Gemma-3-4B shape (vocab 262,144, hidden 2560, 34 layers, ffn 10240, 8 heads / 4 KV heads, head_dim 256, tied):

1. ``peft_mts``: PEFT ``modules_to_save=["embed_tokens", "lm_head"]``, uncapped: the reference;
2. ``peft_mts_capped``: the same under the cap (expected: OOM);
3. ``peft_mts_liger_capped``: the same + Liger's fused linear cross-entropy (no full logits), capped;
4. ``peft_tti_capped``: PEFT ``trainable_token_indices`` (only the ``--new-rows`` newest rows trained), capped;
5. ``ours_capped``: ds_maximus: the embedding's rows a maximus row store with exact sparse AdamW, the head tied
   to it (``ensure_weight_tying``), the loss streamed, the frozen original in host memory; capped.

The loss curve (``--curve-steps``, default 200; ``--curve-layers`` / ``--curve-vocab`` / ``--curve-batch`` /
``--curve-seq`` shrink it to fit a call), the same model on both sides so that the curves can be compared step
by step:

6. ``curve_ref``: plain PEFT with ours' LoRA config (``modules_to_save=["embed_tokens"]``,
   ``ensure_weight_tying=True``: one tied table), DeepSpeed bf16 with fp32 masters, uncapped;
7. ``curve_ours``: ours, capped. The run prints the mean relative difference of the two curves (target <= 0.005).

Llama-3-8B shape with a 262,144 vocabulary (hidden 4096, 32 layers, ffn 14336, 32 heads / 8 KV heads, untied),
QLoRA blocks (every block Linear a bitsandbytes 4-bit NF4 ``Linear4bit``, then PEFT's
``prepare_model_for_kbit_training``; the rows skip with the reason when bitsandbytes or CUDA is missing):

8. ``qlora_peft_mts_capped``: PEFT ``modules_to_save=["embed_tokens", "lm_head"]`` (expected: OOM);
9. ``qlora_ours_capped``: ours, the untied head on the CPU tier (``lm_head.placement: cpu``).

Columns: ms per step, peak GiB, tokens/s, ratio to the reference's tokens/s (``peft_mts``; ``curve_ref`` for
``curve_ours``), last loss beside the reference's, and the mean relative difference of the loss curve from the
reference's (same seed and data).
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
import warnings
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30

SHAPES = {
    "gemma3_4b": dict(family="gemma3", vocab=262144, hidden=2560, layers=34, ffn=10240, heads=8, kv=4, head_dim=256,
                      tied=True),
    "llama3_8b_262k": dict(family="llama", vocab=262144, hidden=4096, layers=32, ffn=14336, heads=32, kv=8,
                           head_dim=128, tied=False),
    "gemma3_small": dict(family="gemma3", vocab=4096, hidden=64, layers=2, ffn=128, heads=4, kv=2, head_dim=16,
                         tied=True),
    "llama3_small": dict(family="llama", vocab=4096, hidden=64, layers=2, ffn=128, heads=4, kv=2, head_dim=16,
                         tied=False),
}
# peer -> (shape key in full / small mode, PEFT variant, maximus?, capped?, QLoRA?)
PEERS = {
    "peft_mts": ("gemma3", "mts", False, False, False),
    "peft_mts_capped": ("gemma3", "mts", False, True, False),
    "peft_mts_liger_capped": ("gemma3", "mts_liger", False, True, False),
    "peft_tti_capped": ("gemma3", "tti", False, True, False),
    "ours_capped": ("gemma3", "ours", True, True, False),
    "curve_ref": ("gemma3", "tied", False, False, False),
    "curve_ours": ("gemma3", "ours", True, True, False),
    "qlora_peft_mts_capped": ("llama", "mts", False, True, True),
    "qlora_ours_capped": ("llama", "ours", True, True, True),
}
REFERENCE = "peft_mts"
# the peer a peer's loss curve is compared with (same model, same data)
CURVE_REFERENCE = {"curve_ours": "curve_ref", **{p: REFERENCE for p, v in PEERS.items()
                                                 if v[0] == "gemma3" and not p.startswith("curve_")}}
# the options a peer's process gets from the driver
FORWARDED = ("batch", "seq", "steps", "warmup", "profile", "trace", "layers", "cap_gib", "new_rows", "cache_rows",
             "chunk_rows", "reuse_rows", "keep_grad_buffer", "bucket_elems", "lr",
             "curve_steps", "curve_layers", "curve_vocab", "curve_batch", "curve_seq")


def _shape(family: str, small: bool) -> dict:
    return SHAPES[{("gemma3", False): "gemma3_4b", ("llama", False): "llama3_8b_262k",
                   ("gemma3", True): "gemma3_small", ("llama", True): "llama3_small"}[(family, small)]]


# ---- one peer, in its own process --------------------------------------------------------------------------------
def _missing(peer: str) -> Optional[str]:
    """Why ``peer`` cannot run on this machine (None when it can)."""
    import importlib.util

    import torch
    variant, qlora = PEERS[peer][1], PEERS[peer][4]
    if qlora and not torch.cuda.is_available():
        return "skipped: QLoRA needs CUDA (bitsandbytes 4-bit)"
    if qlora and importlib.util.find_spec("bitsandbytes") is None:
        return "skipped: bitsandbytes is not installed (pip install bitsandbytes)"
    if variant == "mts_liger" and importlib.util.find_spec("liger_kernel") is None:
        return "skipped: liger-kernel is not installed (pip install liger-kernel)"
    if variant == "mts_liger" and not torch.cuda.is_available():
        return "skipped: Liger's fused linear cross-entropy is a Triton kernel (CUDA)"
    return None


def _build(shape: dict, dtype, qlora: bool, liger: bool):
    """The model in ``dtype`` (built in it: no fp32 copy of 4-8B parameters first) on the GPU where there is one,
    as ``from_pretrained(..., device_map="cuda")`` would leave it; a QLoRA model as ``from_pretrained`` with a
    ``BitsAndBytesConfig(load_in_4bit=True)`` leaves it: its blocks' Linears 4-bit NF4 on the GPU (their bf16 weights
    would not fit under the cap), the embedding, head and norms on the host (:func:`_build_qlora`)."""
    import torch
    dev = "cuda" if torch.cuda.is_available() and not qlora else "cpu"
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_gemma3_text
        apply_liger_kernel_to_gemma3_text(fused_linear_cross_entropy=True, cross_entropy=False)
    common = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape["kv"], head_dim=shape["head_dim"], max_position_embeddings=8192,
                  tie_word_embeddings=shape["tied"])
    from benchmarks.harness import default_dtype
    torch.manual_seed(0)
    if qlora:
        return _build_qlora(common, dtype)
    with default_dtype(dtype), torch.device(dev):
        if shape["family"] == "gemma3":
            from transformers import Gemma3ForCausalLM, Gemma3TextConfig
            model = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=1024,
                                                       final_logit_softcapping=30.0, attn_implementation="sdpa"))
        else:
            from transformers import LlamaConfig, LlamaForCausalLM
            model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
    model.to(dtype)
    return model


def _build_qlora(common: dict, dtype):
    """The Llama-shaped QLoRA model, built without a bf16 copy of its blocks anywhere: the skeleton on the meta
    device, then each block Linear's random bf16 weight drawn on the GPU and quantized there to a bitsandbytes 4-bit
    NF4 Linear (one Linear's bf16 weight at a time), and the embedding, head and norms materialised on the host
    (drawn on the GPU, copied down). DeepSpeed places the tables (plain PEFT), or they become maximus rows (ours).
    Drawing 8B parameters with the host's ``normal_`` and quantizing them from there took minutes."""
    import bitsandbytes as bnb
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from benchmarks.harness import default_dtype
    config = LlamaConfig(**common, attn_implementation="sdpa")
    with default_dtype(dtype), torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    std = config.initializer_range

    def draw(*shape):
        return torch.empty(*shape, dtype=dtype, device="cuda").normal_(0.0, std, generator=gen)

    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and ".layers." in name:
            q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=False, compute_dtype=dtype,
                                  quant_type="nf4", device="meta")
            q.weight = bnb.nn.Params4bit(draw(mod.out_features, mod.in_features), requires_grad=False,
                                         quant_type="nf4")
            q.cuda()                                     # quantizes; the bf16 draw is freed with the old data
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, q)
        elif isinstance(mod, (nn.Embedding, nn.Linear)):  # the tables
            mod.weight = nn.Parameter(draw(*mod.weight.shape).cpu())
        elif hasattr(mod, "weight") and isinstance(mod.weight, nn.Parameter) and mod.weight.is_meta:  # norms
            mod.weight = nn.Parameter(torch.ones(mod.weight.shape, dtype=dtype))
    with torch.device("cpu"):
        model.model.rotary_emb = LlamaRotaryEmbedding(config=config)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise RuntimeError(f"QLoRA build left tensors on the meta device: {meta[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.is_loaded_in_4bit = True
    return model


def _peft(model, shape: dict, variant: str, new_rows: int):
    from peft import LoraConfig, get_peft_model
    kw = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"])
    if variant == "tti":
        kw["trainable_token_indices"] = {"embed_tokens": list(range(shape["vocab"] - new_rows, shape["vocab"]))}
    elif variant in ("ours", "tied") and shape["tied"]:
        kw.update(modules_to_save=["embed_tokens"], ensure_weight_tying=True)   # one table, the head reads it
    else:
        kw["modules_to_save"] = ["embed_tokens", "lm_head"]                      # PEFT's way: unties a tied head
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, LoraConfig(**kw))


def _ds_config(a, shape: dict, ours: bool, bf16: bool, batch: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.0, "betas": [0.9, 0.95],
                                                     "eps": 1e-8, "torch_adam": True}},
           "zero_optimization": {"stage": 2 if bf16 else 0}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if bf16:  # only LoRA (and PEFT's copies) train: DeepSpeed's default 5e8-element buckets would hold ~2 GiB idle
        cfg["zero_optimization"].update(reduce_bucket_size=a.bucket_elems, allgather_bucket_size=a.bucket_elems)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if ours:
        cfg["maximus"] = {"embedding": {"min_rows": shape["vocab"], "gpu_cache_rows": a.cache_rows,
                                        "optimizer": {"mode": "exact"}},
                          "lm_head": {"enabled": True, "chunk_rows": min(a.chunk_rows, shape["vocab"]),
                                      "placement": "gpu" if shape["tied"] else "cpu",
                                      "reuse_rows": a.reuse_rows or "auto"},
                          "logging": {"interval_steps": 10**6}}
    return cfg


def zipf_batches(vocab: int, batch: int, seq: int, steps: int, s: float = 1.1, seed: int = 1):
    """The same ``steps`` batches of Zipf ids for every peer (hot ids small, a long tail)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** s
    return [torch.multinomial(p, batch * seq, replacement=True, generator=g).view(batch, seq) for _ in range(steps)]


def run_peer(a) -> dict:
    """Train one peer ``a.steps`` steps; returns its figures (or an ``error``: OOM, a missing package)."""
    import torch
    reason = _missing(a.peer)
    if reason:
        return {"error": reason}
    family, variant, ours, capped, qlora = PEERS[a.peer]
    shape = dict(_shape(family, a.small))
    steps, batch, seq = a.steps, a.batch, a.seq
    shape["layers"] = a.layers or shape["layers"]
    if a.peer.startswith("curve_"):
        steps, batch, seq = a.curve_steps, a.curve_batch or a.batch, a.curve_seq or a.seq
        shape["layers"] = a.curve_layers or shape["layers"]
        shape["vocab"] = a.curve_vocab or shape["vocab"]
    cuda = torch.cuda.is_available()
    bf16 = cuda and not a.small
    dtype = torch.bfloat16 if bf16 else torch.float32
    if capped and cuda:
        from benchmarks.harness import cap_gpu
        cap_gpu(a.cap_gib)
    try:
        model = _build(shape, dtype, qlora, variant == "mts_liger")
        if qlora:   # what a QLoRA recipe does: norms (and the tables) to fp32, gradient checkpointing on
            from peft import prepare_model_for_kbit_training
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                    gradient_checkpointing_kwargs={"use_reentrant": False})
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model = _peft(model, shape, variant, a.new_rows)
        params = [p for p in model.parameters() if p.requires_grad]
        trainable = sum(p.numel() for p in params)
        import deepspeed

        import ds_maximus
        init = ds_maximus.initialize if ours else deepspeed.initialize
        if ours and a.keep_grad_buffer:
            from ds_maximus.vocab.sharded_embedding import ShardedEmbedding
            ShardedEmbedding.KEEP_GRAD_BUFFER = a.keep_grad_buffer == "on"
        engine, *_ = init(model=model, model_parameters=params, config=_ds_config(a, shape, ours, bf16, batch))
        data = zipf_batches(shape["vocab"], batch, seq, steps)
        # the timed steps run back to back, as in a training run, with one device sync before and after them: work
        # a step leaves on side streams (ours: the step of the rows outside the cache) overlaps the next step
        warmup = a.warmup if a.warmup < len(data) else 0
        losses = []
        t0 = None
        # ours as a user runs it (the loader ds_maximus.initialize returns, or hf.lookahead): one batch ahead, so a
        # batch's rows are in the cache before the step ahead of it ends and its lookup waits for no copy
        from ds_maximus.integrations.hf import lookahead
        batches = lookahead(data, engine.module) if ours else data
        # DeepSpeed skips the first steps while their gradients are not finite (4 at the Gemma-3-4B shape in bf16,
        # for plain PEFT and ours alike): a skipped step moves no optimizer state, so the clock starts after
        # ``warmup`` steps and after a step DeepSpeed applied, and the skipped timed steps are reported
        first = prev = int(getattr(engine, "skipped_steps", 0))
        settled, start, at_start = True, None, None
        for i, ids in enumerate(batches):
            if start is None and i >= warmup and settled:
                if cuda:
                    torch.cuda.synchronize()
                t0, start, at_start = time.perf_counter(), i, prev
                mem0 = _alloc_counts(cuda)
            losses.append(_train_step(engine, ids))
            now = int(getattr(engine, "skipped_steps", 0))
            settled, prev = now == prev, now
        if cuda:
            torch.cuda.synchronize()
        if start is None:
            return {"error": f"no step to time: DeepSpeed skipped every step from {warmup} on (non-finite "
                             "gradients); give more --steps", "losses": losses}
        ms = 1e3 * (time.perf_counter() - t0) / (len(data) - start)
        retries, syncs = (now - before for before, now in zip(mem0, _alloc_counts(cuda)))
        peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
        skipped_timed = prev - at_start
        if at_start > first or skipped_timed:
            print(f"{a.peer}: DeepSpeed skipped {at_start - first} steps before the timed steps {start}-"
                  f"{len(data) - 1} and {skipped_timed} among them", file=sys.stderr, flush=True)
        if a.profile:
            _profile_step(engine, data[-1], a.peer, cuda)
        if a.trace and cuda:
            _trace_steps(engine, data[-a.trace:], a.peer, ours)
        return {"ms": ms, "tokens_per_s": batch * seq / (ms / 1e3), "peak_gib": peak, "losses": losses,
                "trainable_m": trainable / 1e6, "timed_from": start, "skipped_timed": skipped_timed,
                "alloc_retries": retries, "alloc_syncs": syncs}
    except torch.cuda.OutOfMemoryError:
        return {"error": "OOM", "peak_gib": torch.cuda.max_memory_allocated() / GIB}


def _alloc_counts(cuda: bool):
    """``(retries, syncs)`` of the CUDA caching allocator so far: allocations that found no room under the cap and were
    retried after freeing its cached memory, and the times it waited for every stream to do that (each a host wait
    for all queued GPU work, copies on side streams included)."""
    import torch
    if not cuda:
        return 0, 0
    st = torch.cuda.memory_stats()
    return st.get("num_alloc_retries", 0), st.get("num_sync_all_streams", 0)


def _train_step(engine, ids, phase=None) -> float:
    """One step (forward, backward, optimizer step, each a profiler range); returns the loss. ``phase``: a context
    manager factory entered around each phase with its name, the loss read (``"loss read"``) included (the host
    tools in ``scripts/gpu/step_watch.py``)."""
    import contextlib

    import torch
    around = phase or (lambda name: contextlib.nullcontext())
    ids = ids.to(engine.device)
    with torch.profiler.record_function("bench.forward"), around("forward"):
        loss = engine(input_ids=ids, labels=ids).loss
    with torch.profiler.record_function("bench.backward"), around("backward"):
        engine.backward(loss)
    with torch.profiler.record_function("bench.step"), around("step"):
        engine.step()
    with around("loss read"):
        return float(loss.detach().float())


def _profile_step(engine, ids, peer: str, cuda: bool) -> None:
    """``--profile``: one more step (not timed, not in the losses) under ``torch.profiler``; the ops' table, by self
    device time (self CPU time on the CPU) and by total CPU time, goes to ``$MAXIMUS_BENCH_OUT/profile_<peer>.txt``
    (default ``bench_out/``): where a step's time goes, phase by phase (``bench.forward`` / ``backward`` /
    ``step``) and op by op."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        _train_step(engine, ids)
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    out = Path(os.environ.get("MAXIMUS_BENCH_OUT", ROOT / "bench_out")) / f"profile_{peer}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    by_self = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    out.write_text(f"# {peer}: one step under torch.profiler, ops by {by_self}\n"
                   + table.table(sort_by=by_self, row_limit=40)
                   + "\n# by cpu_time_total (the phases bench.forward / bench.backward / bench.step among them)\n"
                   + table.table(sort_by="cpu_time_total", row_limit=40))


def _trace_steps(engine, data, peer: str, ours: bool) -> None:
    """``--trace N``: N more steps, run as the timed ones are (back to back, ours one batch ahead), under
    ``torch.profiler``; the chrome trace goes to ``$MAXIMUS_BENCH_OUT/trace_<peer>.json.gz`` and its per-stream
    timeline and the compute stream's idle gaps (``benchmarks.trace_timeline``) to ``timeline_<peer>.txt``: what the
    GPU waits for in a steady-state step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import trace_timeline
    from ds_maximus.integrations.hf import lookahead
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for ids in (lookahead(data, engine.module) if ours else data):
            _train_step(engine, ids)
        torch.cuda.synchronize()
    out = Path(os.environ.get("MAXIMUS_BENCH_OUT", ROOT / "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    path = str(out / f"trace_{peer}.json.gz")
    prof.export_chrome_trace(path)
    ev = trace_timeline.load(path)
    (out / f"timeline_{peer}.txt").write_text(f"# {peer}: {len(data)} steps under torch.profiler\n"
                                              + trace_timeline.gaps(ev, min_ms=0.5, top=40) + "\n\n"
                                              + trace_timeline.timeline(ev, bucket_ms=20.0) + "\n\n"
                                              + trace_timeline.phases(ev, min_ms=1.0) + "\n")


# ---- the driver ----------------------------------------------------------------------------------------------------
def _spawn(peer: str, a, timeout_s: float) -> dict:
    from benchmarks.harness import free_port, progress
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peer.json")
        cmd = [sys.executable, "-m", "benchmarks.bench_peft_vocab", "--peer", peer, "--json-out", out]
        for k in FORWARDED:
            if getattr(a, k) is not None:
                cmd += ["--" + k.replace("_", "-"), str(getattr(a, k))]
        cmd += ["--small"] if a.small else []
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
        progress(f"{peer}: start (time limit {timeout_s:.0f} s)")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, cwd=str(ROOT))
        timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        tail: List[str] = []
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-8:]
        rc = proc.wait()
        timer.cancel()
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        err = "OOM" if any("OutOfMemory" in ln or "out of memory" in ln for ln in tail) else \
            f"exit {rc}" + (" (time cap)" if rc in (-9, 137) else "")
        progress(f"{peer}: {err}: " + " / ".join(tail[-3:])[:400])
        return {"error": err}


def _curve_diff(losses: List[float], ref: List[float]) -> Optional[float]:
    n = min(len(losses), len(ref))
    if not n:
        return None
    return sum(abs(x - r) / abs(r) for x, r in zip(losses[:n], ref[:n])) / n


# ``--preset gpu600``: one GPU call of 600 s (the lead's): the Gemma-3-4B rows at 6 steps, the curve at a reduced
# size, the QLoRA row (skipped, with its reason, where bitsandbytes does not import)
PRESETS = {
    "gpu600": dict(peers=["ours_capped", "peft_mts", "curve_ref", "curve_ours", "qlora_ours_capped"], batch=4,
                   steps=6, warmup=2, curve_steps=200, curve_layers=2, curve_vocab=32768, curve_batch=1,
                   curve_seq=512, budget_s=560.0, peer_timeout_s=200.0),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU (a smoke test, < 1 min)")
    ap.add_argument("--preset", choices=list(PRESETS), default=None,
                    help="a set of the options below (given options win): gpu600 fits one 600 s GPU call")
    ap.add_argument("--peers", nargs="*", default=None, choices=list(PEERS), help="the peers to run (default: all)")
    ap.add_argument("--batch", type=int, default=None, help="sequences a step (default 8; 2 with --small)")
    ap.add_argument("--seq", type=int, default=None, help="tokens a sequence (default 2048; 32 with --small)")
    ap.add_argument("--steps", type=int, default=None, help="steps a peer (default 200; 3 with --small)")
    ap.add_argument("--warmup", type=int, default=None, help="first steps left out of the timing")
    ap.add_argument("--curve-steps", type=int, default=None,
                    help="steps of the curve_ref / curve_ours loss curves (default 200; 3 with --small)")
    ap.add_argument("--curve-layers", type=int, default=None, help="decoder layers of the curve's model (default: "
                    "the shape's)")
    ap.add_argument("--curve-vocab", type=int, default=None, help="vocabulary of the curve's model (default: the "
                    "shape's; every row of a tied table is stepped every step, so this sets a curve step's cost)")
    ap.add_argument("--curve-batch", type=int, default=None, help="sequences a curve step (default --batch)")
    ap.add_argument("--curve-seq", type=int, default=None, help="tokens a curve sequence (default --seq)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of every peer's model but the curve's (default: the shape's; fewer keep the "
                         "vocabulary's cost and shrink the blocks', e.g. for --profile)")
    ap.add_argument("--profile", type=int, default=None,
                    help="1: each peer runs one more step under torch.profiler, its table in "
                         "$MAXIMUS_BENCH_OUT/profile_<peer>.txt")
    ap.add_argument("--trace", type=int, default=None,
                    help="N: each peer runs N more steps (as the timed ones run) under torch.profiler; the trace "
                         "and its timeline and compute-stream gaps in $MAXIMUS_BENCH_OUT/{trace,timeline}_<peer>.*")
    ap.add_argument("--cap-gib", type=float, default=16.0)
    ap.add_argument("--new-rows", type=int, default=2048, help="rows trainable_token_indices trains (the newest)")
    ap.add_argument("--cache-rows", type=int, default=16384,
                    help="maximus GPU row cache (rows; a step of 8x2048 tokens touches fewer distinct rows)")
    ap.add_argument("--chunk-rows", type=int, default=8192, help="vocabulary rows a chunk of our streamed loss")
    ap.add_argument("--reuse-rows", choices=("auto", "on", "off"), default=None,
                    help="ours: maximus.lm_head.reuse_rows (default auto)")
    ap.add_argument("--keep-grad-buffer", choices=("on", "off"), default=None,
                    help="ours: a tied head's [V, d] gradient memory kept from step to step "
                         "(ShardedEmbedding.KEEP_GRAD_BUFFER; default on)")
    ap.add_argument("--bucket-elems", type=int, default=50_000_000,
                    help="ZeRO-2 reduce/allgather bucket (elements), every bf16 peer alike")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--peer-timeout-s", type=float, default=None, help="time limit of one peer's process "
                    "(default 1800)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="time limit of the whole run: a peer gets what is left (at most --peer-timeout-s), a peer "
                         "with under 30 s left is skipped")
    ap.add_argument("--out", default=None, help="markdown file for the table")
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for k, v in PRESETS.get(a.preset, {}).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    defaults = dict(batch=2, seq=32, steps=3, warmup=1, curve_steps=3) if a.small else \
        dict(batch=8, seq=2048, steps=200, warmup=5, curve_steps=200)
    defaults.update(peers=list(PEERS), peer_timeout_s=1800.0)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.small:
        a.new_rows, a.cache_rows = min(a.new_rows, 256), min(a.cache_rows, 512)
    if a.peer:
        res = run_peer(a)
        with open(a.json_out, "w") as f:
            json.dump(res, f)
        return 0

    from benchmarks.harness import Budget, progress
    budget = Budget(a.budget_s if a.budget_s is not None else float("inf"))
    results = {}
    for peer in a.peers:
        reason = _missing(peer)
        if reason is None and budget.left() < 30:
            reason = f"skipped: {budget.left():.0f} s left of --budget-s {a.budget_s:g}"
        results[peer] = {"error": reason} if reason else _spawn(peer, a, min(a.peer_timeout_s, budget.left() - 5))
        res = results[peer]
        progress(f"{peer}: " + (res.get("error") or f"{res['ms']:.1f} ms/step, timed from step "
                                f"{res.get('timed_from')}, {res.get('skipped_timed', 0)} of them skipped, "
                                f"allocator retries {res.get('alloc_retries')}, waits for all streams "
                                f"{res.get('alloc_syncs')}"))
        _bench(a, results).checkpoint(a.out)   # every row so far, ratios against the references run so far
    tail = _curve_line(results)
    text = _bench(a, results).table() + ("\n\n" + tail if tail else "")
    print(text, flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return 0


def _bench(a, results: dict):
    """The table of ``results`` (peer -> figures), in the order the peers ran."""
    from benchmarks.harness import Bench
    sizes = {"tokens/step": f"{a.batch}x{a.seq}", "steps": a.steps, "cap": f"{a.cap_gib:g} GiB",
             "shapes": "gemma3_small/llama3_small" if a.small else "Gemma-3-4B / Llama-3-8B-262K",
             "curve": f"{a.curve_steps} steps, {a.curve_batch or a.batch}x{a.curve_seq or a.seq} tokens"
                      + (f", {a.curve_layers} layers" if a.curve_layers else "")
                      + (f", vocab {a.curve_vocab}" if a.curve_vocab else "")}
    bench = Bench("peft_vocab", dtype="fp32" if a.small else "bf16", sizes=sizes,
                  notes=f"LoRA r=16 on every projection; gradient checkpointing; Zipf ids; loss diff = mean relative "
                        f"difference of the loss curve from its reference's ({REFERENCE}; curve_ref for curve_ours)")
    for peer, res in results.items():
        _add_row(bench, peer, res, results)
    return bench


def _add_row(bench, peer: str, res: dict, results: dict) -> None:
    if "error" in res:
        bench.add(peer, None, res.get("peak_gib"), error=res["error"])
        return
    curve_ref = results.get(CURVE_REFERENCE.get(peer, ""), {})
    diff = _curve_diff(res["losses"], curve_ref["losses"]) if curve_ref.get("losses") else None
    # throughput against the run of the same shape and sizes: peft_mts, or curve_ref for curve_ours
    ref = curve_ref if peer in CURVE_REFERENCE else {}
    ratio = res["tokens_per_s"] / ref["tokens_per_s"] if ref.get("tokens_per_s") else None
    bench.add(peer, res["ms"], res.get("peak_gib"),
              **{"tokens/s": round(res["tokens_per_s"], 1),
                 "tokens/s vs ref": round(ratio, 3) if ratio is not None else "-",
                 "last loss": round(res["losses"][-1], 4),
                 "ref last loss": round(curve_ref["losses"][-1], 4) if curve_ref.get("losses") else "-",
                 "loss diff": round(diff, 5) if diff is not None else "-",
                 "trainable M": round(res["trainable_m"], 1)})


def _curve_line(results: dict) -> str:
    """The loss-curve verdict: ours against plain PEFT with fp32 masters, the same model, data and seed."""
    ours, ref = results.get("curve_ours", {}), results.get("curve_ref", {})
    if not (ours.get("losses") and ref.get("losses")):
        return ""
    diff = _curve_diff(ours["losses"], ref["losses"])
    n = min(len(ours["losses"]), len(ref["losses"]))
    return (f"loss curve, curve_ours vs curve_ref over {n} steps: mean relative difference {diff:.5f} "
            f"(target <= 0.005: {'met' if diff <= 0.005 else 'NOT met'}); last losses "
            f"{ours['losses'][-1]:.4f} vs {ref['losses'][-1]:.4f}")


if __name__ == "__main__":
    sys.exit(main())
