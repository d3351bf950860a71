"""A checkpoint to a disk that cannot hold it: refused before writing when the free space is short of what the
save is known to write, and a write that fills the disk anyway is a ShardStoreError naming the path and the
bytes (torch's own error is ``[enforce fail at inline_container.cc:672] . unexpected pos``); ``latest`` never
moves to a partial checkpoint."""
import errno
import gc
import subprocess
import uuid

import pytest

from ds_maximus.engine import checkpoint_space, runtime
from ds_maximus.engine.checkpoint_space import disk_full_reported, engine_bytes, is_disk_full, state_bytes
from ds_maximus.errors import ShardStoreError
from tests.engine.llama_utils import build, maximus_section
from tests.helpers.models import train, zipf_batches


def trained():
    e = build(2, "fp32", maximus=maximus_section(cache_rows=64))
    train(e, zipf_batches(2, batch=2, seqlen=16))
    return e


def test_short_free_space_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    e = trained()
    e.save_checkpoint(str(tmp_path), tag="ok")  # a save that fits, for `latest` to point at
    monkeypatch.setattr(checkpoint_space, "free_disk_bytes", lambda path: 1000)
    with pytest.raises(ShardStoreError) as err:
        e.save_checkpoint(str(tmp_path), tag="full")
    msg = str(err.value)
    need = engine_bytes(e) + state_bytes(e.maximus._state())
    assert str(tmp_path) in msg and f"{need / 2**20:.1f} MiB" in msg and "0.0 MiB free" in msg
    assert "maximus state" in msg and "Nothing was written" in msg and err.value.path == str(tmp_path)
    assert not (tmp_path / "full").exists() and (tmp_path / "latest").read_text() == "ok"


def test_the_estimate_counts_the_weights_the_moments_and_the_maximus_state():
    e = trained()
    weights = sum(p.numel() * 4 for p in e.module.parameters())
    assert engine_bytes(e) >= weights + 2 * sum(p.numel() * 4 for p in e.module.parameters() if p.requires_grad)
    assert state_bytes(e.maximus._state()) > 0


def test_write_failures_for_want_of_space_are_recognised():
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6400 vs 6294"))
    assert is_disk_full(RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"))
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(RuntimeError("CUDA error: out of memory"))
    with pytest.raises(ShardStoreError, match=r"saving the checkpoint to /x/y failed: its disk is full"):
        with disk_full_reported("/x/y", 5 << 20, "test"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6400 vs 6294")
    with pytest.raises(OSError, match="Permission denied") as other:
        with disk_full_reported("/x/y", 1, "test"):
            raise OSError(errno.EACCES, "Permission denied")
    assert not isinstance(other.value, ShardStoreError)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 192 KiB tmpfs (needs root and mount): a real disk-full error, not a simulated one."""
    mnt = tmp_path / f"disk_{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        gc.collect()  # the failed writer's file, kept alive by the exception's frames, is closed
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_real_full_disk_is_a_shard_store_error_and_leaves_no_partial_state(tiny_disk, monkeypatch):
    e = trained()
    assert engine_bytes(e) > 192 << 10  # the save cannot fit
    monkeypatch.setattr(runtime, "check_free_space", lambda *a: None)  # as if the estimate had passed
    with pytest.raises(ShardStoreError) as err:
        e.save_checkpoint(str(tiny_disk), tag="t1")
    msg = str(err.value)
    assert str(tiny_disk / "t1") in msg and "disk is full" in msg and "MiB" in msg
    assert isinstance(err.value.__cause__, (RuntimeError, OSError))
    assert not (tiny_disk / "latest").exists() and not list(tiny_disk.rglob("*.tmp.*"))
