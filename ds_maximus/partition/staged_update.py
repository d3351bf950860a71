"""The staged-update pipeline: optimizer state streamed through a device, updated there, streamed back.

A partition's optimizer step (fp32 master, moments, gradient) does not have to run where the state lives:
:class:`StagedUpdate` moves the state of one *piece* at a time (a block of vocabulary rows, a few MoE experts
or a slice of one) to the update device, lets the caller update it there (the ``row_ops`` ``row_update``
kernels, or their plain-PyTorch references) and moves it back, over three CUDA streams:

* ``load`` (host -> device): the piece's state and gradient, into one of two staging sets;
* the update stream (the caller's, or :attr:`StagedUpdate.update` for a step that must not queue on the
  current stream): the update and any conversion to a compute-dtype copy;
* ``store`` (device -> host): the updated state and copies.

The two staging sets alternate, so piece ``i + 1`` is loaded while piece ``i`` is updated and piece
``i - 1`` goes back; a set is loaded again only after its last copies out have left it (its ``freed``
event). The host never waits inside the loop, except that a throttled step (issued by a worker thread,
:class:`BackgroundStep`) keeps at most two pieces of copies queued ahead of the link, so that other
host<->device copies are not stuck behind a whole step.

On a CPU device the same code runs without streams or events, one piece after another: that is how the
tests compare it with the host path and with ``torch.optim.AdamW``.

Example (a CPU device; on a GPU the same loop is asynchronous and :meth:`StagedUpdate.end` gives its event)::

    >>> import torch
    >>> host = torch.arange(10.)
    >>> pl = StagedUpdate("cpu")
    >>> for k, (lo, hi) in pl.pieces([(0, 4), (4, 8), (8, 10)]):
    ...     buf = pl.buffer(k, "x", 4)[:hi - lo]
    ...     with pl.loading(k):
    ...         _ = buf.copy_(host[lo:hi])
    ...     with pl.updating():
    ...         _ = buf.mul_(2)
    ...     with pl.storing(k):
    ...         _ = host[lo:hi].copy_(buf)
    >>> host.tolist()[:5], pl.end() is None
    ([0.0, 2.0, 4.0, 6.0, 8.0], True)
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")


def device_with_index(device) -> torch.device:
    """``device`` with its index ("cuda" and "cuda:0" compare unequal)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def stream_ctx(stream):
    """``torch.cuda.stream(stream)``, or nothing for ``None`` (a CPU device)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class BackgroundStep:
    """A step whose pieces a worker thread is still issuing; ``event()`` joins it (re-raising its error)
    and returns what the issuing function returned (the step's end event).

    >>> BackgroundStep(lambda: 42).event()
    42
    """

    def __init__(self, fn, name: str = "maximus-staged-step"):
        self._result = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by event()
            self._error = e

    def event(self) -> Optional[torch.cuda.Event]:
        self._thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result


class StagedUpdate:
    """Streams and two staging sets of one update device (see module docstring); buffers are made on first
    use, kept between steps and grown when a piece needs more.

    One step is one pass of :meth:`pieces`; per piece, :meth:`loading`, :meth:`updating` and :meth:`storing`
    are entered in that order (each makes its stream wait for the phase before it). :meth:`end` gives the
    event that follows the step's last copy out.
    """

    THROTTLE_PIECES = 2  # pieces of copies a throttled step keeps queued ahead of the link

    def __init__(self, device):
        self.device = device_with_index(device)
        cuda = self.device.type == "cuda"
        self.cuda = cuda
        self.load = torch.cuda.Stream(device=self.device) if cuda else None    # host -> device
        self.update = torch.cuda.Stream(device=self.device) if cuda else None  # updates off the current stream
        self.store = torch.cuda.Stream(device=self.device) if cuda else None   # device -> host
        self.sets: List[Dict[str, torch.Tensor]] = [{}, {}]
        self.freed: List[Optional[torch.cuda.Event]] = [None, None]  # per set: after its copies out
        self._loads: List[torch.cuda.Event] = []   # this step's load events, in piece order
        self._loaded: Optional[torch.cuda.Event] = None
        self._updated: Optional[torch.cuda.Event] = None

    # -- staging buffers --------------------------------------------------------------------------
    def buffer(self, k: int, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Set ``k``'s flat buffer ``name``: at least ``numel`` elements of ``dtype`` on the device."""
        b = self.sets[k].get(name)
        if b is None or b.dtype != dtype or b.numel() < numel:
            self.sets[k].pop(name, None)  # the old one is freed before the new one is allocated
            b = self.sets[k][name] = torch.empty(int(numel), dtype=dtype, device=self.device)
        return b

    def device_bytes(self) -> int:
        """Bytes of the staging buffers now held on the device."""
        return sum(b.numel() * b.element_size() for s in self.sets for b in s.values())

    def synchronize(self) -> None:
        """Wait on the host until every copy out queued so far has landed."""
        if self.store is not None:
            self.store.synchronize()

    def release(self, wait: bool = True) -> None:
        """Free the staging buffers (they come back on the next step). ``wait``: on the host, until the copies out
        have landed; else the allocator reuses their memory only once the pipeline's streams are past them."""
        if wait:
            self.synchronize()
        elif self.cuda:
            for s in self.sets:
                for b in s.values():
                    for st in (self.load, self.update, self.store):
                        b.record_stream(st)
        for s in self.sets:
            s.clear()
        self.freed = [None, None]

    # -- one step ---------------------------------------------------------------------------------
    def pieces(self, pieces: Iterable[T], *, after=None, throttle: bool = False) -> Iterator[Tuple[int, T]]:
        """``(set, piece)`` for every piece of a step, the sets alternating. ``after``: an event or a stream the
        first load waits for (the gradients' copies or kernels). ``throttle``: before piece ``i`` is issued, the
        host waits until piece ``i - 2`` is loaded (at most two pieces of copies queued on the copy engine)."""
        self._loads = []
        if after is not None and self.load is not None:
            if isinstance(after, torch.cuda.Stream):
                self.load.wait_stream(after)
            else:
                self.load.wait_event(after)
        for i, piece in enumerate(pieces):
            if throttle and len(self._loads) >= self.THROTTLE_PIECES:
                self._loads[-self.THROTTLE_PIECES].synchronize()
            yield i % 2, piece

    @contextlib.contextmanager
    def loading(self, k: int):
        """The piece's host -> device copies into set ``k``, on the load stream, once the set is free."""
        if self.load is not None and self.freed[k] is not None:
            self.load.wait_event(self.freed[k])  # the set's previous piece has left the device
        with stream_ctx(self.load):
            yield self.load
        if self.cuda:
            self._loaded = torch.cuda.Event()
            self._loaded.record(self.load)
            self._loads.append(self._loaded)

    @contextlib.contextmanager
    def updating(self, stream=None):
        """The piece's update, on ``stream`` (default: the current stream), after its load."""
        if self.cuda:
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            stream.wait_event(self._loaded)
        with stream_ctx(stream):
            yield stream
        if self.cuda:
            self._updated = torch.cuda.Event()
            self._updated.record(stream)

    @contextlib.contextmanager
    def storing(self, k: int):
        """The piece's device -> host copies out of set ``k``, on the store stream, after its update; the set's
        ``freed`` event follows them."""
        if self.store is not None:
            self.store.wait_event(self._updated)
        with stream_ctx(self.store):
            yield self.store
        if self.cuda:
            self.freed[k] = torch.cuda.Event()
            self.freed[k].record(self.store)

    def end(self, enable_timing: bool = False) -> Optional[torch.cuda.Event]:
        """An event after every copy out queued so far (``None`` on a CPU device: the step is done)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=enable_timing)
        ev.record(self.store)
        return ev
