"""Train a Llama-architecture model (random init) with a large vocabulary under the deepspeed launcher.

    deepspeed --num_gpus 1 examples/train_llama.py --deepspeed_config ds_configs/zero2_cpu_tier.json
    deepspeed --num_gpus 1 examples/train_llama.py --deepspeed_config ds_configs/zero2_cpu_tier.json --plain

With ``--plain`` the same script runs plain ``deepspeed.initialize`` (the "maximus" section is dropped),
for comparison; ``--zero-stage``/``--offload-optimizer``/``--micro-batch`` vary the plain peer, and
``--cap-gib`` caps the process's GPU memory (``torch.cuda.set_per_process_memory_fraction``).

The headline (``ds_configs/llama_262k_16gib.json``, ``benchmarks/bench_headline.py``)::

    python examples/train_llama.py --deepspeed_config ds_configs/llama_262k_16gib.json --vocab 262144 \
        --hidden 2048 --layers 16 --heads 16 --ffn 2816 --seq 2048 --grad-checkpointing --cap-gib 16

Why these sizes: with ffn 2816 the 16 blocks hold 545M params (1.62B with the untied embedding and
head, 1.08B tied). Plain ZeRO-2 keeps ~20-22 B per block param on the GPU at the optimizer step (bf16
params and grads, the fp32 gradient copy, fp32 master, two moments, torch AdamW's temporary):
~11-12 GiB. Gradient checkpointing keeps 16 layer inputs (8 x 2048 x 2048 bf16 = 64 MiB each) plus one
layer's recompute (~1.3 GiB). The embedding (CPU tier, 16K-row GPU cache: 384 MiB) and the head (fp32
master + moments in pinned RAM, 16K-row bf16 chunks streamed, AdamW on the GPU in 4K-row blocks:
~0.7 GiB of staging) add ~1 GiB: ~13 GiB, a ~3 GiB margin under 16 GiB. With ffn 4096 (671M block
params) the margin falls under 1 GiB; offloading the blocks' optimizer too would cost a CPU Adam over
545M params every step (~1 s), far from the throughput target, so the blocks stay on the GPU.
Data: Zipf-distributed ids over a frequency-ordered vocabulary, or real text (``pydoc_data.topics``)
through a tokenizer folder written by ``maximus-tokenizer build`` (``--tokenizer``).
Prints the loss, tokens/s and the maximus stats line.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def parse_args(argv=None):
    import deepspeed
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=65536, help="vocabulary size (ignored with --tokenizer)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=None, help="intermediate size (default 4x hidden rounded)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps")
    ap.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    ap.add_argument("--plain", action="store_true", help="plain deepspeed.initialize (no maximus) for comparison")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (maximus-tokenizer build output)")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of synthetic ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--json-out", default=None, help="write losses and figures to this JSON file (rank 0)")
    ap.add_argument("--cap-gib", type=float, default=None, help="cap this process's GPU memory (GiB)")
    ap.add_argument("--zero-stage", type=int, default=None, help="override zero_optimization.stage")
    ap.add_argument("--offload-optimizer", action="store_true", help="ZeRO optimizer offload to CPU (plain peers)")
    ap.add_argument("--micro-batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    ap.add_argument("--gas", type=int, default=None, help="override gradient_accumulation_steps")
    ap.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the tokens/s figure")
    ap.add_argument("--maximus", action="append", default=[], metavar="KEY=VALUE",
                    help="override one key of the config's maximus section, e.g. lm_head.grad_on_device=bf16 "
                         "(the value is read as JSON when it parses, else as a string; repeatable)")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds of training")
    ap.add_argument("--profile", default=None, help="folder: profile 2 steps after the warm-up (torch.profiler "
                    "tables + chrome trace there) and print per-phase times on the GPU stream")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.add_config_arguments(ap)
    return ap.parse_args(argv)


def make_model(args, vocab: int, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    ffn = args.ffn or max(64, int(args.hidden * 8 / 3) // 64 * 64)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=max(args.seq, 128),
                      tie_word_embeddings=args.tie, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def zipf_stream(vocab: int, batch: int, seq: int, s: float, seed: int, rank: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** s
    p /= p.sum()
    cdf = torch.cumsum(p, 0)
    while True:
        u = torch.rand(batch * seq, generator=g, dtype=torch.float64)
        yield torch.searchsorted(cdf, u).clamp_(max=vocab - 1).view(batch, seq)


def text_stream(tok_dir: str, batch: int, seq: int, rank: int, world: int):
    from pydoc_data.topics import topics

    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    ids = []
    for text in topics.values():
        ids.extend(tok(text)["input_ids"])
    ids = torch.tensor(ids)
    n = (ids.numel() // (batch * seq)) * batch * seq
    chunks = ids[:n].view(-1, batch, seq)
    i = rank
    while True:
        yield chunks[i % chunks.shape[0]]
        i += world


def apply_overrides(ds_cfg: dict, args) -> dict:
    """The command line's variations of the config (plain peers, caps)."""
    if args.plain:
        ds_cfg.pop("maximus", None)
    zero = ds_cfg.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if zero.get("stage", 0) == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        params = ds_cfg.get("optimizer", {}).get("params", {})
        for key in ("torch_adam", "fused", "foreach"):   # DeepSpeedCPUAdam, which takes neither torch option
            params.pop(key, None)
    for item in getattr(args, "maximus", None) or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--maximus wants KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = ds_cfg.setdefault("maximus", {})
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    if args.micro_batch is not None:
        ds_cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.gas is not None:
        ds_cfg["gradient_accumulation_steps"] = args.gas
    ds_cfg.pop("train_batch_size", None)
    return ds_cfg


def main(argv=None):
    args = parse_args(argv)
    if args.cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    try:
        return train(args)
    except torch.cuda.OutOfMemoryError as e:
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"OOM: {str(e).splitlines()[0][:200]} (peak {peak:.2f} GiB)", flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"error": "OOM", "peak_gib": peak}, f)
        raise SystemExit(3)


def train(args):
    import deepspeed

    import ds_maximus
    with open(args.deepspeed_config) as f:
        ds_cfg = apply_overrides(json.load(f), args)
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    vocab = args.vocab
    if args.tokenizer:
        from transformers import PreTrainedTokenizerFast
        vocab = len(PreTrainedTokenizerFast.from_pretrained(args.tokenizer))
    model = make_model(args, vocab)
    n_params = sum(p.numel() for p in model.parameters())
    args.deepspeed_config = None
    engine, _, _, _ = ds_maximus.initialize(args=args, model=model, model_parameters=model.parameters(),
                                            config=ds_cfg)
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    data = (text_stream(args.tokenizer, micro, args.seq, rank, world) if args.tokenizer
            else zipf_stream(vocab, micro, args.seq, args.zipf, args.seed, rank))
    from ds_maximus.integrations.hf import lookahead
    if not args.plain:
        data = lookahead(data, engine.module)
    losses, t_start, tokens, t_train = [], None, 0, time.perf_counter()
    steps_done = 0
    prof, phases = None, []
    cuda = torch.cuda.is_available()

    def mark():
        if not cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    for step in range(args.steps):
        if args.profile and step == args.warmup_steps:
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            prof.__enter__()
        if prof is not None and step == args.warmup_steps + 2:
            _write_profile(prof, args.profile, rank)
            prof = None
        if step == args.warmup_steps:  # skip warm-up (op JIT, allocator) in the throughput figure
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t_start, tokens = time.perf_counter(), 0
        if args.max_seconds and time.perf_counter() - t_train > args.max_seconds and step > args.warmup_steps + 1:
            print(f"stopping at step {step}: --max-seconds {args.max_seconds} reached", flush=True)
            break
        for _ in range(gas):
            ids = next(data)
            if torch.device(engine.device).type == "cuda":
                ids = ids.pin_memory()  # an asynchronous copy: the host does not wait behind queued copies
            ids = ids.to(engine.device, non_blocking=True)
            m0 = mark()
            loss = engine(input_ids=ids, labels=ids).loss
            m1 = mark()
            engine.backward(loss)
            m2 = mark()
            engine.step()
            if args.profile and step >= args.warmup_steps:
                phases.append((m0, m1, m2, mark()))
            tokens += ids.numel() * world
        losses.append(float(loss.detach().float()))
        steps_done = step + 1
        if engine.monitor.enabled and rank == 0:  # the loss beside DeepSpeed's own events (benchmarks.plot --run)
            engine.monitor.write_events([("Train/Samples/train_loss", losses[-1], engine.global_samples)])
        if rank == 0 and (step == 0 or steps_done % args.log_every == 0 or step == args.steps - 1):
            # numbered as the engine's global step (and the maximus stats line): 1 after the first step
            print(f"step {steps_done:4d} loss {losses[-1]:.4f} ({time.perf_counter() - t_train:.1f} s)", flush=True)
    if prof is not None:
        _write_profile(prof, args.profile, rank)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if phases and rank == 0:
        def span(a, b):
            return a.elapsed_time(b) if cuda else (b - a) * 1e3
        names = ("forward", "backward", "step")
        avg = [sum(span(p[i], p[i + 1]) for p in phases) / len(phases) for i in range(3)]
        print("phases (GPU stream, mean of %d micro-steps): " % len(phases)
              + ", ".join(f"{n} {a:.1f} ms" for n, a in zip(names, avg)), flush=True)
    elapsed = time.perf_counter() - t_start if t_start else float("nan")
    tps = tokens / elapsed if t_start else float("nan")
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    peak_txt = f"{peak:.2f} GiB" if peak == peak else "n/a (CPU)"
    if rank == 0:
        print(f"done: {steps_done} steps, {tps:,.0f} tokens/s, peak GPU memory {peak_txt}, "
              f"{'plain DeepSpeed' if args.plain else 'maximus'}", flush=True)
        if not args.plain and getattr(engine, "maximus", None) is not None:
            from ds_maximus.observability import log_stats
            log_stats(engine.maximus, final=True)  # unless the last interval's line was this step's
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"losses": losses, "tokens_per_s": tps, "peak_gib": peak, "steps": steps_done,
                           "params": n_params}, f)
    return losses


def _write_profile(prof, folder: str, rank: int) -> None:
    """Stop ``prof`` and write its tables (self CPU, self CUDA) and a chrome trace into ``folder``."""
    prof.__exit__(None, None, None)
    os.makedirs(folder, exist_ok=True)
    ka = prof.key_averages()
    with open(os.path.join(folder, f"profile_rank{rank}.txt"), "w") as f:
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70) + "\n")
        if torch.cuda.is_available():
            f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70) + "\n")
    prof.export_chrome_trace(os.path.join(folder, f"trace_rank{rank}.json"))
    print(f"profile written to {folder}", flush=True)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # an exit with a live gloo group can abort in teardown (rc -6)
        torch.distributed.destroy_process_group()
