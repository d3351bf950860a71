"""examples/build_tokenizer.py: corpus -> trained tokenizer + token map -> converted checkpoint -> training
-> export, each stage through the command the README shows; the export loads without ds_maximus."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_corpus_to_exported_model(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(ROOT / "examples" / "build_tokenizer.py"), "--out", str(tmp_path), "--vocab", "1000",
           "--hidden", "32", "--steps", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["vocab"] == 1000 and 0.5 < summary["coverage_1024"] <= 1.0
    assert len(summary["losses"]) == 2 and summary["losses"][1] < summary["losses"][0]
    assert summary["max_logit_diff"] < 1e-4 and summary["tokenizer_ids_match"]
    # the converted checkpoint's tokenizer is the token map's: same vocabulary, same ids
    with open(tmp_path / "converted" / "tokenizer.json", encoding="utf-8") as f:
        conv = json.load(f)
    with open(tmp_path / "tokenmap" / "tokenizer" / "tokenizer.json", encoding="utf-8") as f:
        assert conv["model"]["vocab"] == json.load(f)["model"]["vocab"]
