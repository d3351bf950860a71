"""Tiny MoE models and what the expert-training tests read from their engines (plain DeepSpeed vs maximus).

The config, the training loop and the weight policy come from :mod:`tests.helpers.models`.
"""
from __future__ import annotations

import torch

from tests.helpers.models import assert_weights_close, ds_config, initialize

VOCAB = 96


def tiny_mixtral(seed: int = 0, num_experts: int = 4, top_k: int = 2, layers: int = 2, hidden: int = 32,
                 ffn: int = 48):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=num_experts, num_experts_per_tok=top_k,
                        vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="eager",
                        router_aux_loss_coef=0.0)
    cfg._experts_implementation = "grouped_mm"
    model = MixtralForCausalLM(cfg)
    with torch.no_grad():  # decisive routing, so a batch does not touch every expert
        for n, p in model.named_parameters():
            if "gate.weight" in n:
                p.normal_(0, 0.5)
    return model


class TinyDeepSpeedMoE(torch.nn.Module):
    """Embedding -> 2 x (residual DeepSpeed MoE of MLP experts) -> head; ``forward(ids, labels)`` -> loss."""

    def __init__(self, num_experts: int = 4, k: int = 1, d: int = 16, vocab: int = VOCAB, layers: int = 2):
        super().__init__()
        from deepspeed.moe.layer import MoE
        self.emb = torch.nn.Embedding(vocab, d)
        expert = torch.nn.Sequential(torch.nn.Linear(d, 24), torch.nn.GELU(), torch.nn.Linear(24, d))
        self.moes = torch.nn.ModuleList([
            MoE(d, expert, num_experts=num_experts, k=k, capacity_factor=4.0, eval_capacity_factor=4.0,
                min_capacity=4, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
            for _ in range(layers)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        for moe in self.moes:
            out, _, _ = moe(h)
            h = h + out
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


def tiny_ds_moe(seed: int = 0, **kw):
    torch.manual_seed(seed)
    return TinyDeepSpeedMoE(**kw)


def batches(n: int, batch: int = 2, seqlen: int = 8, vocab: int = VOCAB, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seqlen), generator=g) for _ in range(n)]


def moe_section(slots: int = 1, **moe):
    return {"embedding": {"enabled": False},
            "moe": {"enabled": True, "train": True, "gpu_experts_per_layer": slots, **moe},
            "logging": {"interval_steps": 5}}


def build(model, stage, maximus=None, dtype="fp32", **kw):
    """``model`` in a plain engine, or in a maximus one when ``maximus`` (the section) is given."""
    return initialize(model, ds_config(stage, dtype, maximus=maximus, **kw))


def mixtral_experts(engine) -> dict:
    """``{layer: {name: [E, ...] fp32}}`` of a plain or maximus Mixtral engine."""
    import deepspeed
    out = {}
    if getattr(engine, "maximus", None) is not None and "moe" in engine.maximus.modules:
        t = engine.maximus.modules["moe"]
        return {g: t.expert_tensors(g) for g in range(t.num_layers)}
    for i, layer in enumerate(engine.module.model.layers):
        ex = layer.mlp.experts
        ps = [ex.gate_up_proj, ex.down_proj]
        with deepspeed.zero.GatheredParameters(ps, enabled=hasattr(ps[0], "ds_id")):
            out[i] = {"gate_up_proj": ex.gate_up_proj.detach().float().cpu().clone(),
                      "down_proj": ex.down_proj.detach().float().cpu().clone()}
    return out


def ds_moe_experts(engine) -> dict:
    if getattr(engine, "maximus", None) is not None and "moe" in engine.maximus.modules:
        t = engine.maximus.modules["moe"]
        return {g: t.expert_tensors(g) for g in range(t.num_layers)}
    out = {}
    for i, moe in enumerate(engine.module.moes):
        per = [dict(m.named_parameters()) for m in moe.deepspeed_moe.experts.deepspeed_experts]
        out[i] = {n: torch.stack([p[n].detach().float().cpu() for p in per]) for n in per[0]}
    return out


def dense_params(engine) -> dict:
    """Every non-expert parameter (fp32 CPU) by name, carrier excluded."""
    import deepspeed
    out = {}
    for n, p in engine.module.named_parameters():
        if "maximus_norm_carrier" in n or ".experts." in n:
            continue
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out[n] = p.detach().float().cpu().clone()
    return out


def assert_experts_close(got, ref, experts_fn=None, lr: float = 1e-2) -> None:
    """Every expert tensor of ``got`` against ``ref`` (engines), under :func:`assert_weights_close`."""
    experts_fn = experts_fn or mixtral_experts
    er, eg = experts_fn(ref), experts_fn(got)
    for g in er:
        for n in er[g]:
            assert_weights_close(eg[g][n], er[g][n], lr=lr)
