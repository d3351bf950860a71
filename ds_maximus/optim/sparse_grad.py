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
    """Coalesced row-sparse gradient: sorted unique ``ids`` (CPU) and ``rows`` ([U, d] fp32, any device)."""

    def __init__(self):
        self.ids: Optional[Tensor] = None
        self.rows: Optional[Tensor] = None

    def __bool__(self) -> bool:
        return self.ids is not None and self.ids.numel() > 0

    def add(self, ids: Tensor, rows: Tensor) -> None:
        """Add ``rows`` for unique ``ids`` (CPU LongTensor); duplicates with earlier adds are summed."""
        from ds_maximus.ops import row_ops as ops
        ids = ids.to("cpu", torch.long)
        rows = rows.float()
        if self.ids is None:
            a = ids.numpy()  # numpy: the torch comparison and reduction cost ~40 us a step on the host
            if a.size > 1 and not (a[1:] > a[:-1]).all():
                order = torch.argsort(ids)
                ids, rows = ids.index_select(0, order), rows.index_select(0, order.to(rows.device))
            self.ids, self.rows = ids, rows
            return
        rows = rows.to(self.rows.device)
        cat_ids = torch.cat([self.ids, ids])
        uniq, inverse = torch.unique(cat_ids, sorted=True, return_inverse=True)
        if uniq.numel() == cat_ids.numel():
            order = torch.argsort(cat_ids)
            self.ids = cat_ids[order]
            self.rows = torch.cat([self.rows, rows]).index_select(0, order.to(rows.device))
        else:
            self.rows = ops.segment_reduce(torch.cat([self.rows, rows]), inverse.to(rows.device), uniq.numel())
            self.ids = uniq

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
        self.ids, self.rows = None, None
