"""Tiny random-weight models (a dense Llama, the MoE families) and the DeepSpeed engines the tests train them in
(plain DeepSpeed vs maximus).

A test builds the same model twice (same seed), trains one copy in an engine of plain ``deepspeed.initialize``
and the other in one of ``ds_maximus.initialize`` (:func:`initialize` picks by the config's ``"maximus"``
section), and compares them: :func:`assert_weights_close` is the fp32 weight policy trained tables and experts
meet. The single-rank DeepSpeed environment (gloo, ``MASTER_ADDR`` ...) comes from ``tests/conftest.py``.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional, Union

import torch

LLAMA_VOCAB = 384


def tiny_llama(seed: Optional[int] = 0, vocab: int = LLAMA_VOCAB, tie: bool = False):
    """A 2-layer Llama of hidden size 32 with random weights (seeded; ``seed=None`` draws from torch's generator
    as the caller left it), eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if seed is not None:
        torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


MOE_VOCAB = 128


def tiny_moe(family: str, seed: int = 0, ffn: int = 64, impl: str = "grouped_mm", layers: int = 2,
             experts: int = 8, top_k: int = 2, **config):
    """A random-weight MoE model of ``family`` (mixtral, qwen2_moe, qwen3_moe, deepseek_v3, olmoe, gpt_oss):
    hidden size 64, ``layers`` MoE layers of ``experts`` experts of intermediate size ``ffn``, top-``top_k``
    routing, a vocabulary of :data:`MOE_VOCAB`, eager attention, decisive routers (larger router weights, so a
    batch does not touch every expert and logits are not all near zero; GPT-OSS's biases too). ``config``
    overrides entries of the config every family shares; ``None`` leaves that entry at the family's default."""
    import transformers as T
    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=MOE_VOCAB, max_position_embeddings=128, num_experts_per_tok=top_k, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    common = {k: v for k, v in {**common, **config}.items() if v is not None}
    if family == "mixtral":
        cfg = T.MixtralConfig(intermediate_size=ffn, num_local_experts=experts, **common)
    elif family == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=ffn, shared_expert_intermediate_size=64,
                               num_experts=experts, decoder_sparse_step=1, **common)
    elif family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=ffn, num_experts=experts, head_dim=16,
                               decoder_sparse_step=1, norm_topk_prob=True, **common)
    elif family == "deepseek_v3":
        cfg = T.DeepseekV3Config(intermediate_size=96, moe_intermediate_size=ffn, n_routed_experts=experts,
                                 n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1,
                                 q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                 v_head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                 **{**common, "num_key_value_heads": 4})  # MLA: one key/value head per head
    elif family == "olmoe":
        cfg = T.OlmoeConfig(intermediate_size=ffn, num_experts=experts, **common)
    elif family == "gpt_oss":
        cfg = T.GptOssConfig(intermediate_size=ffn, num_local_experts=experts, head_dim=16,
                             layer_types=["sliding_attention", "full_attention"], sliding_window=8, **common)
    else:
        raise ValueError(family)
    cfg._experts_implementation = impl
    model = T.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith((".gate.weight", ".router.weight")):
                p.normal_(0, 0.5)
            elif n.endswith(("_proj_bias", ".router.bias")):
                p.normal_(0, 0.1)
    return model


def zipf_batches(n: int, batch: int, seqlen: int, vocab: int = LLAMA_VOCAB, seed: int = 1, low: int = 0,
                 exponent: float = 1.1) -> List[torch.Tensor]:
    """``n`` batches of Zipf-distributed ids in ``[low, vocab)``: a frequency-ordered vocabulary (hot ids small)
    with a long tail, so a row cache smaller than the vocabulary evicts rows."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, vocab - low + 1, dtype=torch.float64) ** exponent
    return [low + torch.multinomial(p, batch * seqlen, replacement=True, generator=g).view(batch, seqlen)
            for _ in range(n)]


def ds_config(stage: int, dtype: str = "fp32", gas: int = 1, micro: int = 2, clip: float = 0.0,
              maximus: Optional[dict] = None, lr: float = 1e-2, wd: float = 0.1, scheduler: bool = True) -> dict:
    """A DeepSpeed config with torch AdamW (no fused-Adam JIT), a linear warm-up over 5 steps unless
    ``scheduler=False``, and, when given, a ``"maximus"`` section."""
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


def initialize(model: torch.nn.Module, cfg: dict):
    """``ds_maximus.initialize`` when ``cfg`` has a ``"maximus"`` section, else plain ``deepspeed.initialize``;
    the engine (over the parameters that require a gradient, with a copy of ``cfg``)."""
    import deepspeed

    import ds_maximus
    fn = ds_maximus.initialize if "maximus" in cfg else deepspeed.initialize
    engine, *_ = fn(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                    config=copy.deepcopy(cfg))
    return engine


def train(engine, batches: List[Union[torch.Tensor, Dict[str, torch.Tensor]]],
          loss_of: Optional[Callable] = None) -> List[float]:
    """One ``engine.step()`` per batch, a micro-batch each; the losses. A batch is a tensor of ids (the causal LM
    loss, ``input_ids = labels = ids``) or the forward's inputs as a dict; the loss is ``engine(**inputs).loss``,
    or ``loss_of(engine, inputs)``."""
    losses = []
    for batch in batches:
        if isinstance(batch, torch.Tensor):
            ids = batch.to(engine.device)
            inputs = {"input_ids": ids, "labels": ids}
        else:
            inputs = {k: v.to(engine.device) for k, v in batch.items()}
        loss = engine(**inputs).loss if loss_of is None else loss_of(engine, inputs)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def train_rank_slices(engine, batches: List[torch.Tensor], rank: int, world: int, start: int = 0,
                      after_step: Optional[Callable[[int], None]] = None) -> List[float]:
    """One data-parallel rank of :func:`train`: one ``engine.step()`` per global batch of ids from ``batches[start]``
    on, this rank on its ``1/world`` slice of the rows (the causal LM loss); the losses averaged over the ranks.
    ``after_step(i)`` runs after the step of ``batches[i]``."""
    losses = []
    for i in range(start, len(batches)):
        per = batches[i].shape[0] // world
        local = batches[i][rank * per:(rank + 1) * per].to(engine.device)
        loss = engine(input_ids=local, labels=local).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
        if after_step is not None:
            after_step(i)
    return losses


def assert_weights_close(got: torch.Tensor, ref: torch.Tensor, lr: float = 1e-2) -> None:
    """fp32 weights after exact sparse AdamW vs dense AdamW: 99.5% of elements within 1e-5 and every
    element within one lr step. Adam divides by sqrt(v), which amplifies last-bit summation-order
    differences in the few elements whose accumulated gradient nearly cancels; two dense runs that
    sum in a different order differ the same way."""
    diff = (got - ref).abs()
    frac = float((diff > 1e-5).float().mean())
    assert frac < 5e-3, f"{frac:.4%} of elements differ by more than 1e-5 (max {float(diff.max()):.3g})"
    assert float(diff.max()) < lr, f"max difference {float(diff.max()):.3g} exceeds one lr step ({lr})"
