"""Memory-limited generation: a 262144-vocabulary Llama with its embedding (and head) off the GPU.

Peers, in the same run, on the same random-weight model and the same prompts:

* ``plain``: the whole model on the GPU (HF ``generate``, greedy, KV cache);
* ``maximus emb``: ``maximize(inference=True)``; the embedding table in the CPU tier, a GPU row cache
  of ``--cache-rows`` rows; the LM head on the GPU;
* ``maximus emb+head``: the head too in the CPU tier, streamed ``--chunk-rows`` rows at a time
  (only the last position's logits are computed).

Figures: ms per ``generate`` call, peak GPU GiB during it, GiB resident before it, tokens/s, and the
share of generated tokens equal to the plain model's (bf16; the streamed head computes the same dot
products, but GEMM shapes differ, so a near-tie may flip). Prompts are Zipf-distributed ids
(a frequency-ordered vocabulary: hot ids small), as a token map makes them.

    python -m benchmarks.bench_serving                         # V=262144, d=2048, 4 layers, bf16
    python -m benchmarks.bench_serving --vocab 4096 --hidden 256 --layers 2 --new 8   # CPU smoke run
    python -m benchmarks.bench_serving --also-batch 32 --out serving.md    # + batch 32, same process

Under ``--budget-s`` (70 s) each peer starts only when its estimated cost still fits (else a "skipped"
row); the table(s) are written after every peer.
"""
from __future__ import annotations

import argparse
import copy
import gc
from pathlib import Path

import torch

from benchmarks.harness import GIB, Bench, Budget, default_dtype, progress


def build_model(vocab: int, hidden: int, layers: int, dtype: torch.dtype):
    """The random Llama in CPU memory, in ``dtype``. HF's weight init is skipped (``no_init_weights``);
    the weights are allocated in ``dtype`` and filled with N(0, initializer_range) (norms with 1) on the
    GPU when there is one (1.25B parameters at full size: seconds there, slow on CPU), then moved."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=4096,
                      tie_word_embeddings=False)
    where = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with default_dtype(dtype), torch.device(where), no_init_weights():
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() == 1:
                prm.fill_(1.0)
            else:
                prm.normal_(0.0, cfg.initializer_range)
    return model.to("cpu").eval()


def zipf_prompts(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(p, batch * length, replacement=True, generator=g).view(batch, length)


def maximus_config(cache_rows: int, chunk_rows: int, head: bool) -> dict:
    return {"maximus": {"embedding": {"modules": ["model.embed_tokens"], "gpu_cache_rows": cache_rows},
                        "lm_head": {"enabled": head, "placement": "cpu", "chunk_rows": chunk_rows}}}


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--new", type=int, default=64, help="generated tokens per sequence")
    ap.add_argument("--cache-rows", type=int, default=8192, help="GPU row cache of the embedding")
    ap.add_argument("--chunk-rows", type=int, default=32768, help="rows of the head streamed per transfer")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--also-batch", type=int, default=0, help="then the same peers at this batch, in the same "
                    "process (same model), with --also-new tokens and --also-repeat calls; 0: not")
    ap.add_argument("--also-new", type=int, default=32)
    ap.add_argument("--also-repeat", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=70.0, help="wall-clock budget; peers that no longer fit "
                    "are rows that say so")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table(s) here")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    progress(f"building the model (V={args.vocab}, d={args.hidden}, {args.layers} layers, {args.dtype})")
    base = build_model(args.vocab, args.hidden, args.layers, dtype)
    progress(f"model built; budget {args.budget_s:.0f} s, {budget.left():.0f} s left")
    runs = [(args.batch, args.new, args.repeat)]
    if args.also_batch:
        runs.append((args.also_batch, args.also_new, args.also_repeat))
    texts = []
    for batch, new, repeat in runs:
        texts.append(run_batch(base, args, dev, batch, new, repeat, budget,
                               lambda extra: write(args.out, texts + [extra])))
        write(args.out, texts)
    return "\n\n".join(texts)


def write(out, texts) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n\n".join(texts) + "\n")


# seconds one peer needs on an H200 at full size (model copy, maximize, 1 + repeat generate calls)
PEER_S = {"plain": 5, "maximus emb": 8, "maximus emb+head": 12}


def run_batch(base, args, dev, batch, new, repeat, budget, checkpoint) -> str:
    """The three peers at one batch size; returns the table. ``checkpoint(text)`` after every peer."""
    from ds_maximus.integrations.hf import maximize
    prompts = zipf_prompts(batch, args.prompt, args.vocab).to(dev)
    mask = torch.ones_like(prompts)
    n_tokens = batch * new
    bench = Bench(f"serving_B{batch}", dtype=args.dtype,
                  sizes={"V": args.vocab, "d": args.hidden, "layers": args.layers, "B": batch,
                         "prompt": args.prompt, "new": new, "cache_rows": args.cache_rows,
                         "chunk_rows": args.chunk_rows},
                  notes="greedy generate() with KV cache; peak = max GPU memory allocated during generate; "
                        "resident = allocated before it (weights, row cache)")
    ref_tokens = None
    peers = [("plain", None), ("maximus emb", False), ("maximus emb+head", True)]
    scale = (1.0 if dev.type == "cuda" else 0.1) * max(1.0, batch * new / (8 * 64)) ** 0.5
    for name, head in peers:
        if not budget.allows(PEER_S[name] * scale, f"B{batch} {name}"):
            bench.skip(name)
            checkpoint(bench.checkpoint(None, baseline="plain"))
            continue
        progress(f"B{batch} {name}: start ({budget.left():.0f} s left)")
        model = copy.deepcopy(base)
        if head is not None:
            maximize(model, maximus_config(args.cache_rows, args.chunk_rows, head), inference=True)
        model.to(dev)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        resident = torch.cuda.memory_allocated() / GIB if dev.type == "cuda" else float("nan")
        out = {}

        def run():
            with torch.no_grad():
                out["tokens"] = model.generate(prompts, attention_mask=mask, max_new_tokens=new,
                                               min_new_tokens=new, do_sample=False, pad_token_id=0)
        res = bench.measure(name, run, warmup=1, repeat=repeat, resident_gib=round(resident, 3))
        if res.ms:
            res.extra["tokens/s"] = round(n_tokens / (res.ms / 1e3), 1)
            gen = out["tokens"][:, args.prompt:].cpu()
            if ref_tokens is None:
                ref_tokens = gen
            res.extra["same tokens"] = f"{float((gen == ref_tokens).float().mean()):.3f}"
        progress(f"B{batch} {name}: {f'{res.ms:.1f} ms per generate' if res.ms else res.error}")
        model = out = None
        gc.collect()
        checkpoint(bench.checkpoint(None, baseline="plain"))
    return bench.report(baseline="plain")


if __name__ == "__main__":
    main()
