"""Batch-1 decode of a Mixtral-shaped MoE whose experts do not stay on the GPU.

    python -m benchmarks.bench_moe_offload                 # 8 layers, H=4096, F=14336, 8 experts, top-2, bf16
    python -m benchmarks.bench_moe_offload --small         # a CPU-sized smoke run

Peers, same run, same random weights and prompt:
  * full model on GPU (HF generate, no offload): the ceiling;
  * accelerate cpu_offload, or, where accelerate is not installed, a plain hooks baseline that copies
    every expert of a layer to the GPU before the layer runs and drops it after (labelled so);
  * ours, LRU cache, prefetch off (the mixtral-offloading design);
  * ours, LRU cache + speculative prefetch (top-k, and top-1).
Beside each offloaded row: hit rate, prefetch precision/recall, GB moved per token and the PCIe bound
``H2D_GBPS / bytes per token`` from the measured miss bytes.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import Bench
from ds_maximus.moe import offload_experts

H2D_GBPS = 55.0  # pinned host-to-device on the H200 machine, GB/s


class _Clock:
    """A generate() streamer that timestamps tokens: decode rate excludes the prefill."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def decode_tokens_per_s(self) -> float:
        t = self.times[2:]  # [0] = prompt, [1] = first new token (after prefill)
        return (len(t)) / (t[-1] - self.times[1]) if len(t) >= 1 else 0.0


def build(args, device):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                        num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
                        num_local_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
                        max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = MixtralForCausalLM._from_config(cfg, dtype=args.dtype)
    return model.eval()


def decode(model, ids, tokens):
    clock = _Clock()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                   streamer=clock)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock.decode_tokens_per_s()


def run_peer(bench, name, model, ids, tokens, handle=None, **extra):
    try:
        decode(model, ids, 2)                        # warm-up (kernels, allocator, cache)
        if handle is not None:
            handle.reset_stats()
        tps = decode(model, ids, tokens)
    except Exception as e:  # a peer that cannot run is a row
        bench.add(name, None, error=f"{type(e).__name__}: {str(e)[:60]}")
        return None
    row = {"tokens/s": round(tps, 2)}
    if handle is not None:
        st = handle.stats()
        per_tok = st["bytes_moved"] / max(st["tokens"], 1)
        row.update({"hit rate": round(st["hit_rate"], 3), "prefetch prec": round(st["prefetch_precision"], 3),
                    "prefetch recall": round(st["prefetch_recall"], 3), "GB/token": round(per_tok / 1e9, 3),
                    "PCIe bound tok/s": round(H2D_GBPS * 1e9 / per_tok, 2) if per_tok else "-",
                    "stall ms": round(st["stall_ms"], 1)})
    row.update(extra)
    bench.add(name, 1e3 / tps if tps else None, None, **row)
    return tps


def hooks_baseline(model, device):
    """Experts on pinned CPU; a pre-hook copies a layer's experts to the GPU, a post-hook drops them."""
    from ds_maximus.moe.adapters import find_moe_blocks
    handles = []
    for b in find_moe_blocks(model):
        ex = b.experts
        cpu = {n: getattr(ex, n).data.to("cpu").pin_memory() if device.type == "cuda" else getattr(ex, n).data.cpu()
               for n in ("gate_up_proj", "down_proj")}
        for n, t in cpu.items():
            getattr(ex, n).data = t

        def pre(mod, inp, cpu=cpu):
            for n, t in cpu.items():
                getattr(mod, n).data = t.to(device, non_blocking=True)

        def post(mod, inp, out, cpu=cpu):
            for n, t in cpu.items():
                getattr(mod, n).data = t
        handles += [ex.register_forward_pre_hook(pre), ex.register_forward_hook(post)]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return handles


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--baseline-tokens", type=int, default=6, help="tokens for the slow move-every-layer peer")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--small", action="store_true", help="a small CPU-sized model (smoke test)")
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.small:
        args.layers, args.hidden, args.ffn, args.vocab, args.tokens, args.baseline_tokens = 4, 256, 512, 1024, 16, 4
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(args, device)
    expert_gib = 3 * args.hidden * args.ffn * args.experts * args.layers * (2 if device.type == "cuda" else 4) / 2**30
    bench = Bench("moe_offload", dtype=str(args.dtype).replace("torch.", ""),
                  sizes={"layers": args.layers, "H": args.hidden, "F": args.ffn, "E": args.experts,
                         "top_k": args.top_k, "slots/layer": args.slots, "expert GiB": round(expert_gib, 1),
                         "decode tokens": args.tokens, "batch": 1},
                  notes=f"tokens/s = decode only (after prefill); ms = 1000 / tokens/s; PCIe bound at "
                        f"{H2D_GBPS:.0f} GB/s pinned H2D from the measured bytes moved per token")
    ids = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1)).to(device)

    run_peer(bench, "full model on GPU (HF generate)", model, ids, args.tokens)
    try:
        import accelerate  # noqa: F401
        acc = "installed (not run: the hooks row below is the same design)"
    except ImportError:
        acc = "not installed"
    bench.add(f"accelerate cpu_offload: {acc}", None, error="-")
    hooks = hooks_baseline(model, device)
    run_peer(bench, "hooks: copy every expert of a layer per forward (pinned)", model, ids, args.baseline_tokens)
    for h in hooks:
        h.remove()
    handle = offload_experts(model, {"gpu_experts_per_layer": args.slots, "speculative_prefetch": False})
    run_peer(bench, "ours: LRU cache, prefetch off (mixtral-offloading design)", model, ids, args.tokens, handle)
    handle.speculative_prefetch = True
    handle.cfg.prefetch_top_k = None
    run_peer(bench, f"ours: LRU + speculative prefetch top-{args.top_k}", model, ids, args.tokens, handle)
    handle.cfg.prefetch_top_k = 1
    run_peer(bench, "ours: LRU + speculative prefetch top-1", model, ids, args.tokens, handle)
    handle.close()
    text = bench.report(baseline="full model on GPU (HF generate)")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
