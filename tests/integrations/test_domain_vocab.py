"""examples/domain_vocab/walkthrough.py, small: extend + fine-tune write only the new shards (CPU, < 60 s)."""
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


def test_walkthrough_extends_and_trains_only_new_shards(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(ROOT / "examples" / "domain_vocab" / "walkthrough.py"), "--out", str(tmp_path),
           "--vocab", "1000", "--terms", "600", "--steps", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["vocab"] == summary["base_vocab"] + summary["terms"] and summary["terms"] == 600
    # 1000 base rows in 256-row shards: 4 old shards (the last one partial); the extension adds new shards only
    assert summary["old_shards"] == 4 and summary["new_shards"] >= 2
    assert summary["old_shards_untouched"] == summary["old_shards"]
    assert summary["new_shards_trained"] == summary["new_shards"]
    assert len(summary["losses"]) == 3 and all(l == l for l in summary["losses"])
