"""Tiny random-weight MoE models for the expert-offload tests (hidden 64, a few layers, 4-8 experts), built by
:func:`tests.helpers.models.tiny_moe`."""
import copy

import torch

from tests.helpers.models import tiny_moe


def tiny_model(kind: str, experts_impl: str = "grouped_mm", layers: int = 2, num_experts: int = 8,
               top_k: int = 2, dtype=torch.float32, seed: int = 0):
    """:func:`tests.helpers.models.tiny_moe` as the offload tests use it (mixtral, qwen2_moe, qwen3_moe): experts
    of intermediate size 96 (Mixtral) or 48 (Qwen), 256 positions, the family's own token ids and attention
    implementation, in ``dtype`` and eval mode."""
    model = tiny_moe(kind, seed=seed, ffn=96 if kind == "mixtral" else 48, impl=experts_impl, layers=layers,
                     experts=num_experts, top_k=top_k, max_position_embeddings=256, bos_token_id=None,
                     eos_token_id=None, pad_token_id=None, attn_implementation=None)
    return model.to(dtype).eval()


def clone(model):
    return copy.deepcopy(model)
