"""Grow a token map with new tokens (new drug names, new markup) without touching what exists.

New tokens get the ids after the current vocabulary, in the order given, as added tokens of the
rewritten tokenizer. Each shard store passed along grows by new shards whose rows start as the mean
of the rows of the pieces the tokenizer split the word into before the extension; existing shard
files stay byte-identical. Every tokenizer written from the token map is rewritten with it: its own
``tokenizer/`` folder and that of each checkpoint converted from it (recorded by
:func:`ds_maximus.tokenmap.convert.convert_checkpoint`, or found beside a store passed here), so no
``tokenizer.json`` keeps the old vocabulary size. A converted checkpoint's weights keep their rows:
the model grows with ``resize_token_embeddings`` (or reads the grown store).
"""
from __future__ import annotations

import json
from typing import List, Sequence

import torch

from ds_maximus.errors import TokenMapError
from ds_maximus.store import ShardStore
from ds_maximus.tokenmap.converted import CHECKPOINTS_KEY, converted_checkpoint_dirs
from ds_maximus.tokenmap.rewrite import write_tokenizer_folder
from ds_maximus.tokenmap.tokenizer_json import tokenizer_from_json


def _as_list(stores) -> list:
    if stores is None:
        return []
    if isinstance(stores, ShardStore):
        return [stores]
    return list(stores)


def extend_token_map(tm, tokens: Sequence[str], stores=(), progress: bool = True,
                     single_word: bool = False) -> List[int]:
    """Append ``tokens`` to token map ``tm`` (and to each of ``stores``); returns their new ids.

    Saves ``tm`` in place when it was loaded from or saved to a folder.
    """
    from tokenizers import AddedToken

    tokens = list(tokens) if not isinstance(tokens, str) else [tokens]
    if not tokens:
        raise TokenMapError("extend: no tokens given; pass one or more new token strings")
    bad = [t for t in tokens if not isinstance(t, str) or not t.strip()]
    if bad:
        raise TokenMapError(f"extend: tokens must be non-blank strings; got {bad[:5]}")
    seen, dups = set(), []
    for t in tokens:
        if t in seen:
            dups.append(t)
        seen.add(t)
    if dups:
        raise TokenMapError(f"extend: duplicate tokens {sorted(set(dups))[:10]}; pass each new token once")
    present = [t for t in tokens if tm.tokenizer.token_to_id(t) is not None]
    if present:
        raise TokenMapError(f"extend: tokens already in the vocabulary: "
                            f"{[(t, tm.tokenizer.token_to_id(t)) for t in present[:10]]}; leave them out")
    stores = _as_list(stores)
    V = tm.vocab_size
    for s in stores:
        if s.vocab_size != V:
            raise TokenMapError(f"extend: store {s.path} has {s.vocab_size} rows but the token map has {V} tokens; "
                                "pass the store that belongs to this token map")
    pieces = [tm.encode(t) for t in tokens]

    # the new tokenizer first (nothing written yet), so a failure here changes nothing
    tok = tokenizer_from_json(json.loads(tm.tokenizer.to_str()))  # a copy (Unigram scores kept exact)
    tok.add_tokens([AddedToken(t, single_word=single_word) for t in tokens])
    new_ids = [tok.token_to_id(t) for t in tokens]
    if new_ids != list(range(V, V + len(tokens))):
        raise TokenMapError(f"extend: the tokenizer gave ids {new_ids[:5]}..., expected {V}..; "
                            "its vocabulary is not dense; rebuild the token map")

    it = stores
    if progress and stores:
        from tqdm.auto import tqdm
        it = tqdm(stores, desc="appending rows", unit="store")
    for s in it:
        uniq = sorted({i for p in pieces for i in p})
        table = dict(zip(uniq, s.read_rows(torch.tensor(uniq, dtype=torch.long)).float()))
        rows = torch.stack([torch.stack([table[i] for i in p]).mean(0) for p in pieces])
        s.append_shards({"weight": rows.to(s.dtype)})

    n = len(tokens)
    ext = torch.arange(V, V + n, dtype=torch.long)
    tm.old_to_new = torch.cat([tm.old_to_new, ext])
    tm.new_to_old = torch.cat([tm.new_to_old, ext])
    tm.counts = torch.cat([tm.counts, torch.zeros(n, dtype=torch.long)])
    tm.tokenizer_json = json.loads(tok.to_str())
    tm._tokenizer = tok
    tm.meta["vocab_size"] = V + n
    tm.meta["extended_tokens"] = list(tm.meta.get("extended_tokens", [])) + tokens
    ckpts = converted_checkpoint_dirs(tm, stores)
    tm.meta[CHECKPOINTS_KEY] = ckpts
    if tm.path is not None:
        tm.save(tm.path)
    for d in ckpts:
        write_tokenizer_folder(tm.tokenizer_dir or "", d, tm.tokenizer_json, list(range(tm.vocab_size)))
    return new_ids
