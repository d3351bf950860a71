"""Hugging Face transformers 5.x MoE blocks with fused experts.

In transformers 5.x, Mixtral (``MixtralSparseMoeBlock``), Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3,
GPT-OSS and others share one shape: a block with a router (``gate``, or ``router`` in GPT-OSS; a
``weight`` [E, H] and ``top_k``) and an ``experts`` module holding stacked parameters ``gate_up_proj``
and ``down_proj``, called as ``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``.
How the experts module stores its projections is its :class:`~ds_maximus.experts.adapters.projection.
FusedExpertsForm` (GPT-OSS: transposed weights with biases), read from the flags transformers'
``use_experts_implementation`` sets on the module. The gate activation is the module's own
``_apply_gate`` (GPT-OSS's clamped swiglu over interleaved gate/up columns included), so it is
reproduced by calling it. Anything else around the block (Qwen2-MoE's and DeepSeek-V3's shared
experts, the router itself) is left alone and stays on its device.

    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> cfg = MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                     num_key_value_heads=2, num_local_experts=4, vocab_size=64)
    >>> [b.name for b in find_moe_blocks(MixtralForCausalLM(cfg))]
    ['model.layers.0.mlp', 'model.layers.1.mlp']
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch
from torch import nn

from ds_maximus.errors import ConfigError
from ds_maximus.experts.adapters.projection import FusedExpertsForm

ROUTER_NAMES = ("gate", "router")  # Mixtral/Qwen/OLMoE/DeepSeek-V3, GPT-OSS


@dataclasses.dataclass
class MoEBlockInfo:
    name: str
    block: nn.Module
    experts: nn.Module
    router: nn.Module
    num_experts: int
    top_k: int
    form: FusedExpertsForm = FusedExpertsForm()

    def expert_tensors(self) -> Dict[str, torch.Tensor]:
        return {n: getattr(self.experts, n) for n in self.form.tensor_names}

    def router_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The router's linear scores (with its bias where it has one, in its dtype: DeepSeek-V3's router is
        fp32 in a bf16 model): what speculative prefetch ranks."""
        w, bias = self.router.weight, getattr(self.router, "bias", None)
        return torch.nn.functional.linear(hidden.to(w.dtype), w, bias if isinstance(bias, torch.Tensor) else None)


def _is_fused_experts(m: nn.Module) -> bool:
    p = getattr(m, "gate_up_proj", None)
    d = getattr(m, "down_proj", None)
    return isinstance(p, torch.Tensor) and isinstance(d, torch.Tensor) and p.dim() == 3 and d.dim() == 3


def _router_of(name: str, mod: nn.Module) -> nn.Module:
    for attr in ROUTER_NAMES:
        router = getattr(mod, attr, None)
        if isinstance(router, nn.Module) and isinstance(getattr(router, "weight", None), torch.Tensor):
            return router
    raise ConfigError(f"MoE block '{name}' ({type(mod).__name__}) has fused experts but no router "
                      f"({' or '.join(repr(a) for a in ROUTER_NAMES)} with a weight); this architecture needs an "
                      "adapter in ds_maximus/experts/adapters/")


def _form_of(name: str, experts: nn.Module) -> FusedExpertsForm:
    cls = type(experts).__name__
    for flag, ok in (("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(experts, flag, ok) != ok:
            raise ConfigError(f"MoE block '{name}': {cls} has {flag}={not ok}, which the expert cache does not "
                              "reproduce (supported: gated fused experts without a post-expert norm: Mixtral, "
                              "Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS); leave maximus.moe off for this model")
    form = FusedExpertsForm(is_transposed=bool(getattr(experts, "is_transposed", False)),
                            has_bias=bool(getattr(experts, "has_bias", False)))
    missing = [n for n in form.tensor_names if not isinstance(getattr(experts, n, None), torch.Tensor)]
    if missing:
        raise ConfigError(f"MoE block '{name}': {cls} declares has_bias={form.has_bias} but has no {missing}; "
                          "this experts module needs an adapter in ds_maximus/experts/adapters/")
    return form


def find_moe_blocks(model: nn.Module) -> List[MoEBlockInfo]:
    """Every MoE block with fused experts, in module order (= layer order)."""
    found = []
    for name, mod in model.named_modules():
        experts = getattr(mod, "experts", None)
        if not isinstance(experts, nn.Module) or not _is_fused_experts(experts):
            continue
        router = _router_of(name, mod)
        form = _form_of(name, experts)
        num_experts = int(experts.gate_up_proj.shape[0])
        top_k = int(getattr(router, "top_k", getattr(mod, "top_k", 0)) or 0)
        if top_k < 1:
            raise ConfigError(f"MoE block '{name}': cannot read the router's top_k")
        found.append(MoEBlockInfo(name, mod, experts, router, num_experts, top_k, form))
    return found
