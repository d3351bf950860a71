"""A tiny random-weight Llama and the training loop the ZeRO tests share (plain DS vs maximus)."""
from __future__ import annotations

import copy

import torch

VOCAB = 384


def tiny_llama(seed: int = 0, vocab: int = VOCAB, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def zipf_batches(n: int, batch: int, seqlen: int, vocab: int = VOCAB, seed: int = 1):
    """Zipf-distributed ids (frequency-ordered vocabulary: hot ids small)."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    return [torch.multinomial(p, batch * seqlen, replacement=True, generator=g).view(batch, seqlen)
            for _ in range(n)]


def ds_config(stage: int, dtype: str = "fp32", gas: int = 1, micro: int = 2, clip: float = 0.0,
              maximus: dict | None = None, lr: float = 1e-2, wd: float = 0.1, scheduler: bool = True):
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                           "warmup_num_steps": 5, "warmup_type": "linear"}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if maximus is not None:
        cfg["maximus"] = maximus
    return cfg


def maximus_section(cache_rows: int = 48, mode: str = "exact", **emb):
    return {"embedding": {"modules": ["model.embed_tokens"], "gpu_cache_rows": cache_rows,
                          "optimizer": {"mode": mode}, **emb},
            "logging": {"interval_steps": 5}}


def train(engine, batches, gas: int):
    """Train over ``batches`` (micro-batches); returns the loss of every micro-batch."""
    losses = []
    dev = engine.device
    for ids in batches:
        ids = ids.to(dev)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach().float()))
    return losses


def build(stage, dtype, gas=1, clip=0.0, maximus=None, seed=0, tie=False, init=None, **kw):
    import deepspeed

    import ds_maximus
    model = tiny_llama(seed, tie=tie)
    if init is not None:
        model.load_state_dict(copy.deepcopy(init))
    cfg = ds_config(stage, dtype, gas=gas, clip=clip, maximus=maximus, **kw)
    fn = ds_maximus.initialize if maximus is not None else deepspeed.initialize
    engine, *_ = fn(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def embedding_weight(engine) -> torch.Tensor:
    """The full embedding table (fp32, CPU) of a plain or maximus engine."""
    emb = engine.module.model.embed_tokens
    if hasattr(emb, "full_weight"):
        return emb.full_weight().float().cpu()
    import deepspeed
    w = emb.weight
    if hasattr(w, "ds_id"):
        with deepspeed.zero.GatheredParameters([w]):
            return w.detach().float().cpu().clone()
    # the fp32 master lives in the optimizer under bf16/ZeRO; the module copy is what forward used
    return w.detach().float().cpu().clone()


def assert_weights_close(got: torch.Tensor, ref: torch.Tensor, lr: float = 1e-2) -> None:
    """fp32 tables after exact sparse AdamW vs dense AdamW: 99.5% of elements within 1e-5 and every
    element within one lr step. Adam divides by sqrt(v), which amplifies last-bit summation-order
    differences in the few elements whose accumulated gradient nearly cancels; two dense runs that
    sum in a different order differ the same way."""
    diff = (got - ref).abs()
    frac = float((diff > 1e-5).float().mean())
    assert frac < 5e-3, f"{frac:.4%} of elements differ by more than 1e-5 (max {float(diff.max()):.3g})"
    assert float(diff.max()) < lr, f"max difference {float(diff.max()):.3g} exceeds one lr step ({lr})"
