"""``TokenMap``: the vocabulary re-ordered by corpus frequency, and a tokenizer that speaks it.

Hot tokens get small ids, so the head of the embedding table (the rows a batch almost always
touches) is one contiguous block that stays in the GPU cache. Special tokens keep the lowest ids.
The tokenizer is rewritten once so that ``encode`` yields the new ids directly; models are permuted
to match with :func:`ds_maximus.tokenmap.convert.convert_checkpoint`.

A saved token map is a folder::

    token_map.json          meta: sizes, corpus token count, extended tokens, ...
    token_map.safetensors   old_to_new, new_to_old (int64 [V]) and counts (int64 [V], new order)
    tokenizer/              the rewritten tokenizer (tokenizer.json + its transformers companions)
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from safetensors.torch import save as st_save

from ds_maximus.errors import TokenMapError
from ds_maximus.store.format import atomic_write
from ds_maximus.tokenmap.corpus import corpus_stream, count_tokens, encode_ids
from ds_maximus.tokenmap.extend import extend_token_map
from ds_maximus.tokenmap.rewrite import (
    load_tokenizer_json,
    model_vocab_ids,
    permute_tokenizer_json,
    write_tokenizer_folder,
)
from ds_maximus.tokenmap.tokenizer_json import tokenizer_from_json
from ds_maximus.tokenmap.validate import read_maps, read_meta

META_FILE = "token_map.json"
MAPS_FILE = "token_map.safetensors"
TOKENIZER_DIR = "tokenizer"
FORMAT_NAME = "ds_maximus.token_map"
FORMAT_VERSION = 1
_SELF_CHECK_TEXTS = 256


def _load_source(tokenizer) -> Tuple[dict, Optional[str]]:
    """(parsed tokenizer.json, source folder or None) of a path, a ``tokenizers.Tokenizer`` or a
    transformers fast tokenizer."""
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        return load_tokenizer_json(path), (path if os.path.isdir(path) else None)
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise TokenMapError(f"{type(tokenizer).__name__} is not a Hugging Face fast tokenizer; pass a folder with "
                            "tokenizer.json, a tokenizers.Tokenizer or a transformers *Fast tokenizer")
    return json.loads(backend.to_str()), None


class TokenMap:
    """A frequency-ordered vocabulary: ``old_to_new``/``new_to_old`` maps and a rewritten tokenizer.

    Example::

        >>> import os, tempfile
        >>> from ds_maximus.tokenmap.train import save_tokenizer, train_tokenizer
        >>> d = tempfile.mkdtemp()
        >>> tok = train_tokenizer(texts=["hello world", "the cat sat on the mat"] * 50, vocab_size=300,
        ...                       progress=False)
        >>> tokenizer_dir = save_tokenizer(tok, os.path.join(d, "my_tokenizer"))
        >>> with open(os.path.join(d, "corpus.txt"), "w") as f:
        ...     _ = f.write("hello world\\n" * 30 + "the cat sat on the mat\\n" * 5)
        >>> tm = TokenMap.build(tokenizer_dir, [os.path.join(d, "corpus.txt")], progress=False)
        >>> tm = tm.save(os.path.join(d, "tokenmap"))
        >>> tm.encode("hello world")       # new ids, hot tokens small
        [6, 5]
        >>> round(tm.coverage(8), 2)       # share of corpus tokens in rows [0, 8)
        0.8
        >>> import shutil; shutil.rmtree(d)
    """

    def __init__(self, old_to_new: torch.Tensor, new_to_old: torch.Tensor, counts: torch.Tensor,
                 tokenizer_json: dict, meta: dict, source_dir: Optional[str] = None, path: Optional[str] = None):
        self.old_to_new = old_to_new.long()
        self.new_to_old = new_to_old.long()
        self.counts = counts.long()
        self.tokenizer_json = tokenizer_json
        self.meta = meta
        self.path = path
        self._source_dir = source_dir
        self._tokenizer = None

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def build(cls, tokenizer, corpus=None, batch_size: int = 1024, progress: bool = True,
              text_key: str = "text", sample_by: str = "line", *, texts=None) -> "TokenMap":
        """Count a corpus with ``tokenizer`` and order its vocabulary by frequency.

        ``corpus``: text files or folders of them (see :mod:`ds_maximus.tokenmap.corpus` for
        ``text_key`` and ``sample_by``); ``texts``: strings taken as literal text. Give either or
        both; a path that does not exist is a ``FileNotFoundError``.
        """
        src, source_dir = _load_source(tokenizer)
        vocab = model_vocab_ids(src)
        V = len(vocab)
        if sorted(vocab.values()) != list(range(V)):
            raise TokenMapError(f"the tokenizer's ids are not 0..{V - 1} without gaps; a token map needs a dense "
                                "vocabulary (remove the holes or re-train the tokenizer)")
        old = tokenizer_from_json(src)
        stream, total_bytes = corpus_stream(corpus, texts, text_key, sample_by)
        sample: List[str] = []

        def keep(texts):
            for t in texts:
                if len(sample) < _SELF_CHECK_TEXTS:
                    sample.append(t)
                yield t
        counts = count_tokens(old, keep(stream), V, batch_size=batch_size, progress=progress,
                              total_bytes=total_bytes)

        special = sorted(a["id"] for a in src.get("added_tokens") or [] if a.get("special"))
        is_special = np.zeros(V, dtype=bool)
        is_special[special] = True
        rest = np.nonzero(~is_special)[0]
        rest = rest[np.lexsort((rest, -counts[rest]))]  # by count, descending; ties by old id
        new_to_old = np.concatenate([np.array(special, dtype=np.int64), rest])
        old_to_new = np.empty(V, dtype=np.int64)
        old_to_new[new_to_old] = np.arange(V)
        tok_json = permute_tokenizer_json(src, old_to_new.tolist())
        meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "vocab_size": V, "base_vocab_size": V,
                "num_special": len(special), "corpus_tokens": int(counts.sum()), "extended_tokens": [],
                "model_type": src["model"]["type"],
                "source_tokenizer_sha256": hashlib.sha256(json.dumps(src, sort_keys=True).encode()).hexdigest()}
        tm = cls(torch.from_numpy(old_to_new), torch.from_numpy(new_to_old), torch.from_numpy(counts[new_to_old]),
                 tok_json, meta, source_dir)
        tm._self_check(old, sample)
        return tm

    def _self_check(self, old, texts: Sequence[str]) -> None:
        """The rewritten tokenizer must give ``old_to_new[old ids]`` and the same decoded text."""
        new = self.tokenizer
        for t in texts:
            a, b = old.encode(t).ids, new.encode(t).ids
            if [int(self.old_to_new[i]) for i in a] != b or old.decode(a) != new.decode(b):
                raise TokenMapError(f"the rewritten tokenizer disagrees with the original on {t[:60]!r}; this "
                                    "tokenizer uses a feature the rewrite does not handle; please report it")

    # ---- persistence --------------------------------------------------------------------------
    def save(self, path: str) -> "TokenMap":
        """Write the token map folder (maps, meta, rewritten tokenizer). Returns ``self``."""
        os.makedirs(path, exist_ok=True)
        src = self._source_dir
        if src is None and self.path is not None:
            src = os.path.join(self.path, TOKENIZER_DIR)
        write_tokenizer_folder(src or "", os.path.join(path, TOKENIZER_DIR), self.tokenizer_json,
                               self._companion_map())
        atomic_write(os.path.join(path, MAPS_FILE), [st_save(
            {"old_to_new": self.old_to_new.contiguous(), "new_to_old": self.new_to_old.contiguous(),
             "counts": self.counts.contiguous()})])
        atomic_write(os.path.join(path, META_FILE), [json.dumps(self.meta, indent=1).encode()])
        self.path, self._source_dir = os.path.abspath(path), None
        return self

    def _companion_map(self) -> List[int]:
        """Map applied to ids in companion files: old->new for a fresh build, identity once saved."""
        if self._source_dir is not None:
            return self.old_to_new.tolist()
        return list(range(self.vocab_size))

    @classmethod
    def load(cls, path: str) -> "TokenMap":
        """Load a token map folder written by :meth:`save` (or ``maximus-tokenizer build``)."""
        meta_path = os.path.join(path, META_FILE)
        if not os.path.isfile(meta_path):
            raise TokenMapError(f"{path} is not a token map: {META_FILE} is missing; build one with "
                                "`maximus-tokenizer build`")
        meta = read_meta(meta_path, FORMAT_NAME, FORMAT_VERSION)  # every field checked before use
        maps = read_maps(os.path.join(path, MAPS_FILE), meta["vocab_size"])
        tok_json = load_tokenizer_json(os.path.join(path, TOKENIZER_DIR))
        tm = cls(maps["old_to_new"], maps["new_to_old"], maps["counts"], tok_json, meta, path=os.path.abspath(path))
        if not (len(tm.old_to_new) == len(tm.new_to_old) == len(tm.counts) == meta["vocab_size"]):
            raise TokenMapError(f"{path}: maps of {len(tm.old_to_new)} entries but vocab_size {meta['vocab_size']}; "
                                "the token map is corrupt, rebuild it")
        return tm

    # ---- use ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def base_vocab_size(self) -> int:
        """Vocabulary size of the original tokenizer (before :meth:`extend`)."""
        return int(self.meta["base_vocab_size"])

    @property
    def num_special(self) -> int:
        return int(self.meta["num_special"])

    @property
    def tokenizer(self):
        """The rewritten ``tokenizers.Tokenizer`` (its ``encode`` yields new ids)."""
        if self._tokenizer is None:
            self._tokenizer = tokenizer_from_json(self.tokenizer_json)
        return self._tokenizer

    @property
    def tokenizer_dir(self) -> Optional[str]:
        return os.path.join(self.path, TOKENIZER_DIR) if self.path else None

    def hf_tokenizer(self):
        """The rewritten tokenizer as a transformers tokenizer (needs a saved token map)."""
        if self.path is None:
            raise TokenMapError("hf_tokenizer() needs a saved token map; call save(path) first")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_new(self, old_ids: torch.Tensor) -> torch.Tensor:
        return self.old_to_new[torch.as_tensor(old_ids, dtype=torch.long)]

    def to_old(self, new_ids: torch.Tensor) -> torch.Tensor:
        return self.new_to_old[torch.as_tensor(new_ids, dtype=torch.long)]

    def coverage(self, k: int) -> float:
        """Share of the build corpus's tokens whose new id is below ``k``."""
        total = int(self.counts.sum())
        return float(self.counts[:k].sum()) / total if total else 0.0

    def corpus_coverage(self, corpus=None, ks: Sequence[int] = (1024,), text_key: str = "text",
                        progress: bool = False, sample_by: str = "line", *, texts=None) -> Dict[int, float]:
        """Share of a corpus's tokens (files ``corpus`` and/or literal ``texts``, encoded with the
        rewritten tokenizer) whose id is below each k."""
        stream, total_bytes = corpus_stream(corpus, texts, text_key, sample_by)
        counts = count_tokens(self.tokenizer, stream, self.vocab_size, progress=progress, total_bytes=total_bytes)
        cum = np.cumsum(counts)
        return {k: float(cum[min(k, len(cum)) - 1]) / float(cum[-1]) if k > 0 else 0.0 for k in ks}

    def top_tokens(self, n: int = 20) -> List[Tuple[int, str, int]]:
        """``(new id, token, count)`` of the ``n`` most frequent non-special tokens."""
        out = []
        for i in range(self.num_special, min(self.vocab_size, self.num_special + n)):
            out.append((i, self.tokenizer.id_to_token(i), int(self.counts[i])))
        return out

    def extend(self, tokens: Sequence[str], stores=(), progress: bool = True, single_word: bool = False) -> List[int]:
        """Append ``tokens`` as new ids (and new shards of each store in ``stores``); see
        :func:`ds_maximus.tokenmap.extend.extend_token_map`."""
        return extend_token_map(self, tokens, stores, progress=progress, single_word=single_word)

    def __repr__(self) -> str:
        return (f"TokenMap(vocab_size={self.vocab_size}, special={self.num_special}, "
                f"corpus_tokens={self.meta.get('corpus_tokens')}, path={self.path!r})")

    def encode_ids(self, texts: List[str]) -> np.ndarray:
        """New ids of ``texts`` concatenated (no special tokens), as int64."""
        return encode_ids(self.tokenizer, texts)
