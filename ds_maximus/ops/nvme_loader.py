"""Async NVMe loader: reads/writes of CPU tensors on a C++ thread pool (O_DIRECT pread/pwrite),
completion handles, a pool of pinned (page-aligned) buffers, and disk -> GPU streaming.

The C++ op (``csrc/nvme_loader``) splits each request into ``block_bytes`` pieces run by ``threads``
workers, at most ``queue_depth`` pieces at once. Under O_DIRECT, pieces whose memory, offset or length
is not 4096-aligned are bounced through the worker's aligned buffer; where the file system refuses
O_DIRECT the loader falls back to buffered I/O and logs why. Errors come back from ``IOHandle.wait()``
as :class:`ds_maximus.errors.NVMeIOError` naming the path, offset and errno.
"""
from __future__ import annotations

import errno as _errno
import functools
import logging
import os
import threading
from typing import Dict, List, Optional

import torch

from ds_maximus.errors import NVMeIOError

logger = logging.getLogger(__name__)

ALIGN_BYTES = 4096  # O_DIRECT alignment of buffer addresses, offsets and lengths
SHORT_READ_ERRNO = _errno.ENODATA  # what the op reports for a read past the end of the file


@functools.lru_cache(maxsize=None)
def _op():
    from ds_maximus.ops import builder
    return builder("nvme_loader", "NVMeLoaderBuilder").load(verbose=False)


@functools.lru_cache(maxsize=None)
def nvme_loader_available() -> bool:
    """True when the ``maximus_nvme_loader`` C++ op builds and loads on this machine (cached)."""
    try:
        _op()
        return True
    except Exception as e:  # OpBuildError, missing compiler, non-Linux ...
        logger.warning("maximus NVMe loader unavailable, falling back to plain file I/O: %s",
                       str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


_FIXES = {
    _errno.ENOENT: "check the path (and that the file was written before it is read)",
    _errno.EIO: "the device reported an I/O error: check `dmesg` and the drive's health",
    _errno.ENOSPC: "free space on the device holding the file, or point the offload nvme_path elsewhere",
    _errno.EFBIG: "the file would exceed the file-size limit (`ulimit -f`) or the file system's maximum",
    SHORT_READ_ERRNO: "the file is shorter than offset + nbytes: it was truncated, or the offset/size is wrong",
    _errno.ECANCELED: "the loader was closed (cancel=True) before this request ran; wait() before close()",
}


class IOHandle:
    """Completion handle of one :meth:`NVMeLoader.read_into` / :meth:`NVMeLoader.write_from` request."""

    __slots__ = ("_h", "_tensor", "_loader")

    def __init__(self, h, tensor: torch.Tensor, loader: "NVMeLoader"):
        self._h, self._tensor, self._loader = h, tensor, loader

    def done(self) -> bool:
        """True once the request finished (successfully or not); never blocks."""
        return self._h.done()

    def wait(self, timeout_s: Optional[float] = None) -> torch.Tensor:
        """Block until the request finishes; returns its tensor, raises :class:`NVMeIOError` on failure
        and ``TimeoutError`` when ``timeout_s`` passed first."""
        if not self._h.wait(-1.0 if timeout_s is None else float(timeout_s)):
            raise TimeoutError(f"I/O on {self._h.path} at offset {self._h.offset} not done after {timeout_s} s")
        self._loader._log_messages()
        code = self._h.error_code()
        if code:
            at = self._h.error_offset()
            msg = f"{self._h.error_message()} [errno {code}: {_errno.errorcode.get(code, '?')}]"
            fix = _FIXES.get(code)
            raise NVMeIOError(msg + (f"\n  fix: {fix}" if fix else ""), path=self._h.path, offset=at, err=code)
        return self._tensor

    @property
    def used_direct(self) -> bool:
        """Whether the request went through O_DIRECT (False after a buffered fallback)."""
        return self._h.used_direct()

    def __repr__(self):
        state = "done" if self.done() else "pending"
        return f"IOHandle({self._h.path!r}, offset={self._h.offset}, nbytes={self._h.nbytes}, {state})"


def aligned_empty(nbytes: int, pin: Optional[bool] = None) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose address is 4096-aligned; pinned when CUDA is present
    (``pin=None``) or asked. CPU-only torch cannot pin: plain aligned memory is used there."""
    pin = torch.cuda.is_available() if pin is None else pin
    base = None
    if pin:
        try:
            base = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            logger.warning("pin_memory failed (%s); using ordinary aligned memory", str(e).splitlines()[0])
    if base is None:
        base = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    shift = (-base.data_ptr()) % ALIGN_BYTES
    return base[shift:shift + nbytes]


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class PinnedBufferPool:
    """Reusable page-aligned (pinned where CUDA is present) byte buffers.

    ``get(nbytes)`` returns a uint8 view of a pooled buffer; the buffer returns to the pool by itself once
    no tensor uses its memory any more (views of views included), so there is nothing to release.

    >>> pool = PinnedBufferPool()
    >>> buf = pool.get(10_000)
    >>> buf.numel(), buf.data_ptr() % 4096
    (10000, 0)
    """

    def __init__(self, max_cached_bytes: int = 4 << 30):
        self.max_cached_bytes = max_cached_bytes
        self._bufs: Dict[int, List[tuple]] = {}  # size class -> [(base view, idle use count)]
        self._lock = threading.Lock()

    @staticmethod
    def size_class(nbytes: int) -> int:
        """Bytes actually allocated for ``nbytes``: a power of two up to 64 MiB, then 64 MiB multiples."""
        n = max(int(nbytes), ALIGN_BYTES)
        if n <= 64 << 20:
            return 1 << (n - 1).bit_length()
        return -(-n // (64 << 20)) * (64 << 20)

    def cached_bytes(self) -> int:
        return sum(c * len(v) for c, v in self._bufs.items())

    def get(self, nbytes: int) -> torch.Tensor:
        cls = self.size_class(nbytes)
        with self._lock:
            for base, idle in self._bufs.get(cls, ()):
                if _storage_uses(base) == idle:  # nobody else holds its memory
                    return base[:nbytes]
            base = aligned_empty(cls)
            if self.cached_bytes() + cls <= self.max_cached_bytes:
                self._bufs.setdefault(cls, []).append((base, _storage_uses(base)))
            return base[:nbytes]

    def clear(self):
        with self._lock:
            self._bufs.clear()


class NVMeLoader:
    """Async reads and writes of CPU tensors from/to files, on a C++ thread pool with O_DIRECT.

    >>> import torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
    >>> with NVMeLoader(threads=2) as loader:
    ...     src = torch.arange(1000, dtype=torch.float32)
    ...     _ = loader.write_from(src, path, offset=0).wait()
    ...     dst = loader.pinned_buffer(src.nbytes).view(torch.float32)
    ...     bool(torch.equal(loader.read_into(path, 0, dst).wait(), src))
    True

    ``read_into``/``write_from`` return at once with an :class:`IOHandle`; the tensor must stay
    untouched (reads: unread) until ``wait()`` returns. Aligned tensors (``pinned_buffer``) avoid a
    bounce copy. ``close()`` (or leaving the ``with`` block) waits for what is in flight;
    ``close(cancel=True)`` fails queued requests with ECANCELED instead.
    """

    def __init__(self, threads: int = 8, block_bytes: int = 1 << 20, queue_depth: int = 32, o_direct: bool = True,
                 pool_max_bytes: int = 4 << 30):
        if threads < 1 or queue_depth < 1:
            raise ValueError(f"NVMeLoader: threads={threads} and queue_depth={queue_depth} must be >= 1")
        if block_bytes < ALIGN_BYTES or block_bytes % ALIGN_BYTES:
            raise ValueError(f"NVMeLoader: block_bytes={block_bytes} must be a positive multiple of 4096; "
                             f"use {max(ALIGN_BYTES, block_bytes // ALIGN_BYTES * ALIGN_BYTES)}")
        self._impl = _op().Loader(threads=threads, block_bytes=block_bytes, queue_depth=queue_depth,
                                  o_direct=o_direct)
        self.threads, self.block_bytes, self.queue_depth, self.o_direct = threads, block_bytes, queue_depth, o_direct
        self.pool = PinnedBufferPool(pool_max_bytes)
        self._pid = os.getpid()  # worker threads do not survive fork()
        self._device = None  # disk -> GPU streaming state, created on first use (see nvme_loader_cuda)

    @classmethod
    def from_config(cls, io_cfg) -> "NVMeLoader":
        """From ``MaximusConfig.io`` (an ``IOConfig``); a whole ``MaximusConfig`` is accepted too."""
        io_cfg = getattr(io_cfg, "io", io_cfg)
        return cls(threads=io_cfg.threads, block_bytes=io_cfg.block_bytes, queue_depth=io_cfg.queue_depth,
                   o_direct=io_cfg.o_direct)

    # ------------------------------------------------------------------ CPU tensors
    def read_into(self, path, offset: int, tensor: torch.Tensor) -> IOHandle:
        """Fill contiguous CPU ``tensor`` with ``tensor.nbytes`` bytes of file ``path`` from ``offset``."""
        self._check(tensor, "read_into", offset)
        return IOHandle(self._impl.read_into(str(path), int(offset), tensor), tensor, self)

    def write_from(self, tensor: torch.Tensor, path, offset: int, fsync: bool = False) -> IOHandle:
        """Write the bytes of contiguous CPU ``tensor`` into ``path`` (created if missing, never truncated)
        at ``offset``; ``fsync=True`` makes the data durable before the handle completes."""
        self._check(tensor, "write_from", offset)
        return IOHandle(self._impl.write_from(tensor, str(path), int(offset), bool(fsync)), tensor, self)

    def read(self, path, offset: int, nbytes: int) -> torch.Tensor:
        """Blocking read of ``nbytes`` into a fresh aligned uint8 tensor (not from the pool)."""
        return self.read_into(path, offset, aligned_empty(nbytes)).wait()

    def pinned_buffer(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 buffer (pinned where CUDA is present) from the loader's pool."""
        return self.pool.get(nbytes)

    def pending(self) -> int:
        """Pieces (``block_bytes`` each at most) queued or running."""
        return self._impl.pending_pieces()

    # ------------------------------------------------------------------ GPU
    def read_to_device(self, path, offset: int, nbytes: int, out: torch.Tensor,
                       stream: Optional["torch.cuda.Stream"] = None, *,
                       wait_stream: Optional["torch.cuda.Stream"] = None) -> "torch.cuda.Event":
        """Stream ``nbytes`` of ``path`` from ``offset`` into CUDA tensor ``out`` (disk -> pinned -> device,
        double-buffered, copies on ``stream`` or a side stream of the loader). Returns a CUDA event: call
        ``torch.cuda.current_stream().wait_event(ev)`` before using ``out``; the compute stream never waits
        on the host. Returns once the last copy is queued (call it from a prefetch thread to overlap the
        disk time with host work). ``out`` must not be in use by queued kernels; pass ``wait_stream`` to
        order the copies after the work queued on that stream so far."""
        self._check_open()
        if not isinstance(out, torch.Tensor) or out.device.type != "cuda" or not out.is_contiguous() \
                or out.nbytes < nbytes or nbytes < 0 or offset < 0:
            got = (f"{out.device}, contiguous={out.is_contiguous()}, {out.nbytes} bytes"
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            raise ValueError(f"read_to_device: out must be a contiguous CUDA tensor of >= nbytes={nbytes} bytes "
                             f"(offset={offset} and nbytes >= 0), got {got}; use read_into() for CPU tensors")
        if self._device is None:
            self._device = DeviceStreamer(self)
        return self._device.read_to_device(str(path), int(offset), int(nbytes), out, stream, wait_stream)

    # ------------------------------------------------------------------ lifetime
    def close(self, cancel: bool = False) -> None:
        """Stop the workers: wait for everything in flight, or (``cancel=True``) run only what already
        started and fail the queued rest with ECANCELED. Idempotent."""
        self._impl.close(cancel=cancel)
        self._log_messages()

    @property
    def closed(self) -> bool:
        return self._impl.closed()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self, _getpid=os.getpid):
        # stop the workers with the GIL released (close() releases it): a worker dropping the last
        # reference to a tensor may need the GIL, which the C++ destructor would hold while joining.
        # ``_getpid`` is bound at definition: at interpreter exit the module's ``os`` may already be None.
        impl = getattr(self, "_impl", None)
        if impl is not None and not impl.closed() and _getpid() == self._pid:
            impl.close(cancel=False)

    def __repr__(self):
        return (f"NVMeLoader(threads={self.threads}, block_bytes={self.block_bytes}, "
                f"queue_depth={self.queue_depth}, o_direct={self.o_direct})")

    def _check_open(self):
        if self._impl.closed():
            raise ValueError("this NVMeLoader is closed; create a new one")
        if os.getpid() != self._pid:
            raise RuntimeError(f"this NVMeLoader was created in process {self._pid} and its worker threads do "
                               "not exist after fork(); create a new NVMeLoader in the child process")

    def _check(self, tensor: torch.Tensor, fn: str, offset: int):
        self._check_open()
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            got = (f"a tensor on {tensor.device}, contiguous={tensor.is_contiguous()}"
                   if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
            hint = "; for CUDA tensors use read_to_device()" if fn == "read_into" else ""
            raise ValueError(f"{fn}: needs a contiguous CPU tensor, got {got}; use .contiguous().cpu() "
                             f"or loader.pinned_buffer(nbytes){hint}")
        if offset < 0:
            raise ValueError(f"{fn}: offset={offset} must be >= 0")

    def _log_messages(self):
        for m in self._impl.take_messages():
            logger.warning("maximus NVMe loader: %s", m)


class DeviceStreamer:
    """Disk -> pinned -> GPU pipeline of one loader: ``staging_buffers`` pinned chunks of ``chunk_bytes``;
    the read of chunk i+1 runs while chunk i is copied on the side stream. Thread-safe (one lock)."""

    def __init__(self, loader: NVMeLoader, chunk_bytes: Optional[int] = None, staging_buffers: int = 2):
        par = min(loader.threads, loader.queue_depth)
        self.loader = loader
        self.chunk_bytes = chunk_bytes or max(4 << 20, 2 * par * loader.block_bytes)
        self.staging = [aligned_empty(self.chunk_bytes, pin=True) for _ in range(staging_buffers)]
        self.copied = [None] * staging_buffers  # CUDA event of the last copy out of each staging buffer
        self.streams: Dict[int, torch.cuda.Stream] = {}
        self.lock = threading.Lock()

    def read_to_device(self, path: str, offset: int, nbytes: int, out: torch.Tensor, stream, wait_stream):
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        if stream is None:
            stream = self.streams.get(dev)
            if stream is None:
                stream = self.streams[dev] = torch.cuda.Stream(device=dev)
        dst = out.view(-1).view(torch.uint8)[:nbytes]
        n_chunks = -(-nbytes // self.chunk_bytes)
        k = len(self.staging)
        with self.lock:
            if wait_stream is not None:
                stream.wait_stream(wait_stream)

            def submit(i):
                b = i % k
                if self.copied[b] is not None:
                    self.copied[b].synchronize()  # the copy out of this buffer is done: reuse it
                lo = i * self.chunk_bytes
                n = min(self.chunk_bytes, nbytes - lo)
                return self.loader.read_into(path, offset + lo, self.staging[b][:n])

            pending = submit(0) if n_chunks else None
            for i in range(n_chunks):
                nxt = submit(i + 1) if i + 1 < n_chunks else None  # keep the disk busy during the copy
                try:
                    chunk = pending.wait()
                except BaseException:
                    if nxt is not None:  # never leave a read running into a staging buffer
                        nxt._h.wait(-1.0)
                    raise
                lo = i * self.chunk_bytes
                with torch.cuda.stream(stream):
                    dst[lo:lo + chunk.numel()].copy_(chunk, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                self.copied[i % k] = ev
                pending = nxt
            done = torch.cuda.Event()
            done.record(stream)
        out.record_stream(stream)
        return done
