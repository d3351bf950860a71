"""The one transfer engine of the partition core: side copy streams ordered by events, pinned staging,
UVA row copies, and the stall clock; a CPU worker thread stands in for the copy stream on CPU machines.

Two shapes of copy share it. The row cache (:class:`~ds_maximus.partition.cache.PartitionCache`) moves
batches of rows: fills on :attr:`CudaTransfer.stream`, dirty write-backs on :attr:`CudaTransfer.wb_stream`
(fills H2D and write-backs D2H overlap on the full-duplex link), through pinned staging
(:func:`host_staging`) or as single kernels reading/writing a pinned tier through its mapped address
(:func:`row_copy_op`). The slot cache (:class:`~ds_maximus.partition.cache.SlotCache`, MoE experts) moves
one flat entry per slot; for it :class:`CpuTransfer` and :class:`CudaTransfer` expose the same calls, so
the cache and prefetch logic are identical on GPU and CPU:

* ``load(dst, store, uid, after) -> Event`` starts filling the slot buffer ``dst`` with entry
  ``uid`` once ``after`` (the slot's last-use event, or ``None``) has passed; one flat copy.
* ``wait(event)`` makes the *compute* stream wait for a load (CUDA: ``wait_event``, no host sync;
  CPU: blocks until the worker finished). Returns the host ms spent blocked (CPU only).
* ``record_use() -> Event`` marks "the compute queued so far is done with the slot".

Whole tensors (an LM head's chunk of rows, a gradient leaving the device) move by the same engine, again with
the same calls on both:

* ``load_chunk(src, after) -> (tensor, Event)``: a new device copy of the host tensor ``src`` on the fill
  stream; ``take(tensor, event)`` hands it to the compute stream.
* ``with storing(after) as s:`` queues device -> host work (copies out and the device work that makes what
  they copy) on the write-back stream, after the compute stream's work so far; ``s.keep(t)`` holds device
  tensors it reads, ``s.event`` marks its end. ``to_host(t) -> (host, Event)`` is one such copy into a new
  pinned buffer; ``record_store()`` is an event after every store queued so far, ``drain()`` waits for all.

Speculative loads (``prefetch(..., chunk_bytes)``) are :class:`~ds_maximus.partition.speculation.PrefetchJob`
handles instead of one copy: only the guess's first ``chunk_bytes`` are queued at once (sized to the link's
idle gap before the next layer's routing is known); ``cancel`` drops the rest of a wrong guess,
``wait``/``synchronize`` first queue the rest of a right one. A wrong guess thus costs one chunk of link
time, not a whole entry, and no host thread is involved (a Python thread pumping chunks slowed the decode
loop's host path through the GIL).

    >>> import torch
    >>> t = CpuTransfer()
    >>> dst = torch.zeros(4); src = torch.ones(4)
    >>> class S:  # a minimal store
    ...     def host_view(self, uid): return src
    >>> ev = t.load(dst, S(), 0, None); _ = t.wait(ev); dst.tolist()
    [1.0, 1.0, 1.0, 1.0]
    >>> job = t.prefetch(dst, S(), 0, None, chunk_bytes=8); t.cancel(job)  # a wrong guess: the rest never goes
    False
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ds_maximus.ops import to_device, to_device_pair
from ds_maximus.partition.host_memory import pinned_empty
from ds_maximus.partition.speculation import PrefetchJob, cancel


def device_bytes_free(device) -> int:
    """Bytes this process can still allocate on CUDA ``device``: the device's free memory plus the free blocks the
    caching allocator holds, bounded by a per-process cap (``torch.cuda.set_per_process_memory_fraction``)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    avail = free + torch.cuda.memory_reserved(device) - allocated
    frac = torch.cuda.get_per_process_memory_fraction(device)
    if frac < 1.0:
        avail = min(avail, int(frac * total) - allocated)
    return max(0, avail)


def host_staging(like: Dict[str, torch.Tensor], n: int, pin: bool) -> Dict[str, torch.Tensor]:
    """Host buffers for ``n`` entries shaped like the tables ``like`` (``[slots, ...]`` each), pinned when
    ``pin`` (so a copy to or from the device is asynchronous)."""
    return {k: pinned_empty((n, *v.shape[1:]), v.dtype, pin=pin) for k, v in like.items()}


class Stored:
    """What one ``storing`` block queued: :meth:`keep` the device tensors its work reads that were made on
    another stream (their memory is not reused before that work has run); ``event`` marks the end of its work
    once the block has exited (``None`` on the CPU, where the work is done by then)."""

    def __init__(self, stream=None):
        self.stream = stream
        self.event = None

    def keep(self, *tensors: torch.Tensor) -> None:
        if self.stream is not None:
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(self.stream)


def row_copy_op(tier, names: Sequence[str], device: torch.device):
    """The CUDA op whose ``copy_rows`` kernel reads/writes rows of a pinned tier through its mapped address
    (a fill or write-back is then one kernel, no host copy), or None where that path does not apply: not
    CUDA, a tier that is not pinned tensors in memory, a table that is not fp32, or the op not built."""
    whole = tier.whole_tables() if torch.device(device).type == "cuda" and tier.pinned else None
    if whole is None or any(whole[n].dtype != torch.float32 for n in names):
        return None   # decided before the op is loaded: a bf16 or packed tier (experts) never builds it
    from ds_maximus.ops.row_ops import load_op
    op = load_op("cuda")
    return op if op is not None and hasattr(op, "copy_rows") else None


class StallClock:
    """Time the compute stream waited on copies: ``(start, end)`` timing-event pairs recorded around its
    waits, summed once both have completed."""

    def __init__(self):
        self.pairs: List[Tuple[object, object]] = []

    def add(self, start, end) -> None:
        self.pairs.append((start, end))

    def resolve(self, block: bool) -> float:
        """Milliseconds of the completed pairs (all of them with ``block``, which waits for each), dropped
        once counted; at most the newest 1024 unresolved pairs are kept."""
        total, keep = 0.0, []
        for start, end in self.pairs:
            if block:
                end.synchronize()
            if block or (end.query() and start.query()):
                total += max(0.0, start.elapsed_time(end))
            else:
                keep.append((start, end))
        self.pairs = keep[-1024:]
        return total


class CpuTransfer:
    """Copies on one worker thread (ordered, like a stream): the CPU stand-in for a CUDA copy stream."""

    device = torch.device("cpu")

    def __init__(self, delay_s: float = 0.0):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="maximus-moe-copy")
        self.delay_s = float(delay_s)  # tests slow the copier down to keep loads in flight

    def load(self, dst: torch.Tensor, store, uid: int, after=None, head: Optional[torch.Tensor] = None):
        def run():
            if self.delay_s:
                time.sleep(self.delay_s)
            src = store.host_view(uid)
            if head is not None:  # a staged guess: the first head.numel() elements are on the device already
                n = head.numel()
                dst.view(-1)[:n].copy_(head)
                dst.view(-1)[n:].copy_(src.view(-1)[n:])
            elif src is None:
                store.read_into(uid, dst)
            else:
                dst.copy_(src)
        return self._pool.submit(run)

    def load_head(self, stage: torch.Tensor, store, uid: int, after=None):
        """Copy the first ``stage.numel()`` elements of expert ``uid`` into ``stage`` (a staged guess)."""
        def run():
            if self.delay_s:
                time.sleep(self.delay_s)
            stage.copy_(store.host_view(uid).view(-1)[:stage.numel()])
        return self._pool.submit(run)

    def prefetch(self, dst: torch.Tensor, store, uid: int, after=None, chunk_bytes: Optional[int] = None):
        """A speculative load: a job whose head the worker copies first (when ``chunk_bytes`` is set and the
        tier is in memory), else one load like a demand's."""
        src = store.host_view(uid)
        if src is None or not chunk_bytes:
            return self.load(dst, store, uid, after)
        job = PrefetchJob(dst, src, after, chunk_bytes // dst.element_size())
        self._pool.submit(self._head, job)
        return job

    def _head(self, job: PrefetchJob) -> None:
        """Worker: copy the guess's head, unless it was dropped or finished meanwhile."""
        if self.delay_s:
            time.sleep(self.delay_s)
        with job.lock:
            r = job.claim()
            if r is not None and r[1] == job.n:
                job.final = True
        if r is not None:
            self._copy(job, *r)

    def finish(self, job: PrefetchJob) -> None:
        """Queue what is left of ``job`` at once (its guess was right)."""
        with job.lock:
            r = job.claim(rest=True)
            if r is None:
                return
            job.final = True
        self._pool.submit(self._copy, job, *r)

    @staticmethod
    def _copy(job: PrefetchJob, a: int, b: int) -> None:
        job.dst[a:b].copy_(job.src[a:b])
        if b == job.n:
            job.landed.set()

    cancel = staticmethod(cancel)

    @staticmethod
    def done(event) -> bool:
        if isinstance(event, PrefetchJob):
            return event.cancelled or event.landed.is_set()
        return event is None or event.done()

    def wait(self, event) -> float:
        if isinstance(event, PrefetchJob):
            self.finish(event)
            if event.cancelled or event.landed.is_set():
                return 0.0
            t0 = time.perf_counter()
            event.landed.wait()
            return (time.perf_counter() - t0) * 1e3
        if event is None or event.done():
            if event is not None:
                event.result()  # re-raise a failed read
            return 0.0
        t0 = time.perf_counter()
        event.result()
        return (time.perf_counter() - t0) * 1e3

    def synchronize(self, event) -> None:
        self.wait(event)

    def record_use(self):
        return None

    def wait_event(self, ev) -> None:
        """Loads queued from now on start after ``ev`` (on the CPU nothing is queued ahead: a no-op)."""

    # -- whole tensors ----------------------------------------------------------------------------
    def load_chunk(self, src: torch.Tensor, after=None):
        """A copy of ``src`` made by the worker once ``after`` (a load's future, or ``None``) is done:
        ``(tensor, future)``; read the tensor after :meth:`take`."""
        dst = torch.empty(src.shape, dtype=src.dtype)

        def run():
            if after is not None:
                after.result()
            if self.delay_s:
                time.sleep(self.delay_s)
            dst.copy_(src)
        return dst, self._pool.submit(run)

    def take(self, t: torch.Tensor, event) -> torch.Tensor:
        """``t`` once its load ``event`` is done."""
        self.wait(event)
        return t

    @contextlib.contextmanager
    def storing(self, after=None) -> Iterator[Stored]:
        """Run the block on the calling thread once ``after`` (a future, or ``None``) is done: the CPU
        stand-in for work queued on the write-back stream, done when the block exits."""
        self.wait(after)
        yield Stored()

    @staticmethod
    def to_host(t: torch.Tensor):
        """``t`` on the host (itself where it is there already) and ``None``: nothing is left in flight."""
        return (t if t.device.type == "cpu" else t.to("cpu")), None

    @staticmethod
    def record_store():
        """Stores run on the calling thread: none is ever in flight."""
        return None

    def drain(self) -> None:
        """Wait until every copy queued on the worker so far has finished."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaTransfer:
    """Loads on a side stream; the compute stream waits on per-load events (never the host).

    ``priority``: of the copy streams (-1: high, their few copy blocks are scheduled ahead of the compute
    stream's queued blocks); ``write_back``: also make :attr:`wb_stream`, the stream of a write-back cache's
    device-to-host copies (so they overlap the fills).
    """

    def __init__(self, device: torch.device, staging_buffers: int = 2, timing: bool = True, priority: int = 0,
                 write_back: bool = False):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device, priority=priority)
        self.wb_stream = torch.cuda.Stream(device=self.device, priority=priority) if write_back else None
        self.stalls = StallClock()
        self._staging: List[torch.Tensor] = []
        self._staging_ev: List[Optional[torch.cuda.Event]] = []
        self._n_staging = staging_buffers
        self._next = 0
        self.timing = timing

    def _staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned staging buffer for the file tier; reused once its last copy has left it."""
        if not self._staging:
            for _ in range(self._n_staging):
                self._staging.append(pinned_empty((numel,), dtype))
                self._staging_ev.append(None)
        i = self._next
        self._next = (i + 1) % self._n_staging
        ev = self._staging_ev[i]
        if ev is not None:
            ev.synchronize()
        return i

    def load(self, dst: torch.Tensor, store, uid: int, after=None,
             head: Optional[torch.Tensor] = None) -> torch.cuda.Event:
        src = store.host_view(uid)
        if head is not None:  # a staged guess: its head is on the device, only the rest crosses the link
            n = head.numel()
            return self._copies(after, (dst.view(-1)[:n], head), (dst.view(-1)[n:], src.view(-1)[n:]))
        staged = None
        if src is None:
            staged = self._staging_buffer(dst.numel(), dst.dtype)
            src = self._staging[staged]
            store.read_into(uid, src)
        ev = self._copies(after, (dst, src))
        if staged is not None:
            self._staging_ev[staged] = ev
        return ev

    def wait_event(self, ev) -> None:
        """Loads queued from now on start after ``ev`` (e.g. an optimizer step's write-back of the copies
        they read)."""
        self.stream.wait_event(ev)

    def _copies(self, after, *pairs) -> torch.cuda.Event:
        """Queue ``dst.copy_(src)`` for each ``(dst, src)`` on the copy stream after event ``after``;
        returns the event of the last."""
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def load_head(self, stage: torch.Tensor, store, uid: int, after=None) -> torch.cuda.Event:
        """Copy the first ``stage.numel()`` elements of expert ``uid`` into ``stage`` (a staged guess)."""
        return self._copies(after, (stage, store.host_view(uid).view(-1)[:stage.numel()]))

    def prefetch(self, dst: torch.Tensor, store, uid: int, after=None, chunk_bytes: Optional[int] = None):
        """A speculative load: a job whose head chunk is queued now, behind the demand loads queued so far
        (when ``chunk_bytes`` is set and the tier is in memory), else one load like a demand's."""
        src = store.host_view(uid)
        if src is None or not chunk_bytes:
            return self.load(dst, store, uid, after)
        job = PrefetchJob(dst, src, after, chunk_bytes // dst.element_size())
        with job.lock:
            self._queue(job, *job.claim())
        return job

    def _queue(self, job: PrefetchJob, a: int, b: int) -> torch.cuda.Event:
        """Queue ``job``'s elements ``[a, b)`` on the copy stream (caller holds ``job.lock``)."""
        ev = self._copies(job.after if a == 0 else None, (job.dst[a:b], job.src[a:b]))
        if b == job.n:
            job.final = ev
        return ev

    def finish(self, job: PrefetchJob) -> None:
        """Queue what is left of ``job`` at once (its guess was right)."""
        with job.lock:
            r = job.claim(rest=True)
            if r is not None:
                self._queue(job, *r)

    cancel = staticmethod(cancel)

    @staticmethod
    def done(event) -> bool:
        if isinstance(event, PrefetchJob):
            return event.cancelled or (event.final is not None and event.final.query())
        return event is None or event.query()

    def wait(self, event) -> float:
        if isinstance(event, PrefetchJob):
            self.finish(event)
            event = event.final  # None when cancelled: nothing to wait for
        if event is None:
            return 0.0
        cur = torch.cuda.current_stream(self.device)
        if self.timing and not event.query():
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record(cur)
            cur.wait_event(event)
            t1.record(cur)
            self.stalls.add(t0, t1)
        else:
            cur.wait_event(event)
        return 0.0

    def synchronize(self, event) -> None:
        if isinstance(event, PrefetchJob):
            self.finish(event)
            event = event.final
        if event is not None:
            event.synchronize()

    def record_use(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    # -- row copies: batches of rows between a device table and its tier (the row cache) -------------
    def fill_rows(self, staging: Dict[str, torch.Tensor], storage: Dict[str, torch.Tensor],
                  slots: torch.Tensor) -> torch.cuda.Event:
        """``storage[k][slots] = staging[k]`` (pinned host rows) on the fill stream, after the compute stream's
        work queued so far (earlier readers of these slots, a gather in flight); returns its timing event."""
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)  # earlier readers of these slots (a gather in flight) come first
        with torch.cuda.stream(self.stream):
            dslots = to_device(slots, self.device)
            for k, v in storage.items():
                v.index_copy_(0, dslots, staging[k].to(self.device, non_blocking=True))
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
        return ev

    def read_rows(self, storage: Dict[str, torch.Tensor], slots: torch.Tensor,
                  staging: Dict[str, torch.Tensor]) -> torch.cuda.Event:
        """``staging[k] = storage[k][slots]`` (into pinned host rows) on the fill stream, after the compute
        stream's last writes to these slots; returns its event."""
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)  # the compute stream's last writes to these slots come first
        with torch.cuda.stream(self.stream):
            dslots = to_device(slots, self.device)
            for k, v in storage.items():
                staging[k].copy_(v.index_select(0, dslots), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def fill_rows_uva(self, op, tables: Dict[str, torch.Tensor], ids: torch.Tensor,
                      storage: Dict[str, torch.Tensor], slots: torch.Tensor, blocks: int,
                      after=None) -> torch.cuda.Event:
        """``storage[k][slots] = tables[k][ids]`` by one ``op.copy_rows`` kernel per table reading the pinned
        tier through its mapped address, on the fill stream after the compute stream (earlier readers of
        these slots) and ``after`` (a write-back of these ids not yet landed); returns its timing event."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # earlier readers of these slots
        if after is not None:
            self.stream.wait_event(after)  # an id coming back before its write-back landed
        with torch.cuda.stream(self.stream):
            dslots, dids = to_device_pair(slots, ids, self.device)
            for k, v in storage.items():
                op.copy_rows(tables[k], dids, v, dslots, blocks)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
        return ev

    def write_back_rows_uva(self, op, storage: Dict[str, torch.Tensor], slots: torch.Tensor, ids: torch.Tensor,
                            tables: Dict[str, torch.Tensor], blocks: int, stage: bool,
                            iota: Optional[torch.Tensor] = None, stage_blocks: int = 0) -> torch.cuda.Event:
        """``tables[k][ids] = storage[k][slots]`` by ``op.copy_rows`` kernels on the write-back stream (D2H,
        overlapping the fills); returns its event.

        ``stage``: first copy the rows on the device (on the fill stream, before the fills that reuse these
        slots; ``iota`` is ``arange(slots)`` on the device, ``stage_blocks`` that copy's grid), so the slots can
        be refilled at once; a flush, which refills nothing, writes straight from the slots.
        """
        cur = torch.cuda.current_stream(self.device)
        if stage:
            # on the fill stream, before the fills that reuse these slots: a device-to-device copy
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                dslots, dids = to_device_pair(slots, ids, self.device)
                src_idx = iota[:ids.numel()]
                src = {}
                for k, v in storage.items():  # the op's kernel: a third of index_select's host time
                    src[k] = torch.empty((ids.numel(), *v.shape[1:]), dtype=v.dtype, device=self.device)
                    op.copy_rows(v, dslots, src[k], src_idx, stage_blocks)  # device to device: every SM
                staged = torch.cuda.Event()
                staged.record(self.stream)
            self.wb_stream.wait_event(staged)
        else:
            self.wb_stream.wait_stream(cur)
            src = storage
            with torch.cuda.stream(self.wb_stream):
                src_idx, dids = to_device_pair(slots, ids, self.device)
        with torch.cuda.stream(self.wb_stream):
            for k, v in src.items():
                op.copy_rows(v, src_idx, tables[k], dids, blocks)
                if stage:
                    v.record_stream(self.wb_stream)
            if stage:  # made on the fill stream, read on this one
                dids.record_stream(self.wb_stream)
            ev = torch.cuda.Event()
            ev.record(self.wb_stream)
        return ev

    # -- whole tensors: a chunk in, copies out -------------------------------------------------------
    def load_chunk(self, src: torch.Tensor, after=None) -> Tuple[torch.Tensor, torch.cuda.Event]:
        """A new device copy of the host tensor ``src`` (pinned: one asynchronous DMA), allocated and copied on
        the fill stream once event ``after`` (or ``None``) has passed; returns it with its copy's event. Give it
        to the compute stream with :meth:`take`."""
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return dst, ev

    def take(self, t: torch.Tensor, event) -> torch.Tensor:
        """``t`` (made on a copy stream, e.g. by :meth:`load_chunk`) for the compute stream: the compute stream
        waits for ``event`` (never the host) and owns ``t`` from now on (its memory is not reused before the
        compute stream's work queued with it has run)."""
        self.wait(event)
        t.record_stream(torch.cuda.current_stream(self.device))
        return t

    def _store_stream(self) -> torch.cuda.Stream:
        return self.wb_stream if self.wb_stream is not None else self.stream

    @contextlib.contextmanager
    def storing(self, after=None) -> Iterator[Stored]:
        """Queue device -> host work on the write-back stream (the fill stream for an engine without one): what
        the block queues runs after the compute stream's work queued so far (what wrote its sources) and after
        event ``after``. ``s.keep(t)`` holds device tensors made on another stream that the work reads;
        ``s.event``, set on exit, marks its end: wait on it before the host reads what was copied out."""
        side = self._store_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            side.wait_event(after)
        s = Stored(side)
        with torch.cuda.stream(side):
            yield s
            s.event = torch.cuda.Event()
            s.event.record(side)

    def to_host(self, t: torch.Tensor) -> Tuple[torch.Tensor, torch.cuda.Event]:
        """A copy of the device tensor ``t`` into a new pinned host buffer, queued by :meth:`storing` (after the
        kernels that wrote ``t``; ``t`` is held until the copy has run); returns the buffer and the event after
        which the host may read it."""
        host = pinned_empty(t.shape, t.dtype)
        with self.storing() as s:
            host.copy_(t, non_blocking=True)
            s.keep(t)
        return host, s.event

    def record_store(self) -> torch.cuda.Event:
        """An event after every store queued so far (work that must see their copies waits on it)."""
        ev = torch.cuda.Event()
        ev.record(self._store_stream())
        return ev

    def drain(self) -> None:
        """Wait on the host until every copy queued on this engine's streams has finished."""
        self.stream.synchronize()
        if self.wb_stream is not None:
            self.wb_stream.synchronize()

    def gpu_stall_ms(self) -> float:
        """Sum of the compute stream's waits on loads (resolves the recorded event pairs)."""
        return self.stalls.resolve(block=True)

    def close(self) -> None:
        self.stream.synchronize()
