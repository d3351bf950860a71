"""Load saved model folders with plain transformers in a fresh python process where ds_maximus cannot be imported,
so that a folder which needs ds_maximus to load (or a loader that reaches for it) fails there."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict

import torch

# The first lines of a script run in a fresh interpreter: ds_maximus is made un-importable before anything else
# is imported (every reload script starts with it).
BLOCK_DS_MAXIMUS = r'''
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ds_maximus" or name.startswith("ds_maximus."):
            raise ImportError("ds_maximus is blocked in this process")
sys.meta_path.insert(0, _Block())
'''

LOADER = BLOCK_DS_MAXIMUS + r'''import torch, transformers
jobs = torch.load(sys.argv[1])
out = {}
for key, job in jobs.items():
    cls = getattr(transformers, job.get("auto", "AutoModelForCausalLM"))
    model, info = cls.from_pretrained(job["dir"], output_loading_info=True, **job.get("load_kwargs", {}))
    model.eval()
    got = {"info": {k: sorted(v) if isinstance(v, (set, list)) else v for k, v in info.items()},
           "tie": getattr(model.config, "tie_word_embeddings", None), "dtype": str(model.dtype),
           "keys": sorted(model.state_dict())}
    with torch.no_grad():
        got["logits"] = model(**job.get("kwargs", {})).logits
        if "prompt" in job:
            p = job["prompt"]
            got["tokens"] = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=job["new"],
                                           do_sample=False)
    if "text" in job:
        tok = transformers.AutoTokenizer.from_pretrained(job["dir"])
        got["encoded"] = tok(job["text"], add_special_tokens=False)["input_ids"]
    out[key] = got
try:
    import ds_maximus  # noqa: F401
    out["_importable"] = True
except ImportError:
    out["_importable"] = False
out["_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "ds_maximus")
torch.save(out, sys.argv[2])
'''


def load_in_fresh_process(tmp_path, jobs: Dict[str, dict], timeout: float = 600) -> Dict[str, dict]:
    """Load each ``jobs[key] = {"dir", "auto" (a transformers Auto class name, causal LM if left out), "kwargs"
    (forward inputs)}``, optionally with ``"prompt"`` and ``"new"`` (greedy ``generate`` of ``new`` tokens) and
    ``"text"`` (encoded by the folder's tokenizer), in a python process where ds_maximus cannot be imported.
    Returns per key ``{"logits", "info" (from_pretrained's loading info), "tie" (config.tie_word_embeddings),
    "dtype", "keys" (the state dict's), "tokens", "encoded"}``, the last two where asked for."""
    req, res = tmp_path / "jobs.pt", tmp_path / "results.pt"
    torch.save(jobs, req)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", LOADER, str(req), str(res)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    out = torch.load(res)
    assert out.pop("_importable") is False and out.pop("_loaded") == [], "the reloading process imported ds_maximus"
    return out
