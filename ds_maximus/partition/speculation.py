"""Speculation of a partition cache: prefetch jobs and staged guesses.

A guess of which entries a consumer will need next (the next MoE layer's router applied to this layer's
input) should cost little when it is wrong. Two pieces make that so, for any entry kind:

* :class:`PrefetchJob`: a speculative load of which only a head of ``chunk`` elements is queued at once
  (sized to the link's idle gap before the real demand is known); the transfer engine queues the rest
  when the guess is confirmed (``finish``) and never when it is dropped (:func:`cancel`).
* :class:`StagedGuess`: the head of a guess goes into one staging buffer on the device instead of a cache
  slot, so a guess evicts nothing; a right guess copies the head on the device and moves only the rest.

    >>> import torch
    >>> job = PrefetchJob(torch.zeros(4), torch.ones(4), None, chunk=1)
    >>> job.claim(), job.unqueued_bytes()
    ((0, 1), 12)
    >>> cancel(job), job.claim()   # a wrong guess: the rest is never queued
    (False, None)
"""
from __future__ import annotations

import threading
from typing import Optional, Tuple

import torch


class PrefetchJob:
    """One speculative load: a head of ``chunk`` elements first, the rest on ``finish`` (state guarded by
    ``lock``)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, after, chunk: int):
        self.dst, self.src = dst.view(-1), src.view(-1)
        self.after = after
        self.n = self.dst.numel()
        self.chunk = max(1, int(chunk))
        self.next = 0                 # first element not yet queued
        self.cancelled = False
        self.final = None             # set when the last chunk is queued: its event (CUDA) or True (CPU)
        self.landed = threading.Event()  # CPU engine: the last chunk has been copied
        self.lock = threading.Lock()

    def claim(self, rest: bool = False) -> Optional[tuple]:
        """The next range to queue (all that is left with ``rest``), or None when stopped or done."""
        if self.cancelled or self.final is not None or self.next >= self.n:
            return None
        a = self.next
        self.next = self.n if rest else min(self.n, a + self.chunk)
        return a, self.next

    def unqueued_bytes(self) -> int:
        return (self.n - self.next) * self.dst.element_size()


def cancel(job) -> bool:
    """Drop the unqueued rest of ``job``; True when it was already fully queued (it will land whole)."""
    if not isinstance(job, PrefetchJob):
        return True  # a plain load cannot be stopped
    with job.lock:
        if job.final is not None:
            return True
        job.cancelled = True
        return False


class StagedGuess:
    """The one staged guess of a cache: the head of entry ``key`` in a device buffer of ``chunk_bytes``.

    ``begin`` replaces an unresolved guess (counted as cancelled), ``take`` hands the guess over when
    the demand asks for it, ``drop`` forgets it. ``event`` is the buffer's last copy (a load that reads
    the head, or the next head, queues behind it).

    >>> g = StagedGuess(chunk_bytes=8, numel=4, dtype=torch.float32, device="cpu")
    >>> _ = g.begin((0, 3)); g.key, g.nbytes
    ((0, 3), 8)
    >>> g.take((0, 3)), g.key, g.cancelled
    (True, None, 0)
    """

    def __init__(self, chunk_bytes: int, numel: int, dtype: torch.dtype, device):
        self.chunk_bytes = int(chunk_bytes)
        self.numel, self.dtype, self.device = int(numel), dtype, torch.device(device)
        self.buffer: Optional[torch.Tensor] = None  # allocated on first use
        self.event = None
        self.key: Optional[Tuple[int, int]] = None  # (group, id) whose head is staged
        self.cancelled = 0                          # guesses dropped unused

    @property
    def nbytes(self) -> int:
        """Bytes of the staging buffer (0 before the first guess)."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def begin(self, key: Tuple[int, int]) -> torch.Tensor:
        """Make ``key`` the staged guess (dropping the one before); returns the buffer to load its head into."""
        if self.buffer is None:
            n = min(self.numel, max(1, self.chunk_bytes // self.dtype.itemsize))
            self.buffer = torch.empty(n, dtype=self.dtype, device=self.device)
        self.drop()
        self.key = key
        return self.buffer

    def drop(self) -> None:
        if self.key is not None:
            self.key = None
            self.cancelled += 1

    def take(self, key: Tuple[int, int]) -> bool:
        """True (and the guess resolved) when ``key`` is the staged guess."""
        if self.key != key:
            return False
        self.key = None
        return True
