"""Copy engines of the expert cache: a CUDA side stream ordered by events, or a CPU worker thread.

Both expose the same three calls, so the cache and prefetch logic are identical on GPU and CPU:

* ``load(dst, store, uid, after) -> Event`` starts filling the slot buffer ``dst`` with expert
  ``uid`` once ``after`` (the slot's last-use event, or ``None``) has passed; one flat copy.
* ``wait(event)`` makes the *compute* stream wait for a load (CUDA: ``wait_event``, no host sync;
  CPU: blocks until the worker finished). Returns the host ms spent blocked (CPU only).
* ``record_use() -> Event`` marks "the compute queued so far is done with the slot".

    >>> import torch
    >>> t = CpuTransfer()
    >>> dst = torch.zeros(4); src = torch.ones(4)
    >>> class S:  # a minimal store
    ...     def host_view(self, uid): return src
    >>> ev = t.load(dst, S(), 0, None); _ = t.wait(ev); dst.tolist()
    [1.0, 1.0, 1.0, 1.0]
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import List, Optional

import torch


class CpuTransfer:
    """Copies on one worker thread (ordered, like a stream): the CPU stand-in for a CUDA copy stream."""

    device = torch.device("cpu")

    def __init__(self, delay_s: float = 0.0):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="maximus-moe-copy")
        self.delay_s = float(delay_s)  # tests slow the copier down to keep loads in flight

    def load(self, dst: torch.Tensor, store, uid: int, after=None):
        def run():
            if self.delay_s:
                time.sleep(self.delay_s)
            src = store.host_view(uid)
            if src is None:
                store.read_into(uid, dst)
            else:
                dst.copy_(src)
        return self._pool.submit(run)

    @staticmethod
    def done(event) -> bool:
        return event is None or event.done()

    def wait(self, event) -> float:
        if event is None or event.done():
            if event is not None:
                event.result()  # re-raise a failed read
            return 0.0
        t0 = time.perf_counter()
        event.result()
        return (time.perf_counter() - t0) * 1e3

    def synchronize(self, event) -> None:
        if event is not None:
            event.result()

    def record_use(self):
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaTransfer:
    """Loads on a side stream; the compute stream waits on per-load events (never the host)."""

    def __init__(self, device: torch.device, staging_buffers: int = 2, timing: bool = True):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._staging: List[torch.Tensor] = []
        self._staging_ev: List[Optional[torch.cuda.Event]] = []
        self._n_staging = staging_buffers
        self._next = 0
        self.timing = timing
        self.stall_events: List[tuple] = []

    def _staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned staging buffer for the file tier; reused once its last copy has left it."""
        if not self._staging:
            for _ in range(self._n_staging):
                self._staging.append(torch.empty(numel, dtype=dtype, pin_memory=True))
                self._staging_ev.append(None)
        i = self._next
        self._next = (i + 1) % self._n_staging
        ev = self._staging_ev[i]
        if ev is not None:
            ev.synchronize()
        return i

    def load(self, dst: torch.Tensor, store, uid: int, after=None) -> torch.cuda.Event:
        src = store.host_view(uid)
        staged = None
        if src is None:
            staged = self._staging_buffer(dst.numel(), dst.dtype)
            src = self._staging[staged]
            store.read_into(uid, src)
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        if staged is not None:
            self._staging_ev[staged] = ev
        return ev

    @staticmethod
    def done(event) -> bool:
        return event is None or event.query()

    def wait(self, event) -> float:
        if event is None:
            return 0.0
        cur = torch.cuda.current_stream(self.device)
        if self.timing and not event.query():
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record(cur)
            cur.wait_event(event)
            t1.record(cur)
            self.stall_events.append((t0, t1))
        else:
            cur.wait_event(event)
        return 0.0

    def synchronize(self, event) -> None:
        if event is not None:
            event.synchronize()

    def record_use(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def gpu_stall_ms(self) -> float:
        """Sum of the compute stream's waits on loads (resolves the recorded event pairs)."""
        total = 0.0
        for t0, t1 in self.stall_events:
            t1.synchronize()
            total += t0.elapsed_time(t1)
        self.stall_events.clear()
        return total

    def close(self) -> None:
        self.stream.synchronize()
