"""Memory-limited generation: the embedding (and the LM head) stay in the CPU tier during ``generate()``.

``maximize(model, config, inference=True)`` calls :func:`prepare_inference`:

* every large embedding becomes a ``ShardedEmbedding``: the table stays in (pinned) CPU memory and
  only ``embedding.gpu_cache_rows`` rows live on the GPU (a row cache; frequency-ordered ids keep the
  hot rows resident; a prompt with more distinct ids than slots is looked up in groups, see
  :class:`ChunkedLookup`). Generation never steps the sparse optimizer, so the cheapest optimizer
  state (Adagrad's one table, never updated) is chosen;
* with ``lm_head: {"enabled": true, "placement": "cpu"}`` the output layer becomes a ``ShardedLMHead``
  whose rows stay in the CPU tier and stream through the GPU ``chunk_rows`` at a time (a head tied
  to a swapped embedding always reads that embedding's rows);
* only the last position's logits are computed: HF ``generate()`` passes ``logits_to_keep=1`` to
  models whose forward accepts it (Llama, Mistral, Qwen, Gemma, ...), so the head sees ``[B, 1, d]``.

Example::

    model = AutoModelForCausalLM.from_pretrained("out/hf", dtype=torch.bfloat16)
    maximize(model, {"maximus": {"embedding": {"min_rows": 65536, "gpu_cache_rows": 16384},
                                 "lm_head": {"enabled": True, "placement": "cpu"}}}, inference=True)
    model.to("cuda")                      # moves the dense layers and the row cache only
    out = model.generate(ids.cuda(), max_new_tokens=64)
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ds_maximus.config import HeadPlacement, MaximusConfig, OptimizerType

logger = logging.getLogger("ds_maximus")


def inference_config(cfg: MaximusConfig) -> MaximusConfig:
    """``cfg`` with the smallest per-row optimizer state (generation never steps it)."""
    cfg = cfg.model_copy(deep=True)
    cfg.embedding.optimizer.type = OptimizerType.ADAGRAD
    return cfg


def offload_lm_head(model: nn.Module, cfg: MaximusConfig) -> Optional[nn.Module]:
    """Replace ``model``'s untied ``nn.Linear`` output layer by a CPU-tier ``ShardedLMHead``; returns it."""
    from ds_maximus.vocab import ShardedLMHead
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, ShardedLMHead) or not isinstance(head, nn.Linear):
        return head if isinstance(head, ShardedLMHead) else None
    if head.bias is not None:
        logger.warning("ds_maximus: the LM head has a bias; it stays on the compute device")
        return None
    new = ShardedLMHead.from_linear(head, cfg.lm_head)
    model.set_output_embeddings(new)
    logger.info("ds_maximus: LM head %d x %d -> CPU tier, streamed %d rows at a time", new.vocab_size,
                new.hidden_size, new.chunk_rows)
    return new


class ChunkedLookup:
    """``forward`` of a ``ShardedEmbedding`` for generation: a batch with more distinct ids than the row
    cache has slots (a long prompt) is looked up in groups of at most half the slots, so the cache
    size bounds GPU memory, not the prompt. With gradients enabled it is the module's own forward."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.inner = module.forward

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        m = self.module
        if torch.is_grad_enabled():
            return self.inner(input)
        flat = input.reshape(-1)
        uniq = torch.unique(flat)
        if uniq.numel() <= m.cache.num_slots:
            return self.inner(input)
        group = max(1, m.cache.num_slots // 2)
        out = torch.empty(flat.numel(), m.embedding_dim, dtype=m.out_dtype, device=m.compute_device)
        for lo in range(0, uniq.numel(), group):
            sel = torch.isin(flat, uniq[lo:lo + group])
            out[sel.to(out.device)] = self.inner(flat[sel]).to(out.dtype)
        return out.view(*input.shape, m.embedding_dim)


def prepare_inference(model: nn.Module, cfg: MaximusConfig) -> nn.Module:
    """Swap embeddings (and, with ``lm_head.placement: cpu``, the head) for generation; ``model.eval()``."""
    from ds_maximus.engine.swap import swap_embeddings
    cfg = inference_config(cfg)
    plan = swap_embeddings(model, cfg, training=False)
    for emb in plan.swapped.values():
        if not isinstance(emb.forward, ChunkedLookup):
            emb.forward = ChunkedLookup(emb)
    if cfg.lm_head.enabled and cfg.lm_head.placement == HeadPlacement.CPU:
        offload_lm_head(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
