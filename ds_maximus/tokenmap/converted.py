"""The record of checkpoints converted from a token map: the summary file ``convert_checkpoint`` writes beside
each one, and the token map's meta key listing their folders.

:func:`ds_maximus.tokenmap.convert.convert_checkpoint` writes the record; extending a token map
(:mod:`ds_maximus.tokenmap.extend`) reads it to rewrite every tokenizer made from the map. Kept apart from both
so that the token map can extend itself without importing the converter (which loads token maps).
"""
from __future__ import annotations

import json
import os
from typing import List

CONVERT_FILE = "maximus_convert.json"  # the summary written beside a converted checkpoint
CHECKPOINTS_KEY = "converted_checkpoints"  # token map meta: folders convert_checkpoint wrote from it


def converted_checkpoint_dirs(tm, stores=()) -> List[str]:
    """Folders of the checkpoints converted from token map ``tm`` that still exist: those its meta records and
    those whose embedding store is one of ``stores``."""
    dirs = list(tm.meta.get(CHECKPOINTS_KEY, []))
    for s in stores:
        parent = os.path.dirname(os.path.abspath(s.path))
        summary = os.path.join(parent, CONVERT_FILE)
        if os.path.isfile(summary):
            with open(summary) as f:
                if os.path.abspath(json.load(f).get("store", "")) == os.path.abspath(s.path):
                    dirs.append(parent)
    out: List[str] = []
    for d in dirs:
        if d not in out and os.path.isfile(os.path.join(d, CONVERT_FILE)):
            out.append(d)
    return out
