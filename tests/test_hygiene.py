"""Project hygiene that CI keeps: the config reference in ds_configs/README.md is what the generator makes from
``MaximusConfig`` today, ``ruff check .`` passes, and pyproject.toml installs every package (test tools are extras,
not runtime dependencies)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None


def _generator():
    return load_script("scripts/gen_config_reference.py")


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


# ---- the config reference -----------------------------------------------------------------------------------------

def test_config_reference_is_current():
    gen = _generator()
    with open(os.path.join(ROOT, "ds_configs", "README.md")) as f:
        readme = f.read()
    table = gen.table()
    assert table.count("\n| `") >= 10, "the generated table has (almost) no rows"
    assert table in readme, ("ds_configs/README.md's key table is not what MaximusConfig generates: "
                             "run python scripts/gen_config_reference.py --write")
    assert gen.with_table(readme, table) == readme  # the table is the README's only run of rows under its header


def test_generator_replaces_only_the_table():
    gen = _generator()
    readme = f"# title\n\nintro\n\n{gen.HEADER}\n|---|---|---|---|---|\n| `old` | int | `1` |  | gone |\n\nafter\n"
    new = gen.with_table(readme, gen.table())
    assert new.startswith("# title\n\nintro\n\n" + gen.table())
    assert new.endswith("\nafter\n") and "`old`" not in new
    assert gen.with_table(new, gen.table()) == new
    with pytest.raises(SystemExit, match="no table header"):
        gen.with_table("# no table here\n", gen.table())


# ---- lint -----------------------------------------------------------------------------------------------------------

def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (scripts/env.sh installs it with the test extra: pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, ("ruff check . failed (ruff check --fix . fixes the mechanical ones):\n"
                              f"{r.stdout}{r.stderr}")


# ---- packaging ------------------------------------------------------------------------------------------------------

def test_pyproject_lists_every_package():
    """Automatic discovery cannot map op_builder/ to ``ds_maximus.op_builder``, so the packages are listed; a new
    subpackage missing from the list would be left out of a wheel."""
    tool = _pyproject()["tool"]["setuptools"]
    assert tool["package-dir"] == {"ds_maximus.op_builder": "op_builder"}
    found = {"ds_maximus.op_builder"}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "ds_maximus")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    missing, extra = sorted(found - set(tool["packages"])), sorted(set(tool["packages"]) - found)
    assert not missing and not extra, f"pyproject.toml [tool.setuptools] packages: add {missing}, remove {extra}"


def test_test_and_bench_tools_are_extras_not_runtime_dependencies():
    project = _pyproject()["project"]
    names = {re.split(r"[\s;\[<>=!~]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert not names & {"pytest", "ruff", "matplotlib"}, names
    assert {"torch", "deepspeed", "transformers", "safetensors", "ninja", "peft"} <= names
    extras = project["optional-dependencies"]
    assert {"pytest", "ruff"} <= set(extras["test"]) and "matplotlib" in extras["bench"]


def test_one_pytest_run_covers_tests_and_doctests():
    opts = _pyproject()["tool"]["pytest"]["ini_options"]
    assert "--doctest-modules" in opts["addopts"].split()
    assert {"tests", "ds_maximus", "op_builder"} <= set(opts["testpaths"])
