"""``ShardedEmbedding.weight``: the table as a tensor for code written for ``nn.Embedding``, built as far as it is read.

No Parameter holds a swapped table, yet model code reads ``embed_tokens.weight``: Llama-4's forward moves the ids to
its ``.device`` on every call, Gemma-4's multimodal forward takes the pad row ``weight[pad_id, :]`` on every call.
Building the whole ``[V, d]`` table for that (262,144 x 2,560 for Gemma-4) would put a dense table on the device
each forward, and its gradient would touch every row, so the sparse step would become a dense one.

:class:`TableView` is a tensor with the table's shape, dtype and device that holds one element (a zero expanded to
``[V, d]``); under ``__torch_function__``:

- its metadata (``.device``, ``.dtype``, ``.shape``, ``.requires_grad``, ...) answers from that, building nothing;
- indexing a few rows (``w[i]``, ``w[i, :]``, ``w[ids]`` for up to :data:`ROW_READ_MAX` ids) reads only those rows,
  and under grad mode their gradient goes to those rows (the padding row's included: indexing a weight is not a
  lookup, whose ``padding_idx`` rule stops it);
- anything else (a matmul, ``.t()``, a reduction, printing) gets the whole table
  (:meth:`ShardedEmbedding.compute_weight`, differentiable into the rows) in its place;
- a write (``w[ids] = rows``, ``w.data[...] = ...``, ``w.normal_()``, ``nn.init.*``) raises a ``TypeError``: it would
  go to a copy of the table and be lost. ``.data`` is the view itself, so a write through it raises too.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

#: the most ids a row read fetches one by one; more take the whole table
ROW_READ_MAX = 256

_META = {
    Tensor.device.__get__, Tensor.dtype.__get__, Tensor.shape.__get__, Tensor.ndim.__get__, Tensor.is_cuda.__get__,
    Tensor.requires_grad.__get__, Tensor.layout.__get__, Tensor.is_leaf.__get__, Tensor.grad.__get__,
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.element_size, Tensor.__len__, Tensor.is_floating_point,
    Tensor.get_device, Tensor.is_complex,
}


class _Rows(torch.autograd.Function):
    """Rows ``ids`` of a ``ShardedEmbedding`` as they are now; the gradient goes to those rows (``add_head_grad_``)."""

    @staticmethod
    def forward(ctx, anchor, emb, ids, device, dtype):
        ctx.emb, ctx.ids = emb, ids
        ctx.anchor = (anchor.device, anchor.dtype)
        return _fetch(emb, ids, device, dtype)

    @staticmethod
    def backward(ctx, grad):
        adev, adtype = ctx.anchor
        anchor_grad = torch.zeros((), dtype=adtype, device=adev) if ctx.needs_input_grad[0] else None
        if grad is not None:
            uniq, inverse = torch.unique(ctx.ids, sorted=True, return_inverse=True)
            rows = torch.zeros(uniq.numel(), grad.shape[-1], dtype=torch.float32, device=grad.device)
            rows.index_add_(0, inverse.to(grad.device), grad.float())
            ctx.emb.add_head_grad_(uniq, rows)
        return anchor_grad, None, None, None, None


def _fetch(emb, ids: Tensor, device, dtype) -> Tensor:
    return torch.cat([emb.rows_for_compute(i, i + 1, device, dtype) for i in ids.tolist()])


def sharded_rows(emb, ids: Tensor) -> Tensor:
    """Rows ``ids`` of a ``ShardedEmbedding`` on its compute device in its output dtype; under grad mode their
    gradient goes to those rows (``ShardedEmbedding.read_rows``)."""
    if torch.is_grad_enabled():
        anchor = emb._anchor_fn() if emb._anchor_fn is not None else emb._anchor
        return _Rows.apply(anchor, emb, ids, emb.compute_device, emb.out_dtype)
    return _fetch(emb, ids, emb.compute_device, emb.out_dtype)


class WeightView:
    """``module.weight`` as a :class:`TableView` for a maximus table module, which provides ``num_embeddings``,
    ``embedding_dim``, ``out_dtype``, ``compute_device``, ``read_rows(ids)`` and ``compute_weight()``. A mixin placed
    before ``nn.Module``: no Parameter holds the table, and code written for ``nn.Embedding`` reads ``.weight``
    (Llama-4's forward moves the ids to its ``.device``; Gemma-4's multimodal forward reads the pad row)."""

    def __getattr__(self, name: str):
        if name == "weight":  # the table's metadata and the rows it indexes, building only what is read
            return TableView(self)
        return super().__getattr__(name)


class TableView(Tensor):
    """See the module docstring. ``TableView(emb)``: a view of ``emb``'s whole table."""

    @staticmethod
    def __new__(cls, emb):
        base = torch.zeros((), dtype=emb.out_dtype, device=emb.compute_device).expand(emb.num_embeddings,
                                                                                      emb.embedding_dim)
        view = Tensor._make_subclass(cls, base, True)   # a trainable table, as nn.Embedding's weight says
        view._emb = emb
        return view

    def __init__(self, emb):
        pass

    def _row_ids(self, index) -> Optional[tuple]:
        """``(ids, squeeze)`` when ``index`` picks a few whole rows, else None."""
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if not all(r is Ellipsis or (isinstance(r, slice) and r == slice(None)) for r in rest):
            return None
        rows = self._emb.num_embeddings
        if isinstance(first, int) or (isinstance(first, Tensor) and first.dim() == 0 and not first.is_floating_point()
                                      and first.dtype != torch.bool):
            i = int(first)
            if not -rows <= i < rows:
                raise IndexError(f"index {i} is out of bounds for dimension 0 with size {rows}")
            return torch.tensor([i % rows]), True
        if isinstance(first, Tensor) and first.dim() == 1 and first.dtype in (torch.long, torch.int32) \
                and 0 < first.numel() <= ROW_READ_MAX:
            ids = first.to("cpu", torch.long)
            if bool(((ids < -rows) | (ids >= rows)).any()):
                raise IndexError(f"an index is out of bounds for dimension 0 with size {rows}")
            return ids % rows, False
        return None

    def _rows(self, index) -> Optional[Tensor]:
        picked = self._row_ids(index)
        if picked is None:
            return None
        ids, squeeze = picked
        out = self._emb.read_rows(ids)
        return out[0] if squeeze else out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func == Tensor.data.__get__:
            return args[0]
        name = getattr(func, "__name__", "")
        if name == "requires_grad_":
            raise TypeError("requires_grad_ on a swapped table's .weight: maximus trains every row of a table it "
                            "swaps; freeze the nn.Embedding before ds_maximus.initialize (it is then left alone)")
        if func is Tensor.__setitem__ or (name.endswith("_") and not name.startswith("__")) or \
                kwargs.get("out") is not None:
            raise TypeError(f"{name or func}: the rows of a swapped table (ShardedEmbedding) live in its tiers, and "
                            "its .weight is a read-only view; a write here would be lost. Set rows before "
                            "ds_maximus.initialize (on the nn.Embedding), or grow the vocabulary with "
                            "ds_maximus's resize (embedding.new_row_init)")
        if func is Tensor.__getitem__ and isinstance(args[0], TableView):
            rows = args[0]._rows(args[1])
            if rows is not None:
                return rows

        def whole(a):
            return a._emb.compute_weight() if isinstance(a, TableView) else a
        return func(*tree_map(whole, args), **tree_map(whole, kwargs))
