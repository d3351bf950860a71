"""What the conformance tests share beyond :mod:`tests.helpers.models`: their config, batches and ``maximus``
section, and a fresh-process reload.

Every family test builds the same random-weight model twice (same seed), runs one copy through plain
``deepspeed.initialize`` and one through ``ds_maximus.initialize`` (:func:`tests.helpers.models.initialize`,
trained by :func:`tests.helpers.models.train`) and compares logits, losses and the reloaded exports. Every
engine in a pytest process shares its one process group.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Optional

import torch

from tests.helpers import models

# Runs in a fresh interpreter: ds_maximus is made un-importable before anything else is imported, so a
# folder that needs ds_maximus to load fails here.
LOADER = r'''
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ds_maximus" or name.startswith("ds_maximus."):
            raise ImportError("ds_maximus is blocked in this process")
sys.meta_path.insert(0, _Block())
import torch, transformers
jobs = torch.load(sys.argv[1])
out = {}
for key, job in jobs.items():
    cls = getattr(transformers, job.get("auto", "AutoModelForCausalLM"))
    model, info = cls.from_pretrained(job["dir"], output_loading_info=True)
    model.eval()
    with torch.no_grad():
        kw = dict(job.get("kwargs", {}))
        out[key] = {"logits": model(**kw).logits, "info": {k: sorted(v) if isinstance(v, (set, list)) else v
                                                          for k, v in info.items()},
                    "tie": getattr(model.config, "tie_word_embeddings", None)}
out["_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "ds_maximus")
torch.save(out, sys.argv[2])
'''


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


def load_in_fresh_process(tmp_path, jobs: Dict[str, dict]) -> Dict[str, dict]:
    """Load each ``jobs[key] = {"dir", "auto" (a transformers Auto class name), "kwargs" (forward inputs)}``
    with plain transformers in a python process where ds_maximus cannot be imported; returns per key
    ``{"logits", "info" (from_pretrained's loading info), "tie" (config.tie_word_embeddings)}``."""
    req, res = tmp_path / "jobs.pt", tmp_path / "results.pt"
    torch.save(jobs, req)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", LOADER, str(req), str(res)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out = torch.load(res)
    assert out.pop("_loaded") == [], "the reloading process imported ds_maximus"
    return out
