"""The GPU machine's scripts (``scripts/gpu``) parse, and ``pack_out`` packs ``$OUT`` into one archive (the device
tool returns at most 8 files), on this machine: a syntax error there costs a whole device call."""
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts" / "gpu").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_gpu_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_pack_out_leaves_one_archive_of_everything(tmp_path):
    out = tmp_path / "out"
    (out / "old").mkdir(parents=True)
    (out / "a.md").write_text("a")
    (out / "old" / "b.csv").write_text("b")
    r = subprocess.run(["bash", "-c", f'OUT="{out}"; . scripts/gpu/common.sh; pack_out'], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.iterdir()] == ["results.tgz"]
    with tarfile.open(out / "results.tgz") as t:
        names = {n.lstrip("./") for n in t.getnames()}
    assert {"a.md", "old/b.csv"} <= names
