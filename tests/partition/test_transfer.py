"""The transfer engine's whole-tensor copies (a chunk in, copies out) keep their order: a load starts after the
event it is given, a store after the compute stream's work that wrote its source and after its event, and the
host reads a copy only after its event. CpuTransfer (the worker thread) on this machine, CudaTransfer on a GPU."""
import concurrent.futures
import threading

import pytest
import torch

from ds_maximus.partition.host_memory import pinned_empty
from ds_maximus.partition.transfer import CpuTransfer, CudaTransfer

N = 1 << 20  # elements: a copy long enough that a missing wait shows


@pytest.fixture
def cpu():
    t = CpuTransfer()
    yield t
    t.close()


def test_cpu_load_chunk_copies_after_its_event(cpu):
    src = torch.ones(5, 3)
    gate = concurrent.futures.Future()
    dst, ev = cpu.load_chunk(src, after=gate)
    src.fill_(7.0)  # the copy has not started: it waits for the gate
    gate.set_result(None)
    out = cpu.take(dst, ev)
    assert out is dst and torch.equal(out, torch.full((5, 3), 7.0)) and cpu.done(ev)
    assert out.data_ptr() != src.data_ptr()


def test_cpu_load_chunk_keeps_dtype_and_shape(cpu):
    src = torch.randn(4, 6).to(torch.bfloat16)[1:3]
    dst, ev = cpu.load_chunk(src)
    assert torch.equal(cpu.take(dst, ev), src) and dst.dtype == torch.bfloat16 and dst.is_contiguous()


def test_cpu_storing_runs_after_its_event():
    slow = CpuTransfer(delay_s=0.05)
    try:
        seen = []
        _, ev = slow.load_chunk(torch.zeros(2))
        with slow.storing(after=ev) as s:
            seen.append(slow.done(ev))
        assert seen == [True] and s.event is None and slow.done(s.event)
    finally:
        slow.close()


def test_cpu_storing_waits_for_a_future_of_another_thread(cpu):
    gate = concurrent.futures.Future()
    flag = []
    timer = threading.Timer(0.05, lambda: (flag.append(1), gate.set_result(None)))
    timer.start()
    with cpu.storing(after=gate):
        assert flag == [1]
    timer.join()


def test_cpu_to_host_and_record_store(cpu):
    t = torch.arange(6.0)
    host, ev = cpu.to_host(t)
    assert host is t and ev is None and cpu.record_store() is None


def test_cpu_drain_waits_for_every_queued_copy():
    slow = CpuTransfer(delay_s=0.02)
    try:
        evs = [slow.load_chunk(torch.full((3,), float(i)))[1] for i in range(3)]
        slow.drain()
        assert all(slow.done(ev) for ev in evs)
    finally:
        slow.close()


# -- CUDA ------------------------------------------------------------------------------------------
def _late(stream, cycles=100_000_000):
    """Queue a long spin on ``stream``: work queued behind it runs late."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


@pytest.mark.gpu
def test_gpu_load_chunk_starts_after_its_event():
    """The host source is written by a device copy queued behind a long spin on another stream; a load given
    that copy's event reads the new bytes, and the compute stream sees them after take()."""
    tr = CudaTransfer(torch.device("cuda"), timing=False, write_back=True)
    src = pinned_empty((N,), torch.float32)
    src.fill_(1.0)
    other = torch.cuda.Stream()
    x = torch.full((N,), 2.0, device="cuda")
    torch.cuda.synchronize()
    _late(other)
    with torch.cuda.stream(other):
        src.copy_(x, non_blocking=True)
        written = other.record_event()
    dst, ev = tr.load_chunk(src, after=written)
    out = tr.take(dst, ev)
    assert out.is_cuda and torch.equal(out.cpu(), torch.full((N,), 2.0))


@pytest.mark.gpu
def test_gpu_storing_runs_after_the_compute_stream_and_its_event():
    """A store queued after the compute stream's slow write of its source, and after another stream's event,
    copies the written bytes; the host reads them after the store's event."""
    tr = CudaTransfer(torch.device("cuda"), timing=False, write_back=True)
    x = torch.zeros(N, device="cuda")
    y = torch.zeros(N, device="cuda")
    other = torch.cuda.Stream()
    torch.cuda.synchronize()
    _late(torch.cuda.current_stream())
    x.fill_(3.0)                                     # the compute stream, late
    _late(other)
    with torch.cuda.stream(other):
        y.fill_(4.0)
        y_done = other.record_event()
    hx, hy = pinned_empty((N,), torch.float32), pinned_empty((N,), torch.float32)
    with tr.storing(after=y_done) as s:
        hx.copy_(x, non_blocking=True)
        hy.copy_(y, non_blocking=True)
        s.keep(x, y)
    assert s.event is not None
    s.event.synchronize()
    assert torch.equal(hx, torch.full((N,), 3.0)) and torch.equal(hy, torch.full((N,), 4.0))


@pytest.mark.gpu
def test_gpu_to_host_record_store_and_drain():
    """to_host copies into a new pinned buffer after the kernels that wrote the source; record_store's event
    follows it; drain leaves nothing in flight."""
    tr = CudaTransfer(torch.device("cuda"), timing=False, write_back=True)
    g = torch.zeros(N, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    _late(torch.cuda.current_stream())
    g.fill_(1.5)
    host, ev = tr.to_host(g)
    after = tr.record_store()
    assert host.is_pinned() and host.dtype == torch.bfloat16 and host.device.type == "cpu"
    tr.drain()
    assert ev.query() and after.query()
    assert torch.equal(host, torch.full((N,), 1.5, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_gpu_storing_without_a_write_back_stream_uses_the_fill_stream():
    tr = CudaTransfer(torch.device("cuda"), timing=False)
    x = torch.arange(1000.0, device="cuda")
    host, ev = tr.to_host(x)
    ev.synchronize()
    assert torch.equal(host, torch.arange(1000.0))
