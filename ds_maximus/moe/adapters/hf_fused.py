"""Hugging Face transformers 5.x MoE blocks with fused experts.

In transformers 5.x, Mixtral (``MixtralSparseMoeBlock``), Qwen2-MoE, Qwen3-MoE, OLMoE and others
share one shape: a block with a router ``gate`` (``weight`` [E, H], ``top_k``) and an ``experts``
module holding stacked parameters ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F], called as
``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``. Anything else around the
block (Qwen2-MoE's shared expert, its gate) is left alone and stays on its device.

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

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


@dataclasses.dataclass
class MoEBlockInfo:
    name: str
    block: nn.Module
    experts: nn.Module
    router: nn.Module
    num_experts: int
    top_k: int

    def expert_tensors(self) -> Dict[str, torch.Tensor]:
        return {n: getattr(self.experts, n) for n in EXPERT_TENSORS}


def _is_fused_experts(m: nn.Module) -> bool:
    p = getattr(m, "gate_up_proj", None)
    d = getattr(m, "down_proj", None)
    return isinstance(p, torch.Tensor) and isinstance(d, torch.Tensor) and p.dim() == 3 and d.dim() == 3


def find_moe_blocks(model: nn.Module) -> List[MoEBlockInfo]:
    """Every MoE block with fused experts, in module order (= layer order)."""
    found = []
    for name, mod in model.named_modules():
        experts = getattr(mod, "experts", None)
        router = getattr(mod, "gate", None)
        if not isinstance(experts, nn.Module) or not _is_fused_experts(experts):
            continue
        if router is None or not isinstance(getattr(router, "weight", None), torch.Tensor):
            raise ConfigError(f"MoE block '{name}' has fused experts but no router 'gate' with a weight; "
                              "this architecture needs an adapter in ds_maximus/moe/adapters/")
        for flag, ok in (("is_transposed", False), ("has_bias", False), ("has_gate", True),
                         ("has_post_expert_norm", False)):
            if getattr(experts, flag, ok) != ok:
                raise ConfigError(f"MoE block '{name}': experts with {flag}={not ok} are not supported yet "
                                  "(supported: Mixtral/Qwen-MoE style gate_up_proj [E,2F,H], down_proj [E,H,F])")
        num_experts = int(experts.gate_up_proj.shape[0])
        top_k = int(getattr(router, "top_k", getattr(mod, "top_k", 0)) or 0)
        if top_k < 1:
            raise ConfigError(f"MoE block '{name}': cannot read the router's top_k")
        found.append(MoEBlockInfo(name, mod, experts, router, num_experts, top_k))
    return found
