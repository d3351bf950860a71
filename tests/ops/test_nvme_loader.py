"""The async NVMe loader against plain Python file I/O: byte-exact at odd sizes/offsets, under load,
when closed mid-flight, for every error it reports, and (GPU) disk -> device beside a matmul loop."""
import errno
import logging
import os
import random
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from ds_maximus.config import MaximusConfig
from ds_maximus.errors import NVMeIOError
from ds_maximus.ops.nvme_loader import ALIGN_BYTES, NVMeLoader, PinnedBufferPool, aligned_empty, nvme_loader_available

pytestmark = pytest.mark.nvme

BLOCK = 8192  # small blocks: many pieces, every split path


def _rand_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _write_file(path, data: torch.Tensor):
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())


def _file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _misaligned(n: int, shift: int) -> torch.Tensor:
    """A uint8 tensor of n bytes whose address is ``shift`` bytes past a 4096 boundary."""
    return aligned_empty(n + shift, pin=False)[shift:shift + n]


def _allows_o_direct(folder) -> bool:
    probe = os.path.join(folder, "probe.odirect")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.fixture(scope="module")
def loader():
    assert nvme_loader_available()
    with NVMeLoader(threads=4, block_bytes=BLOCK, queue_depth=8) as ld:
        yield ld


@pytest.fixture(scope="module")
def buffered_loader():
    with NVMeLoader(threads=2, block_bytes=BLOCK, queue_depth=4, o_direct=False) as ld:
        yield ld


SIZES = [0, 1, 4095, 4096, 4097, 3 * BLOCK + 17, 5 * BLOCK]
OFFSETS = [0, 1, 4095, 4096, BLOCK - 3, 3 * BLOCK + 4096]


@pytest.mark.parametrize("shift", [0, 64, 1])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_read_byte_exact(loader, tmp_path, size, offset, shift):
    data = _rand_bytes(offset + size + 999, seed=size + offset)
    path = tmp_path / "f.bin"
    _write_file(path, data)
    out = _misaligned(size, shift)
    h = loader.read_into(path, offset, out)
    assert h.wait() is out and h.done()
    assert torch.equal(out, data[offset:offset + size])
    assert h.used_direct == _allows_o_direct(tmp_path)


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_write_byte_exact_keeps_neighbours(loader, tmp_path, size, offset, shift):
    old = _rand_bytes(offset + size + 5000, seed=1)
    path = tmp_path / "f.bin"
    _write_file(path, old)
    src = _misaligned(size, shift)
    src.copy_(_rand_bytes(size, seed=2))
    loader.write_from(src, path, offset).wait()
    want = old.clone()
    want[offset:offset + size] = src
    assert _file_bytes(path) == want.numpy().tobytes()


@pytest.mark.parametrize("size", [1, 4097, 3 * BLOCK + 17])
def test_write_creates_and_extends_file(loader, tmp_path, size):
    path = tmp_path / "new.bin"
    src = _rand_bytes(size, seed=3)
    loader.write_from(src, path, 4096 + 5, fsync=True).wait()
    raw = _file_bytes(path)
    assert len(raw) == 4096 + 5 + size and raw[:4101] == bytes(4101)
    assert raw[4101:] == src.numpy().tobytes()


@pytest.mark.parametrize("size,offset", [(3 * BLOCK + 17, 4095), (4096, 0), (10, 7)])
def test_buffered_mode_byte_exact(buffered_loader, tmp_path, size, offset):
    path = tmp_path / "b.bin"
    src = _rand_bytes(size, seed=4)
    buffered_loader.write_from(src, path, offset).wait()
    out = torch.empty(size, dtype=torch.uint8)
    h = buffered_loader.read_into(path, offset, out)
    h.wait()
    assert torch.equal(out, src) and not h.used_direct


def test_typed_tensors_round_trip(loader, tmp_path):
    x = torch.randn(333, 77, dtype=torch.float32)
    loader.write_from(x, tmp_path / "x.bin", 12).wait()
    y = torch.empty_like(x)
    loader.read_into(tmp_path / "x.bin", 12, y).wait()
    assert torch.equal(x, y)


def test_hundreds_of_concurrent_requests(loader, tmp_path):
    rng = random.Random(0)
    files = []
    for i in range(4):
        data = _rand_bytes(1_000_000 + 4099 * i, seed=10 + i)
        _write_file(tmp_path / f"c{i}.bin", data)
        files.append(data)
    jobs = []
    for _ in range(400):
        i = rng.randrange(len(files))
        size = rng.choice([1, 100, 4096, 5000, 65536, 200_001])
        off = rng.randrange(0, len(files[i]) - size)
        out = _misaligned(size, rng.choice([0, 1, 64]))
        jobs.append((i, off, size, out, loader.read_into(tmp_path / f"c{i}.bin", off, out)))
    # writes to disjoint regions of one file, all in flight together
    wpath = tmp_path / "w.bin"
    chunks = [_rand_bytes(rng.randrange(1, 30_000), seed=100 + k) for k in range(200)]
    pos, writes = 0, []
    for c in chunks:
        writes.append(loader.write_from(c, wpath, pos))
        pos += c.numel()
    for i, off, size, out, h in jobs:
        h.wait()
        assert torch.equal(out, files[i][off:off + size])
    for h in writes:
        h.wait()
    assert _file_bytes(wpath) == torch.cat(chunks).numpy().tobytes()
    assert loader.pending() == 0


def test_close_waits_for_requests_in_flight(tmp_path):
    data = _rand_bytes(2_000_000, seed=5)
    _write_file(tmp_path / "d.bin", data)
    ld = NVMeLoader(threads=2, block_bytes=4096, queue_depth=2)
    outs = [torch.empty(100_000, dtype=torch.uint8) for _ in range(50)]
    hs = [ld.read_into(tmp_path / "d.bin", 1000 * k, o) for k, o in enumerate(outs)]
    ld.close()
    assert ld.closed and all(h.done() for h in hs)
    for k, (h, o) in enumerate(zip(hs, outs)):
        h.wait()
        assert torch.equal(o, data[1000 * k:1000 * k + 100_000])
    with pytest.raises(ValueError, match="closed"):
        ld.read_into(tmp_path / "d.bin", 0, outs[0])
    ld.close()  # idempotent


def test_close_cancel_fails_queued_requests_only(tmp_path):
    data = _rand_bytes(4_000_000, seed=6)
    _write_file(tmp_path / "d.bin", data)
    ld = NVMeLoader(threads=1, block_bytes=4096, queue_depth=1)
    outs = [torch.zeros(400_000, dtype=torch.uint8) for _ in range(200)]
    hs = [ld.read_into(tmp_path / "d.bin", 10_000 * k, o) for k, o in enumerate(outs)]
    ld.close(cancel=True)
    assert all(h.done() for h in hs)
    cancelled = 0
    for k, (h, o) in enumerate(zip(hs, outs)):
        try:
            h.wait()
            assert torch.equal(o, data[10_000 * k:10_000 * k + 400_000])
        except NVMeIOError as e:
            assert e.err == errno.ECANCELED and e.errno == errno.ECANCELED and "closed" in str(e)
            cancelled += 1
    assert cancelled > 100  # 80 MB through one 4 KiB worker cannot finish before close()


def test_error_enoent(loader, tmp_path):
    path = tmp_path / "missing.bin"
    with pytest.raises(NVMeIOError) as ei:
        loader.read_into(path, 123, torch.empty(10, dtype=torch.uint8)).wait()
    e = ei.value
    assert e.err == errno.ENOENT and e.path == str(path) and str(path) in str(e) and "fix:" in str(e)
    assert isinstance(e, OSError)


@pytest.mark.parametrize("shift", [0, 1])
def test_error_short_read_past_end_of_file(loader, tmp_path, shift):
    path = tmp_path / "short.bin"
    _write_file(path, _rand_bytes(3 * BLOCK + 100, seed=7))
    out = _misaligned(4 * BLOCK, shift)
    with pytest.raises(NVMeIOError, match="past end of file") as ei:
        loader.read_into(path, 50, out).wait()
    assert ei.value.err == errno.ENODATA and ei.value.offset == 3 * BLOCK + 100 and ei.value.path == str(path)
    with pytest.raises(NVMeIOError, match="past end of file"):  # entirely beyond the end
        loader.read_into(path, 10 * BLOCK, torch.empty(5, dtype=torch.uint8)).wait()


def test_error_eisdir_carries_errno(loader, tmp_path):
    """Any errno of pread comes back typed (EIO itself needs a failing device; see the report)."""
    with pytest.raises(NVMeIOError) as ei:
        loader.read_into(tmp_path, 0, torch.empty(4096, dtype=torch.uint8)).wait()
    assert ei.value.err in (errno.EISDIR, errno.EINVAL) and ei.value.path == str(tmp_path)


def test_error_efbig_with_rlimit_fsize(tmp_path):
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from ds_maximus.errors import NVMeIOError
        from ds_maximus.ops.nvme_loader import NVMeLoader
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # else the kernel kills us instead of EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with NVMeLoader(threads=2, block_bytes=65536) as ld:
            try:
                ld.write_from(torch.ones(3 << 20, dtype=torch.uint8), {str(tmp_path / 'big.bin')!r}, 0).wait()
            except NVMeIOError as e:
                print("ERR", e.err, e.offset, e.path)
            else:
                print("NOERR")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    line = [ln for ln in res.stdout.splitlines() if ln.startswith(("ERR", "NOERR"))]
    assert line, res.stdout + res.stderr
    parts = line[0].split()
    assert parts[0] == "ERR" and int(parts[1]) == errno.EFBIG and int(parts[2]) >= 1 << 20
    assert parts[3] == str(tmp_path / "big.bin")


@pytest.fixture
def mounted(tmp_path):
    """mount(fstype, options) -> folder; skips where this process may not mount (not root)."""
    mounts = []

    def mount(fstype, options=""):
        d = tmp_path / f"mnt_{uuid.uuid4().hex[:6]}"
        d.mkdir()
        cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(d)]
        if os.geteuid() != 0 or subprocess.run(cmd, capture_output=True).returncode != 0:
            pytest.skip(f"cannot mount a {fstype} here (needs root)")
        mounts.append(d)
        return d

    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_error_enospc_on_tiny_tmpfs(loader, mounted):
    d = mounted("tmpfs", "size=256k")
    with pytest.raises(NVMeIOError) as ei:
        loader.write_from(torch.ones(2 << 20, dtype=torch.uint8), d / "full.bin", 3).wait()
    assert ei.value.err == errno.ENOSPC and ei.value.path == str(d / "full.bin") and "fix:" in str(ei.value)


@pytest.mark.parametrize("direct", [True, False])
def test_error_eio_from_a_failing_file_system(tmp_path, direct):
    from _fuse_eio import eio_mount  # tests/ops is on sys.path (rootdir-style test imports)
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount the EIO file system")
    try:
        cm = eio_mount(tmp_path / "eio")
        path = cm.__enter__()
    except OSError as e:
        pytest.skip(str(e))
    try:
        with NVMeLoader(threads=2, block_bytes=BLOCK, o_direct=direct) as ld:
            with pytest.raises(NVMeIOError) as ei:
                ld.read_into(path, 4096 + 3, _misaligned(3 * BLOCK, 1)).wait()
        assert ei.value.err == errno.EIO and ei.value.path == path and "dmesg" in str(ei.value)
    finally:
        cm.__exit__(None, None, None)


def test_buffered_fallback_where_o_direct_is_refused(loader, mounted, caplog):
    d = mounted("ramfs")  # ramfs has no direct I/O: open(O_DIRECT) fails with EINVAL
    src = _rand_bytes(3 * BLOCK + 5, seed=8)
    with caplog.at_level(logging.WARNING, logger="ds_maximus.ops.nvme_loader"):
        h = loader.write_from(src, d / "r.bin", 7)
        h.wait()
    assert not h.used_direct
    assert any("O_DIRECT refused" in r.getMessage() and str(d) in r.getMessage() for r in caplog.records)
    out = _misaligned(src.numel(), 1)
    loader.read_into(d / "r.bin", 7, out).wait()
    assert torch.equal(out, src)


_FORK_CHILD = r"""
import os, sys, time, torch
from ds_maximus.ops.nvme_loader import NVMeLoader
path, data = sys.argv[1], open(sys.argv[1], "rb").read()
ld = NVMeLoader(threads=2)
pid = os.fork()
if pid == 0:  # child: the parent's workers are gone
    code = 1
    try:
        try:
            ld.read_into(path, 0, torch.empty(10, dtype=torch.uint8))
        except RuntimeError as e:
            code = 0 if "fork" in str(e) else 2
        del ld  # must neither hang (joining absent threads) nor terminate
        with NVMeLoader(threads=1) as fresh:
            out = fresh.read(path, 0, len(data))
        code = code if bytes(out.numpy()) == data else 3
    finally:
        os._exit(code)
deadline = time.time() + 60
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    if time.time() > deadline:
        os.kill(pid, 9)
        sys.exit("forked child hung")
    time.sleep(0.05)
ld.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_forked_child_gets_a_clear_error_and_exits(tmp_path):
    """A loader's owner forks; the child's use is a clear error, dropping it neither hangs nor kills, and a fresh
    loader in the child works. The fork happens in a small fresh interpreter: forking the test session itself
    needs as much committable memory as everything the session has mapped."""
    import subprocess
    import sys
    data = _rand_bytes(10_000, seed=11)
    _write_file(tmp_path / "f.bin", data)
    r = subprocess.run([sys.executable, "-c", _FORK_CHILD, str(tmp_path / "f.bin")], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


def test_docstring_examples():
    import doctest

    import ds_maximus.ops.nvme_loader as mod
    res = doctest.testmod(mod)
    assert res.attempted >= 5 and res.failed == 0


def test_bad_arguments(loader, tmp_path):
    with pytest.raises(ValueError, match="contiguous"):
        loader.read_into(tmp_path / "x", 0, torch.empty(4, 4).t())
    with pytest.raises(ValueError, match=">= 0"):
        loader.write_from(torch.empty(4), tmp_path / "x", -1)
    with pytest.raises(ValueError, match="multiple of 4096"):
        NVMeLoader(block_bytes=5000)
    with pytest.raises(ValueError, match="CUDA tensor"):
        loader.read_to_device(tmp_path / "x", 0, 16, torch.empty(16, dtype=torch.uint8))


def test_from_config():
    cfg = MaximusConfig.model_validate({"io": {"threads": 3, "block_bytes": 65536, "queue_depth": 5,
                                               "o_direct": False}})
    for arg in (cfg.io, cfg):
        with NVMeLoader.from_config(arg) as ld:
            assert (ld.threads, ld.block_bytes, ld.queue_depth, ld.o_direct) == (3, 65536, 5, False)


def test_pinned_buffer_pool_reuses_free_buffers_only():
    pool = PinnedBufferPool()
    a = pool.get(10_000)
    assert a.numel() == 10_000 and a.data_ptr() % ALIGN_BYTES == 0 and a.dtype == torch.uint8
    ptr = a.data_ptr()
    b = pool.get(9_000)  # same size class, but `a` is still alive
    assert b.data_ptr() != ptr
    f = a.view(torch.float32)[:10]
    del a
    assert pool.get(10_000).data_ptr() not in (ptr, b.data_ptr())  # a view of `a` still holds it
    del f
    assert pool.get(16_000).data_ptr() == ptr  # free again: reused
    assert PinnedBufferPool.size_class(1) == 4096 and PinnedBufferPool.size_class((64 << 20) + 1) == 128 << 20


@pytest.mark.gpu
def test_read_to_device_byte_exact_during_matmuls(tmp_path):
    nbytes = 96 << 20
    data = _rand_bytes(nbytes + 12345, seed=9)
    path = tmp_path / "dev.bin"
    _write_file(path, data)
    a = torch.randn(4096, 4096, device="cuda")
    out = torch.empty(nbytes // 4 + 1, dtype=torch.float32, device="cuda")
    with NVMeLoader(threads=8, block_bytes=1 << 20) as ld:
        for offset, n in [(12345, nbytes), (0, 4097), (4095, 3 << 20)]:
            torch.cuda.synchronize()
            c = a
            for _ in range(30):  # compute stream kept busy while the loader streams
                c = torch.tanh(c @ a) * 0.01
            ev = ld.read_to_device(path, offset, n, out)
            torch.cuda.current_stream().wait_event(ev)
            got = out.view(torch.uint8)[:n].cpu()
            assert torch.equal(got, data[offset:offset + n])
            assert torch.isfinite(c).all()
