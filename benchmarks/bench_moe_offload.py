"""Batch-1 decode of a Mixtral-shaped MoE whose experts do not stay on the GPU.

    python -m benchmarks.bench_moe_offload                 # 8 layers, H=4096, F=14336, 8 experts, top-2, bf16
    python -m benchmarks.bench_moe_offload --small         # a CPU-sized smoke run

Under ``--budget-s`` (165 s; the model is built on the GPU in bf16 without HF's weight init, ~22 GiB in
seconds) every peer starts only when its estimated cost still fits; the rest are "skipped" rows, and the
table is written after every peer.

Peers, same run, same random weights and prompt:
  * full model on GPU (HF generate, no offload): the ceiling;
  * a plain hooks baseline that copies every expert of a layer (pinned) to the GPU before the layer runs
    and drops it after;
  * accelerate ``cpu_offload`` on each experts module (its AlignDevicesHook moves the module's weights to
    the GPU at every forward; the rest of the model stays on the GPU, as ``device_map`` would place it);
  * ours, LRU cache, prefetch off (the mixtral-offloading design);
  * ours, LRU cache + speculative prefetch top-1 (the default): of a guess only the first 96 MiB are
    queued, into one staging buffer on the GPU (+96 MiB), behind the guessing layer's demand loads; the
    next layer's routing drops it, or loads only the rest and copies the head on the device;
  * ours, the same guesses loaded into the slot they will use (evicting a resident outside the predicted
    routing, or the least recent one), as whole loads (the first design), and top-k;
  * accelerate ``cpu_offload`` of the whole model (a fresh copy), as the issue's 0.29 tokens/s was measured.
Beside each offloaded row: hit rate, prefetch precision/recall, GB moved per token and the PCIe bound
``H2D_GBPS / bytes per token`` from the measured miss bytes.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import Bench, Budget, progress
from ds_maximus.experts import offload_experts

H2D_GBPS = 55.0  # pinned host-to-device on the H200 machine, GB/s


class TokenClock:
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
    """The random Mixtral-shaped model, allocated directly on ``device`` in ``args.dtype``.

    HF's weight init is skipped (``no_init_weights``: 11B parameters through ``_init_weights`` is slow,
    on CPU in fp32 minutes); every matrix is then filled in place with N(0, initializer_range) and every
    norm weight with 1, on the device. Buffers (rotary ``inv_freq``) are computed by the constructors.
    """
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.initialization import no_init_weights
    cfg = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                        num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
                        num_local_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
                        max_position_embeddings=4096)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(args.dtype)
    try:
        with torch.device(device), no_init_weights():
            model = MixtralForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, cfg.initializer_range)
    return model.eval()


def decode(model, ids, tokens):
    clock = TokenClock()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                   streamer=clock)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock.decode_tokens_per_s()


def run_peer(bench, name, model, ids, tokens, handle=None, warmup_tokens=2, **extra):
    try:
        decode(model, ids, warmup_tokens)            # warm-up (kernels, allocator, cache)
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


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` in CPU memory, pinned in place when ``pin`` (no pageable copy first)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t)


def hooks_baseline(model, device):
    """Experts on pinned CPU; a pre-hook copies a layer's experts to the GPU, a post-hook drops them."""
    from ds_maximus.experts.adapters import find_moe_blocks
    handles = []
    for b in find_moe_blocks(model):
        ex = b.experts
        cpu = {n: _host_copy(getattr(ex, n).data, device.type == "cuda") for n in ("gate_up_proj", "down_proj")}
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
    p.add_argument("--quick", action="store_true", help="only ours: LRU, staged guesses, in-slot guesses")
    p.add_argument("--budget-s", type=float, default=165.0, help="wall-clock budget; peers that no longer fit "
                   "are rows that say so")
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    if args.small:
        args.layers, args.hidden, args.ffn, args.vocab, args.tokens, args.baseline_tokens = 4, 256, 512, 1024, 16, 4
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    progress(f"building the model on {device} ({args.layers} layers, H={args.hidden}, F={args.ffn}, "
             f"E={args.experts}, {args.dtype})")
    model = build(args, device)
    expert_gib = 3 * args.hidden * args.ffn * args.experts * args.layers * (2 if device.type == "cuda" else 4) / 2**30
    bench = Bench("moe_offload", dtype=str(args.dtype).replace("torch.", ""),
                  sizes={"layers": args.layers, "H": args.hidden, "F": args.ffn, "E": args.experts,
                         "top_k": args.top_k, "slots/layer": args.slots, "expert GiB": round(expert_gib, 1),
                         "decode tokens": args.tokens, "batch": 1},
                  notes=f"tokens/s = decode only (after prefill); ms = 1000 / tokens/s; PCIe bound at "
                        f"{H2D_GBPS:.0f} GB/s pinned H2D from the measured bytes moved per token")
    ids = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1)).to(device)

    base = "full model on GPU (HF generate)"
    scale = 1.0 if device.type == "cuda" else 0.1
    # seconds each step needs on an H200 at full size (a step starts only when it still fits):
    # hooks = 22.5 GB pinned copy + ~10 forwards that each move every expert; ours = its pinned store
    cost = {"full": 14, "hooks setup": 12, "hooks": 12, "ours setup": 12, "ours": 8, "whole setup": 10}

    def checkpoint():
        bench.checkpoint(args.out, baseline=base)

    acc_tps = []

    def peer(name, key, *a, **kw):
        tps = None
        if not budget.allows(cost[key] * scale, name):
            bench.skip(name)
        else:
            progress(f"{name}: start ({budget.left():.0f} s left)")
            if key == "ours" and acc_tps:
                kw = {**kw, "x accelerate": "pending"}
            tps = run_peer(bench, name, *a, **kw)
            if tps and key == "ours" and acc_tps:
                bench.results[-1].extra["x accelerate"] = f"{tps / acc_tps[0]:.1f}x"
            progress(f"{name}: {f'{tps:.2f} tokens/s' if tps else bench.results[-1].error}")
        checkpoint()
        return tps

    progress(f"model built on {device} ({expert_gib:.1f} GiB of experts); budget {args.budget_s:.0f} s")
    # the first peer warms up over the whole length: attention builds a cuDNN graph for each new sequence
    # length (~40 ms each on the H200), cached for the later peers
    if not args.quick:
        peer(base, "full", model, ids, args.tokens, warmup_tokens=args.tokens)
    hooks_name = "hooks: copy every expert of a layer per forward (pinned)"
    acc_name = "accelerate cpu_offload (experts modules)"
    if args.quick:
        pass
    elif budget.allows((cost["hooks setup"] + cost["hooks"]) * scale, hooks_name):
        progress("hooks baseline: copying the experts to pinned CPU memory")
        hooks = hooks_baseline(model, device)
        peer(hooks_name, "hooks", model, ids, args.baseline_tokens)
        for h in hooks:
            h.remove()
        # the experts now live in pinned CPU memory: accelerate's hooks offload from there
        try:
            import accelerate
        except ImportError:
            bench.add(f"{acc_name}: not installed", None, error="-")
        else:
            from ds_maximus.experts.adapters import find_moe_blocks
            blocks = find_moe_blocks(model)
            for b in blocks:
                accelerate.cpu_offload(b.experts, execution_device=device,
                                       state_dict={n: t.data for n, t in b.expert_tensors().items()})
            tps = peer(f"{acc_name} {accelerate.__version__}", "hooks", model, ids, args.baseline_tokens)
            if tps:
                acc_tps.append(tps)
            for b in blocks:  # detaching puts the weights back (CPU) for the next peer
                accelerate.hooks.remove_hook_from_module(b.experts, recurse=True)
    else:
        bench.skip(hooks_name)
        bench.skip(acc_name)
    ours = ["ours: LRU cache, prefetch off (mixtral-offloading design)",
            "ours: prefetch top-1, head staged (+96 MiB GPU; the default)",
            "ours: prefetch top-1, 96 MiB head into a slot",
            "ours: prefetch top-1, head into a slot, LRU victims",
            "ours: prefetch top-1, whole-expert guesses into a slot",
            f"ours: prefetch top-{args.top_k}, heads into slots"]
    if not budget.allows((cost["ours setup"] + cost["ours"]) * scale, "ours (offload_experts)"):
        for name in ours:
            bench.skip(name)
    else:
        progress("ours: offload_experts (experts into the pinned store)")
        handle = offload_experts(model, {"gpu_experts_per_layer": args.slots, "speculative_prefetch": False})
        cache = handle.cache
        peer(ours[0], "ours", model, ids, args.tokens, handle, warmup_tokens=args.tokens if args.quick else 2)
        handle.speculative_prefetch = True
        handle.cfg.prefetch_top_k = 1
        peer(ours[1], "ours", model, ids, args.tokens, handle)
        cache.stage_guesses = False  # the guess's head goes into the slot it will use (evicting a resident)
        peer(ours[2], "ours", model, ids, args.tokens, handle)
        if not args.quick:
            handle.keep_predicted = False  # ... and the victim is the least recent, predicted or not
            peer(ours[3], "ours", model, ids, args.tokens, handle)
            handle.keep_predicted = True
            chunk, cache.prefetch_chunk_bytes = cache.prefetch_chunk_bytes, None  # whole loads
            peer(ours[4], "ours", model, ids, args.tokens, handle)
            cache.prefetch_chunk_bytes = chunk
            handle.cfg.prefetch_top_k = None
            peer(ours[5], "ours", model, ids, args.tokens, handle)
        handle.close()
    # accelerate as the issue ran it: the whole model under cpu_offload, a new copy (docs/bench/code_history.md)
    whole = "accelerate cpu_offload (whole model)"
    try:
        import accelerate
    except ImportError:
        accelerate = None
    if args.quick:
        pass
    elif accelerate is None:
        bench.add(f"{whole}: not installed", None, error="-")
    elif not budget.allows((cost["whole setup"] + cost["hooks"]) * scale, whole):
        bench.skip(whole)
    else:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        progress(f"{whole}: building a fresh model and offloading all of it")
        model = build(args, device)
        accelerate.cpu_offload(model, execution_device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        peer(f"{whole} {accelerate.__version__}", "hooks", model, ids, max(2, args.baseline_tokens // 2))
    text = bench.report(baseline=None if args.quick else base)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
