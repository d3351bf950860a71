"""Checks of a saved token map's files before they are used: ``token_map.json`` field by field and the
id maps of ``token_map.safetensors`` (shapes, dtypes, a true permutation).

Token maps are shared (a domain vocabulary); a tampered or corrupt one is a :class:`TokenMapError`
naming the field, never a wrong remap, a huge allocation or an ``IndexError`` deep in a step.
"""
from __future__ import annotations

import json
import os

import torch

from ds_maximus.errors import TokenMapError

MAX_META_BYTES = 256 << 20  # bytes of token_map.json
MAX_VOCAB = 1 << 32  # ids of a vocabulary
_MAPS_HEADER_BYTES = 1 << 20  # bound of the safetensors header of the id maps


def _int(meta: dict, key: str, lo: int, hi: int, path: str, default=None) -> int:
    if key not in meta and default is not None:
        return default
    v = meta.get(key)
    if type(v) is not int or not lo <= v <= hi:  # bool is an int subclass: refused too
        raise TokenMapError(f"{path}: field {key!r} is {v!r:.80}; it must be an integer in [{lo}, {hi}]; the token "
                            "map is corrupt: rebuild it with `maximus-tokenizer build`")
    return v


def _str_list(meta: dict, key: str, path: str, length=None) -> None:
    v = meta.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v) or (length is not None and len(v) != length):
        want = f" of {length} entries" if length is not None else ""
        raise TokenMapError(f"{path}: field {key!r} must be a list of strings{want}; got {v!r:.80}; the token map "
                            "is corrupt: rebuild it with `maximus-tokenizer build`")


def read_meta(path: str, format_name: str, format_version: int) -> dict:
    """``token_map.json`` parsed and checked: format, sizes (``num_special <= base_vocab_size <= vocab_size``),
    counts, and the lists it holds."""
    size = os.path.getsize(path)
    if size > MAX_META_BYTES:
        raise TokenMapError(f"{path} is {size} bytes, more than any real token map meta ({MAX_META_BYTES}); it is "
                            "corrupt: rebuild the token map")
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, or a number of over 4300 digits
        raise TokenMapError(f"{path} is not valid JSON ({type(e).__name__}: {e}); rebuild the token map") from None
    if not isinstance(meta, dict):
        raise TokenMapError(f"{path} must hold a JSON object, not {type(meta).__name__}; rebuild the token map")
    version = meta.get("format_version")
    if meta.get("format") != format_name or type(version) is not int or version != format_version:
        raise TokenMapError(f"{path}: format {meta.get('format')!r:.40} v{version!r:.20}; this ds_maximus reads "
                            f"{format_name} v{format_version}")
    vocab = _int(meta, "vocab_size", 1, MAX_VOCAB, path)
    base = _int(meta, "base_vocab_size", 1, vocab, path)
    _int(meta, "num_special", 0, base, path)
    _int(meta, "corpus_tokens", 0, (1 << 63) - 1, path, default=0)
    _str_list(meta, "extended_tokens", path, length=vocab - base)
    _str_list(meta, "converted_checkpoints", path)
    for key in ("model_type", "source_tokenizer_sha256"):
        if key in meta and not isinstance(meta[key], str):
            raise TokenMapError(f"{path}: field {key!r} must be a string; got {meta[key]!r:.80}")
    return meta


def read_maps(path: str, vocab_size: int) -> dict:
    """The id maps of ``token_map.safetensors``: ``old_to_new``/``new_to_old`` int64 ``[vocab_size]`` inverse
    permutations and ``counts`` int64 ``[vocab_size]`` >= 0. The file is bounded by those sizes before it is read."""
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load
    size = os.path.getsize(path)
    bound = 3 * 8 * vocab_size + _MAPS_HEADER_BYTES
    if size > bound:
        raise TokenMapError(f"{path} is {size} bytes; maps of {vocab_size} ids take at most {bound}; the token map "
                            "is corrupt: rebuild it")
    try:
        with open(path, "rb") as f:
            maps = st_load(f.read())
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise TokenMapError(f"{path} is not a readable safetensors file ({e}); rebuild the token map") from None
    for name in ("old_to_new", "new_to_old", "counts"):
        t = maps.get(name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (vocab_size,):
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else None
            raise TokenMapError(f"{path}: tensor {name!r} must be int64 [{vocab_size}] (vocab_size in the meta); "
                                f"got {got}; the token map is corrupt: rebuild it")
    o2n, n2o = maps["old_to_new"], maps["new_to_old"]
    ids = torch.arange(vocab_size)
    if (bool(((o2n < 0) | (o2n >= vocab_size)).any()) or bool(((n2o < 0) | (n2o >= vocab_size)).any())
            or not torch.equal(o2n[n2o], ids)):
        raise TokenMapError(f"{path}: old_to_new and new_to_old are not inverse permutations of [0, {vocab_size}); "
                            "the token map is corrupt: rebuild it")
    if bool((maps["counts"] < 0).any()):
        raise TokenMapError(f"{path}: tensor 'counts' holds negative counts; the token map is corrupt: rebuild it")
    return maps
