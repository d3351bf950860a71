"""``python -m ds_maximus.run``: an unchanged script runs with ``ds_maximus.enable()`` in effect, with the argv, path
and ``__name__`` it would have had under ``python`` (the launcher's ``--local_rank`` handed on behind the path)."""
import json
import subprocess
import sys

import pytest

from ds_maximus.run import _split
from tests.distributed.ranks import ROOT, clean_env, launch

PROBE = """
import json, sys, deepspeed, ds_maximus
import helper_next_to_the_script
print(json.dumps({"routed": deepspeed.initialize is ds_maximus.initialize, "argv": sys.argv,
                  "name": __name__, "helper": helper_next_to_the_script.VALUE}))
"""


def _run(tmp_path, *args):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "helper_next_to_the_script.py").write_text("VALUE = 7\n")
    res = subprocess.run([sys.executable, "-m", "ds_maximus.run", *map(str, args)], env=clean_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    return res


def test_a_script_runs_with_initialize_routed_and_its_own_argv(tmp_path):
    res = _run(tmp_path, "--local_rank=3", tmp_path / "probe.py", "--deepspeed", "cfg.json")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"routed": True, "argv": [str(tmp_path / "probe.py"), "--local_rank=3", "--deepspeed", "cfg.json"],
                   "name": "__main__", "helper": 7}


def test_a_module_runs_like_python_dash_m(tmp_path):
    res = _run(tmp_path, "-m", "probe", "--x", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["routed"] and got["name"] == "__main__" and got["argv"][1:] == ["--x", "1"]


def test_a_missing_script_or_no_script_is_a_usage_error(tmp_path):
    res = _run(tmp_path, tmp_path / "nope.py")
    assert res.returncode != 0 and "no such script" in res.stderr and "usage" in res.stderr
    with pytest.raises(SystemExit, match="usage"):
        _split(["--local_rank=0"])
    assert _split(["--local_rank", "1", "t.py", "a"]) == (["--local_rank", "1"], "path", "t.py", ["a"])


@pytest.mark.slow
def test_the_unchanged_plain_script_trains_with_maximus_under_the_launcher():
    """``deepspeed --module ds_maximus.run train_plain.py`` with the maximus config: the plain script, not a line
    changed, trains with its embedding swapped, to the losses of its maximus twin."""
    d = ROOT / "examples" / "existing_script"
    out = launch(1, "--module", "ds_maximus.run", d / "train_plain.py", "--deepspeed_config",
                 d / "ds_config_maximus.json", "--steps", "4")
    twin = launch(1, d / "train_maximus.py", "--deepspeed_config", d / "ds_config_maximus.json", "--steps", "4")

    def losses(text):
        return [float(ln.split()[3]) for ln in text.splitlines() if ln.startswith("step ")]
    assert "maximus step=4" in out and len(losses(out)) == 4
    assert losses(out) == losses(twin)
