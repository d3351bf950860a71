"""``SparseRowGrad``: a row-sparse gradient accumulated across micro-batches (unique ids + fp32 rows).

>>> import torch
>>> g = SparseRowGrad()
>>> g.add(torch.tensor([1, 4]), torch.ones(2, 3))
>>> g.add(torch.tensor([4]), torch.ones(1, 3))
>>> g.ids.tolist(), g.rows[:, 0].tolist()
([1, 4], [1.0, 2.0])
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class SparseRowGrad:
    """Coalesced row-sparse gradient: sorted unique ``ids`` (CPU) and ``rows`` ([U, d] fp32, any device).

    Two adds cost no reallocation of what is held: rows for ids past the last one held (a tied head's gradient,
    chunk after chunk of the vocabulary) wait as pieces joined once when read, and rows for ids already held
    (the lookup's gradient on top of a tied head's) are added in place.

    ``keep_buffer``: the memory of the joined rows is kept after :meth:`clear` and the next adds are copied straight
    into it, so a gradient of the same size costs no new allocation (a tied head's ``[V, d]`` fp32 gradient: under a
    capped allocator with expandable segments, mapping it anew took tens of ms of host time a step).
    """

    def __init__(self, keep_buffer: bool = False):
        self._ids: Optional[Tensor] = None
        self._rows: Optional[Tensor] = None
        self._tail: list = []   # (ids, rows) past the last id held, in order: joined once, when read
        self.keep_buffer = keep_buffer
        self._buf: Optional[Tensor] = None   # the kept memory (keep_buffer)
        self._buf_end: Optional[int] = None  # rows held and tail pieces lie in order in _buf[:_buf_end]
        self._read_events: list = []         # (rows read up to, event): side-stream reads of _buf (read_on)

    @property
    def ids(self) -> Optional[Tensor]:
        self._join_tail()
        return self._ids

    @ids.setter
    def ids(self, value: Optional[Tensor]) -> None:
        self._join_tail()
        self._ids = value

    @property
    def rows(self) -> Optional[Tensor]:
        self._join_tail()
        return self._rows

    @rows.setter
    def rows(self, value: Optional[Tensor]) -> None:
        self._join_tail()
        self._rows, self._buf_end = value, None

    def __bool__(self) -> bool:
        return (self._ids is not None and self._ids.numel() > 0) or bool(self._tail)

    def read_on(self, stream, upto: Optional[int] = None) -> None:
        """``rows`` (with ``upto``: rows ``[:upto]``) are read by the work queued so far on CUDA ``stream``, which runs
        on after the caller moves on: the kept memory is not written again before that read has run (the writer's
        stream waits for it, no host wait). Calls come in the order of the reads on one stream, ``upto`` increasing,
        so a write of rows ``[at, at + n)`` waits only for the first read that covers them: the next step's first
        rows are written while the last step still reads its last ones."""
        if self._buf is not None and stream is not None:
            self._read_events.append((self._buf.shape[0] if upto is None else int(upto), stream.record_event()))

    def _buf_rows(self, at: int, n: int, like: Tensor) -> Optional[Tensor]:
        """``_buf[at:at + n]`` for rows shaped, typed and placed as ``like``, ready to be written (its last reader's
        stream waited for), or None where the kept memory does not take them."""
        buf = self._buf
        if (buf is None or buf.device != like.device or buf.dtype != like.dtype or buf.shape[1:] != like.shape[1:]
                or at + n > buf.shape[0]):
            return None
        if self._read_events:   # the first read covering the rows (or the last read): the ones before it ran earlier
            k = next((i for i, (upto, _) in enumerate(self._read_events) if upto >= at + n), len(self._read_events) - 1)
            torch.cuda.current_stream(buf.device).wait_event(self._read_events[k][1])
            del self._read_events[:k + 1]
        return buf[at:at + n]

    def _into_buf(self, rows: Tensor, at: int) -> Optional[Tensor]:
        """``rows`` copied to ``_buf[at:]`` (a view), or None where the kept memory does not take them."""
        view = self._buf_rows(at, rows.shape[0], rows)
        if view is not None:
            view.copy_(rows)
        return view

    def _join_tail(self) -> None:
        if not self._tail:
            return
        dev = self._rows.device
        ids = torch.cat([self._ids] + [i for i, _ in self._tail])
        parts, self._tail = [self._rows] + [r for _, r in self._tail], []
        if self._buf_end is not None:  # every piece already lies in order in the kept memory
            self._ids, self._rows = ids, self._buf[:self._buf_end]
            return
        rows = self._buf_rows(0, ids.numel(), self._rows)
        if rows is None:
            rows = torch.empty((ids.numel(), *self._rows.shape[1:]), dtype=self._rows.dtype, device=dev)
            if self.keep_buffer:
                self._buf = rows
        self._rows, lo = None, 0
        while parts:                  # each piece dropped once copied: the peak is the result plus what is left
            r = parts.pop(0)
            if r.data_ptr() != rows[lo:].data_ptr():  # a piece of the kept memory already in place stays
                rows[lo:lo + r.shape[0]].copy_(r)
            lo += r.shape[0]
        kept = self._buf is not None and rows.data_ptr() == self._buf.data_ptr()
        self._ids, self._rows, self._buf_end = ids, rows, rows.shape[0] if kept else None

    def add(self, ids: Tensor, rows: Tensor) -> None:
        """Add ``rows`` for unique ``ids`` (CPU LongTensor); duplicates with earlier adds are summed."""
        from ds_maximus.ops import row_ops as ops
        from ds_maximus.ops import to_device
        ids = ids.to("cpu", torch.long)
        rows = rows.float().contiguous()  # a broadcast gradient (of a sum) has one element for many: later adds write
        a = ids.numpy()  # numpy: the torch comparison and reduction cost ~40 us a step on the host
        ascending = a.size <= 1 or bool((a[1:] > a[:-1]).all())
        if self._ids is None:
            if not ascending:
                order = torch.argsort(ids)
                ids, rows = ids.index_select(0, order), rows.index_select(0, to_device(order, rows.device))
            kept = self._into_buf(rows, 0) if self.keep_buffer else None
            self._ids, self._rows = ids, rows if kept is None else kept
            self._buf_end = None if kept is None else kept.shape[0]
            return
        if not a.size:
            return
        last = self._tail[-1][0] if self._tail else self._ids
        if ascending and last.numel() and a[0] > int(last[-1]):
            rows = rows.to(self._rows.device)
            kept = self._into_buf(rows, self._buf_end) if self._buf_end is not None else None
            if kept is None:
                self._buf_end = None
            else:
                rows, self._buf_end = kept, self._buf_end + kept.shape[0]
            self._tail.append((ids, rows))
            return
        self._join_tail()
        rows = rows.to(self._rows.device)
        n = self._ids.numel()
        if n:
            pos = torch.searchsorted(self._ids, ids)
            if bool((pos < n).all()) and torch.equal(self._ids[pos], ids):   # every id held: add in place
                self._rows.index_add_(0, to_device(pos, rows.device), rows)  # pinned: no host wait
                return
        cat_ids = torch.cat([self._ids, ids])
        uniq, inverse = torch.unique(cat_ids, sorted=True, return_inverse=True)
        if uniq.numel() == cat_ids.numel():
            order = torch.argsort(cat_ids)
            self._ids = cat_ids[order]
            self._rows = torch.cat([self._rows, rows]).index_select(0, to_device(order, rows.device))
        else:
            self._rows = ops.segment_reduce(torch.cat([self._rows, rows]), to_device(inverse, rows.device),
                                            uniq.numel())
            self._ids = uniq
        self._buf_end = None

    def norm_sq(self, device=None) -> Tensor:
        if not self:
            return torch.zeros((), dtype=torch.float32, device=device)
        r = self.rows
        return torch.dot(r.flatten(), r.flatten())

    def scale_(self, factor: float) -> None:
        if self:
            self.rows.mul_(factor)

    def finite(self) -> bool:
        return not self or bool(torch.isfinite(self.rows).all())

    def clear(self) -> None:
        """Drop the gradient (the kept memory stays, for the next one)."""
        self._ids, self._rows, self._tail, self._buf_end = None, None, [], None
