"""What the conformance tests share beyond :mod:`tests.helpers.models`: their config, batches and ``maximus``
section, and (from :mod:`tests.helpers.fresh_process`) the fresh-process reload.

Every family test builds the same random-weight model twice (same seed), runs one copy through plain
``deepspeed.initialize`` and one through ``ds_maximus.initialize`` (:func:`tests.helpers.models.initialize`,
trained by :func:`tests.helpers.models.train`) and compares logits, losses and the reloaded exports. Every
engine in a pytest process shares its one process group.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from tests.helpers import models
from tests.helpers.fresh_process import load_in_fresh_process  # noqa: F401  (the family tests import it here)


def ds_config(stage: int, maximus: Optional[dict] = None, **kw) -> dict:
    """The conformance runs' config: :func:`tests.helpers.models.ds_config` in fp32 with a constant learning
    rate (no warm-up schedule) and, when given, a ``"maximus"`` section."""
    return models.ds_config(stage, maximus=maximus, scheduler=False, **kw)


def maximus_section(modules: List[str], cache_rows: int, lm_head: Optional[dict] = None, **emb) -> dict:
    """Swap exactly ``modules`` with a ``cache_rows``-row cache (exact sparse AdamW, which equals dense AdamW)."""
    sec = {"embedding": {"modules": list(modules), "gpu_cache_rows": cache_rows, "optimizer": {"mode": "exact"},
                         **emb},
           "logging": {"interval_steps": 1000}}
    if lm_head is not None:
        sec["lm_head"] = lm_head
    return sec


def zipf_ids(n: int, batch: int, seqlen: int, vocab: int, seed: int = 1, low: int = 0) -> List[torch.Tensor]:
    """``n`` batches of ids in ``[low, vocab)`` under a flatter Zipf law than the engine tests' (exponent 1.05)."""
    return models.zipf_batches(n, batch, seqlen, vocab, seed=seed, low=low, exponent=1.05)
