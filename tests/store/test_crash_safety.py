"""A writer killed with SIGKILL in the middle of a shard write leaves the old store readable."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_maximus.store import ShardStore

# The child rewrites shard 0 (16 MiB) and appends a shard through the real write path; each write
# call is slowed so the parent can kill it while a temporary file is half written.
CHILD = textwrap.dedent("""
    import sys, time, torch
    from ds_maximus.store import ShardStore
    from ds_maximus.store import format as fmt
    real = fmt._write_all
    def slow(fd, buf):
        mv = memoryview(buf).cast("B")
        for i in range(0, len(mv), 1 << 20):
            real(fd, mv[i:i + (1 << 20)])
            print("wrote", flush=True)
            time.sleep(0.02)
    fmt._write_all = slow
    s = ShardStore.open(sys.argv[1], loader=False)
    if sys.argv[2] == "write":
        s.write_shard(0, {"weight": torch.ones(s.shard_info(0).rows, s.dim)})
    else:
        s.append_shards({"weight": torch.ones(s.rows_per_shard, s.dim)})
    print("finished", flush=True)
""")


@pytest.mark.parametrize("op", ["write", "append"])
def test_sigkill_mid_write(tmp_path, op):
    path = str(tmp_path / "s")
    dim, rps = 512, 8192  # 16 MiB per shard
    store = ShardStore.create(path, 2 * rps, dim, rows_per_shard=rps,
                              init=lambda lo, hi: {"weight": torch.full((hi - lo, dim), float(lo))}, loader=False)
    before = {i: open(store.shard_path(i), "rb").read() for i in range(store.num_shards)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path, op], stdout=subprocess.PIPE, text=True)
    try:
        lines = 0
        for line in proc.stdout:  # wait until several MiB of the new file are on disk
            lines += line.startswith("wrote")
            if lines >= 4:
                break
        assert lines >= 4, "the child ended before it wrote anything"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    again = ShardStore.open(path, loader=False)
    assert again.num_shards == 2 and again.vocab_size == 2 * rps
    report = again.verify()
    assert len(report["orphans"]) == 1 and ".tmp-" in report["orphans"][0]  # the half-written temp file
    for i in range(2):
        assert open(again.shard_path(i), "rb").read() == before[i]
    assert torch.equal(again.read_shard(0)["weight"][:2], torch.zeros(2, dim))
    again.remove_orphans()
    # and the store still takes writes afterwards
    again.write_shard(1, {"weight": torch.zeros(rps, dim)})
    assert ShardStore.open(path, loader=False).verify()["orphans"] == []
