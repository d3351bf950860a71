"""The examples run as a user would run them: under the ``deepspeed`` launcher, on CPU ranks."""
import pytest

from tests.distributed.ranks import ROOT, launch


def _losses(out):
    return [float(ln.split()[3]) for ln in out.splitlines() if ln.startswith("step ")]


@pytest.mark.slow
def test_existing_script_twin_runs_under_launcher():
    d = ROOT / "examples" / "existing_script"
    plain = launch(1, d / "train_plain.py", "--deepspeed_config", d / "ds_config.json", "--steps", "4")
    ours = launch(1, d / "train_maximus.py", "--deepspeed_config", d / "ds_config_maximus.json", "--steps", "4")
    assert len(_losses(plain)) == 4 and len(_losses(ours)) == 4
    # same seed, same data, exact sparse AdamW: the twins train alike
    assert abs(_losses(plain)[-1] - _losses(ours)[-1]) < 1e-3
    assert "maximus step=4" in ours


@pytest.mark.slow
def test_train_llama_quick_start():
    out = launch(1, ROOT / "examples" / "train_llama.py", "--deepspeed_config",
                 ROOT / "ds_configs" / "zero2_cpu_tier.json", "--steps", "4", "--log-every", "1")
    assert "done: 4 steps" in out and "maximus step=" in out
