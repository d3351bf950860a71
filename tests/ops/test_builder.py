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
    from ds_maximus.op_builder.sharded_embedding import ShardedEmbeddingBuilder
    for cls, var in ((NVMeLoaderBuilder, "DS_BUILD_MAXIMUS_NVME_LOADER"),
                     (ShardedEmbeddingBuilder, "DS_BUILD_MAXIMUS_SHARDED_EMBEDDING")):
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
