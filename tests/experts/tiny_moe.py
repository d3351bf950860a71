"""Tiny random-weight MoE models for the expert-offload tests (hidden 64, a few layers, 4-8 experts)."""
import copy

import torch


def tiny_model(kind: str, experts_impl: str = "grouped_mm", layers: int = 2, num_experts: int = 8,
               top_k: int = 2, dtype=torch.float32, seed: int = 0):
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )
    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, max_position_embeddings=256, num_experts_per_tok=top_k)
    if kind == "mixtral":
        cfg = MixtralConfig(intermediate_size=96, num_local_experts=num_experts, **common)
        cls = MixtralForCausalLM
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                             num_experts=num_experts, decoder_sparse_step=1, **common)
        cls = Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=num_experts,
                             head_dim=16, decoder_sparse_step=1, norm_topk_prob=True, **common)
        cls = Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    cfg._experts_implementation = experts_impl
    model = cls(cfg).to(dtype).eval()
    # larger init so routing is decisive and logits are not all near zero
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "gate.weight" in n:
                p.normal_(0, 0.5)
    return model


def clone(model):
    return copy.deepcopy(model)
