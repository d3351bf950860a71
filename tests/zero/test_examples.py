"""The examples run as a user would run them: under the ``deepspeed`` launcher, on CPU ranks."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _launch(args, port, n=1):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                             "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    res = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(n), "--master_port",
                          str(port), *args], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow
def test_existing_script_twin_runs_under_launcher():
    plain = _launch(["examples/existing_script/train_plain.py", "--deepspeed_config",
                     "examples/existing_script/ds_config.json", "--steps", "4"], 29641)
    ours = _launch(["examples/existing_script/train_maximus.py", "--deepspeed_config",
                    "examples/existing_script/ds_config_maximus.json", "--steps", "4"], 29642)
    loss = lambda out: [float(ln.split()[-1]) for ln in out.splitlines() if ln.startswith("step ")]
    assert len(loss(plain)) == 4 and len(loss(ours)) == 4
    # same seed, same data, exact sparse AdamW: the twins train alike
    assert abs(loss(plain)[-1] - loss(ours)[-1]) < 1e-3
    assert "maximus step=4" in ours


@pytest.mark.slow
def test_train_llama_quick_start():
    out = _launch(["examples/train_llama.py", "--deepspeed_config", "ds_configs/zero2_cpu_tier.json",
                   "--steps", "4", "--log-every", "1"], 29643)
    assert "done: 4 steps" in out and "maximus step=" in out
