"""``attach_expert_training``: move a model's MoE experts into an :class:`ExpertTrainer`.

Finds the MoE layers (HF fused experts, or DeepSpeed-MoE), copies every expert into the trainer's
tier, replaces each experts module by its thin stand-in and removes the expert parameters from the
model (``trainer.removed_params``: ``ds_maximus.initialize`` keeps them away from DeepSpeed).

    >>> import torch
    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> from ds_maximus.config import MaximusConfig
    >>> model = MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, vocab_size=64))
    >>> t = attach_expert_training(model, MaximusConfig.from_dict({"moe": {"enabled": True, "train": True}}))
    >>> t.num_layers, t.num_experts, sum(p.numel() for p in model.model.layers[0].mlp.experts.parameters())
    (2, 4, 0)
"""
from __future__ import annotations

import torch
from torch import nn

from ds_maximus.config import MaximusConfig
from ds_maximus.errors import ConfigError
from ds_maximus.experts.adapters import find_moe_blocks
from ds_maximus.experts.adapters.deepspeed_moe import find_deepspeed_moe_layers, hide_from_engine
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.training.function import FusedExpertsKind, ModuleExpertsKind
from ds_maximus.experts.training.modules import TrainedFusedExperts, TrainedModuleExperts
from ds_maximus.experts.training.trainer import ExpertTrainer, LayerSpec


def _stacked_spec(name, tensors, kind_fn, num_experts, top_k, router_weight):
    layout = ExpertLayout.from_stacked(tensors, num_experts)
    return LayerSpec(name, kind_fn(layout), num_experts, top_k,
                     tensors=lambda t=tensors: t, router_weight=router_weight)


def attach_expert_training(model: nn.Module, cfg: MaximusConfig) -> ExpertTrainer:
    """Replace the experts of every MoE layer of ``model`` by a shared :class:`ExpertTrainer`; returns it."""
    hf = find_moe_blocks(model)
    ds = find_deepspeed_moe_layers(model)
    if hf and ds:
        raise ConfigError("the model mixes HF fused-expert blocks and DeepSpeed MoE layers; train one kind")
    if not hf and not ds:
        raise ConfigError(f"maximus.moe.train is on but {type(model).__name__} has no MoE layer the trainer knows: "
                          "HF fused experts (Mixtral, Qwen2-MoE, Qwen3-MoE) or deepspeed.moe.layer.MoE",
                          "maximus.moe.train")
    specs, removed = [], []
    if hf:
        for b in hf:
            original = b.experts
            specs.append(_stacked_spec(b.name, {n: t.detach() for n, t in b.expert_tensors().items()},
                                       lambda lay, o=original, f=b.form: FusedExpertsKind(lay, o._apply_gate, f),
                                       b.num_experts, b.top_k, lambda r=b.router: r.weight))
        first = hf[0].experts.gate_up_proj
    else:
        for info in ds:
            template = info.experts[0]
            specs.append(_stacked_spec(info.name, info.expert_tensors(),
                                       lambda lay, t=template: ModuleExpertsKind(lay, t),
                                       info.num_experts, info.top_k, lambda g=info.layer.gate: g.wg.weight))
        first = next(info.experts[0].parameters())
    trainer = ExpertTrainer(specs, cfg, first.device, first.dtype)
    if hf:
        for gi, b in enumerate(hf):
            original = b.experts
            removed += list(original.parameters())
            for name in b.expert_tensors():
                delattr(original, name)
            mod = TrainedFusedExperts(trainer, gi, original)
            b.block.experts = mod
    else:
        for gi, info in enumerate(ds):
            removed += list(info.layer.experts.parameters())
            info.layer.experts = TrainedModuleExperts(trainer, gi, info.layer)
            info.layer.register_forward_pre_hook(_keep_input)
        hide_from_engine(model, ds)
    trainer.carrier_host = (hf[0].block.experts if hf else ds[0].layer.experts)
    for p in removed:  # the trainer holds the experts now: free the model's copy, keep the identity (filters)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    trainer.removed_params = removed
    return trainer


def _keep_input(module, args):
    """The MOELayer's input, for the speculative prefetch of the next layer."""
    module.maximus_input = args[0].detach()
