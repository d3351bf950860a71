"""Two CPU ranks under the ``deepspeed`` launcher equal one rank with the same global batch."""
from pathlib import Path

import pytest
import torch

from tests.distributed.ranks import ROOT, launch
from tests.helpers.models import assert_weights_close

WORKER = ROOT / "tests" / "engine" / "dp_worker.py"


def _run(n: int, out: Path):
    launch(n, WORKER, "--out", out, timeout=900)
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_equal_one(tmp_path):
    one = _run(1, tmp_path / "one.pt")
    out = launch(2, WORKER, "--out", tmp_path / "two.pt", timeout=900)
    two = torch.load(tmp_path / "two.pt")
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert_weights_close(two["embedding"], one["embedding"])
    # the stats line is printed by rank 0 only
    assert out.count("maximus step=20") == 1, out[-2000:]
