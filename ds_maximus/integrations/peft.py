"""PEFT models under ds_maximus: LoRA on the blocks, the embedding and head trained in full as maximus rows.

``ds_maximus.initialize`` (or HF Trainer after ``ds_maximus.enable()``) takes a ``peft.PeftModel`` as it is.
PEFT's ``modules_to_save=["embed_tokens", "lm_head"]`` wraps each table in a ``ModulesToSaveWrapper``: a
frozen ``original_module`` and the trained copy ``modules_to_save["default"]`` that forward calls. maximus
swaps the trained embedding copy for a ``ShardedEmbedding`` (exact sparse AdamW on fp32 master rows, the
table in the CPU tier) and streams the loss through the head (``lm_head`` section), so neither a dense
V x d gradient nor full logits exist. LoRA adapters stay ordinary DeepSpeed parameters.

**Frozen originals.** Each wrapper's frozen ``original_module`` (read only with the adapters disabled) is moved
to host memory as a :class:`~ds_maximus.vocab.host_table.HostTable` when the model is swapped (the
``prepare_model`` hook of the engine, :func:`host_frozen_originals`): no dense V x d table of it stays on the
compute device, ``with model.disable_adapter():`` computes the original's forward, and ``state_dict`` keeps its
keys.

**Quantized blocks (QLoRA).** Only the vocabulary tables are swapped: bitsandbytes ``Linear4bit`` blocks (packed
uint8 weights) and the LoRA on them stay as PEFT and DeepSpeed have them, and tables that
``prepare_model_for_kbit_training`` made fp32 become fp32 master rows as any other.

**Ties.** PEFT's default (``ensure_weight_tying=False``) gives a tied model (Gemma-3) two independent copies,
an untied head; maximus reproduces that as it is: two tables. With ``LoraConfig(ensure_weight_tying=True)``
(``modules_to_save=["embed_tokens"]`` suffices) PEFT keeps one trained copy that the head reads; maximus
keeps that tie as one row store, the head a ``ShardedLMHead`` on it. The saved folder is then PEFT's own
tied format: ``adapter_config.json`` says ``ensure_weight_tying: true`` and the safetensors hold the
trained table under both PEFT keys (``...embed_tokens.weight`` and ``...lm_head.weight``), so plain ``peft``
reloads it tied.

Example::

    model = get_peft_model(Gemma3ForCausalLM.from_pretrained(...), LoraConfig(
        r=16, target_modules="all-linear", modules_to_save=["embed_tokens"], ensure_weight_tying=True))
    engine, *_ = ds_maximus.initialize(model=model, config=cfg,
                                       model_parameters=[p for p in model.parameters() if p.requires_grad])
    ...  # train
    ds_maximus.save_peft(engine, "out/adapter")    # then, without ds_maximus:
    # PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/adapter").merge_and_unload()
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional

import torch
from torch import nn

from ds_maximus.config import MaximusConfig
from ds_maximus.engine.adapters import ModelAdapter, register_adapter
from ds_maximus.errors import ConfigError

COPY = ".modules_to_save."
ORIGINAL = ".original_module."


def is_peft_model(model) -> bool:
    """``model`` is a ``peft.PeftModel`` (checked by class name and its ``peft_config``: peft stays optional)."""
    return any(c.__name__ == "PeftModel" for c in type(model).__mro__) and hasattr(model, "peft_config")


def _unwrap(model_or_engine) -> nn.Module:
    model = getattr(model_or_engine, "module", model_or_engine)
    if not is_peft_model(model):
        raise ConfigError(f"save_peft takes a peft.PeftModel (or an engine around one); got {type(model).__name__}. "
                          "Save a model without adapters with ds_maximus.export_hf", "maximus")
    return model


def _tied_source(m: nn.Module) -> Optional[nn.Module]:
    src = getattr(m, "tied_to", None)
    return src[0] if isinstance(src, (list, tuple)) and src else None


def _plain_table(m: nn.Module) -> Optional[nn.Module]:
    """A partitioned or broadcast table as a plain ``nn.Embedding`` holding its whole table (its own state dict
    holds no rows: a rank's slice must not reach DeepSpeed's module checkpoint). ``full_weight`` is a collective:
    every rank calls it, in the same module order. None for any other module."""
    from ds_maximus.distributed.partitioned_embedding import PartitionedEmbedding
    if not isinstance(m, PartitionedEmbedding):
        return None
    w = m.full_weight()
    plain = nn.Embedding(w.shape[0], w.shape[1], padding_idx=m.padding_idx, device="meta")
    plain.weight = nn.Parameter(w, requires_grad=False)
    return plain


@contextlib.contextmanager
def _plain_tied_heads(model: nn.Module, collectives: bool = True):
    """Each head tied to a maximus table, inside a PEFT wrapper, seen as a plain ``nn.Linear`` holding the table's
    rows while PEFT collects the adapter's keys (PEFT asks the trained copy's own ``state_dict`` for them, and a
    tied head owns no weight); a partitioned or broadcast table likewise as a plain ``nn.Embedding``
    (:func:`_plain_table`, a collective: not with ``collectives=False``). The modules are put back afterwards."""
    swapped = []
    for m in list(model.modules()):
        copies = getattr(m, "modules_to_save", None)
        if not isinstance(copies, nn.ModuleDict):
            continue
        for key, head in list(copies.items()):
            src = _tied_source(head)
            if src is None:
                plain = _plain_table(head) if collectives else None
                if plain is not None:
                    copies[key] = plain
                    swapped.append((copies, key, head))
                continue
            w = src.full_weight()
            plain = nn.Linear(w.shape[1], w.shape[0], bias=head.bias is not None, device="meta")
            plain.weight = nn.Parameter(w, requires_grad=False)
            if head.bias is not None:
                plain.bias = head.bias
            copies[key] = plain
            swapped.append((copies, key, head))
    try:
        yield
    finally:
        for copies, key, head in swapped:
            copies[key] = head


def peft_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The PeftModel's ``state_dict`` as plain PEFT would have it: every maximus table in full (a tied head's
    rows under its own key, see :func:`save_peft`), each trained copy in its frozen original's dtype."""
    sd = model.state_dict()
    for key in list(sd):
        if COPY not in key:
            continue
        stem, rest = key.split(COPY, 1)
        orig = sd.get(stem + ORIGINAL + rest.split(".", 1)[1])
        if orig is not None and orig.dtype != sd[key].dtype:
            sd[key] = sd[key].to(orig.dtype)
    return sd


def _gathered(model: nn.Module):
    """Under ZeRO-3, the trained parameters (LoRA, unswapped copies) gathered for the state dict."""
    params = [p for p in model.parameters() if p.requires_grad and hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters(params)


def save_peft(model_or_engine, out_dir: str, **save_kwargs) -> str:
    """Write an ordinary PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) with the
    LoRA weights and the full trained embedding and head, loadable with plain ``peft`` + ``transformers``.

    ``save_kwargs`` go to ``PeftModel.save_pretrained``. Only rank 0 writes. A grown vocabulary
    (:func:`ds_maximus.resize_token_embeddings`) reloads onto a base model resized to the same size first
    (``base.resize_token_embeddings(len(tokenizer))``), as with plain PEFT. Returns ``out_dir``.
    """
    model = _unwrap(model_or_engine)
    rank = int(os.environ.get("RANK", "0"))
    save = getattr(model, "_maximus_plain_save_pretrained", model.save_pretrained)
    with _gathered(model), _plain_tied_heads(model):
        sd = peft_state_dict(model)
        if rank == 0:
            save(out_dir, state_dict=sd, **save_kwargs)
    return out_dir


def complete_peft_saves(model: nn.Module) -> bool:
    """Make ``model.save_pretrained`` (what ``trainer.save_model()`` calls) write what :func:`save_peft` writes where
    it needs no collective: the state dict it is given (the HF Trainer passes DeepSpeed's) is completed with a
    tied head's rows under PEFT's head key, which a ``ShardedLMHead`` owning no weight left out, so plain ``peft``
    reloads the folder tied. Partitioned and broadcast tables need every rank: save those with :func:`save_peft`.
    Returns whether it was installed (a PEFT model with a tied maximus head)."""
    if not is_peft_model(model) or "_maximus_plain_save_pretrained" in model.__dict__:
        return False
    tied = any(_tied_source(h) is not None for m in model.modules()
               if isinstance(getattr(m, "modules_to_save", None), nn.ModuleDict) for h in m.modules_to_save.values())
    if not tied:
        return False
    plain = model.save_pretrained

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        # PEFT looks at the live modules too while it saves: the tied heads stay plain until it is done. ZeRO-3's
        # gather is a collective: with several ranks the HF Trainer saves on rank 0 only, from the state dict it
        # consolidated on every rank, so only a call without one (or a single rank) gathers here
        one_rank = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
        gather = _gathered(model) if state_dict is None or one_rank else contextlib.nullcontext()
        with gather, _plain_tied_heads(model, collectives=False):
            ours = peft_state_dict(model)
            if state_dict is not None:   # the caller's (LoRA gathered by DeepSpeed ...), the tables from maximus
                ours = {**ours, **{k: v for k, v in state_dict.items() if COPY not in k}}
            return plain(save_directory, *args, state_dict=ours, **kwargs)

    model.__dict__["_maximus_plain_save_pretrained"] = plain
    model.__dict__["save_pretrained"] = save_pretrained
    return True


def _prepare(model: nn.Module, cfg: MaximusConfig) -> List[str]:
    done = host_frozen_originals(model, cfg)
    complete_peft_saves(model)
    return done


def _wrappers(model: nn.Module):
    """``(name, wrapper)`` of every PEFT ``ModulesToSaveWrapper`` (a frozen ``original_module`` beside the trained
    copies in a ``modules_to_save`` ModuleDict), by structure: peft stays optional."""
    for name, m in model.named_modules():
        if isinstance(getattr(m, "modules_to_save", None), nn.ModuleDict) and "original_module" in m._modules:
            yield name, m


def host_frozen_originals(model: nn.Module, cfg: MaximusConfig) -> List[str]:
    """Move the frozen ``original_module`` of every PEFT wrapper around a vocabulary table (an ``nn.Embedding``
    or ``nn.Linear`` with at least ``embedding.min_rows`` rows) to host memory as a ``HostTable``, once the
    engine swapped the model's tables: PEFT reads the original only with the adapters disabled, and as a
    Parameter it would put a dense V x d table on the compute device. Returns the wrappers' names."""
    from ds_maximus.vocab.host_table import HostTable
    if not is_peft_model(model):
        return []
    done = []
    for name, wrapper in _wrappers(model):
        orig = wrapper.original_module
        if isinstance(orig, HostTable) or not isinstance(orig, (nn.Embedding, nn.Linear)):
            continue
        weight = orig.weight
        if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[0] < cfg.embedding.min_rows:
            continue
        wrapper._modules["original_module"] = HostTable(orig, chunk_rows=cfg.lm_head.chunk_rows)
        done.append(name)
    return done


register_adapter(ModelAdapter("peft", prepare_model=_prepare))
