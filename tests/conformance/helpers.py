"""What the conformance tests share: DeepSpeed configs, a training loop, batches, a fresh-process reload.

Every family test builds the same random-weight model twice (same seed), runs one copy through plain
``deepspeed.initialize`` and one through ``ds_maximus.initialize`` and compares logits, losses and the
reloaded exports. The single-rank DeepSpeed environment (gloo, ``MASTER_ADDR`` ...) comes from
``tests/conftest.py``; every engine in a pytest process shares its one process group.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional

import torch

LR = 1e-2

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


def ds_config(stage: int, maximus: Optional[dict] = None, micro: int = 2, gas: int = 1, clip: float = 0.0,
              lr: float = LR, wd: float = 0.1) -> dict:
    """An fp32 DeepSpeed config with torch AdamW (no fused-Adam JIT) and, when given, a ``"maximus"`` section."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if maximus is not None:
        cfg["maximus"] = maximus
    return cfg


def maximus_section(modules: List[str], cache_rows: int, lm_head: Optional[dict] = None, **emb) -> dict:
    """Swap exactly ``modules`` with a ``cache_rows``-row cache (exact sparse AdamW, which equals dense AdamW)."""
    sec = {"embedding": {"modules": list(modules), "gpu_cache_rows": cache_rows, "optimizer": {"mode": "exact"},
                         **emb},
           "logging": {"interval_steps": 1000}}
    if lm_head is not None:
        sec["lm_head"] = lm_head
    return sec


def zipf_ids(n: int, batch: int, seqlen: int, vocab: int, seed: int = 1, low: int = 0) -> List[torch.Tensor]:
    """``n`` batches of Zipf-distributed ids in ``[low, vocab)`` (hot ids small, a long tail: rows get evicted)."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, vocab - low + 1, dtype=torch.float64) ** 1.05
    return [low + torch.multinomial(p, batch * seqlen, replacement=True, generator=g).view(batch, seqlen)
            for _ in range(n)]


def initialize(model: torch.nn.Module, cfg: dict):
    """``ds_maximus.initialize`` when ``cfg`` has a ``"maximus"`` section, else plain ``deepspeed.initialize``."""
    import deepspeed

    import ds_maximus
    fn = ds_maximus.initialize if "maximus" in cfg else deepspeed.initialize
    engine, *_ = fn(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                    config=copy.deepcopy(cfg))
    return engine


def train(engine, batches: List[Dict[str, torch.Tensor]],
          loss_of: Optional[Callable] = None) -> List[float]:
    """One optimizer step per batch (``engine(**batch).loss``, or ``loss_of(engine, batch)``); the losses."""
    losses = []
    for batch in batches:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss = engine(**batch).loss if loss_of is None else loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


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
