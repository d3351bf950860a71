"""Greedy decode (batch 1, or ``--batch N`` sequences) of a Mixtral- or Qwen3-MoE-shaped model whose experts do not
stay on the GPU.

    python -m benchmarks.bench_moe_offload                 # 8 layers, H=4096, F=14336, 8 experts, top-2, bf16
    python -m benchmarks.bench_moe_offload --small         # a CPU-sized smoke run
    python -m benchmarks.bench_moe_offload --layers 32 --cap-gib 16 --slots auto --agree-tokens 256 \
        --peers full,int4,int4+cpu,ours,bf16+cpu --ours-variants default   # the real Mixtral-8x7B
    python -m benchmarks.bench_moe_offload --family qwen3 --cap-gib 16 --slots auto   # Qwen3-30B-A3B's shape
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
Beside each offloaded row: hit rate (a used guess counts as a hit; "resident hit rate" counts only the experts
that needed no copy), prefetch precision/recall, GB moved per token and the PCIe bound
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
cache variants; with ``--quick`` only the first three, with ``--ours-variants default`` only the default cache),
``bf16+cpu``, ``int8`` ... ``int2``, ``int8+cpu`` ... ``int2+cpu`` (``cpu_compute: misses``), ``bf16+auto``,
``int8+auto`` ... ``int2+auto`` (``cpu_compute: auto``: on CUDA its light misses split between host and link),
``bnb``, ``cpu``, ``whole``) and runs them in
the order given (most important first: a budget cut leaves the rest as "skipped" rows); ``full`` always runs
first, ``cpu`` and ``whole`` last. ``--cap-gib`` caps the GPU (``torch.cuda.set_per_process_memory_fraction``) for every
peer but ``full`` (all on GPU, uncapped) once the model's experts have been moved to host memory; ``peak GiB``
is each peer's GPU peak.

``--family qwen3``: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 128 experts of ffn 768, top-8, vocabulary 151936,
32 heads of 128, 4 KV heads); the size flags override either family. ``--slots auto`` (with ``--cap-gib``): each
offloaded peer gets as many GPU slots per layer as fit, ``(cap - non-expert weights - reserve) / (layers x that
peer's expert bytes as the slots hold them)`` (:func:`auto_slots`; ``slots/layer`` in each row). ``--agree-tokens``:
the length of the bf16 continuation ``token agree`` / ``rel err`` are measured over (one forward per peer),
apart from the timed decode's ``--tokens``.

``--expert-source``: ``host`` keeps one pageable host copy of every expert that each offloaded peer re-attaches
(small runs, the CPU). ``gpu`` (the default once the experts take 40% of host memory: the real Mixtral-8x7B's
90 GB host copy next to a bf16 peer's 90 GB pinned tier does not fit a 125 GiB host) keeps none: each peer
regenerates the experts on the device from the build's per-layer generators (the same weights, bit for bit) with
the cap lifted, then ``offload_experts`` quantizes them there and copies them into the host tier. That set-up peaks
above the cap (the whole model on the GPU for a moment; a user with a 16 GB card would load the experts from a
checkpoint on the host instead); the cap is applied again before the timed decode, and ``peak GiB`` is the capped
run's peak. The host's read bandwidth is measured once at the start (a ~2 GB ``sum()``), and every ``+cpu`` row
shows ``host bound tok/s`` = that bandwidth / the expert bytes the host read per token, beside the PCIe bound, and
``both bound tok/s``: the bytes moved and host-read a token over the two rates added, the ceiling of any split
of those bytes between the link and the host (``scripts/gpu/probe_host_table.py`` measures whether the host op
keeps its speed while the link copies).
``cpu``: CPU-only inference of the whole model, where it fits host memory next to what is held there (else a row
that says why); it runs after every other peer but ``whole``. ``bnb``: bitsandbytes' 4-bit model,
not offloaded: the fused 3-D expert tensors are not ``nn.Linear`` (``Linear4bit`` cannot take them), so each is
quantized to nf4 in place by ``bitsandbytes.nn.parametrize.replace_parameter_4bit`` and dequantized whole at every
access; where it does not fit the cap (the 32-layer Mixtral's nf4 experts alone are ~25 GB), a row that says so.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import time

import torch
from torch import nn

from benchmarks.harness import Bench, Budget, cap_gpu, default_dtype, gpu_fraction, progress
from ds_maximus.config import ExpertCPUCompute
from ds_maximus.experts import offload_experts
from ds_maximus.experts.adapters import find_moe_blocks
from ds_maximus.experts.expert_cache import slot_range
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.quant_layout import QuantizedExpertLayout

H2D_GBPS = 55.0  # pinned host-to-device on the H200 machine, GB/s
QUANT_BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
CPU_MODES = {"cpu": "misses", "auto": "auto"}  # a peer key's suffix -> moe.cpu_compute
PEERS = ("full", "hooks", "ours", "bf16+cpu", "bf16+auto", *QUANT_BITS,
         *(f"{k}+{m}" for m in CPU_MODES for k in QUANT_BITS), "bnb", "cpu", "whole")
QUICK_PEERS = ("ours",)
LAST_PEERS = ("cpu", "whole")  # run after every other peer: they move the model off the GPU or replace it
EXPERT_SEED = 1000  # layer i's experts come from torch.Generator(device).manual_seed(EXPERT_SEED + i)
# the shapes: Mixtral-8x7B's layer (8 layers by default; --layers 32 is the whole model) and Qwen3-30B-A3B
FAMILIES = {
    "mixtral": dict(layers=8, hidden=4096, ffn=14336, experts=8, top_k=2, vocab=32000, heads=32, kv_heads=8,
                    head_dim=128),
    "qwen3": dict(layers=48, hidden=2048, ffn=768, experts=128, top_k=8, vocab=151936, heads=32, kv_heads=4,
                  head_dim=128),
}
SMALL = {  # --small: CPU-sized
    "mixtral": dict(layers=4, hidden=256, ffn=512, vocab=1024, heads=2, kv_heads=1, head_dim=128),
    "qwen3": dict(layers=4, hidden=256, ffn=128, experts=16, top_k=4, vocab=1024, heads=4, kv_heads=2, head_dim=64),
}
MIXTRAL_8L_EXPERT_BYTES = 8 * 8 * 3 * 4096 * 14336 * 2  # the default run's bf16 experts: what `cost` is timed at
GIB = 2**30


class TokenClock:
    """A generate() streamer that timestamps tokens: decode rate excludes the prefill. ``on_first_token`` runs when
    the prefill's token arrives, before the decode's clock starts (the offload's stats reset there, so that they
    count the decode's forwards only)."""

    def __init__(self, on_first_token=None):
        self.times = []
        self.on_first_token = on_first_token

    def put(self, value):
        if len(self.times) == 1 and self.on_first_token is not None:
            self.on_first_token()
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def decode_tokens_per_s(self) -> float:
        t = self.times[2:]  # [0] = prompt, [1] = first new token (after prefill)
        return (len(t)) / (t[-1] - self.times[1]) if len(t) >= 1 else 0.0


def model_config(args):
    """``(config, model class)`` of ``--family`` at the run's sizes (``args`` after :func:`resolve_shape`)."""
    if args.family == "qwen3":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        return Qwen3MoeConfig(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                              moe_intermediate_size=args.ffn,
                              num_hidden_layers=args.layers, num_attention_heads=args.heads,
                              num_key_value_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts,
                              num_experts_per_tok=args.top_k, vocab_size=args.vocab, max_position_embeddings=4096,
                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                              tie_word_embeddings=False), Qwen3MoeForCausalLM
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         num_local_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
                         max_position_embeddings=4096), MixtralForCausalLM


def fill_experts(tensors: dict, layer: int, stds: dict, device=None) -> None:
    """Fill one MoE layer's expert tensors (``{name: [E, ...]}``, in the block's order) in place from that
    layer's own generator, ``torch.Generator(device).manual_seed(EXPERT_SEED + layer)``, each with its std
    (``stds[name]``): the build and every regeneration (``--expert-source gpu``) draw the same numbers.
    ``device``: where they are drawn (default: the tensors' own); a tensor on another device type (the host, with
    ``--expert-source host-regen``) gets a copy of what ``device`` draws, one tensor at a time."""
    device = torch.device(device) if device is not None else next(iter(tensors.values())).device
    gen = torch.Generator(device).manual_seed(EXPERT_SEED + layer)
    for name, t in tensors.items():
        if t.device.type == device.type:
            t.normal_(0.0, stds[name], generator=gen)
        else:
            t.copy_(torch.empty(t.shape, dtype=t.dtype, device=device).normal_(0.0, stds[name], generator=gen))


def init_stds(args, cfg) -> tuple:
    """``(std, embed_std, out_std)`` of ``--init``: ``hf``, every matrix N(0, initializer_range); ``scaled`` (the
    default), the projections that write into the residual stream (attention's o_proj, the experts' and shared
    experts' down projections) at initializer_range / sqrt(2 x layers) and the embedding at N(0, 1), as Megatron-LM
    and GPT-2 initialise: each block then adds a small update to the residual stream, as in a trained model. With
    ``hf`` every layer's output is larger than its input, a random 32-layer model is chaotic (bf16 rounding alone
    changes 85% of its teacher-forced greedy tokens) and token agreement measures nothing."""
    std = cfg.initializer_range
    if getattr(args, "init", "scaled") == "hf":
        return std, std, std
    return std, 1.0, std / math.sqrt(2 * cfg.num_hidden_layers)


def _is_residual_out(name: str) -> bool:
    return name.endswith("o_proj.weight") or "down_proj" in name or name.endswith("w2")


def build(args, device, host_experts: bool = False):
    """The random model of ``--family``, allocated directly on ``device`` in ``args.dtype``; with
    ``host_experts`` its experts in pageable host memory instead (drawn on the device a tensor at a time and
    copied there: the same numbers), as a model loaded on the host for ``offload_experts`` has them, so that a
    model whose experts do not fit the GPU can be built at all.

    HF's weight init is skipped (``no_init_weights``: 11B parameters through ``_init_weights`` is slow,
    on CPU in fp32 minutes); every matrix is then filled in place from a normal of :func:`init_stds`' std
    (``--init``) and every norm weight with 1, on the device: the experts a layer at a time from per-layer generators
    (:func:`fill_experts`), the rest from the global seed. Buffers (rotary ``inv_freq``) are computed by the
    constructors.
    """
    from transformers.initialization import no_init_weights
    cfg, cls = model_config(args)
    torch.manual_seed(0)
    with default_dtype(args.dtype), torch.device("cpu" if host_experts else device), no_init_weights():
        model = cls(cfg)  # on the host: untouched pages until the experts are copied in
    blocks = find_moe_blocks(model)
    experts = {id(t) for b in blocks for t in b.expert_tensors().values()}
    if host_experts:  # everything but the experts to the device
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and id(p) not in experts:
                    mod._parameters[name] = nn.Parameter(p.data.to(device), requires_grad=p.requires_grad)
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = b.to(device)
    std, embed_std, out_std = init_stds(args, cfg)
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in experts:
                continue
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, embed_std if p is emb else out_std if _is_residual_out(name) else std)
        model.bench_expert_stds = {n: out_std if _is_residual_out(n) else std for n in blocks[0].expert_tensors()}
        for i, b in enumerate(blocks):
            fill_experts(b.expert_tensors(), i, model.bench_expert_stds, device)
        if getattr(args, "router_skew", 0.0):
            skew_routers(blocks, args.router_skew)
    return model.eval()


def skew_routers(blocks, skew: float) -> None:
    """Uneven expert load, as a trained router has and a random one has not: each layer's router rows scaled by
    ``1 + skew`` down to 1 (linearly, over a per-layer random order of the experts), so a larger row wins the
    top-k more often; different experts are popular in different layers."""
    g = torch.Generator().manual_seed(1234)
    for b in blocks:
        w = b.router.weight
        E = w.shape[0]
        scale = torch.empty(E)
        scale[torch.randperm(E, generator=g)] = torch.linspace(1.0 + skew, 1.0, E)
        w.mul_(scale.to(w.device, w.dtype)[:, None])


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


def decode(model, ids, tokens, mask=None, on_first_token=None, cache=None):
    """Decode tokens/s of every sequence together (``generate``'s steps after the prefill, times the batch);
    ``on_first_token``: see :class:`TokenClock`; ``cache``: generate's ``cache_implementation`` (None: dynamic)."""
    clock = TokenClock(on_first_token)
    kw = {"cache_implementation": cache} if cache else {}
    model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                   pad_token_id=0, streamer=clock, **kw)
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
    peer's ``token agree`` (its argmax against the bf16 model's, position by position) and ``rel err`` are measured
    against, by one teacher-forced forward of ``seq``."""

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
        dev = model.get_input_embeddings().weight.device  # the CPU-only peer runs where its model is
        kw = {k: v.to(dev) for k, v in self.kw.items()}
        with torch.no_grad():
            logits = model(self.seq.to(dev), **kw).logits[:, self.prompt_len - 1:-1]
        return logits.float().cpu()

    def compare(self, model, handle=None) -> dict:
        """``token agree`` and ``rel err`` of ``model``. With CPU compute of misses (``handle.host_compute``), the
        teacher-forced forward runs under ``cpu_compute: auto``: an expert routed more than
        ``cpu_compute_max_tokens`` of its tokens is computed on the GPU (the host would take a GEMM's time per
        expert), the rest on the host, as decode computes them."""
        host = getattr(handle, "host_compute", None)
        mode = host.mode if host is not None else None
        if host is not None:
            host.mode = ExpertCPUCompute.AUTO
        try:
            logits = self.forward(model)
        finally:
            if host is not None:
                host.mode = mode
        # against the bf16 model's own teacher-forced argmax at each position (the same forward shape: its greedy
        # decode can differ from it by bf16 rounding where two logits are near-tied)
        agree = (logits.argmax(-1) == self.logits.argmax(-1)).float().mean().item()
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
    detach_offload(blocks)
    for b, tensors in zip(blocks, snap):
        for n, t in tensors.items():
            setattr(b.experts, n, nn.Parameter(t, requires_grad=False))


def detach_offload(blocks):
    """The model's own experts modules back in its MoE blocks, and an earlier offload's handle, store and slots
    freed (its modules and handle form a cycle)."""
    for b in blocks:
        b.block.experts = b.experts
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # the hooks peers' pinned copies come from torch's caching host allocator, which keeps freed blocks
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def regenerate_experts(blocks, specs: dict, device, std: dict, on_host: bool = False):
    """Every MoE layer's experts made again on ``device``, layer by layer, from the generators the build used
    (:func:`fill_experts`): the same weights, bit for bit, as the model had before an earlier offload took them
    (``on_host``: drawn there and kept in pageable host memory).
    ``specs``: ``{name: (shape, dtype)}`` of one layer's expert tensors, in the block's order."""
    detach_offload(blocks)
    with torch.no_grad():
        for i, b in enumerate(blocks):
            tensors = {n: torch.empty(shape, dtype=dtype, device="cpu" if on_host else device)
                       for n, (shape, dtype) in specs.items()}
            fill_experts(tensors, i, std, device)
            for n, t in tensors.items():
                setattr(b.experts, n, nn.Parameter(t, requires_grad=False))


class ExpertSource:
    """Where each offloaded peer's experts come from, and the GPU cap around it.

    ``host``: one pageable host copy of every expert (:func:`experts_to_host`), re-attached before each offload:
    for small runs and the CPU. ``host-regen``: the model was built with its experts in pageable host memory
    (:func:`build`'s ``host_experts``), and each peer regenerates them there (:func:`regenerate_experts`
    ``on_host``; the first peer offloads the build's own), as a user's model loaded from a checkpoint on the host
    has them: the GPU never holds more than one layer's tensor of them, so a model whose experts exceed the GPU
    can run (the 32-layer Mixtral-8x7B on an 80 GB card); the peers that need the whole model on the GPU (full,
    the agreement reference) do not run.
    ``gpu``: no host copy; each peer regenerates the experts on the compute device
    (:func:`regenerate_experts`) with the cap lifted, offloads them (``offload_experts`` quantizes on the device
    and copies into the host tier, freeing the device copies), and :meth:`settle` applies the cap again and
    resets the peak. That set-up peaks above the cap (the whole model on the GPU for a moment; a user with a
    16 GiB card would load the experts from a checkpoint on the host instead); the timed decode runs under the
    cap. A host copy next to a bf16 peer's pinned tier does not fit the host at the real Mixtral-8x7B size.
    """

    def __init__(self, kind: str, blocks, device, std: dict, cap_gib=None):
        self.kind, self.blocks, self.device, self.std, self.cap_gib = kind, blocks, device, std, cap_gib
        self.specs = {n: (tuple(t.shape), t.dtype) for n, t in blocks[0].expert_tensors().items()}
        self.snap = experts_to_host(blocks) if kind == "host" else None
        if kind == "gpu":  # the build's copies go: every peer makes its own, and the cap holds until then
            for b in blocks:
                for n in self.specs:
                    delattr(b.experts, n)
        self.cuda = device.type == "cuda"

    def layout(self) -> ExpertLayout:
        """The exact layout of one expert (from the shapes alone)."""
        E = self.specs[next(iter(self.specs))][0][0]
        return ExpertLayout.from_stacked({n: torch.empty(shape, dtype=dtype, device="meta")
                                          for n, (shape, dtype) in self.specs.items()}, E)

    def restore(self):
        """The model's own experts modules hold every expert again (an earlier offload undone), ready for the
        next ``offload_experts``; with ``gpu`` the cap is lifted first."""
        if self.cuda:
            gpu_fraction(1.0, self.device)
        if self.snap is not None:
            attach_experts(self.blocks, self.snap)
        elif self.kind == "host-regen" and all(b.block.experts is b.experts and hasattr(b.experts, n)
                                               for b in self.blocks for n in self.specs):
            pass  # the build's host copies, not offloaded yet: the first peer takes them as they are
        else:
            regenerate_experts(self.blocks, self.specs, self.device, self.std, on_host=self.kind == "host-regen")

    def settle(self):
        """After an offload: free what it left, cap the GPU, and start the peak count from here."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            apply_cap(self.cap_gib, self.device)
            torch.cuda.reset_peak_memory_stats()


def apply_cap(cap_gib, device):
    """Cap the GPU at ``cap_gib`` (``torch.cuda.set_per_process_memory_fraction``); ``None``: no cap."""
    if cap_gib and device.type == "cuda":
        cap_gpu(cap_gib, device)


def auto_slots(cap_bytes: float, resident_bytes: float, layers: int, expert_bytes: int, num_experts: int,
               reserve_bytes: float = None) -> int:
    """GPU expert slots per layer that fit a cap: ``(cap - resident - reserve) / (layers * expert_bytes)``, at
    least 1 and at most ``num_experts``. ``resident_bytes``: the model's weights that stay on the GPU (all but
    the experts); ``expert_bytes``: one expert as the slots hold it (packed when quantized); ``reserve_bytes``
    (activations, the prefetch staging buffer, the KV cache, the allocator's slack): 1.5 GiB + 10% of the cap
    when ``None``.

    >>> auto_slots(16 * 2**30, 3.2e9, 32, 352_321_536, 8)    # Mixtral-8x7B bf16 under 16 GiB
    1
    >>> auto_slots(16 * 2**30, 3.2e9, 32, 99_090_432, 8)     # ... int4 (group 64)
    3
    """
    return int(max(1, min(num_experts, fill_bytes(cap_bytes, resident_bytes, layers, expert_bytes, reserve_bytes)
                          // (layers * expert_bytes))))


def fill_bytes(cap_bytes: float, resident_bytes: float, layers: int, expert_bytes: int,
               reserve_bytes: float = None) -> int:
    """GPU bytes left for expert slots under a cap: ``cap - resident - reserve`` (``reserve_bytes``: 1.5 GiB + 10% of
    the cap when ``None``), at least a slot a layer. ``--slots fill`` gives it whole as
    ``moe.gpu_expert_total_bytes``; :func:`auto_slots` divides it evenly over the layers.

    >>> fill_bytes(16 * 2**30, 3.2e9, 32, 99_090_432) // 99_090_432   # Mixtral-8x7B int4 (group 64): 3.3 a layer
    107
    """
    if reserve_bytes is None:
        reserve_bytes = 1.5 * GIB + 0.1 * cap_bytes
    return int(max(layers * expert_bytes, cap_bytes - resident_bytes - reserve_bytes))


def slot_text(handle) -> str:
    """A handle's slots a layer: ``3``, or ``4-5`` (mean 4.59) when a total budget spreads a remainder."""
    n = handle.cache.group_slots
    return slot_range(n) + (f" (mean {sum(n) / len(n):.2f})" if min(n) != max(n) else "")


def resident_bytes(model, blocks) -> int:
    """Bytes of the model's parameters and buffers outside its experts (what stays on the GPU when they are
    offloaded)."""
    experts = {id(t) for b in blocks for t in b.expert_tensors().values()}
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if id(t) not in experts)


def host_bandwidth_gbps(nbytes: int) -> float:
    """Host memory read bandwidth, GB/s: the best of 3 ``sum()`` of an ``nbytes`` fp32 tensor on the CPU (every
    intra-op thread), what the CPU-compute peers' host bound is computed from."""
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    t.sum()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - t0)
    return t.numel() * 4 / best / 1e9


def host_memory() -> dict:
    """``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo`` in bytes (``psutil``'s where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return {"total": info["MemTotal"], "available": info["MemAvailable"]}
    except (OSError, KeyError):
        import psutil
        vm = psutil.virtual_memory()
        return {"total": vm.total, "available": vm.available}


def union_length(spans) -> float:
    """The length of the union of the intervals ``(start, end)`` (overlaps counted once: several streams)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def gpu_busy(model, ids, tokens, mask=None, out=None, name="", cache=None) -> dict:
    """The share of a decode's wall time in which the GPU ran anything (the union of its kernels' and copies'
    intervals, every stream), from ``torch.profiler`` over the decode steps of a ``tokens``-token ``generate`` (it
    starts when the prefill's token arrives: the prefill is left out): how far the step is bound by the host's
    launches and waits rather than by the device. With ``out``, appends the top device ops to that file and writes
    the timeline beside it (``OUT.<n>.json``, for chrome://tracing or Perfetto)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    t0 = []

    def start():
        if cuda:
            torch.cuda.synchronize()
        prof.start()
        t0.append(time.perf_counter())

    decode(model, ids, tokens, mask, on_first_token=start, cache=cache)   # decode() synchronizes at its end
    wall_us = (time.perf_counter() - t0[0]) * 1e6
    prof.stop()
    busy = union_length((e.time_range.start, e.time_range.end) for e in prof.events()
                        if e.device_type == DeviceType.CUDA)
    if out:
        with open(out, "a") as f:
            n = f.tell()
            f.write(f"## {name}: {tokens - 1} decode steps, wall {wall_us / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms"
                    f" (timeline: {os.path.basename(out)}.{n}.json)\n\n")
            f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18) + "\n\n")
        prof.export_chrome_trace(f"{out}.{n}.json")
    return {"GPU busy %": round(100 * busy / wall_us, 1)}


# The decodes (prompt shape, tokens, cache kind) a process has run whole: on Hopper, PyTorch's SDPA takes the cuDNN
# backend, which builds a graph for each new sequence length once a process, so the first row of a process warms up
# over its whole length, whichever peer it is; with a short warm-up its timed decode would pay a build a token
# (docs/moe_inference.md, "A process's first generate")
_WARMED: set = set()


def run_peer(bench, name, model, ids, tokens, handle=None, warmup_tokens=2, reference=None, mask=None,
             prefill_ids=None, host_gbps=None, gpu=True, profile_tokens=0, profile_out=None, cache=None, **extra):
    cuda = gpu and torch.cuda.is_available()
    key = (tuple(ids.shape), tokens, cache)
    if key not in _WARMED:
        warmup_tokens = max(warmup_tokens, tokens)
    try:
        decode(model, ids, warmup_tokens, mask, cache=cache)      # warm-up (kernels, allocator, cache, attention)
        _WARMED.add(key)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        # the stats count the decode's forwards only: a prompt's prefill loads most of a layer's experts and
        # would count its tokens beside them
        tps = decode(model, ids, tokens, mask, on_first_token=handle.reset_stats if handle is not None else None,
                     cache=cache)
        st = handle.stats() if handle is not None else None
        peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
        if cuda and profile_tokens:
            extra = {**extra, **gpu_busy(model, ids, profile_tokens, mask, profile_out, name, cache)}
        pre = {}
        if prefill_ids is not None:  # warm-up forward at the length (attention's graphs), then the timed one
            prefill(model, prefill_ids)
            if handle is not None:
                handle.reset_stats()
            sec = prefill(model, prefill_ids)
            pre = {"prefill s": round(sec, 3), "prefill tok/s": round(prefill_ids.numel() / sec, 1)}
            if cuda:
                pre["prefill peak GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            if handle is not None:
                pst = handle.stats()
                pre.update({"prefill experts/layer": round(pst["experts_per_layer"], 2),
                            "prefill hit rate": round(pst["hit_rate"], 3)})
        quality = reference.compare(model, handle) if reference is not None else {}
    except Exception as e:  # a peer that cannot run is a row
        bench.add(name, None, error=f"{type(e).__name__}: {str(e)[:60]}")
        return None
    row = {"tokens/s": round(tps, 2)}
    if st is not None:
        per_tok = st["bytes_moved"] / max(st["tokens"], 1)
        host_tok = st.get("cpu_experts", 0) * st["expert_bytes"] / max(st["tokens"], 1)  # host bytes read a token
        row.update({"slots/layer": round(st["slots_per_layer"], 2), "hit rate": round(st["hit_rate"], 3),
                    "resident hit rate": round(st["resident_hit_rate"], 3),
                    "prefetch prec": round(st["prefetch_precision"], 3),
                    "prefetch recall": round(st["prefetch_recall"], 3), "GB/token": round(per_tok / 1e9, 3),
                    "PCIe bound tok/s": round(H2D_GBPS * 1e9 / per_tok, 2) if per_tok else "-",
                    "stall ms": round(st["stall_ms"], 1), "expert MB": round(st["expert_bytes"] / 1e6, 1),
                    "host experts/token": round(st.get("cpu_experts", 0) / max(st["tokens"], 1), 2)})
        if handle.host_compute is not None:
            row.update({"host GB/token": round(host_tok / 1e9, 3),
                        "host bound tok/s": round(host_gbps * 1e9 / host_tok, 2) if host_tok and host_gbps else "-",
                        # the same bytes (moved and host-read) if any of them could go to either side, both at their
                        # rates alone: the ceiling of any split between the link and the host
                        "both bound tok/s": round((H2D_GBPS + host_gbps) * 1e9 / (per_tok + host_tok), 2)
                        if host_gbps and per_tok + host_tok else "-",
                        # auto's two cost estimates (what split it made): host ms an expert (running mean of the
                        # experts it computed), link ms an expert (one timed copy)
                        "host ms/expert": round(st["cpu_ms_per_expert"], 2),
                        "link ms/expert": round(st["link_ms_per_expert"], 2) if st.get("link_ms_per_expert") else "-"})
        row["experts/layer"] = round(st["experts_per_layer"], 2)
        if handle.decode_graphs is not None:  # moe.decode_graphs installed: whether the row's steps replayed graphs
            row["graph replays/token"] = round(st["decode_graph_replays"] / max(st["tokens"], 1), 2)
            row["split eager/token"] = round(st["decode_graph_eager_steps"] / max(st["tokens"], 1), 2)
            if st["decode_graph_failed"]:
                row["graphs failed"] = st["decode_graph_failed"][:80]
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


def int_list(least: int):
    """An argparse type: one integer of at least ``least``, or a comma list of them (``--prefetch-top-k``: 1)."""
    def parse(text: str) -> list:
        try:
            ns = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            ns = []
        if not ns or min(ns) < least:
            raise argparse.ArgumentTypeError(f"takes integers of at least {least}, comma-separated: {text!r}")
        return ns
    return parse


def on_off_list(text: str) -> list:
    """``--skip-resident``: ``on``, ``off`` or a comma list of them, as booleans."""
    words = [t.strip() for t in text.split(",") if t.strip()]
    if not words or set(words) - {"on", "off"}:
        raise argparse.ArgumentTypeError(f"takes on/off, comma-separated: {text!r}")
    return [w == "on" for w in words]


def graph_modes(text: str) -> list:
    """``--decode-graphs``: ``off``, ``static`` or ``on``, or a comma list of them."""
    modes = [t.strip() for t in text.split(",") if t.strip()]
    bad = [m for m in modes if m not in ("off", "static", "on")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"expected off, static or on, comma-separated; got {text!r}")
    return modes


def parse_peers(args) -> list:
    """The peer keys to run, in order: ``--peers`` (comma-separated keys of ``PEERS``, run in the order given),
    else ``--quick``'s, else all; ``full`` runs first (the quality reference is taken after it) and ``cpu`` and
    ``whole`` last, wherever they are named."""
    if args.peers:
        keys = list(dict.fromkeys(k.strip() for k in args.peers.split(",") if k.strip()))
        bad = set(keys) - set(PEERS)
        if bad:
            raise SystemExit(f"--peers: unknown {sorted(bad)}; choose from {', '.join(PEERS)}")
    else:
        keys = list(QUICK_PEERS) if args.quick else list(PEERS)
    return ([k for k in keys if k == "full"] + [k for k in keys if k not in ("full", *LAST_PEERS)]
            + [k for k in LAST_PEERS if k in keys])


def resolve_shape(args) -> None:
    """Fill ``args``' model sizes: ``--family``'s shape (``--small``: a CPU-sized one), then the flags given."""
    shape = dict(FAMILIES[args.family])
    if args.small:
        shape.update(SMALL[args.family])
    for k in ("layers", "hidden", "ffn", "experts", "top_k", "vocab"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    if args.family == "mixtral" and args.hidden is not None:  # heads of 128, a KV head per 4 of them
        shape.update(heads=max(1, shape["hidden"] // 128), kv_heads=max(1, shape["hidden"] // 512))
    for k, v in shape.items():
        setattr(args, k, v)
    if args.tokens is None:
        args.tokens = 16 if args.small else 32
    if args.baseline_tokens is None:
        args.baseline_tokens = 4 if args.small else 6
    if args.agree_tokens is None:
        args.agree_tokens = args.tokens


def expert_bytes_bf16(args) -> int:
    """Bytes of every expert of the model in bf16."""
    return 3 * args.hidden * args.ffn * args.experts * args.layers * 2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="mixtral", help="mixtral (Mixtral-8x7B layers) or "
                   "qwen3 (Qwen3-30B-A3B: 48 layers, 128 experts of ffn 768, top-8)")
    p.add_argument("--layers", type=int, default=None, help="override the family's layer count")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--slots", default="2", help="GPU expert slots per layer: an integer, 'auto' (as many as fit "
                   "the --cap-gib in every layer alike, per peer from its packed expert size) or 'fill' (the same "
                   "budget as moe.gpu_expert_total_bytes: its remainder gives some layers one slot more)")
    p.add_argument("--reserve-gib", type=float, default=None, help="with --slots auto or fill: GPU memory kept for "
                   "activations, staging and the KV cache (default 1.5 GiB + 10%% of the cap)")
    p.add_argument("--tokens", type=int, default=None, help="timed decode tokens (32; --small 16)")
    p.add_argument("--agree-tokens", type=int, default=None, help="length of the bf16 model's greedy continuation "
                   "that token agree / rel err are measured over, in one teacher-forced forward per peer "
                   "(default --tokens)")
    p.add_argument("--baseline-tokens", type=int, default=None, help="tokens for the slow move-every-layer peers")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (left padded, masked); "
                   "tokens/s counts all of them")
    p.add_argument("--prefill-len", type=int, default=None, help="also time one prefill of a prompt of this many "
                   "tokens (batch 1) per peer")
    p.add_argument("--group-size", type=int, default=64, help="moe.quant.group_size of the int peers")
    p.add_argument("--prefetch-top-k", type=int_list(1), default=None, help="moe.prefetch_top_k of the bf16+/int "
                   "peers (default: the config's, 1), each guess staged in its own buffer; a comma list (1,2,1) "
                   "runs each of those peers once per value, in order, in one process")
    p.add_argument("--skip-resident", type=on_off_list, default=None, help="moe.prefetch_skip_resident of the "
                   "bf16+/int peers: on, off, or a comma list, each a timed run on the same offloaded model")
    p.add_argument("--router-skew", type=float, default=0.0, help="uneven expert load: each layer's router rows "
                   "scaled by 1+SKEW down to 1 over a random order of its experts (0: the random router as drawn)")
    p.add_argument("--small", action="store_true", help="a small CPU-sized model (smoke test)")
    p.add_argument("--init", choices=("scaled", "hf"), default="scaled", help="random weights: 'scaled' (residual "
                   "outputs at std / sqrt(2 x layers), embedding N(0, 1): a stable model whose token agreement "
                   "means something) or 'hf' (every matrix N(0, initializer_range))")
    p.add_argument("--quick", action="store_true", help="only ours: LRU, staged guesses, in-slot guesses")
    p.add_argument("--ours-variants", choices=("all", "quick", "default"), default=None, help="the bf16 cache "
                   "variants of peer 'ours': all six, the first three (--quick's), or only the default cache "
                   "(prefetch top-1, head staged)")
    p.add_argument("--peers", default=None, help=f"comma-separated peers to run, of: {', '.join(PEERS)}")
    p.add_argument("--cap-gib", type=float, default=None, help="cap the GPU at this many GiB for every peer but "
                   "'full' (torch.cuda.set_per_process_memory_fraction); on the CPU only --slots auto uses it")
    p.add_argument("--expert-source", choices=("gpu", "host", "host-regen"), default=None, help="where each "
                   "offloaded peer's experts come from: 'host', one pageable host copy; 'gpu', regenerated on the "
                   "compute device; 'host-regen', built and regenerated in host memory (experts larger than the "
                   "GPU; no 'full' peer, no agreement reference) "
                   "(default: host when the experts take under 40%% of host memory)")
    p.add_argument("--host-bw-gb", type=float, default=2.0, help="GB read to measure the host's bandwidth")
    p.add_argument("--budget-s", type=float, default=165.0, help="wall-clock budget; peers that no longer fit "
                   "are rows that say so")
    p.add_argument("--decode-gemv", choices=("tile", "one-row"), default="one-row", help="the quantized peers' "
                   "kernel where each expert has one row (batch-1 decode): the one-row gemv (the default) or the "
                   "token-tile kernel (ds_maximus.experts.compute.DECODE_GEMV)")
    p.add_argument("--round-mma", choices=("off", "on"), default="on", help="the quantized peers' kernel where "
                   "an expert has several rows (a prefill, batched decode): the tensor-core kernel at "
                   "quant_triton.MMA_CONFIG (on, the default) or the token-tile kernel (ds_maximus.experts.compute."
                   "ROUND_MMA)")
    p.add_argument("--host-rows", choices=("dynamic", "static"), default="dynamic", help="how the host expert op "
                   "(cpu_compute peers) spreads an expert's rows over its threads: dynamically (the default) or in "
                   "static shares (ds_maximus.ops.expert_cpu.set_dynamic_rows)")
    p.add_argument("--decode-graphs", type=graph_modes, default=None, help="moe.decode_graphs of the ours rows, "
                   "comma-separated: off (dynamic KV cache, the default), static (a static KV cache, no graphs), on "
                   "(a static KV cache and the layers' CUDA graphs); a row each")
    p.add_argument("--profile-tokens", type=int, default=0, help="on a GPU, after each peer's timed decode, profile "
                   "a decode of this many tokens: 'GPU busy %%' (the share of wall time the device ran anything) and, "
                   "with --out, the top device ops in OUT.profile.txt")
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.host_rows == "static":
        from ds_maximus.ops import expert_cpu
        expert_cpu.set_dynamic_rows(False)
    from ds_maximus.experts import compute
    from ds_maximus.experts.quant_triton import MMA_CONFIG
    compute.DECODE_GEMV = args.decode_gemv == "one-row"
    compute.ROUND_MMA = MMA_CONFIG if args.round_mma == "on" else None
    budget = Budget(args.budget_s)
    want = parse_peers(args)
    resolve_shape(args)
    ours_variants = args.ours_variants or ("quick" if args.quick else "all")
    if args.slots not in ("auto", "fill") and not args.slots.isdigit():
        raise SystemExit(f"--slots takes a positive integer, 'auto' or 'fill', not {args.slots!r}")
    if args.batch < 1 or (args.prefill_len is not None and args.prefill_len < 1) or args.agree_tokens < 1:
        raise SystemExit("--batch, --prefill-len and --agree-tokens take positive integers")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mem = host_memory()
    expert_bytes = expert_bytes_bf16(args) * (1 if device.type == "cuda" else 2)  # fp32 on the CPU
    source = args.expert_source or ("host" if expert_bytes < 0.4 * mem["total"] else "gpu")
    progress(f"expert source: {source} ({expert_bytes / 1e9:.1f} GB of experts, host memory "
             f"{mem['total'] / 1e9:.0f} GB, {mem['available'] / 1e9:.0f} GB available)")
    host_gbps = host_bandwidth_gbps(int(args.host_bw_gb * 1e9 if not args.small else min(args.host_bw_gb, 0.25) * 1e9))
    progress(f"host memory bandwidth: {host_gbps:.1f} GB/s ({torch.get_num_threads()} threads, sum() of fp32)")
    progress(f"building the {args.family} model on {device} ({args.layers} layers, H={args.hidden}, F={args.ffn}, "
             f"E={args.experts}, top-{args.top_k}, {args.dtype})")
    if source == "host-regen" and "full" in want:
        progress("expert source host-regen: the experts never all sit on the GPU, so no 'full' peer")
        want = [w for w in want if w != "full"]
    model = build(args, device, host_experts=source == "host-regen")
    expert_gib = expert_bytes / GIB
    cap = args.cap_gib if device.type == "cuda" else None
    bench = Bench("moe_offload", dtype=str(args.dtype).replace("torch.", ""),
                  sizes={"family": args.family, "init": args.init, "layers": args.layers, "H": args.hidden,
                         "F": args.ffn, "E": args.experts, "top_k": args.top_k, "slots/layer": args.slots,
                         "expert GiB": round(expert_gib, 1), "decode tokens": args.tokens,
                         "agree tokens": args.agree_tokens, "batch": args.batch,
                         "prefill tokens": args.prefill_len or "-", "group size": args.group_size,
                         "GPU cap GiB": cap if cap else "none", "expert source": source,
                         "decode gemv": args.decode_gemv,
                         "host GB/s": round(host_gbps, 1)},
                  notes=f"tokens/s = decode only (after prefill), every sequence of the batch; ms = 1000 / "
                        f"tokens/s; hit rates, prefetch, GB/token, stall ms, host experts/token: the decode's "
                        f"forwards only (the prompt's prefill left out); experts/layer = distinct experts a MoE "
                        f"layer call hit; PCIe bound at "
                        f"{H2D_GBPS:.0f} GB/s pinned H2D from the measured bytes moved per token; host bound "
                        f"(+cpu rows) at the measured {host_gbps:.0f} GB/s host bandwidth from the expert bytes the "
                        f"host read per token; host / link ms/expert (+cpu rows) = cpu_compute's cost estimates "
                        f"(its running mean of a host expert, one timed copy); token agree / rel err: "
                        f"teacher-forced over the bf16 model's "
                        f"{args.agree_tokens}-token greedy continuation, each position's argmax / the logits "
                        f"against the bf16 model's in the same forward (+cpu rows: that forward under "
                        f"cpu_compute=auto)")
    ids, mask = prompts(args, device)
    prefill_ids = None
    if args.prefill_len:
        prefill_ids = torch.randint(1, args.vocab, (1, args.prefill_len),
                                    generator=torch.Generator().manual_seed(2)).to(device)

    base = "full model on GPU (HF generate)"
    # seconds each step needs on the GPU host at the default size (8 Mixtral-8x7B layers, 22.5 GB of bf16
    # experts), scaled by the model's expert bytes (a step starts only when it still fits):
    # hooks = 22.5 GB pinned copy + ~10 forwards that each move every expert; ours = its pinned store (gpu source:
    # plus regenerating the experts on the device); quant setup = quantizing every expert on the GPU into the
    # pinned packed store, its decode the packed bytes; reference = a 32-token greedy decode on the GPU; cpu = the
    # whole model moved to the host and decoded there
    scale = (1.0 if device.type == "cuda" else 0.1) * expert_bytes_bf16(args) / MIXTRAL_8L_EXPERT_BYTES
    cost = {"full": 14, "hooks setup": 12, "hooks": 12, "ours setup": 12, "ours": 8, "whole setup": 10,
            "quant setup": 10, "reference": 6 * max(1.0, args.agree_tokens / 32), "cpu setup": 10, "cpu": 30}
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

    def peer(name, key, *a, need=None, **kw):
        tps = None
        if not budget.allows((cost[key] if need is None else need) * scale, name):
            bench.skip(name)
        else:
            progress(f"{name}: start ({budget.left():.0f} s left)")
            if key == "ours" and acc_tps:
                kw = {**kw, "x accelerate": "pending"}
            tps = run_peer(bench, name, *a, reference=reference, mask=mask, prefill_ids=prefill_ids,
                           host_gbps=host_gbps, profile_tokens=args.profile_tokens,
                           profile_out=args.out and args.out + ".profile.txt", **kw)
            if tps and key == "ours" and acc_tps:
                bench.results[-1].extra["x accelerate"] = f"{tps / acc_tps[0]:.1f}x"
            progress(f"{name}: {f'{tps:.2f} tokens/s' if tps else bench.results[-1].error}")
        checkpoint()
        return tps

    progress(f"model built on {device} ({expert_gib:.1f} GiB of experts); budget {args.budget_s:.0f} s; "
             f"peers {want}")
    if "full" in want:  # (the first row of a process warms up over the whole length: run_peer)
        peer(base, "full", model, ids, args.tokens)
    if source == "host-regen":
        progress("expert source host-regen: no bf16 reference (it needs the whole model on the GPU); token agree "
                 "and rel err are not measured")
    elif budget.allows(cost["reference"] * scale, "the bf16 reference (token agree, rel err)"):
        progress(f"the bf16 model's {args.agree_tokens}-token greedy continuation and logits (the quality "
                 f"reference)")
        reference = Reference(model, ids, args.agree_tokens, mask)
        if "full" in want and bench.results and bench.results[-1].error == "":
            bench.results[-1].extra.update(reference.compare(model))
    blocks = find_moe_blocks(model)
    std = model.bench_expert_stds
    resident = resident_bytes(model, blocks)
    progress("experts: " + {"host": "moved to host memory (each offloaded peer starts from there)",
                            "host-regen": "in host memory, regenerated there by each offloaded peer"}.get(
        source, "regenerated on the device by each offloaded peer"))
    src = ExpertSource(source, blocks, device, std, cap)
    src.settle()
    if cap:
        progress(f"GPU capped at {cap:g} GiB of {torch.cuda.get_device_properties(device).total_memory / GIB:.0f}")
    exact = src.layout()
    slot_cap = args.cap_gib * GIB if args.cap_gib else (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
    reserve = args.reserve_gib * GIB if args.reserve_gib is not None else None

    def slots_for(bits):
        """The ``moe`` keys sizing the GPU slots of a peer whose tier holds ``bits``-bit experts (``None``: bf16):
        ``gpu_experts_per_layer``, or with ``--slots fill`` ``gpu_expert_total_bytes``."""
        if args.slots not in ("auto", "fill"):
            return {"gpu_experts_per_layer": int(args.slots)}
        lay = QuantizedExpertLayout.from_layout(exact, bits, args.group_size) if bits else exact
        if slot_cap is None:  # no cap on the CPU: every expert
            return {"gpu_experts_per_layer": args.experts}
        if args.slots == "fill":
            return {"gpu_expert_total_bytes": int(fill_bytes(slot_cap, resident, args.layers, lay.nbytes, reserve))}
        return {"gpu_experts_per_layer": auto_slots(slot_cap, resident, args.layers, lay.nbytes, args.experts,
                                                    reserve)}

    def setup_need(bits, key):
        """Estimated set-up seconds (at the default run's size) of an offload whose tier holds ``bits``."""
        return cost[key] * (bits / 16 if bits else 1.0) + 2

    def run_hooks():
        hooks_name = "hooks: copy every expert of a layer per forward (pinned)"
        acc_name = "accelerate cpu_offload (experts modules)"
        if not budget.allows((cost["hooks setup"] + cost["hooks"]) * scale, hooks_name):
            bench.skip(hooks_name)
            bench.skip(acc_name)
            return
        progress("hooks baseline: copying the experts to pinned CPU memory")
        src.restore()
        hooks = hooks_baseline(model, device)
        src.settle()
        peer(hooks_name, "hooks", model, ids, args.baseline_tokens)
        for h in hooks:
            h.remove()
        try:
            import accelerate
        except ImportError:
            bench.add(f"{acc_name}: not installed", None, error="-")
            return
        for b in blocks:
            accelerate.cpu_offload(b.experts, execution_device=device,
                                   state_dict={n: t.data for n, t in b.expert_tensors().items()})
        tps = peer(f"{acc_name} {accelerate.__version__}", "hooks", model, ids, args.baseline_tokens)
        if tps:
            acc_tps.append(tps)
        for b in blocks:
            accelerate.hooks.remove_hook_from_module(b.experts, recurse=True)

    ours = ["ours: LRU cache, prefetch off (mixtral-offloading design)",
            "ours: prefetch top-1, head staged (+96 MiB GPU; the default)",
            "ours: prefetch top-1, 96 MiB head into a slot",
            "ours: prefetch top-1, head into a slot, LRU victims",
            "ours: prefetch top-1, whole-expert guesses into a slot",
            f"ours: prefetch top-{args.top_k}, heads into slots"]

    def run_ours():
        names = {"all": ours, "quick": ours[:3], "default": ours[1:2]}[ours_variants]
        if not budget.allows((setup_need(None, "ours setup") + cost["ours"]) * scale, "ours (offload_experts)"):
            for name in names:
                bench.skip(name)
            return
        progress("ours: offload_experts (experts into the pinned store)")
        src.restore()
        slots = slots_for(None)
        default_only = ours_variants == "default"
        try:
            handle = offload_experts(model, {**slots, "speculative_prefetch": default_only})
        except Exception as e:  # a configuration that cannot run (host memory, say) is a row
            bench.add(names[0], None, error=f"{type(e).__name__}: {str(e)[:60]}")
            checkpoint()
            return
        src.settle()
        progress(f"ours: {slot_text(handle)} slots/layer of {handle.cache.layout.nbytes / 1e6:.1f} MB")
        cache = handle.cache
        if not default_only:
            peer(ours[0], "ours", model, ids, args.tokens, handle,
                 warmup_tokens=args.tokens if ours_variants == "quick" else 2)
            handle.speculative_prefetch = True
        handle.cfg.prefetch_top_k = 1
        peer(ours[1], "ours", model, ids, args.tokens, handle)
        if not default_only:
            cache.stage_guesses = False  # the guess's head goes into the slot it will use (evicting a resident)
            peer(ours[2], "ours", model, ids, args.tokens, handle)
        if ours_variants == "all":
            handle.keep_predicted = False  # ... and the victim is the least recent, predicted or not
            peer(ours[3], "ours", model, ids, args.tokens, handle)
            handle.keep_predicted = True
            chunk, cache.prefetch_chunk_bytes = cache.prefetch_chunk_bytes, None  # whole loads
            peer(ours[4], "ours", model, ids, args.tokens, handle)
            cache.prefetch_chunk_bytes = chunk
            handle.cfg.prefetch_top_k = None
            peer(ours[5], "ours", model, ids, args.tokens, handle)
        handle.close()

    def run_variant(key):
        """The default cache (staged guesses) with CPU compute of misses and/or the quantized tier, once per
        ``--prefetch-top-k`` value."""
        for k in args.prefetch_top_k or [None]:
            run_variant_once(key, k)

    def run_variant_once(key, top_k):
        base, _, suffix = key.partition("+")
        bits, cpu = QUANT_BITS.get(base), CPU_MODES.get(suffix)
        name = (f"ours int{bits} (group {args.group_size})" if bits else "ours bf16") + \
            (f" + cpu_compute={cpu}" if cpu else "") + (f", prefetch top-{top_k}" if top_k is not None else "")
        need = setup_need(bits, "quant setup" if bits else "ours setup") + cost["ours"] * (bits / 16 if bits else 1)
        if not budget.allows(need * scale, name):
            bench.skip(name)
            checkpoint()
            return
        progress(f"{name}: offload_experts" + (" (quantizing every expert once)" if bits else ""))
        src.restore()
        try:
            slots = slots_for(bits)
            cfg = {**slots, "cpu_compute": cpu or "off"}
            if top_k is not None:
                cfg["prefetch_top_k"] = top_k
            if bits:
                cfg["quant"] = {"bits": bits, "group_size": args.group_size}
            if "on" in (args.decode_graphs or []):
                cfg["decode_graphs"] = True  # installed once; each row below switches it
            handle = offload_experts(model, cfg)
        except Exception as e:  # a configuration that cannot run is a row
            bench.add(name, None, error=f"{type(e).__name__}: {str(e)[:60]}")
            checkpoint()
            return
        src.settle()
        progress(f"{name}: {slot_text(handle)} slots/layer of {handle.cache.layout.nbytes / 1e6:.1f} MB")
        for skip in args.skip_resident or [None]:
            for graphs in args.decode_graphs or [None]:
                if skip is not None:
                    handle.cfg.prefetch_skip_resident = skip
                if graphs is not None:
                    handle.cfg.decode_graphs = graphs == "on"
                peer(name + ("" if skip is None else f", skip resident {'on' if skip else 'off'}")
                     + ("" if graphs is None else f", decode graphs {graphs}"), "ours", model, ids, args.tokens,
                     handle, need=0, cache="static" if graphs in ("static", "on") else None)
        handle.close()

    def run_bnb():
        """bitsandbytes' 4-bit model, not offloaded: every expert tensor (fused, 3-D: not an ``nn.Linear`` that
        ``Linear4bit`` could replace) quantized to nf4 in place by ``bitsandbytes.nn.parametrize.
        replace_parameter_4bit``, which dequantizes the whole tensor at every access (a layer's experts in bf16
        for a moment); where the model does not fit the cap, a row that says by how much."""
        name = "bitsandbytes nf4 experts (replace_parameter_4bit), not offloaded"
        try:
            import bitsandbytes
            from bitsandbytes.nn.parametrize import replace_parameter_4bit
        except Exception as e:  # not installed, no build for this machine, or too old for fused experts
            bench.add(f"{name}: not available", None, error=f"{type(e).__name__}: {str(e)[:60]}")
            checkpoint()
            return
        from torch.nn.utils import parametrize
        layer_bytes = expert_bytes / args.layers
        params = expert_bytes / (2 if device.type == "cuda" else 4)
        need = resident + params * (0.5 + 4 / 64) + layer_bytes  # nf4 codes, an fp32 absmax per 64, one layer's
        if cap and need + 1.5 * GIB > cap * GIB:                  # dequantized experts
            bench.add(name, None, error=f"does not fit the {cap:g} GiB cap: needs {need / GIB:.1f} GiB + 1.5 GiB "
                                        f"of activations")
            checkpoint()
            return
        if not budget.allows((cost["quant setup"] * 0.25 + cost["ours"]) * scale, name):
            bench.skip(name)
            checkpoint()
            return
        progress(f"{name}: quantizing every expert tensor in place ({need / GIB:.1f} GiB)")
        src.restore()
        try:
            with torch.no_grad():
                for b in blocks:
                    for n in src.specs:
                        t = getattr(b.experts, n)
                        setattr(b.experts, n, nn.Parameter(t.detach().to(device), requires_grad=False))
                        replace_parameter_4bit(b.experts, n, quant_type="nf4")
        except Exception as e:  # no kernels for this machine, say: a row
            bench.add(name, None, error=f"{type(e).__name__}: {str(e)[:60]}")
        else:
            src.settle()
            peer(f"{name} {bitsandbytes.__version__}", "ours", model, ids, args.tokens, need=0)
        for b in blocks:  # back to a plain experts module without expert tensors (the next peer makes its own)
            for n in src.specs:
                if parametrize.is_parametrized(b.experts, n):
                    parametrize.remove_parametrizations(b.experts, n, leave_parametrized=False)
                if hasattr(b.experts, n):
                    delattr(b.experts, n)
        checkpoint()

    def run_cpu():
        """CPU-only inference of the whole model, where it fits host memory next to what is held there."""
        nonlocal model
        name = "CPU only (whole model on the host)"
        on_host = sum(t.numel() * t.element_size() for layer in (src.snap or ()) for t in layer.values())
        need_bytes = resident + expert_bytes - on_host  # what moving the model to the host adds there
        detach_offload(blocks)  # the last offload's pinned tier freed before the host's free memory is read
        free = host_memory()["available"]
        if need_bytes + 4 * GIB + 0.05 * need_bytes > free:
            bench.add(name, None, error=f"does not fit: needs {need_bytes / 1e9:.0f} GB + 4 GiB, host has "
                                        f"{free / 1e9:.0f} GB available")
            checkpoint()
            return
        if not budget.allows((cost["cpu setup"] + cost["cpu"]) * scale, name):
            bench.skip(name)
            checkpoint()
            return
        progress(f"{name}: the model to the host ({need_bytes / 1e9:.0f} GB of {free / 1e9:.0f} GB available)")
        src.restore()
        model = model.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cpu_mask = mask.cpu() if mask is not None else None
        progress(f"{name}: start ({budget.left():.0f} s left)")
        tps = run_peer(bench, name, model, ids.cpu(), args.baseline_tokens, reference=reference, mask=cpu_mask,
                       gpu=False, threads=torch.get_num_threads())
        progress(f"{name}: {f'{tps:.2f} tokens/s' if tps else bench.results[-1].error}")
        checkpoint()

    def run_whole():
        # accelerate as the issue ran it: the whole model under cpu_offload, a new copy
        # (docs/bench/code_history.md)
        nonlocal model, blocks, src
        whole = "accelerate cpu_offload (whole model)"
        try:
            import accelerate
        except ImportError:
            bench.add(f"{whole}: not installed", None, error="-")
            return
        if not budget.allows((cost["whole setup"] + cost["hooks"]) * scale, whole):
            bench.skip(whole)
            return
        model = blocks = src = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            gpu_fraction(1.0, device)  # built on the GPU, then offloaded whole
        progress(f"{whole}: building a fresh model and offloading all of it")
        model = build(args, device)
        accelerate.cpu_offload(model, execution_device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            apply_cap(cap, device)
            torch.cuda.reset_peak_memory_stats()
        peer(f"{whole} {accelerate.__version__}", "hooks", model, ids, max(2, args.baseline_tokens // 2))

    for key in want:
        if key == "full":
            continue
        progress(f"peer {key} ({budget.left():.0f} s left)")
        {"hooks": run_hooks, "ours": run_ours, "bnb": run_bnb, "cpu": run_cpu,
         "whole": run_whole}.get(key, lambda k=key: run_variant(k))()
    if device.type == "cuda":  # the cap is this process's: lift it for whatever runs after (a test session)
        gpu_fraction(1.0, device)
    text = bench.report(baseline=base if "full" in want else None)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    main()
