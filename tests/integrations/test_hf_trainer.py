"""HF Trainer with ``deepspeed=<config>`` after ``ds_maximus.enable()`` trains with maximus, on 1 and 2 ranks."""
import json
import subprocess
import sys

import pytest

from tests.distributed.ranks import ROOT, clean_env, free_port, launch

SCRIPT = ROOT / "examples" / "hf_trainer.py"


def _result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{") and "maximus_steps" in ln]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1])


@pytest.mark.slow
def test_trainer_one_process(tmp_path):
    """The documented ``python examples/hf_trainer.py``: no launcher, no RANK/MASTER_ADDR (it used to stop at
    DeepSpeed's MPI discovery: No module named 'mpi4py')."""
    env = clean_env()
    res = subprocess.run([sys.executable, str(SCRIPT), "--steps", "4", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = _result(res.stdout)
    assert out["maximus_steps"] == 4 and out["train_loss"] == out["train_loss"]  # not NaN


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_two_ranks(tmp_path):
    out = launch(2, SCRIPT, "--steps", "4", "--out", tmp_path, timeout=900)
    assert _result(out)["maximus_steps"] == 4


@pytest.mark.slow
def test_trainer_moe_experts_one_process(tmp_path):
    """HF Trainer on a tiny Mixtral with maximus.moe.train: the experts leave ZeRO and are stepped by maximus."""
    env = clean_env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    res = subprocess.run([sys.executable, str(SCRIPT), "--steps", "4", "--moe", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = _result(res.stdout)
    assert out["maximus_steps"] == 4 and out["train_loss"] == out["train_loss"]
    assert "'maximus/moe/hit_rate'" in res.stdout  # the expert cache's figures, in the Trainer's log lines
