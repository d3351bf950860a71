"""Generate with a Mixtral-shaped MoE whose experts live in pinned CPU memory (or NVMe).

    python examples/generate_moe_offload.py                      # tiny random model, checks equality
    python examples/generate_moe_offload.py --layers 8 --hidden 4096 --ffn 14336 --slots 2 --no-check
    python examples/generate_moe_offload.py --nvme-path /tmp/experts --no-prefetch
    python examples/generate_moe_offload.py --expert-gib 0.035     # one budget for all layers' slots

The model has random weights (no download); the point is the machinery: the expert cache, the
side-stream loads and speculative prefetch, and that greedy tokens equal the un-offloaded model's.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ds_maximus.experts import offload_experts


def build(args):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                        num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
                        num_local_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
                        max_position_embeddings=4096)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = MixtralForCausalLM._from_config(cfg, torch_dtype=dtype)
    return model.eval()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--slots", type=int, default=2, help="moe.gpu_experts_per_layer")
    p.add_argument("--expert-gib", type=float, default=None, help="moe.gpu_expert_total_bytes in GiB: the slots of "
                   "all layers together, spread over them (overrides --slots)")
    p.add_argument("--policy", choices=["lru", "lfu"], default="lru")
    p.add_argument("--no-prefetch", action="store_true", help="turn speculative prefetch off")
    p.add_argument("--quant-bits", type=int, choices=[8, 4, 3, 2], default=None, help="moe.quant.bits (group 32)")
    p.add_argument("--decode-graphs", action="store_true", help="moe.decode_graphs: each layer's attention, norms "
                   "and router one CUDA graph a decode step (generate with cache_implementation='static')")
    p.add_argument("--nvme-path", default=None, help="keep experts in a file in this folder instead of RAM")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the equality check against the full model")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")

    model = build(args)
    ids = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    if args.decode_graphs:  # the graphs need a static KV cache; the plain model's run too, to compare like with like
        kw.update(cache_implementation="static", disable_compile=True)
    ref = None
    if not args.no_check:
        ref = model.generate(ids, **kw)
    moe = {"gpu_experts_per_layer": args.slots, "cache_policy": args.policy,
           "speculative_prefetch": not args.no_prefetch}
    if args.expert_gib is not None:
        moe["gpu_expert_total_bytes"] = int(args.expert_gib * 2**30)
    if args.quant_bits:
        moe["quant"] = {"bits": args.quant_bits, "group_size": 32}
    if args.decode_graphs:
        moe["decode_graphs"] = True
    if args.nvme_path:
        moe["offload"] = {"device": "nvme", "nvme_path": args.nvme_path}
    handle = offload_experts(model, {"maximus": {"moe": moe}})
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    if args.device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    stats = handle.stats()
    stats["slots_by_layer"] = handle.cache.group_slots
    handle.close()
    print(f"generated {args.tokens} tokens in {dt:.2f} s ({args.tokens / dt:.2f} tokens/s incl. prefill)")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()}, indent=1))
    if ref is not None and args.quant_bits:  # quantized experts compute a (slightly) different model
        agree = (out[:, -args.tokens:] == ref[:, -args.tokens:]).float().mean().item()
        print(f"greedy tokens equal to the un-offloaded bf16/fp32 model's: {agree:.0%} (quantized experts)")
    elif ref is not None:
        same = torch.equal(out, ref)
        print("greedy tokens identical to the un-offloaded model:", same)
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
