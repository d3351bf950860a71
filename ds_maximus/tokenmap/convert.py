"""Permute a Hugging Face checkpoint to a token map, and write its embedding shard store.

``convert_checkpoint(model_dir, token_map, out_dir)`` reads a safetensors checkpoint (one file or
an index of several), permutes every vocabulary-sized tensor (input embedding, LM head, its bias)
so that row ``new`` holds what row ``new_to_old[new]`` held, remaps the special-token ids of
``config.json``/``generation_config.json``, writes the rewritten tokenizer beside the weights and
creates the shard store of the input embedding (fp32, optionally with zeroed AdamW state). A saved
token map records the checkpoint folders converted from it (meta ``converted_checkpoints``), so that
:func:`ds_maximus.tokenmap.extend.extend_token_map` keeps their tokenizers in step with it.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ds_maximus.errors import TokenMapError
from ds_maximus.store import ShardStore
from ds_maximus.tokenmap.converted import CHECKPOINTS_KEY, CONVERT_FILE
from ds_maximus.tokenmap.rewrite import write_tokenizer_folder
from ds_maximus.tokenmap.token_map import TokenMap

ADAMW_STATE_NAMES = ("exp_avg", "exp_avg_sq")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id",
                  "unk_token_id", "cls_token_id", "mask_token_id")
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                    "added_tokens.json"}
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model", ".msgpack", ".h5", ".index.json")


def _weight_files(model_dir: str) -> List[str]:
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(idx):
        with open(idx) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        return ["model.safetensors"]
    raise TokenMapError(f"{model_dir} holds no safetensors checkpoint (model.safetensors or "
                        "model.safetensors.index.json); save it with "
                        "model.save_pretrained(dir, safe_serialization=True)")


def _config_vocab(cfg: dict, path: str) -> int:
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    raise TokenMapError(f"{path} has no vocab_size; is this a causal LM checkpoint?")


def _vocab_tensor_names(model_dir: str, keys: Sequence[str], shapes: Dict[str, tuple], vocab: int):
    """(names of the vocab-sized tensors, name of the input embedding) in the checkpoint."""
    names, emb = [], None
    try:  # ask transformers which parameters are the input / output embeddings
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        targets = {id(model.get_input_embeddings().weight)}
        out = model.get_output_embeddings()
        if out is not None:
            targets |= {id(out.weight)} | ({id(out.bias)} if getattr(out, "bias", None) is not None else set())
        params = list(model.named_parameters(remove_duplicate=False))
        names = [n for n, p in params if id(p) in targets and n in shapes]
        emb_names = [n for n, p in params if p is model.get_input_embeddings().weight and n in shapes]
        emb = emb_names[0] if emb_names else None
    except Exception:  # an architecture transformers cannot build here: fall back to shapes
        names = []
    if not names or emb is None:
        names = [k for k in keys if len(shapes[k]) in (1, 2) and shapes[k][0] == vocab]
        cands = [k for k in names if len(shapes[k]) == 2 and "embed" in k] or [k for k in names if len(shapes[k]) == 2]
        emb = cands[0] if cands else None
    if emb is None:
        raise TokenMapError(f"no [vocab_size={vocab}, dim] embedding tensor found in {model_dir}; "
                            f"vocab-sized tensors: {names}")
    return names, emb


def _remap_ids(cfg: dict, perm: torch.Tensor) -> dict:
    def m(v):
        if isinstance(v, int) and 0 <= v < len(perm):
            return int(perm[v])
        if isinstance(v, list):
            return [m(x) for x in v]
        return v
    for k in _TOKEN_ID_KEYS:
        if k in cfg:
            cfg[k] = m(cfg[k])
    if isinstance(cfg.get("text_config"), dict):
        _remap_ids(cfg["text_config"], perm)
    return cfg


def convert_checkpoint(model_dir: str, token_map, out_dir: str, store_dir: Optional[str] = None,
                       rows_per_shard: int = 32768, state_names: Sequence[str] = (),
                       allow_padded_vocab: bool = False, progress: bool = True) -> dict:
    """Write ``out_dir`` (permuted checkpoint + rewritten tokenizer) and the embedding shard store.

    ``token_map`` is a :class:`TokenMap` or its folder. A checkpoint whose vocabulary differs from
    the token map's is refused, unless ``allow_padded_vocab`` and the checkpoint is larger (its
    padding rows then keep their place at the end). Returns a summary dict.
    """
    tm = token_map if isinstance(token_map, TokenMap) else TokenMap.load(token_map)
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise TokenMapError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint folder")
    with open(cfg_path) as f:
        cfg = json.load(f)
    vocab = _config_vocab(cfg, cfg_path)
    files = _weight_files(model_dir)
    shapes = {}
    for fn in files:
        with safe_open(os.path.join(model_dir, fn), "pt") as f:
            for k in f.keys():
                shapes[k] = tuple(f.get_slice(k).get_shape())
    names, emb_name = _vocab_tensor_names(model_dir, list(shapes), shapes, vocab)
    rows = shapes[emb_name][0]
    if rows != vocab:
        raise TokenMapError(f"{model_dir}: config vocab_size {vocab} but {emb_name} has {rows} rows")
    if vocab != tm.vocab_size and not (allow_padded_vocab and vocab > tm.vocab_size):
        raise TokenMapError(
            f"vocab size mismatch: the checkpoint {model_dir} has {vocab} rows, the token map {tm.vocab_size} "
            "tokens; build the token map from this model's own tokenizer"
            + (" (or pass allow_padded_vocab / --allow-padded-vocab if the extra rows are padding)"
               if vocab > tm.vocab_size else ""))
    perm = torch.cat([tm.new_to_old, torch.arange(tm.vocab_size, vocab, dtype=torch.long)])  # new -> old
    fwd = torch.empty_like(perm)
    fwd[perm] = torch.arange(vocab)  # old -> new

    os.makedirs(out_dir, exist_ok=True)
    it = files
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(files, desc="permuting checkpoint", unit="file")
    emb = None
    for fn in it:
        out: Dict[str, torch.Tensor] = {}
        with safe_open(os.path.join(model_dir, fn), "pt") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                t = f.get_tensor(k)
                out[k] = t.index_select(0, perm).contiguous() if k in names else t
        if emb_name in out:
            emb = out[emb_name]
        save_file(out, os.path.join(out_dir, fn), metadata={**meta, "format": meta.get("format", "pt")})
    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        if not os.path.isfile(src) or name in _TOKENIZER_FILES:
            continue
        if name in ("config.json", "generation_config.json"):
            with open(src) as f:
                c = _remap_ids(json.load(f), fwd)
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump(c, f, indent=2)
        elif name == "model.safetensors.index.json" or not name.endswith(_SKIP_SUFFIXES):
            shutil.copyfile(src, os.path.join(out_dir, name))
    write_tokenizer_folder(tm.tokenizer_dir or "", out_dir, tm.tokenizer_json, list(range(tm.vocab_size)))

    store_dir = store_dir or os.path.join(out_dir, "embedding_store")
    w = emb.float()
    store = ShardStore.create(store_dir, vocab, w.shape[1], torch.float32, rows_per_shard=rows_per_shard,
                              state_names=tuple(state_names), init=lambda lo, hi: {"weight": w[lo:hi]},
                              overwrite=True, progress=progress, loader=False)
    store.remove_orphans()  # shards of an earlier store at the same place
    summary = {"model_dir": os.path.abspath(model_dir), "out_dir": os.path.abspath(out_dir),
               "token_map": tm.path, "store": store.path, "vocab_size": vocab, "dim": int(w.shape[1]),
               "permuted_tensors": names, "embedding_tensor": emb_name, "state_names": list(state_names),
               "num_shards": store.num_shards}
    with open(os.path.join(out_dir, CONVERT_FILE), "w") as f:
        json.dump(summary, f, indent=1)
    if tm.path is not None:  # so that extending the token map later rewrites this checkpoint's tokenizer too
        tm.meta[CHECKPOINTS_KEY] = [d for d in tm.meta.get(CHECKPOINTS_KEY, []) if d != summary["out_dir"]] \
            + [summary["out_dir"]]
        tm.save(tm.path)
    return summary
