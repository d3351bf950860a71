"""Rewrite a Hugging Face tokenizer so that it emits permuted ids directly.

Only ids change: the vocabulary of the model (``BPE``, ``WordPiece``, ``WordLevel``: a
``token -> id`` dict; ``Unigram``: a list whose position is the id), the added tokens, the post
processor's special-token ids and the padding id. BPE merges are stored by string and stay as they
are, so the rewritten tokenizer splits every text exactly as before.

Next to ``tokenizer.json``, a saved transformers tokenizer folder has ``tokenizer_config.json``
(``added_tokens_decoder`` is keyed by id) and maybe ``vocab.json`` (GPT-2 style); both are
rewritten. SentencePiece ``*.model`` files cannot be permuted and are left out.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Dict, List

from ds_maximus.errors import TokenMapError

TOKENIZER_FILE = "tokenizer.json"
_SKIP_FILES = (".model",)  # sentencepiece protos: ids are implicit, cannot be rewritten


def load_tokenizer_json(path: str) -> dict:
    """The parsed ``tokenizer.json`` of ``path`` (a folder holding it, or the file itself)."""
    f = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise TokenMapError(f"no {TOKENIZER_FILE} at {path}: a Hugging Face *fast* tokenizer is needed; "
                            "save one with tokenizer.save_pretrained(folder) or tokenizers.Tokenizer.save(file)")
    with open(f, encoding="utf-8") as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as e:
            raise TokenMapError(f"{f} is not valid JSON ({e})") from None


def model_vocab_ids(tok: dict) -> Dict[str, int]:
    """token -> id of every entry of the model vocabulary and the added tokens."""
    model = tok["model"]
    kind = model.get("type")
    if kind == "Unigram":
        vocab = {piece: i for i, (piece, _score) in enumerate(model["vocab"])}
    elif kind in ("BPE", "WordPiece", "WordLevel"):
        vocab = dict(model["vocab"])
    else:
        raise TokenMapError(f"tokenizer model type {kind!r} is not supported; "
                            "allowed: BPE, WordPiece, WordLevel, Unigram")
    for a in tok.get("added_tokens") or []:
        vocab[a["content"]] = a["id"]
    return vocab


def permute_tokenizer_json(tok: dict, old_to_new: List[int]) -> dict:
    """A copy of ``tok`` (parsed tokenizer.json) whose ids are ``old_to_new[old id]``."""
    tok = copy.deepcopy(tok)
    n = len(old_to_new)

    def m(i: int) -> int:
        if not 0 <= i < n:
            raise TokenMapError(f"tokenizer.json uses id {i}, outside the token map's vocabulary of {n}")
        return int(old_to_new[i])

    model = tok["model"]
    if model["type"] == "Unigram":
        vocab = model["vocab"]
        new = [None] * len(vocab)
        for i, entry in enumerate(vocab):
            new[m(i)] = entry
        if any(e is None for e in new):
            raise TokenMapError("the Unigram vocabulary does not map onto itself; rebuild the token map")
        model["vocab"] = new
        if model.get("unk_id") is not None:
            model["unk_id"] = m(model["unk_id"])
    else:
        model["vocab"] = {t: m(i) for t, i in model["vocab"].items()}
    for a in tok.get("added_tokens") or []:
        a["id"] = m(a["id"])
    tok["added_tokens"] = sorted(tok.get("added_tokens") or [], key=lambda a: a["id"])
    if tok.get("post_processor"):
        tok["post_processor"] = _permute_processor(tok["post_processor"], m)
    if tok.get("padding") and "pad_id" in tok["padding"]:
        tok["padding"]["pad_id"] = m(tok["padding"]["pad_id"])
    return tok


def _permute_processor(p: dict, m) -> dict:
    kind = p.get("type")
    if kind == "TemplateProcessing":
        for spec in p.get("special_tokens", {}).values():
            spec["ids"] = [m(i) for i in spec["ids"]]
    elif kind in ("BertProcessing", "RobertaProcessing"):
        for key in ("sep", "cls"):
            if key in p:
                p[key] = [p[key][0], m(p[key][1])]
    elif kind == "Sequence":
        p["processors"] = [_permute_processor(q, m) for q in p["processors"]]
    return p


def write_tokenizer_folder(src: str, dst: str, tok: dict, old_to_new: List[int]) -> None:
    """Write the rewritten tokenizer ``tok`` to ``dst`` with the companion files of ``src`` adjusted
    (``old_to_new`` maps the ids of ``src``'s ``vocab.json``)."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
    if not os.path.isdir(src):
        return
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if name == TOKENIZER_FILE or not os.path.isfile(s) or name.endswith(_SKIP_FILES):
            continue
        if name == "tokenizer_config.json":
            with open(s, encoding="utf-8") as f:
                cfg = json.load(f)
            if isinstance(cfg.get("added_tokens_decoder"), dict):  # keyed by id: rebuilt from tokenizer.json
                cfg["added_tokens_decoder"] = {
                    str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word",
                                                     "special") if k in a}
                    for a in tok.get("added_tokens") or []}
            cfg.pop("tokenizer_file", None)
            _dump(cfg, d)
        elif name == "vocab.json":
            with open(s, encoding="utf-8") as f:
                _dump({t: int(old_to_new[i]) for t, i in json.load(f).items()}, d)
        elif name.endswith((".json", ".txt", ".jinja")) and name not in ("config.json", "generation_config.json"):
            if not (os.path.exists(d) and os.path.samefile(s, d)):
                shutil.copyfile(s, d)


def _dump(obj, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
