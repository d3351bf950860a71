"""Two CPU ranks under the ``deepspeed`` launcher equal one rank with the same global batch."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.zero.llama_utils import assert_weights_close

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "zero" / "dp_worker.py"


def launch(n: int, out: Path, *extra, port: int):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                             "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(n), "--master_port", str(port),
           str(WORKER), "--out", str(out), *extra]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(out), res.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_equal_one(tmp_path):
    one, _ = launch(1, tmp_path / "one.pt", port=29611)
    two, log = launch(2, tmp_path / "two.pt", port=29612)
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert_weights_close(two["embedding"], one["embedding"])
    # the stats line is printed by rank 0 only
    assert log.count("maximus step=20") == 1, log[-2000:]
