"""The op builder base: arch-list sanitising, typed build errors with the compiler log, and no clash
with DeepSpeed's own builders."""
import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from ds_maximus.errors import OpBuildError
from ds_maximus.ops import op_builder_module


def test_sanitize_cuda_arch_list():
    b = op_builder_module().builder
    assert b.sanitize_cuda_arch_list("9.0a") == "9.0"
    assert b.sanitize_cuda_arch_list("8.0;9.0a 10.0f+PTX") == "8.0;9.0;10.0+PTX"
    assert b.sanitize_cuda_arch_list(None) is None


def test_names_and_build_vars():
    from ds_maximus.op_builder.nvme_loader import NVMeLoaderBuilder
    from ds_maximus.op_builder.row_ops import RowOpsBuilder
    for cls, var in ((NVMeLoaderBuilder, "DS_BUILD_MAXIMUS_NVME_LOADER"),
                     (RowOpsBuilder, "DS_BUILD_MAXIMUS_ROW_OPS")):
        b = cls()
        assert b.name.startswith("maximus_") and b.BUILD_VAR == var
        assert all(src.startswith("/") for src in b.sources())


def test_failed_build_is_a_typed_error_with_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    src = tmp_path / "broken.cpp"
    src.write_text("#include <torch/extension.h>\nint broken( { return 0; }\n")
    base = op_builder_module().builder.MaximusOpBuilder

    class Broken(base):
        NAME = f"broken_{uuid.uuid4().hex[:8]}"

        def sources(self):
            return [str(src)]

    with pytest.raises(OpBuildError) as e:
        Broken().load()
    assert e.value.op_name.startswith("maximus_broken_")
    assert "broken.cpp" in e.value.log and "error" in e.value.log.lower()
    assert e.value.fix


@pytest.mark.slow
def test_deepspeed_builders_still_load_with_ours_imported():
    op_builder_module()
    # installed, ours lives under our namespace: no top-level "op_builder" outside the checkout
    res = subprocess.run([sys.executable, "-c", "import op_builder"], cwd=tempfile.gettempdir(),
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True)
    assert res.returncode != 0
    # and inside it (the repo root on sys.path), DeepSpeed's probe still says "not DeepSpeed's own"
    with pytest.raises(ImportError):
        exec("from op_builder import __deepspeed__", {})
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    assert FusedAdamBuilder().is_compatible()
    op = CPUAdamBuilder().load()
    assert hasattr(op, "create_adam")


def test_stale_build_locks_are_removed_and_live_ones_kept(tmp_path):
    """A killed JIT build leaves ``lock`` behind and every later load would wait forever: a lock whose owner
    pid is gone, or an ownerless one older than the limit, is removed; a live owner's or a young one stays."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from ds_maximus.op_builder.builder import clear_stale_build_locks
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cases = {"maximus_x": dead.pid, "maximus_x_cuda": os.getpid(), "maximus_x_old": None, "maximus_x_new": None,
             "other_op": dead.pid}
    for name, pid in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "lock").write_text("")
        if pid is not None:
            (tmp_path / name / "lock.owner").write_text(f"{socket.gethostname()} {pid}")
    old = time.time() - 3600
    os.utime(tmp_path / "maximus_x_old" / "lock", (old, old))
    removed = clear_stale_build_locks(tmp_path, "maximus_x", max_age_s=600)
    assert sorted(p.parent.name for p in removed) == ["maximus_x", "maximus_x_old"]
    assert not (tmp_path / "maximus_x" / "lock").exists() and not (tmp_path / "maximus_x" / "lock.owner").exists()
    for kept in ("maximus_x_cuda", "maximus_x_new", "other_op"):
        assert (tmp_path / kept / "lock").exists(), kept
    # an owner note without a lock, left by a dead loader, goes too (it could name a later live lock wrongly)
    (tmp_path / "maximus_x_note").mkdir()
    (tmp_path / "maximus_x_note" / "lock.owner").write_text(f"{socket.gethostname()} {dead.pid}")
    assert clear_stale_build_locks(tmp_path, "maximus_x", max_age_s=600) == []
    assert not (tmp_path / "maximus_x_note" / "lock.owner").exists()


def test_a_load_after_a_killed_build_does_not_hang(tmp_path):
    """The real sequence: a build killed mid-way leaves torch's lock; the next load clears it and builds
    (a tiny pybind11 op, a few seconds of compile)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    ext = tmp_path / "ext"
    src = tmp_path / "tiny.cpp"
    src.write_text("#include <pybind11/pybind11.h>\nint answer() { return 42; }\n"
                   "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"answer\", &answer); }\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    code = ("from ds_maximus.ops import op_builder_module\n"
            "class Tiny(op_builder_module().builder.MaximusOpBuilder):\n"
            "    NAME = 'tiny_lock_test'\n"
            f"    def sources(self): return [{str(src)!r}]\n"
            "print('answer', Tiny().load().answer())\n")
    p = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    lock = None
    for _ in range(1200):  # the lock appears once torch starts the build
        locks = list(ext.glob("*/lock"))
        if locks:
            lock = locks[0]
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert lock is not None and lock.exists(), "the killed build left no lock (nothing to test)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "answer 42" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "stale JIT build lock" in out.stderr


def test_the_cuda_build_compiles_its_cpu_kernels_like_the_cpu_build():
    """The CUDA op serves host tensors too (``host_op``: the slot map, the batch plan, ``grad_sum``), so its C++
    files need the CPU build's OpenMP, vector and math flags; without ``-fopenmp`` ``at::parallel_for`` runs on
    one thread (the H200 host's ``grad_sum`` took 62 ms for 22M elements)."""
    from ds_maximus.ops import builder
    cpu = builder("row_ops", "RowOpsBuilder").cxx_args()
    cuda = builder("row_ops", "RowOpsCUDABuilder").cxx_args()
    assert "-fopenmp" in cuda and "-ffp-contract=off" in cuda and "-DMAXIMUS_WITH_CUDA" in cuda
    missing = [a for a in cpu if a and not a.startswith("-std=") and a not in cuda]
    assert not missing, f"the CUDA build lacks the CPU build's host flags {missing}"
