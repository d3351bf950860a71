"""Hugging Face integration: ``maximize(model, config)`` and ``MaximusDataCollator``.

Example::

    model = LlamaForCausalLM(LlamaConfig(vocab_size=262144, ...))
    maximize(model, "ds_configs/zero2_cpu_tier.json")        # embedding (and head) become sharded
    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed="ds_configs/zero2_cpu_tier.json"),
                      data_collator=MaximusDataCollator(DataCollatorForLanguageModeling(tok, mlm=False), model))

With ``ds_maximus.enable()`` called first, the Trainer's ``deepspeed.initialize`` goes through
``ds_maximus.initialize``, which does the same swap itself: ``maximize`` is then optional.

Importing this module registers the Hugging Face :class:`~ds_maximus.engine.adapters.ModelAdapter` with the
engine (the streamed LM head of an ``XForCausalLM``, the Trainer callback at ``ds_maximus.enable()``); the
engine loads it by name (``ds_maximus.ADAPTERS``) and never imports it.
"""
from __future__ import annotations

import importlib.util
from typing import Iterable, List, Union

import torch
from torch import nn

from ds_maximus.config import MaximusConfig
from ds_maximus.engine import lookahead as _engine_lookahead
from ds_maximus.engine.adapters import ModelAdapter, register_adapter

_unique_ids = _engine_lookahead.unique_ids


def _cfg(config) -> MaximusConfig:
    if isinstance(config, MaximusConfig):
        return config
    return MaximusConfig.from_ds_config(config)


def sharded_modules(model: nn.Module) -> List[nn.Module]:
    """Every module of ``model`` that has row prefetch (sharded embeddings, partitioned ones included: their
    prefetch is collective, every rank's loader runs it at the same point)."""
    from ds_maximus.distributed.partitioned_embedding import PartitionedEmbedding
    from ds_maximus.vocab import ShardedEmbedding
    return [m for m in model.modules() if isinstance(m, (ShardedEmbedding, PartitionedEmbedding))]


def attach_lm_head(model: nn.Module, cfg: MaximusConfig):
    """Route an HF causal LM's ``labels=`` loss through ``ShardedLMHead`` (no full logits)."""
    from ds_maximus.integrations.hf_lm_head import patch_causal_lm_loss
    return patch_causal_lm_loss(_head_owner(model, cfg), config=cfg.lm_head)


def _head_owner(model: nn.Module, cfg: MaximusConfig) -> nn.Module:
    """The causal LM holding ``lm_head`` as a child, whose forward and loss the patch wraps: ``model``, or the base
    model a PEFT model reaches through ``__getattr__``. A frozen head (PEFT freezes the base model) is refused
    for a CPU-tier head, which would train its rows."""
    from ds_maximus.config import HeadPlacement
    from ds_maximus.errors import ConfigError
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        return model
    from ds_maximus.vocab import plain_weight
    w = plain_weight(head)   # (no table built to look)
    if (cfg.lm_head.placement in (HeadPlacement.CPU, HeadPlacement.CPU_OPTIMIZER) and isinstance(w, torch.Tensor)
            and not w.requires_grad):
        raise ConfigError(f"the LM head ({type(head).__name__}) is frozen (requires_grad=False; PEFT freezes the base "
                          f"model's weights) and lm_head.placement '{cfg.lm_head.placement.value}' trains its rows; "
                          "use placement 'gpu' (the loss is streamed, the head stays frozen), or train the head "
                          "(PEFT: modules_to_save=[..., 'lm_head'], maximus then holds the trained copy)",
                          "maximus.lm_head.placement")
    if model._modules.get("lm_head") is head:
        return model
    return next((m for m in model.modules() if m._modules.get("lm_head") is head), model)


def maximize(model: nn.Module, config: Union[str, dict, MaximusConfig], inference: bool = False) -> nn.Module:
    """Swap ``model``'s large embeddings for ``ShardedEmbedding`` (and its loss for the streamed LM head).

    ``inference=True`` keeps the table in the CPU tier with the GPU row cache for ``generate()`` (and,
    with ``lm_head.placement: cpu``, the head too; see :mod:`ds_maximus.integrations.serving`).
    Returns the same model object.
    """
    from ds_maximus.engine.swap import swap_embeddings
    cfg = _cfg(config)
    if not cfg.enabled:
        return model
    if inference:
        from ds_maximus.integrations.serving import prepare_inference
        return prepare_inference(model, cfg)
    swap_embeddings(model, cfg)
    if cfg.lm_head.enabled:
        attach_lm_head(model, cfg)
    return model


class MaximusDataCollator:
    """Wraps a collator; each collated batch's unique ids are prefetched into the row caches.

    Loaders that run one batch ahead (accelerate's, or :func:`lookahead`) thereby stage batch t+1's
    rows while batch t trains. In a DataLoader worker process the modules are not reachable, so there
    the collator only collates (use ``num_workers=0`` or :func:`lookahead` in the main process).
    """

    def __init__(self, base_collator, model_or_modules: Union[nn.Module, Iterable[nn.Module], None] = None):
        self.base = base_collator
        self._source = model_or_modules
        self.prefetches = 0

    def __getattr__(self, name):
        # the wrapped collator's attributes (``tokenizer``, ``mlm``, ...) read through this one
        if name.startswith("__") or name in ("base", "_source", "prefetches"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def __getstate__(self):
        # a DataLoader worker started by spawn gets a copy without the model: it could not reach the caches anyway
        return {"base": self.base, "_source": None, "prefetches": self.prefetches}

    def _modules(self) -> List[nn.Module]:
        src = self._source
        if src is None:
            return []
        if isinstance(src, nn.Module):
            return sharded_modules(src)
        return list(src)

    def __call__(self, features):
        batch = self.base(features)
        if torch.utils.data.get_worker_info() is None:
            ids = _unique_ids(batch)
            if ids is not None:
                for m in self._modules():
                    if ids.numel() and int(ids.max()) < m.num_embeddings:
                        m.prefetch(ids)
                        self.prefetches += 1
        return batch


def lookahead(loader: Iterable, model_or_modules) -> Iterable:
    """Iterate ``loader`` one batch ahead, prefetching the next batch's rows before yielding this one."""
    modules = sharded_modules(model_or_modules) if isinstance(model_or_modules, nn.Module) else list(model_or_modules)
    yield from _engine_lookahead.lookahead(loader, modules)


def _install_trainer_callback() -> None:
    if importlib.util.find_spec("transformers") is not None:
        from ds_maximus.integrations.trainer_callback import install_default_callback
        install_default_callback()


def _remove_trainer_callback() -> None:
    if importlib.util.find_spec("transformers") is not None:
        from ds_maximus.integrations.trainer_callback import remove_default_callback
        remove_default_callback()


def refuse_resize_after_swap(model: nn.Module, cfg: MaximusConfig) -> None:
    """``model.resize_token_embeddings`` (transformers') on a model whose table maximus holds failed inside
    transformers with ``'ShardedEmbedding' object has no attribute 'weight'``: it now raises a ``ConfigError`` that
    says what to do (grow the vocabulary before ``initialize``, with ``ds_maximus.resize_token_embeddings``)."""
    from ds_maximus.errors import ConfigError
    if not sharded_modules(model):
        return
    owners = [model]
    base = getattr(model, "get_base_model", None)
    if callable(base):
        owners.append(base())   # a PeftModel reaches the transformers model through __getattr__

    def refuse(*args, **kwargs):
        raise ConfigError("resize_token_embeddings after ds_maximus.initialize: maximus holds the table now; grow "
                          "the vocabulary on the model as loaded, before initialize (ds_maximus.resize_token_embeddings"
                          "(model, new_size) fills new rows per embedding.new_row_init, or transformers' own "
                          "model.resize_token_embeddings), then initialize", "maximus.embedding.new_row_init")

    for m in owners:
        if callable(getattr(type(m), "resize_token_embeddings", None)):
            m.__dict__["resize_token_embeddings"] = refuse


register_adapter(ModelAdapter("huggingface", attach_lm_head=attach_lm_head, prepare_model=refuse_resize_after_swap,
                              on_enable=_install_trainer_callback, on_disable=_remove_trainer_callback))
