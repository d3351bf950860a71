"""The real Mixtral-8x7B shape (32 layers, hidden 4096, ffn 14336, 8 experts, top-2: 90 GB of bf16 experts)
offloaded to the pinned CPU tier and generating on one GPU.

    python scripts/gpu/mixtral_32l_offload.py --out $OUT/mixtral_32l_offload.json   # the H200 (125 GiB host)
    python scripts/gpu/mixtral_32l_offload.py --tiny --check                         # anywhere, CPU, seconds

The model is never materialised on the GPU: it is built on the meta device, every weight outside the experts
is made on the compute device (random, as HF's init would: N(0, initializer_range), norms 1), and every
layer's experts are made in bf16 CPU memory (random numbers drawn on the GPU when there is one, a layer at a
time). ``offload_experts`` then plans the CPU tier against the host's free memory (the CPU experts it frees
as it copies them in count as free), copies the experts into ~1 GiB pinned pieces layer by layer, freeing
each layer's CPU copy as it goes, so host memory peaks near one copy of the experts (~94 GB), not two.
Prints the setup time (build, random fill, offload), decode tokens/s of ``--tokens`` new tokens after a
``--prompt-len`` prompt, GPU peak memory and host peak RSS; ``--check`` (tiny sizes) also checks that the
greedy tokens equal the model's before offload.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when run as a file

from benchmarks.bench_moe_offload import TokenClock  # noqa: E402
from ds_maximus.experts import offload_experts  # noqa: E402
from ds_maximus.experts.adapters import find_moe_blocks  # noqa: E402

MIXTRAL_8X7B = dict(layers=32, hidden=4096, ffn=14336, experts=8, top_k=2, vocab=32000, heads=32, kv_heads=8)
TINY = dict(layers=3, hidden=64, ffn=96, experts=4, top_k=2, vocab=128, heads=4, kv_heads=2)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def build(shape: dict, device, dtype=torch.bfloat16, seed: int = 0):
    """The random model: experts in CPU memory, everything else on ``device``; returns (model, timings)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.initialization import no_init_weights
    cfg = MixtralConfig(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                        num_key_value_heads=shape["kv_heads"], num_local_experts=shape["experts"],
                        num_experts_per_tok=shape["top_k"], vocab_size=shape["vocab"], max_position_embeddings=4096)
    t0 = time.perf_counter()
    with torch.device("meta"), no_init_weights():
        model = MixtralForCausalLM(cfg).to(dtype)
    with torch.device(device):  # its buffers computed on the device, not left on meta
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = cfg.initializer_range
    experts = {id(b.experts) for b in find_moe_blocks(model)}
    t_fill = time.perf_counter()
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(mod) in experts:  # one layer's experts at a time: drawn on the device, kept on the CPU
                t = torch.empty(p.shape, dtype=dtype, device="cpu")
                for e in range(p.shape[0]):
                    t[e].copy_(torch.randn(p.shape[1:], generator=gen, device=device, dtype=dtype).mul_(std))
            elif p.dim() == 1:
                t = torch.ones(p.shape, dtype=dtype, device=device)
            else:
                t = torch.randn(p.shape, generator=gen, device=device, dtype=dtype).mul_(std)
            mod._parameters[name] = nn.Parameter(t, requires_grad=False)
    _sync(device)
    t_end = time.perf_counter()
    return model.eval(), {"build_s": t_fill - t0, "fill_s": t_end - t_fill}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny dims (3 layers, hidden 64): a CPU smoke run")
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--slots", type=int, default=2, help="moe.gpu_experts_per_layer")
    p.add_argument("--no-prefetch", action="store_true", help="turn speculative prefetch off")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check", action="store_true", help="greedy tokens equal the model's before offload (tiny)")
    p.add_argument("--repeat", type=int, default=1, help="generate this many times (figures of the last)")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    shape = dict(TINY if args.tiny else MIXTRAL_8X7B)
    if args.layers:
        shape["layers"] = args.layers
    dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    model, times = build(shape, args.device, dtype)
    ids = torch.randint(1, shape["vocab"], (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    ref = copy.deepcopy(model).generate(ids, **kw) if args.check else None

    t0 = time.perf_counter()
    handle = offload_experts(model, {"maximus": {"moe": {"gpu_experts_per_layer": args.slots,
                                                         "speculative_prefetch": not args.no_prefetch}}})
    _sync(args.device)
    times["offload_s"] = time.perf_counter() - t0
    times["setup_s"] = times["build_s"] + times["fill_s"] + times["offload_s"]
    store = handle.cache.store

    first_token_s = []  # per generate(): the prompt's prefill and first token (every expert of every layer)
    for _ in range(args.repeat):  # a repeat tells one-time costs (first use of each piece, kernels) from the rest
        clock = TokenClock()
        t0 = time.perf_counter()
        out = model.generate(ids, streamer=clock, **kw)
        _sync(args.device)
        wall = time.perf_counter() - t0
        first_token_s.append(round(clock.times[1] - t0, 2) if len(clock.times) > 1 else None)
    stats = handle.stats()
    figures = {
        "shape": shape, "dtype": str(dtype), "device": args.device, "slots": args.slots,
        "prompt_len": args.prompt_len, "new_tokens": args.tokens,
        **{k: round(v, 2) for k, v in times.items()},
        "generate_s": round(wall, 2), "tokens_per_s": round(args.tokens / wall, 3),
        "decode_tokens_per_s": round(clock.decode_tokens_per_s(), 3),
        "expert_table_gb": round(store.table.nbytes / 1e9, 2) if hasattr(store, "table") else None,
        "pieces": getattr(getattr(store, "table", None), "num_pieces", None),
        "pinned": getattr(store, "pinned", None),
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.device(args.device).type == "cuda" else None,
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "first_token_s": first_token_s, "hit_rate": round(stats["hit_rate"], 3),
        "stall_ms": round(stats.get("stall_ms", 0.0), 1),
    }
    if ref is not None:
        figures["tokens_equal_before_offload"] = bool(torch.equal(out.cpu(), ref.cpu()))
    handle.close()
    print(f"setup {figures['setup_s']} s (build {figures['build_s']} s, random fill {figures['fill_s']} s, "
          f"offload {figures['offload_s']} s); {args.tokens} tokens after a {args.prompt_len}-token prompt: "
          f"{figures['tokens_per_s']} tokens/s ({figures['decode_tokens_per_s']} decode); GPU peak "
          f"{figures['gpu_peak_gib']} GiB; host peak RSS {figures['host_peak_rss_gib']} GiB")
    print(json.dumps(figures))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    if ref is not None and not figures["tokens_equal_before_offload"]:
        raise SystemExit("greedy tokens differ from the model's before offload")
    return figures


if __name__ == "__main__":
    main()
