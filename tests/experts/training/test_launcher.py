"""examples/train_moe.py under the deepspeed launcher: 2 data-parallel CPU ranks (expert grads all-reduced)
equal 1 rank that accumulates the same global batch, and plain DeepSpeed."""
import pytest

from tests.distributed.ranks import ROOT, launch

SCRIPT = ROOT / "examples" / "train_moe.py"
CONFIG = ROOT / "ds_configs" / "moe_training.json"
COMMON = ("--deepspeed_config", CONFIG, "--torch-adam", "--fp32", "--steps", "4", "--global-batch", "4")


def _digest(out):
    losses = [float(ln.split()[3]) for ln in out.splitlines() if ln.startswith("step ")]
    delta = next(float(ln.split()[2]) for ln in out.splitlines() if ln.startswith("experts delta"))
    return losses, delta


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_equal_one_rank_and_plain():
    two = launch(2, SCRIPT, *COMMON, timeout=300)
    plain = launch(1, SCRIPT, *COMMON, "--gas", "2", "--plain", timeout=300)
    assert "maximus moe: hit rate" in two
    (_, s2), (_, sp) = _digest(two), _digest(plain)
    assert s2 == pytest.approx(sp, rel=1e-4)
