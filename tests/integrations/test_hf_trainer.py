"""HF Trainer with ``deepspeed=<config>`` after ``ds_maximus.enable()`` trains with maximus, on 1 and 2 ranks."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hf_trainer.py"


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                             "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{") and "maximus_steps" in ln]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1])


@pytest.mark.slow
def test_trainer_one_process(tmp_path):
    env = _env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29631")
    res = subprocess.run([sys.executable, str(SCRIPT), "--steps", "4", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = _result(res.stdout)
    assert out["maximus_steps"] == 4 and out["train_loss"] == out["train_loss"]  # not NaN


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_two_ranks(tmp_path):
    res = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                          "29632", str(SCRIPT), "--steps", "4", "--out", str(tmp_path)], env=_env(),
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _result(res.stdout)["maximus_steps"] == 4
