"""Greedy decode (batch 1, or ``--batch N`` sequences) of a Mixtral-shaped MoE whose experts do not stay on the GPU.

    python -m benchmarks.bench_moe_offload                 # 8 layers, H=4096, F=14336, 8 experts, top-2, bf16
    python -m benchmarks.bench_moe_offload --small         # a CPU-sized smoke run
    python -m benchmarks.bench_moe_offload --batch 8 --prefill-len 2048 --peers full,ours,int8,int8+cpu
    python -m benchmarks.bench_moe_offload --cap-gib 16 --quick --peers ours,int8,int4,int4+cpu   # a subset, capped

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
  * ours with CPU compute of the missed experts (``cpu_compute: misses``), bf16;
  * ours with the quantized expert tier (``quant: {bits: 8 | 4 | 3 | 2}``, ``--group-size``), each without and
    with ``cpu_compute: misses``: the tier, the slots and the link hold the packed form;
  * accelerate ``cpu_offload`` of the whole model (a fresh copy), as the issue's 0.29 tokens/s was measured.
Beside each offloaded row: hit rate, prefetch precision/recall, GB moved per token and the PCIe bound
``H2D_GBPS / bytes per token`` from the measured miss bytes, and ``experts/layer``: the distinct experts one MoE
layer call routed to (mean over the decode's calls; top-k at batch 1, up to every expert for a batch).

``--batch N`` decodes N prompts together (lengths from half the prompt length to all of it, left padded with an
attention mask, as ``generate`` runs a batch): ``tokens/s`` counts every sequence's new tokens. ``--prefill-len L``
adds, per peer, the time of one forward of an L-token prompt (batch 1, after a warm-up forward of the same length:
``prefill s``, ``prefill tok/s``) and, for ours, the experts its layers hit there (``prefill experts/layer``: with
fewer slots than that the cache serves the layer in rounds) and its hit rate. Every peer's quality against the model
before offload (bf16): the bf16 model's greedy continuation of the prompt is fed through the peer in one forward
(teacher forcing), and ``token agree`` is the fraction of positions whose argmax is the bf16 model's token,
``rel err`` is ``||logits - logits_bf16|| / ||logits_bf16||`` over those positions.

``--peers`` picks a subset by key (``full``, ``hooks`` (with accelerate's experts offload), ``ours`` (the bf16
cache variants; with ``--quick`` only the first three), ``bf16+cpu``, ``int8`` ... ``int2``, ``int8+cpu`` ...
``int2+cpu``, ``whole``). ``--cap-gib`` caps the GPU (``torch.cuda.set_per_process_memory_fraction``) for every
peer but ``full`` (all on GPU, uncapped) once the model's experts have been moved to host memory; ``peak GiB``
is each peer's GPU peak.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch
from torch import nn

from benchmarks.harness import Bench, Budget, progress
from ds_maximus.experts import offload_experts
from ds_maximus.experts.adapters import find_moe_blocks

H2D_GBPS = 55.0  # pinned host-to-device on the H200 machine, GB/s
QUANT_BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
PEERS = ("full", "hooks", "ours", "bf16+cpu", *QUANT_BITS, *(f"{k}+cpu" for k in QUANT_BITS), "whole")
QUICK_PEERS = ("ours",)


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


def prompts(args, device):
    """``(ids, attention_mask)``: batch 1, the ``--prompt-len`` random prompt (no mask, as before ``--batch``); a
    batch, prompts of ``prompt_len // 2 .. prompt_len`` tokens (1 .. vocab, so none is the pad id 0), left padded."""
    g = torch.Generator().manual_seed(1)
    if args.batch == 1:
        return torch.randint(0, args.vocab, (1, args.prompt_len), generator=g).to(device), None
    lengths = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (args.batch,), generator=g)
    lengths[0] = args.prompt_len
    ids = torch.zeros((args.batch, args.prompt_len), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        ids[i, args.prompt_len - n:] = torch.randint(1, args.vocab, (n,), generator=g)
        mask[i, args.prompt_len - n:] = 1
    return ids.to(device), mask.to(device)


def decode(model, ids, tokens, mask=None):
    """Decode tokens/s of every sequence together (``generate``'s steps after the prefill, times the batch)."""
    clock = TokenClock()
    model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                   pad_token_id=0, streamer=clock)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock.decode_tokens_per_s() * ids.shape[0]


def prefill(model, ids) -> float:
    """Seconds of one forward of ``ids`` (the prompt's prefill: KV cache built, last position's logits only)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


class Reference:
    """The bf16 model's greedy continuation ``seq`` of the prompt and its logits there (fp32, host): what every
    peer's ``token agree`` and ``rel err`` are measured against, by one teacher-forced forward of ``seq``."""

    def __init__(self, model, ids, tokens, mask=None):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)
        self.seq, self.prompt_len = out, ids.shape[1]
        self.kw = {}  # a padded batch: its mask and generate's positions (each row counted from its first token)
        if mask is not None:
            full = torch.cat([mask, mask.new_ones((mask.shape[0], tokens))], dim=1)
            self.kw = {"attention_mask": full, "position_ids": (full.cumsum(-1) - 1).clamp(min=0)}
        self.logits = self.forward(model)

    def forward(self, model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(self.seq, **self.kw).logits[:, self.prompt_len - 1:-1]
        return logits.float().cpu()

    def compare(self, model) -> dict:
        logits = self.forward(model)
        agree = (logits.argmax(-1) == self.seq[:, self.prompt_len:].cpu()).float().mean().item()
        err = ((logits - self.logits).norm() / self.logits.norm()).item()
        return {"token agree": round(agree, 3), "rel err": float(f"{err:.3g}")}


def experts_to_host(blocks):
    """Every MoE block's expert weights moved to host memory (their GPU copies freed): the tensors each offloaded
    peer starts from (``attach_experts``); one copy, kept while the peers run."""
    snap = []
    for b in blocks:
        snap.append({n: t.detach().to("cpu") for n, t in b.expert_tensors().items()})
        for n, t in snap[-1].items():
            setattr(b.experts, n, nn.Parameter(t, requires_grad=False))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return snap


def attach_experts(blocks, snap):
    """Put the host expert weights back into the model's own experts modules (undoing an earlier offload)."""
    for b, tensors in zip(blocks, snap):
        for n, t in tensors.items():
            setattr(b.experts, n, nn.Parameter(t, requires_grad=False))
        b.block.experts = b.experts
    gc.collect()  # the previous offload's modules and handle form a cycle: free its pinned store and slots now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_peer(bench, name, model, ids, tokens, handle=None, warmup_tokens=2, reference=None, mask=None,
             prefill_ids=None, **extra):
    try:
        decode(model, ids, warmup_tokens, mask)      # warm-up (kernels, allocator, cache)
        if handle is not None:
            handle.reset_stats()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        tps = decode(model, ids, tokens, mask)
        st = handle.stats() if handle is not None else None
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        pre = {}
        if prefill_ids is not None:  # warm-up forward at the length (attention's graphs), then the timed one
            prefill(model, prefill_ids)
            if handle is not None:
                handle.reset_stats()
            sec = prefill(model, prefill_ids)
            pre = {"prefill s": round(sec, 3), "prefill tok/s": round(prefill_ids.numel() / sec, 1)}
            if torch.cuda.is_available():
                pre["prefill peak GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if handle is not None:
                pst = handle.stats()
                pre.update({"prefill experts/layer": round(pst["experts_per_layer"], 2),
                            "prefill hit rate": round(pst["hit_rate"], 3)})
        quality = reference.compare(model) if reference is not None else {}
    except Exception as e:  # a peer that cannot run is a row
        bench.add(name, None, error=f"{type(e).__name__}: {str(e)[:60]}")
        return None
    row = {"tokens/s": round(tps, 2)}
    if st is not None:
        per_tok = st["bytes_moved"] / max(st["tokens"], 1)
        row.update({"hit rate": round(st["hit_rate"], 3), "prefetch prec": round(st["prefetch_precision"], 3),
                    "prefetch recall": round(st["prefetch_recall"], 3), "GB/token": round(per_tok / 1e9, 3),
                    "PCIe bound tok/s": round(H2D_GBPS * 1e9 / per_tok, 2) if per_tok else "-",
                    "stall ms": round(st["stall_ms"], 1), "expert MB": round(st["expert_bytes"] / 1e6, 1),
                    "host experts/token": round(st.get("cpu_experts", 0) / max(st["tokens"], 1), 2),
                    "experts/layer": round(st["experts_per_layer"], 2)})
    row.update(pre)
    row.update(quality)
    row.update(extra)
    bench.add(name, 1e3 / tps if tps else None, round(peak, 2) if peak is not None else None, **row)
    return tps


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` in CPU memory, pinned in place when ``pin`` (no pageable copy first)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t)


def hooks_baseline(model, device):
    """Experts on pinned CPU; a pre-hook copies a layer's experts to the GPU, a post-hook drops them."""
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


def parse_peers(args) -> set:
    """The peer keys to run: ``--peers`` (comma-separated keys of ``PEERS``), else ``--quick``'s, else all."""
    if args.peers:
        keys = {k.strip() for k in args.peers.split(",") if k.strip()}
        bad = keys - set(PEERS)
        if bad:
            raise SystemExit(f"--peers: unknown {sorted(bad)}; choose from {', '.join(PEERS)}")
        return keys
    return set(QUICK_PEERS) if args.quick else set(PEERS)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (left padded, masked); "
                   "tokens/s counts all of them")
    p.add_argument("--prefill-len", type=int, default=None, help="also time one prefill of a prompt of this many "
                   "tokens (batch 1) per peer")
    p.add_argument("--group-size", type=int, default=64, help="moe.quant.group_size of the int peers")
    p.add_argument("--small", action="store_true", help="a small CPU-sized model (smoke test)")
    p.add_argument("--quick", action="store_true", help="only ours: LRU, staged guesses, in-slot guesses")
    p.add_argument("--peers", default=None, help=f"comma-separated peers to run, of: {', '.join(PEERS)}")
    p.add_argument("--cap-gib", type=float, default=None, help="cap the GPU at this many GiB for every peer but "
                   "'full' (torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--budget-s", type=float, default=165.0, help="wall-clock budget; peers that no longer fit "
                   "are rows that say so")
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    want = parse_peers(args)
    quick_ours = args.quick
    if args.small:
        args.layers, args.hidden, args.ffn, args.vocab, args.tokens, args.baseline_tokens = 4, 256, 512, 1024, 16, 4
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    progress(f"building the model on {device} ({args.layers} layers, H={args.hidden}, F={args.ffn}, "
             f"E={args.experts}, {args.dtype})")
    model = build(args, device)
    expert_gib = 3 * args.hidden * args.ffn * args.experts * args.layers * (2 if device.type == "cuda" else 4) / 2**30
    cap = args.cap_gib if device.type == "cuda" else None
    bench = Bench("moe_offload", dtype=str(args.dtype).replace("torch.", ""),
                  sizes={"layers": args.layers, "H": args.hidden, "F": args.ffn, "E": args.experts,
                         "top_k": args.top_k, "slots/layer": args.slots, "expert GiB": round(expert_gib, 1),
                         "decode tokens": args.tokens, "batch": args.batch,
                         "prefill tokens": args.prefill_len or "-", "group size": args.group_size,
                         "GPU cap GiB": cap if cap else "none"},
                  notes=f"tokens/s = decode only (after prefill), every sequence of the batch; ms = 1000 / "
                        f"tokens/s; experts/layer = distinct experts a MoE layer call hit; PCIe bound at "
                        f"{H2D_GBPS:.0f} GB/s pinned H2D from the measured bytes moved per token; token agree / "
                        f"rel err: teacher-forced over the bf16 model's {args.tokens}-token greedy continuation")
    if args.batch < 1 or (args.prefill_len is not None and args.prefill_len < 1):
        raise SystemExit("--batch and --prefill-len take positive integers")
    ids, mask = prompts(args, device)
    prefill_ids = None
    if args.prefill_len:
        prefill_ids = torch.randint(1, args.vocab, (1, args.prefill_len),
                                    generator=torch.Generator().manual_seed(2)).to(device)

    base = "full model on GPU (HF generate)"
    scale = (1.0 if device.type == "cuda" else 0.1) * args.layers / 8
    # seconds each step needs on an H200 at 8 full-size layers, scaled by the layers (a step starts only when it
    # still fits):
    # hooks = 22.5 GB pinned copy + ~10 forwards that each move every expert; ours = its pinned store;
    # quant setup = quantizing every expert on the GPU into the pinned packed store
    cost = {"full": 14, "hooks setup": 12, "hooks": 12, "ours setup": 12, "ours": 8, "whole setup": 10,
            "quant setup": 10, "reference": 6}
    # a batch's decode step hits up to every expert of a layer (each miss a whole expert over the link), and a
    # prefill two forwards that hit every expert: ours and the copy-everything peers cost that much more
    hit = min(args.experts, args.batch * args.top_k) / args.top_k
    cost["ours"] *= hit
    if args.prefill_len:
        cost["ours"] += 2 * cost["ours"] / hit * args.experts / args.top_k / args.tokens
        cost["hooks"] *= 2

    def checkpoint():
        bench.checkpoint(args.out, baseline=base if "full" in want else None)

    acc_tps = []
    reference = None

    def peer(name, key, *a, **kw):
        tps = None
        if not budget.allows(cost[key] * scale, name):
            bench.skip(name)
        else:
            progress(f"{name}: start ({budget.left():.0f} s left)")
            if key == "ours" and acc_tps:
                kw = {**kw, "x accelerate": "pending"}
            tps = run_peer(bench, name, *a, reference=reference, mask=mask, prefill_ids=prefill_ids, **kw)
            if tps and key == "ours" and acc_tps:
                bench.results[-1].extra["x accelerate"] = f"{tps / acc_tps[0]:.1f}x"
            progress(f"{name}: {f'{tps:.2f} tokens/s' if tps else bench.results[-1].error}")
        checkpoint()
        return tps

    progress(f"model built on {device} ({expert_gib:.1f} GiB of experts); budget {args.budget_s:.0f} s; "
             f"peers {sorted(want)}")
    # the first peer warms up over the whole length: attention builds a cuDNN graph for each new sequence
    # length (~40 ms each on the H200), cached for the later peers
    if "full" in want:
        peer(base, "full", model, ids, args.tokens, warmup_tokens=args.tokens)
    if budget.allows(cost["reference"] * scale, "the bf16 reference (token agree, rel err)"):
        progress("the bf16 model's greedy continuation and logits (the quality reference)")
        reference = Reference(model, ids, args.tokens, mask)
        if "full" in want and bench.results and bench.results[-1].error == "":
            bench.results[-1].extra.update(reference.compare(model))
    blocks = find_moe_blocks(model)
    progress("moving the experts to host memory (each offloaded peer starts from there)")
    snap = experts_to_host(blocks)
    if cap:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total), device)
        progress(f"GPU capped at {cap:g} GiB of {total / 2**30:.0f}")
    hooks_name = "hooks: copy every expert of a layer per forward (pinned)"
    acc_name = "accelerate cpu_offload (experts modules)"
    if "hooks" not in want:
        pass
    elif budget.allows((cost["hooks setup"] + cost["hooks"]) * scale, hooks_name):
        progress("hooks baseline: copying the experts to pinned CPU memory")
        hooks = hooks_baseline(model, device)
        peer(hooks_name, "hooks", model, ids, args.baseline_tokens)
        for h in hooks:
            h.remove()
        try:
            import accelerate
        except ImportError:
            bench.add(f"{acc_name}: not installed", None, error="-")
        else:
            for b in blocks:
                accelerate.cpu_offload(b.experts, execution_device=device,
                                       state_dict={n: t.data for n, t in b.expert_tensors().items()})
            tps = peer(f"{acc_name} {accelerate.__version__}", "hooks", model, ids, args.baseline_tokens)
            if tps:
                acc_tps.append(tps)
            for b in blocks:
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
    if "ours" not in want:
        pass
    elif not budget.allows((cost["ours setup"] + cost["ours"]) * scale, "ours (offload_experts)"):
        for name in ours:
            bench.skip(name)
    else:
        progress("ours: offload_experts (experts into the pinned store)")
        attach_experts(blocks, snap)
        handle = offload_experts(model, {"gpu_experts_per_layer": args.slots, "speculative_prefetch": False})
        cache = handle.cache
        peer(ours[0], "ours", model, ids, args.tokens, handle, warmup_tokens=args.tokens if quick_ours else 2)
        handle.speculative_prefetch = True
        handle.cfg.prefetch_top_k = 1
        peer(ours[1], "ours", model, ids, args.tokens, handle)
        cache.stage_guesses = False  # the guess's head goes into the slot it will use (evicting a resident)
        peer(ours[2], "ours", model, ids, args.tokens, handle)
        if not quick_ours:
            handle.keep_predicted = False  # ... and the victim is the least recent, predicted or not
            peer(ours[3], "ours", model, ids, args.tokens, handle)
            handle.keep_predicted = True
            chunk, cache.prefetch_chunk_bytes = cache.prefetch_chunk_bytes, None  # whole loads
            peer(ours[4], "ours", model, ids, args.tokens, handle)
            cache.prefetch_chunk_bytes = chunk
            handle.cfg.prefetch_top_k = None
            peer(ours[5], "ours", model, ids, args.tokens, handle)
        handle.close()
        handle = cache = None
    # the default cache (prefetch top-1, staged head) with CPU compute of misses and/or the quantized tier
    variants = [("bf16+cpu", None, True)] + [(k, b, cpu) for cpu in (False, True) for k, b in QUANT_BITS.items()]
    for key, bits, cpu in variants:
        key = key if key == "bf16+cpu" else key + ("+cpu" if cpu else "")
        if key not in want:
            continue
        name = (f"ours int{bits} (group {args.group_size})" if bits else "ours bf16") + \
            (" + cpu_compute=misses" if cpu else "")
        if not budget.allows((cost["quant setup"] + cost["ours"]) * scale, name):
            bench.skip(name)
            checkpoint()
            continue
        progress(f"{name}: offload_experts" + (" (quantizing every expert once)" if bits else ""))
        attach_experts(blocks, snap)
        cfg = {"gpu_experts_per_layer": args.slots, "cpu_compute": "misses" if cpu else "off"}
        if bits:
            cfg["quant"] = {"bits": bits, "group_size": args.group_size}
        try:
            handle = offload_experts(model, cfg)
        except Exception as e:  # a configuration that cannot run is a row
            bench.add(name, None, error=f"{type(e).__name__}: {str(e)[:60]}")
            checkpoint()
            continue
        peer(name, "ours", model, ids, args.tokens, handle)
        handle.close()
        handle = None
    # accelerate as the issue ran it: the whole model under cpu_offload, a new copy (docs/bench/code_history.md)
    whole = "accelerate cpu_offload (whole model)"
    try:
        import accelerate
    except ImportError:
        accelerate = None
    if "whole" not in want:
        pass
    elif accelerate is None:
        bench.add(f"{whole}: not installed", None, error="-")
    elif not budget.allows((cost["whole setup"] + cost["hooks"]) * scale, whole):
        bench.skip(whole)
    else:
        model = blocks = snap = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)  # built on the GPU, then offloaded whole
        progress(f"{whole}: building a fresh model and offloading all of it")
        model = build(args, device)
        accelerate.cpu_offload(model, execution_device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            if cap:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total), device)
        peer(f"{whole} {accelerate.__version__}", "hooks", model, ids, max(2, args.baseline_tokens // 2))
    text = bench.report(baseline=base if "full" in want else None)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0

if __name__ == "__main__":
    main()
