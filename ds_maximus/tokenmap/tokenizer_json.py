"""A ``tokenizers.Tokenizer`` from parsed ``tokenizer.json``, with a Unigram model's scores kept exact.

Shared by the token map (which builds and loads rewritten tokenizers) and its extension (which copies one to
add tokens), so neither imports the other for it.
"""
from __future__ import annotations

import json


def tokenizer_from_json(d: dict):
    """A ``Tokenizer`` from parsed tokenizer.json. A Unigram model is rebuilt from the Python floats: the Rust
    JSON parser can land one ulp off a score (-7.6145106463098715 read as -7.614510646309872), and the
    Viterbi segmentation then breaks exact ties ("=" + "===" vs "===" + "=") differently from the tokenizer
    the scores came from."""
    from tokenizers import Tokenizer, models
    tok = Tokenizer.from_str(json.dumps(d))
    m = d.get("model") or {}
    if m.get("type") == "Unigram":
        tok.model = models.Unigram([(p, float(s)) for p, s in m["vocab"]], m.get("unk_id"),
                                   bool(m.get("byte_fallback", False)))
    return tok
