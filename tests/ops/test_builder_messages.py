"""No silent minutes: a build says when it starts and ends (only when it compiles), and our JIT cache folder is
given to our builds only, so DeepSpeed's own ops keep DeepSpeed's default folder."""
import os
import subprocess
import sys

TINY = ("#include <pybind11/pybind11.h>\nint answer() { return %d; }\n"
        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"answer\", &answer); }\n")

LOAD = """
import os, sys
from pathlib import Path
from ds_maximus.ops import op_builder_module
b = op_builder_module().builder
b.DEFAULT_EXTENSIONS_DIR = Path({ext!r})  # stands for the checkout's build/ folder
class Tiny(b.MaximusOpBuilder):
    NAME = 'tiny_messages_test'
    def sources(self): return [{src!r}]
print('answer', Tiny().load().answer())
print('env after', os.environ.get('TORCH_EXTENSIONS_DIR'))
import torch.utils.cpp_extension as ce
print('deepspeed ops build in', ce._get_build_directory('fused_adam', False))
"""


def run(code, env):
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out


def lines(stderr, word):
    return [ln for ln in stderr.splitlines() if ln.startswith(f"ds_maximus: {word} maximus_tiny_messages_test")]


def test_a_build_says_when_it_starts_and_ends_and_a_cached_load_says_nothing(tmp_path):
    ext = tmp_path / "ours"
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY % 42)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    code = LOAD.format(ext=str(ext), src=str(src))

    first = run(code, env)
    assert "answer 42" in first.stdout
    start, done = lines(first.stderr, "building"), lines(first.stderr, "built")
    assert len(start) == 1 and "(first run only, ~1 min)" in start[0] and str(ext) in start[0], first.stderr
    assert len(done) == 1 and done[0].endswith(" s"), first.stderr
    # our folder was ours only: unset again after the load, and torch would build DeepSpeed's ops elsewhere
    assert "env after None" in first.stdout
    ds_dir = first.stdout.split("deepspeed ops build in ")[1].split()[0]
    assert not ds_dir.startswith(str(ext)), ds_dir
    assert (ext / "maximus_tiny_messages_test").is_dir()

    again = run(code, env)  # from the JIT cache: no compile, no message
    assert "answer 42" in again.stdout and not lines(again.stderr, "building") and not lines(again.stderr, "built")

    src.write_text(TINY % 43)  # a changed source compiles again, and says so
    changed = run(code, env)
    assert "answer 43" in changed.stdout and len(lines(changed.stderr, "building")) == 1
    assert len(lines(changed.stderr, "built")) == 1


def test_a_users_extensions_dir_is_used_and_kept(tmp_path):
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY % 7)
    mine = tmp_path / "users"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(mine)}
    out = run(LOAD.format(ext=str(tmp_path / "unused"), src=str(src)), env)
    assert "answer 7" in out.stdout and f"env after {mine}" in out.stdout
    assert (mine / "maximus_tiny_messages_test").is_dir() and not (tmp_path / "unused").exists()
    assert out.stdout.split("deepspeed ops build in ")[1].split()[0].startswith(str(mine))
