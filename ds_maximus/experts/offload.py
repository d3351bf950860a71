"""``offload_experts``: run an HF MoE model whose experts do not fit on the compute device.

Every fused-experts module (``block.experts``) is replaced by :class:`OffloadedExperts`, which keeps
no expert weights: they live in the CPU tier (one pinned flat buffer per expert) or on NVMe, and a
per-layer :class:`ExpertCache` on the compute device holds ``gpu_experts_per_layer`` of them.
Routing, the router, attention and every other weight stay where they were; ``model.generate()``
works unchanged and gives the same tokens and logits as before. With ``moe.quant`` the experts are quantized once
as they enter the tier, which, the slots and the link then hold only their packed form
(:mod:`ds_maximus.experts.quant_layout`); the outputs are those of the model holding the dequantized weights.

    >>> import torch
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> from ds_maximus.experts import offload_experts
    >>> cfg = MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                     num_key_value_heads=2, num_local_experts=4, vocab_size=64)
    >>> model = MixtralForCausalLM(cfg).eval()
    >>> handle = offload_experts(model, {"gpu_experts_per_layer": 1})
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    >>> 0.0 <= handle.stats()["hit_rate"] <= 1.0
    True
    >>> handle.close()
"""
from __future__ import annotations

import logging
import os
import time
from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from ds_maximus.config import ExpertCPUCompute, MaximusConfig, MoEConfig, OffloadDevice
from ds_maximus.errors import ConfigError
from ds_maximus.experts import compute
from ds_maximus.experts.adapters import FusedExpertsForm, MoEBlockInfo, find_moe_blocks
from ds_maximus.experts.cpu_compute import HostExpertCompute
from ds_maximus.experts.decode_graphs import DecodeGraphs, decoder_layers
from ds_maximus.experts.expert_cache import ExpertCache, layer_slots
from ds_maximus.experts.expert_store import CpuExpertStore, FileExpertStore, make_loader
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.quant_layout import QuantizedExpertLayout
from ds_maximus.partition.host_memory import HostMemoryPlan, HostTier, TierDemand

log = logging.getLogger(__name__)

ConfigLike = Union[None, MaximusConfig, MoEConfig, dict, str, os.PathLike]

# of a speculative load, only this much is queued before the next layer's routing confirms or drops it
# (96 MiB: ~2 ms of a 50 GB/s link, about the time from a layer's loads ending to the next layer's loads
# being queued; a wrong guess costs that, not a whole expert. The sizes measured against each other:
# docs/bench/code_history.md).
# The head is staged in a buffer of this size on the device (ExpertCache(stage_guesses=n), one buffer a guess of
# a layer, moe.prefetch_top_k), so a guess evicts nothing; the buffers are the extra device memory prefetch uses.
PREFETCH_CHUNK_BYTES = 96 << 20


def _resolve(config: ConfigLike):
    """(MoEConfig, IOConfig) from a MaximusConfig, its moe section, a ds_config dict/path, or a moe dict."""
    if config is None:
        full = MaximusConfig()
    elif isinstance(config, MaximusConfig):
        full = config
    elif isinstance(config, MoEConfig):
        return config, MaximusConfig().io
    elif isinstance(config, dict) and "maximus" not in config and set(config) <= set(MoEConfig.model_fields):
        full = MaximusConfig.from_dict({"moe": config})  # a bare "moe" section
    else:
        full = MaximusConfig.from_ds_config(config)
        if not full.enabled:
            raise ConfigError("the ds_config has no enabled \"maximus\" section; add \"maximus\": {\"moe\": "
                              "{\"gpu_experts_per_layer\": 2}} or pass the moe section itself", "maximus")
    return full.moe, full.io


class OffloadedExperts(nn.Module):
    """Drop-in for a fused HF experts module; computes on experts from the cache."""

    def __init__(self, handle: "MoEOffload", group: int, original: nn.Module, num_experts: int,
                 form: FusedExpertsForm = FusedExpertsForm()):
        super().__init__()
        self.group = group
        self.num_experts = num_experts
        self.form = form  # how the original stored its projections (GPT-OSS: transposed, with biases)
        self.act_fn = getattr(original, "act_fn", None)
        self.__dict__["_handle"] = handle          # not a submodule: no recursion into the handle
        self.__dict__["_original"] = original      # keeps config, _apply_gate; its weights were dropped

    def extra_repr(self) -> str:
        h = self._handle
        return (f"layer={self.group}, num_experts={self.num_experts}, "
                f"slots={h.cache.slots_of(self.group)}, tier={h.cache.store.tier}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self._handle._forward(self, hidden_states, top_k_index, top_k_weights)


class MoEOffload:
    """The handle ``offload_experts`` returns: the cache, its stats, and ``close()``."""

    def __init__(self, blocks: List[MoEBlockInfo], cache: ExpertCache, cfg: MoEConfig):
        self.blocks = blocks
        self.cache = cache
        self.cfg = cfg
        self.speculative_prefetch = bool(cfg.speculative_prefetch)
        self.keep_predicted = True  # in-slot guesses evict only residents outside the predicted routing
        self._tokens = 0
        self._layer_calls = 0   # MoE layer forwards (a step of a batch, or a prefill, is one call a layer)
        self._experts_hit = 0   # distinct experts those calls routed to, summed
        self._experts_hit_max = 0
        self._t_first: Optional[float] = None
        self._t_last: Optional[float] = None
        self.modules: List[OffloadedExperts] = []
        self.host_compute: Optional[HostExpertCompute] = None  # moe.cpu_compute: missed experts on the host
        self.decode_graphs: Optional[DecodeGraphs] = None  # moe.decode_graphs: installed when on at offload time
        self._restore_compile = None  # (generation_config, its disable_compile before the offload)
        self.quantized = isinstance(cache.layout, QuantizedExpertLayout)  # moe.quant: slots hold the packed form

    # -- the forward of one layer -------------------------------------------------------------
    def _prefetch_picks(self, group: int, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The next MoE layer's router applied to this layer's input: each token's predicted experts of that layer,
        best first ([tokens, top_k]), or None without speculative prefetch or after the last layer."""
        if not self.speculative_prefetch or group + 1 >= len(self.blocks):
            return None
        nxt = self.blocks[group + 1]
        return torch.topk(nxt.router_logits(hidden), min(nxt.top_k, nxt.num_experts), dim=-1).indices

    def _votes(self, group: int, picks: Sequence[int]) -> List[int]:
        """``group``'s votes from the predicted picks (flat, ``top_k`` a token, best first): for its guesses (each
        token's first ``prefetch_top_k``), then for its whole predicted routing weighted by rank (``top_k`` for a
        token's first pick, 1 for its last): nonzero exactly for the predicted experts, and an order among them.
        Counted here on the host: the picks cross in the layer's one sync anyway, where votes counted on the
        device took a handful of launches a layer."""
        b = self.blocks[group]
        E, K = b.num_experts, min(b.top_k, b.num_experts)
        k = min(self.cfg.guesses(K), K)
        guess, predicted = [0] * E, [0] * E
        for i, e in enumerate(picks):
            r = i % K
            predicted[e] += K - r
            if r < k:
                guess[e] += 1
        return guess + predicted

    def _forward(self, mod: OffloadedExperts, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        group = mod.group
        if hidden.device != self.cache.device:
            raise ConfigError(f"MoE layer {group} got hidden states on {hidden.device} but its expert cache is "
                              f"on {self.cache.device}; call offload_experts after moving the model to its device")
        if group == 0:
            now = time.perf_counter()
            self._t_first = self._t_first or now
            self._tokens += hidden.shape[0]
        E = mod.num_experts
        with torch.no_grad():
            picks = self._prefetch_picks(group, hidden)
        parts = [top_k_index.flatten().long()] + ([picks.flatten()] if picks is not None else [])
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # the layer's one sync
        n_pairs = top_k_index.numel()
        pairs = host[:n_pairs]  # each (token, k) pair's expert, token-major
        counts = [0] * E
        for e in pairs:
            counts[e] += 1
        used = [e for e in range(E) if counts[e] > 0]
        self._layer_calls += 1
        self._experts_hit += len(used)
        self._experts_hit_max = max(self._experts_hit_max, len(used))
        on_host = self._host_experts(group, used, counts) if self.host_compute else []
        if on_host:  # copied before the GPU's expert work is queued, so the host computes while the GPU does
            used = [e for e in used if e not in on_host]
            host_in = (hidden.to("cpu"), top_k_weights.to("cpu"))
        ctx = compute.ExpertComputeContext(self.cache, group, mod._original._apply_gate, E, mod.form)
        ctx.needed = used
        if picks is not None:  # counted then too: nothing of the guesses sits between the sync and the experts
            ctx.after_first_round = lambda: self._issue_prefetch(group + 1, self._votes(group + 1, host[n_pairs:]))
        impl = getattr(getattr(mod._original, "config", None), "_experts_implementation", "eager")
        # packed slots: the eager loop's numbers, each projection of a round's experts in one dequant-GEMM launch
        loop = compute.packed_forward if self.quantized else compute.eager_forward
        if self.quantized:
            impl = "eager"
        if on_host:  # the resident experts by the eager loop (the grouped forms need every routed row)
            out = loop(ctx, hidden, top_k_index, top_k_weights, used, pairs)
            ctx.round_done()  # the prefetch, where no round ran (every expert on the host)
            where = compute._pairs_of(pairs, top_k_index.size(-1), on_host)
            out = out + self.host_compute.forward(group, *host_in, on_host, where).to(out.device, out.dtype)
        elif impl == "grouped_mm":
            out = compute.grouped_forward(ctx, hidden, top_k_index, top_k_weights, used, counts)
        elif impl == "batched_mm":
            out = compute.batched_forward(ctx, hidden, top_k_index, top_k_weights, used, pairs)
        else:
            if impl not in (None, "eager"):
                log.warning("experts_implementation %r is not mirrored by the expert cache; computing with the "
                            "eager loop (results equal experts_implementation='eager')", impl)
            out = loop(ctx, hidden, top_k_index, top_k_weights, used, pairs)
        if group == len(self.blocks) - 1:
            self._t_last = time.perf_counter()
        return out

    def _host_experts(self, group: int, used: List[int], counts: List[int]) -> List[int]:
        """The routed experts of ``group`` computed on the host (``moe.cpu_compute``), told the layer's slots and
        its staged guess (only the rest of which would cross the link)."""
        ids = self.cache.staged_ids(group)
        staged = ids[0] if ids else None
        frac = max(0.0, 1.0 - self.cache.stages[0].nbytes / self.cache.entry_bytes) if staged is not None else 1.0
        return self.host_compute.choose(used, counts, self.cache.resident(group), self.cache.slots_of(group),
                                        staged, frac)

    def _issue_prefetch(self, group: int, votes: List[int]) -> None:
        E = len(votes) // 2
        guess, predicted = votes[:E], votes[E:]
        limit = min(self.cfg.guesses(self.blocks[group].top_k), self.cache.slots_of(group))
        if self.cfg.prefetch_skip_resident:  # the best predicted experts that are not already in a slot
            resident = set(self.cache.resident(group))
            ranked = sorted((e for e in range(E) if predicted[e] > 0 and e not in resident),
                            key=lambda e: (-guess[e], -predicted[e]))[:limit]
        else:
            ranked = sorted((e for e in range(E) if guess[e] > 0), key=lambda e: -guess[e])[:limit]
        # a guess never evicts a resident expert the prediction also routes to (it would likely hit)
        keep = [e for e in range(E) if predicted[e] > 0] if self.keep_predicted else None
        self.cache.prefetch(group, ranked, keep=keep)

    # -- reporting -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Hit rate, prefetch precision/recall, bytes moved, stall ms, tokens/s (host clock); ``experts_per_layer``
        (the mean number of distinct experts one MoE layer call routed to: a batch's decode step or a prefill hits
        more than ``top_k``, up to every expert, which the cache serves in rounds of its slots) and
        ``experts_per_layer_max``; with ``moe.quant``
        ``quant_bits``, and ``expert_bytes`` (what one expert moves) beside ``expert_bytes_exact`` (what it would
        move in the model's dtype)."""
        s = self.cache.stats()
        span = (self._t_last - self._t_first) if self._t_first and self._t_last else 0.0
        s["tokens"] = self._tokens
        s["layer_calls"] = self._layer_calls
        s["experts_per_layer"] = self._experts_hit / self._layer_calls if self._layer_calls else 0.0
        s["experts_per_layer_max"] = self._experts_hit_max
        s["tokens_per_s"] = self._tokens / span if span > 0 else 0.0
        s["tier"] = self.cache.store.tier
        s["speculative_prefetch"] = self.speculative_prefetch
        lay = self.cache.layout
        s["quant_bits"] = lay.bits if self.quantized else None
        s["expert_bytes_exact"] = lay.exact_nbytes if self.quantized else lay.nbytes
        if self.host_compute is not None:
            s.update(self.host_compute.stats())
        if self.decode_graphs is not None:
            s.update(self.decode_graphs.stats())
        return s

    def reset_stats(self) -> None:
        self.cache.synchronize()
        self.cache.reset_stats()
        if self.host_compute is not None:
            self.host_compute.reset_stats()
        if self.decode_graphs is not None:
            self.decode_graphs.reset_stats()
        self._tokens, self._t_first, self._t_last = 0, None, None
        self._layer_calls = self._experts_hit = self._experts_hit_max = 0

    def close(self) -> None:
        if self.decode_graphs is not None:
            self.decode_graphs.close()
        if self._restore_compile is not None:
            gen, value = self._restore_compile
            gen.disable_compile = value
            self._restore_compile = None
        self.cache.close()
        self.cache.store.close()


def _quantized_layout(layout: ExpertLayout, cfg: MoEConfig, block: MoEBlockInfo, device) -> QuantizedExpertLayout:
    """The packed layout of ``moe.quant``, or a ``ConfigError`` saying why these experts cannot be quantized."""
    name = type(block.experts).__name__
    if block.form.is_transposed or block.form.has_bias:
        raise ConfigError(f"moe.quant supports fused experts stored [out, in] without biases; {name} stores "
                          f"{'transposed ' if block.form.is_transposed else ''}projections"
                          f"{' with biases' if block.form.has_bias else ''}: set quant.bits to null",
                          "maximus.moe.quant")
    if set(layout.names) != {"gate_up_proj", "down_proj"}:
        raise ConfigError(f"moe.quant quantizes experts made of gate_up_proj and down_proj; {name} has "
                          f"{sorted(layout.names)}: set quant.bits to null", "maximus.moe.quant")
    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401  (the kernel that decodes the codes inside the expert GEMM)
        except ImportError:
            raise ConfigError("moe.quant on a CUDA device computes the experts with a Triton kernel, and triton is "
                              "not installed: pip install triton, or set quant.bits to null",
                              "maximus.moe.quant") from None
    return QuantizedExpertLayout.from_layout(layout, cfg.quant.bits, cfg.quant.group_size)


def offload_experts(model: nn.Module, config: ConfigLike = None) -> MoEOffload:
    """Move every fused-experts module of ``model`` into the expert cache; returns the handle.

    ``config``: a :class:`MaximusConfig`, its ``moe`` section (object or dict), or a ds_config
    (dict or JSON path) with a ``"maximus"`` section. Call it after placing the model on its device.
    """
    cfg, io_cfg = _resolve(config)
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ConfigError(f"{type(model).__name__} has no MoE block with fused experts (gate_up_proj/down_proj); "
                          "supported: Mixtral, Qwen2-MoE, Qwen3-MoE and other transformers 5.x fused-expert models")
    E = blocks[0].num_experts
    layout = ExpertLayout.from_stacked(blocks[0].expert_tensors(), E)
    for b in blocks[1:]:
        if b.num_experts != E or ExpertLayout.from_stacked(b.expert_tensors(), E) != layout:
            raise ConfigError(f"MoE block '{b.name}' differs in expert count or shapes from '{blocks[0].name}'; "
                              "layers with different experts are not supported")
    device = blocks[0].router.weight.device
    if cfg.quant.bits is not None:
        layout = _quantized_layout(layout, cfg, blocks[0], device)
    graph_layers = decoder_layers(model, blocks) if cfg.decode_graphs else None  # refused before anything moves
    slots = layer_slots(cfg, layout.nbytes, len(blocks), E)
    n = len(blocks) * E
    # the model's own CPU expert weights are freed layer by layer below as they are copied in: the CPU tier's
    # plan counts them as memory it gets back (on the GPU they free device memory instead)
    on_cpu = sum(t.numel() * t.element_size() for b in blocks for t in b.expert_tensors().values()
                 if t.device.type == "cpu")
    if cfg.offload.device == OffloadDevice.NVME:
        os.makedirs(cfg.offload.nvme_path, exist_ok=True)
        path = os.path.join(cfg.offload.nvme_path, "experts")  # a shard store folder, one shard per expert
        record = FileExpertStore.record_bytes_for(layout)
        HostMemoryPlan([TierDemand(HostTier.NVME, n * record, f"{n} experts of {layout.nbytes / 2**20:.1f} MiB "
                                   f"in {path}", path=cfg.offload.nvme_path,
                                   reclaimable_bytes=FileExpertStore.existing_bytes(path),
                                   fix="point moe.offload.nvme_path at a disk with more free space, or free "
                                       "space there")]).check()
        store = FileExpertStore(layout, n, path, loader=make_loader(io_cfg))
    else:
        store = CpuExpertStore(layout, n, pin_memory=cfg.offload.pin_memory, reclaimable_bytes=on_cpu)
    # moe.prefetch_top_k guesses a layer, each one's head staged in a buffer of its own (it evicts nothing until the
    # demand is known), except with cpu_compute "misses": a staged guess is not resident, so the host would compute
    # it and its head would cross for nothing; there the link brings guesses into slots, where the GPU computes
    # them. "auto" keeps the stages: its split sends a staged guess to the link, which only moves the rest of it
    stages = min(cfg.guesses(blocks[0].top_k), min(slots)) if cfg.cpu_compute != ExpertCPUCompute.MISSES else 0
    cache = ExpertCache(store, len(blocks), E, slots, device, cfg.cache_policy,
                        prefetch_chunk_bytes=PREFETCH_CHUNK_BYTES, stage_guesses=stages)
    handle = MoEOffload(blocks, cache, cfg)
    if cfg.cpu_compute != ExpertCPUCompute.OFF:
        HostExpertCompute.check_supported(store, blocks[0].experts, blocks[0].form)
        handle.host_compute = HostExpertCompute(store, E, cfg.cpu_compute, cfg.cpu_compute_max_tokens, device)
    with torch.no_grad():
        for gi, b in enumerate(blocks):
            tensors = b.expert_tensors()
            for e in range(E):
                expert = {name: t[e] for name, t in tensors.items()}
                if handle.quantized:  # quantized on the compute device (fast; only the packed bytes go to the tier)
                    expert = {name: t.to(device) for name, t in expert.items()}
                store.write(gi * E + e, expert)
            del tensors
            original = b.experts
            for name in b.expert_tensors():
                delattr(original, name)  # frees this layer's copy (the store has it now) before the next is copied
            mod = OffloadedExperts(handle, gi, original, E, b.form)
            b.block.experts = mod
            b.experts = mod
            handle.modules.append(mod)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if handle.host_compute is not None:
        handle.host_compute.calibrate()  # auto's host estimate, from the filled tier
    if cfg.decode_graphs:  # read at each call from then on: the key can be switched off and on between generations
        handle.decode_graphs = DecodeGraphs(graph_layers, lambda: handle.cfg.decode_graphs)
    # generate() with a static cache on a GPU would torch.compile the forward on its own ("auto-compile"): dynamo
    # cannot trace the expert cache's host decisions, and its cudagraphs would capture the copies; off while
    # offloaded (moe.decode_graphs is the graphs that fit), the model's own setting back at close()
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "disable_compile"):
        handle._restore_compile = (gen, gen.disable_compile)
        gen.disable_compile = True
    return handle
