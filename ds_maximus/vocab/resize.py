"""Grow a model's vocabulary for new tokens: ``resize_token_embeddings`` with a chosen start for the new rows.

A domain vocabulary (drug names, ICD codes, Latin terms) is appended to a tokenizer (``maximus-tokenizer
extend``, or ``tokenizer.add_tokens``); the model's tables then need one row per new id. This grows every
table that has a row per token (the input embedding, an untied LM head, and inside PEFT's
``ModulesToSaveWrapper`` both the frozen original and the trained copy) where it lives, on the CPU when the
model was loaded there, before ``ds_maximus.initialize`` moves the table into the row store: no dense copy
of the table is ever made on the GPU. Old rows stay bit-equal; tied tables stay one Parameter; the new rows
start as ``embedding.new_row_init`` says (:class:`ds_maximus.config.NewRowInit`).

Example::

    old_tok = AutoTokenizer.from_pretrained("base")
    pieces = pieces_of(["acetylsalicylic", "ICD-10"], old_tok)     # how the old tokenizer splits them
    tok.add_tokens(["acetylsalicylic", "ICD-10"])                   # or: maximus-tokenizer extend
    ds_maximus.resize_token_embeddings(model, len(tok), pieces=pieces)   # rows = mean of their pieces' rows
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from ds_maximus.config import MaximusConfig, NewRowInit
from ds_maximus.errors import ConfigError


def pieces_of(tokens: Sequence[str], tokenizer) -> List[List[int]]:
    """The ids ``tokenizer`` (the one *before* the extension) splits each of ``tokens`` into, without special
    tokens. Takes a ``transformers`` tokenizer, a ``tokenizers.Tokenizer`` or a :class:`TokenMap`."""
    out = []
    for t in tokens:
        if hasattr(tokenizer, "convert_ids_to_tokens"):          # transformers
            ids = tokenizer.encode(t, add_special_tokens=False)
        elif hasattr(tokenizer, "encode_batch"):                 # tokenizers.Tokenizer
            ids = tokenizer.encode(t, add_special_tokens=False).ids
        else:                                                    # TokenMap
            ids = tokenizer.encode(t)
        out.append([int(i) for i in ids])
    return out


def _inner(mod: nn.Module) -> List[nn.Module]:
    """The modules holding rows behind ``mod``: itself, or a PEFT ModulesToSaveWrapper's original and copies."""
    if hasattr(mod, "original_module") and hasattr(mod, "modules_to_save"):
        return [mod.original_module, *mod.modules_to_save.values()]
    if hasattr(mod, "token_adapter"):
        raise ConfigError(f"{type(mod).__name__} (PEFT trainable_token_indices) trains chosen rows of a frozen table; "
                          "resize the model before get_peft_model, then list the new ids in "
                          "trainable_token_indices", "maximus.embedding.new_row_init")
    return [mod]


def _new_rows(old: torch.Tensor, n_new: int, init: NewRowInit, pieces, seed: int) -> torch.Tensor:
    """``n_new`` rows (fp32) for the table ``old`` (``old_rows x ...``)."""
    w = old.detach().float()
    mean = w.mean(0)
    if init == NewRowInit.MEAN:
        return mean.expand(n_new, *w.shape[1:]).clone()
    if init == NewRowInit.NORMAL:
        g = torch.Generator(device="cpu").manual_seed(seed)
        std = w.std(0) if w.shape[0] > 1 else torch.zeros_like(mean)
        noise = torch.randn((n_new, *w.shape[1:]), generator=g).to(w.device)
        return mean + noise * std
    rows = []
    for p in pieces:
        rows.append(w[torch.as_tensor(p, dtype=torch.long, device=w.device)].mean(0) if len(p) else mean)
    return torch.stack(rows) if rows else w.new_zeros((0, *w.shape[1:]))


def _check_pieces(pieces, n_new: int, old_rows: int) -> None:
    if pieces is None:
        raise ConfigError(f"new_row_init 'mean_of_pieces' needs pieces: for each of the {n_new} new tokens the ids "
                          "the old tokenizer splits it into "
                          "(ds_maximus.vocab.resize.pieces_of(tokens, old_tokenizer)); "
                          "pass pieces=, or choose new_row_init 'mean' or 'normal'", "maximus.embedding.new_row_init")
    if len(pieces) != n_new:
        raise ConfigError(f"pieces has {len(pieces)} entries but the vocabulary grows by {n_new} rows; give one list "
                          "of old ids per new token, in the order of their new ids", "maximus.embedding.new_row_init")
    bad = [i for p in pieces for i in p if not 0 <= int(i) < old_rows]
    if bad:
        raise ConfigError(f"pieces name ids {bad[:5]} outside the old vocabulary [0, {old_rows}); pieces come from the "
                          "tokenizer before the extension", "maximus.embedding.new_row_init")


def resize_token_embeddings(model: nn.Module, new_size: int, *, pieces: Optional[Sequence[Sequence[int]]] = None,
                            init: Union[NewRowInit, str, None] = None, config: Union[MaximusConfig, dict, None] = None,
                            seed: int = 0) -> nn.Module:
    """Grow ``model``'s token tables (a ``transformers`` model or a ``peft.PeftModel``) to ``new_size`` rows.

    ``init`` (default: ``config``'s ``embedding.new_row_init``, else ``mean_of_pieces``) fills the new rows of
    every table alike, each from its own old rows: the embedding's from the embedding, an untied head's from
    the head (its bias too). ``pieces[k]`` are the old ids of new token ``old_size + k`` (:func:`pieces_of`);
    a token with no pieces starts at the mean row. Returns ``model``; ``config.vocab_size`` follows.
    """
    if init is None:
        cfg = config if isinstance(config, MaximusConfig) else MaximusConfig.from_ds_config(config or {})
        init = cfg.embedding.new_row_init
    init = NewRowInit(init)
    emb = model.get_input_embeddings()
    from ds_maximus.vocab import ShardedEmbedding
    if isinstance(emb, ShardedEmbedding) or any(isinstance(m, ShardedEmbedding) for m in emb.modules()):
        raise ConfigError("resize_token_embeddings grows the tables before ds_maximus.initialize moves them into the "
                          "row store; call it on the model as loaded (on the CPU), then initialize",
                          "maximus.embedding.new_row_init")
    tables = _inner(emb)
    old_size = tables[0].weight.shape[0]
    n_new = int(new_size) - old_size
    if n_new < 0:
        raise ConfigError(f"resize_token_embeddings grows a vocabulary; {new_size} < its {old_size} rows",
                          "maximus.embedding.new_row_init")
    out = model.get_output_embeddings()
    tables += [m for m in (_inner(out) if out is not None else []) if m.weight.shape[0] == old_size]
    if n_new == 0:
        return model
    if init == NewRowInit.MEAN_OF_PIECES:
        _check_pieces(pieces, n_new, old_size)
    grown: Dict[int, nn.Parameter] = {}   # id(old Parameter) -> the grown one: ties stay one Parameter
    for m in tables:
        for name in ("weight", "bias"):
            p = m._parameters.get(name)
            if p is None or (name == "bias" and p.shape[0] != old_size):
                continue
            if id(p) not in grown:
                with torch.no_grad():
                    rows = _new_rows(p, n_new, init, pieces, seed).to(p.dtype)
                    grown[id(p)] = nn.Parameter(torch.cat([p.detach(), rows]), requires_grad=p.requires_grad)
            setattr(m, name, grown[id(p)])
        if isinstance(m, nn.Embedding):
            m.num_embeddings = new_size
        elif isinstance(m, nn.Linear):
            m.out_features = new_size
    hf_config = getattr(model, "config", None)
    if hf_config is not None and getattr(hf_config, "vocab_size", None) is not None:
        hf_config.vocab_size = new_size
    text = getattr(hf_config, "text_config", None) if hf_config is not None else None
    if getattr(text, "vocab_size", None) is not None:
        text.vocab_size = new_size
    return model
