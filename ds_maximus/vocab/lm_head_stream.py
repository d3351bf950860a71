"""Streamed linear cross-entropy: the head's rows come from a :class:`ChunkSource`, chunk by chunk.

Used when the weight is not one resident tensor: a CPU-tier head (rows copied to the GPU per chunk,
double-buffered on a side stream) or a head tied to a ``ShardedEmbedding`` (``rows_for_compute``).
Each chunk of ``chunk_rows`` rows is fetched once per pass, so the order is vocab-outer:

* forward: for each chunk, for each token block: logits tile ``[T, chunk_rows]`` (GEMM), online
  log-sum-exp -> per-token loss; keeps the log-sum-exp ``[n]`` for backward;
* backward: for each chunk, for each token block: logits again (GEMM), the tile becomes
  ``d loss / d logits`` (times ``grad_output``), ``grad_h += tile @ W_c`` (fp32 accumulator
  ``[n, d]``) and ``grad_W_c += tile.T @ h_b`` (fp32 ``[chunk_rows, d]``), handed to
  ``source.add_grad_(lo, hi, grad_W_c)`` when the chunk is done.

4 GEMMs in all (the resident path needs 3) and the weight travels twice; the copies overlap the
GEMMs. With ``reuse`` (``lm_head.reuse_rows``) the forward keeps each chunk it fetched, in the compute dtype, and
the backward takes it instead of fetching it again (and frees it): the weight travels once, as in plain PyTorch,
whose backward uses the weight its forward saved. Memory: the tile ``T * chunk_rows`` (``T`` from
``block_bytes``), ``grad_h`` in fp32, one fp32 ``grad_W_c`` chunk in flight plus the source's staging buffers (two
chunks), and with ``reuse`` the kept chunks, freed one by one as the backward goes.

:func:`streamed_logits` is the same walk for a caller that wants the logits themselves (a model computing its
own loss): differentiable, its backward hands each chunk's weight gradient to ``source.add_grad_``.
"""
from __future__ import annotations

import math
from typing import Optional, Protocol

import torch

from ds_maximus.partition.transfer import device_bytes_free
from ds_maximus.vocab.linear_cross_entropy import (
    LCEOptions,
    _acc_mm_,
    mm_f32,
    prepare,
    reduce_loss,
    row_weights,
    scatter_rows,
    stat_dtype,
    token_block_for,
    token_losses,
)
from ds_maximus.vocab.lm_head_tiles import KERNELS


class ChunkSource(Protocol):
    """Where a streamed head's rows come from and where their gradients go."""

    vocab_size: int
    dim: int

    def fetch(self, lo: int, hi: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[lo, hi)`` on ``device`` in ``dtype``, ready for use on the current stream."""

    def prefetch(self, lo: int, hi: int, device: torch.device, dtype: torch.dtype) -> None:
        """A hint: rows ``[lo, hi)`` are fetched next; start their copy now."""

    def add_grad_(self, lo: int, hi: int, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` (fp32, on the compute device) into rows ``[lo, hi)``'s gradient."""

    def version(self) -> int:
        """A number that changes whenever the rows change (the optimizer's step count): rows a forward kept are
        used by its backward only while it is unchanged."""

    def release_rows(self) -> None:
        """The backward has read every row: what the source keeps on the device for the head's passes can go."""


def _chunks(vocab: int, rows: int):
    return [(lo, min(vocab, lo + rows)) for lo in range(0, vocab, rows)]


def _walk(h, source: ChunkSource, opts: LCEOptions, cdtype, fn, kept: Optional[dict] = None, keep: bool = False):
    """Call ``fn(lo, hi, w_c, b0, b1, tile)`` for every (chunk, token block), prefetching the next chunk.

    ``keep``: each fetched chunk is also stored in ``kept`` (the forward). Otherwise a chunk found in ``kept`` is
    taken from it (and dropped from it) instead of fetched (the backward)."""
    n = h.shape[0]
    vocab = source.vocab_size
    rows = min(opts.chunk_rows, vocab)
    tb = token_block_for(n, rows, h.element_size(), opts)
    flat = torch.empty(tb * rows, dtype=cdtype, device=h.device)
    chunks = _chunks(vocab, rows)
    take = kept if kept is not None and not keep else {}
    for i, (lo, hi) in enumerate(chunks):
        if i + 1 < len(chunks) and chunks[i + 1] not in take:
            source.prefetch(*chunks[i + 1], h.device, cdtype)
        w_c = take.pop((lo, hi), None)
        if w_c is None:
            w_c = source.fetch(lo, hi, h.device, cdtype)
            if keep:
                kept[(lo, hi)] = w_c
        for b0 in range(0, n, tb):
            b1 = min(n, b0 + tb)
            tile = flat[: (b1 - b0) * (hi - lo)].view(b1 - b0, hi - lo)
            torch.mm(h[b0:b1], w_c.t(), out=tile)
            fn(lo, hi, w_c, b0, b1, tile)
        yield lo, hi


def streamed_stats(h, y, source: ChunkSource, opts: LCEOptions, cdtype, kept: Optional[dict] = None):
    """Forward pass: per-token ``(loss [n], lse [n])`` with one fetch of every chunk (kept in ``kept``, if given,
    for :func:`streamed_grads`)."""
    n = h.shape[0]
    acc = stat_dtype(cdtype)
    m = torch.full((n,), -math.inf, dtype=acc, device=h.device)
    l = torch.zeros_like(m)
    tgt = torch.zeros_like(m)
    eps = opts.label_smoothing
    ssum = torch.zeros_like(m) if eps else None

    def stats(lo, hi, w_c, b0, b1, tile):
        KERNELS.stats_(tile, y[b0:b1] - lo, opts.logit_softcap, m[b0:b1], l[b0:b1], tgt[b0:b1],
                       None if ssum is None else ssum[b0:b1])

    for _ in _walk(h, source, opts, cdtype, stats, kept, keep=kept is not None):
        pass
    return token_losses(m, l, tgt, ssum, source.vocab_size, opts)


def streamed_grads(h, y, lse, row_w, source: ChunkSource, opts: LCEOptions, cdtype, need_gh: bool,
                   kept: Optional[dict] = None):
    """Backward pass: returns ``grad_h [n, d]`` (fp32, or None) and feeds ``source.add_grad_`` per chunk; chunks
    in ``kept`` (the forward's) are used, and freed, instead of fetched again."""
    n, d = h.shape
    vocab = source.vocab_size
    rows = min(opts.chunk_rows, vocab)
    eps = opts.label_smoothing
    gh = torch.zeros(n, d, dtype=stat_dtype(cdtype), device=h.device) if need_gh else None
    state = {"gw": None, "first": True}

    def grads(lo, hi, w_c, b0, b1, tile):
        KERNELS.grad_(tile, y[b0:b1] - lo, lse[b0:b1], row_w[b0:b1], opts.logit_softcap, eps / vocab, 1.0 - eps)
        if gh is not None:
            gh[b0:b1] += mm_f32(tile, w_c)
        if state["gw"] is None:
            state["gw"] = torch.empty(hi - lo, d, dtype=gh.dtype if gh is not None else stat_dtype(cdtype),
                                      device=h.device)
            state["first"] = True
        _acc_mm_(state["gw"], tile.t(), h[b0:b1], first=state["first"], chunk_rows=rows)
        state["first"] = False

    for lo, hi in _walk(h, source, opts, cdtype, grads, kept):
        if state["gw"] is not None:
            source.add_grad_(lo, hi, state["gw"])
        state["gw"] = None
    source.release_rows()
    return gh


def keeps_rows(reuse: str, source: ChunkSource, n: int, d: int, device: torch.device, cdtype,
               opts: LCEOptions) -> bool:
    """Whether a forward keeps its chunks for the backward (``reuse``: ``on``, ``off`` or ``auto``). ``auto``: on a
    CUDA device whose free memory under the process's cap holds the weight in ``cdtype`` beside the backward's
    buffers (the hidden gradient, a logits tile, a chunk's weight gradient, a chunk in flight) and a margin.
    The backward frees a kept chunk as it adds that chunk's gradient, so keeping never raises the peak the
    backward reaches by itself when the gradient accumulates on the device."""
    reuse = getattr(reuse, "value", reuse)
    if reuse in ("on", "off"):
        return reuse == "on"
    if device.type != "cuda":
        return False
    esz = torch.empty((), dtype=cdtype).element_size()
    rows = min(opts.chunk_rows, source.vocab_size)
    need = source.vocab_size * d * esz
    reserve = n * d * 4 + min(opts.block_bytes, n * rows * esz) + rows * d * (8 + esz) + 256 * 2 ** 20
    return need + reserve <= device_bytes_free(device)


class _StreamedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, anchor, labels, source, opts: LCEOptions, cdtype, reuse="off"):
        kept = None
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, valid_idx, y, n = prepare(hidden, labels, source.vocab_size, opts)
            h = (h_all if valid_idx is None else h_all.index_select(0, valid_idx)).to(cdtype)
            if n == 0:
                loss_tok = torch.zeros(0, dtype=stat_dtype(cdtype), device=hidden.device)
                lse = None
            else:
                if any(ctx.needs_input_grad[:2]) and keeps_rows(reuse, source, n, h.shape[1], h.device, cdtype,
                                                                opts):
                    kept = {}
                loss_tok, lse = streamed_stats(h, y, source, opts, cdtype, kept)
        ctx.kept = None if kept is None else (kept, source.version())
        ctx.source, ctx.opts, ctx.cdtype, ctx.anchor = source, opts, cdtype, (anchor.device, anchor.dtype)
        ctx.meta = (hidden.shape, hidden.dtype, h_all.shape[0], n)
        ctx.y, ctx.valid_idx, ctx.lse = y, valid_idx, lse
        ctx.save_for_backward(hidden)
        return reduce_loss(loss_tok, h_all.shape[0], valid_idx, labels.shape, opts)

    @staticmethod
    def backward(ctx, grad_out):
        hshape, hdtype, n_total, n = ctx.meta
        (hidden,) = ctx.saved_tensors
        opts, cdtype = ctx.opts, ctx.cdtype
        need_gh = ctx.needs_input_grad[0]
        adev, adtype = ctx.anchor
        anchor_grad = torch.zeros((), dtype=adtype, device=adev) if ctx.needs_input_grad[1] else None
        kept, ctx.kept = ctx.kept, None
        if kept is not None:   # the forward's rows, while no step has changed the source since
            kept = kept[0] if kept[1] == ctx.source.version() else None
        if n == 0:
            grad_h = torch.zeros(hshape, dtype=hdtype, device=hidden.device) if need_gh else None
            return grad_h, anchor_grad, None, None, None, None, None
        acc = stat_dtype(cdtype)
        with torch.autocast(grad_out.device.type, enabled=False):
            h_all = hidden.reshape(-1, hshape[-1])
            h = (h_all if ctx.valid_idx is None else h_all.index_select(0, ctx.valid_idx)).to(cdtype)
            if opts.reduction == "none":
                go = grad_out.reshape(-1).to(acc)
                row_w = (go if ctx.valid_idx is None else go.index_select(0, ctx.valid_idx)).contiguous()
            else:
                row_w = row_weights(n, opts, h.device, acc) * grad_out.to(acc)
            gh = streamed_grads(h, ctx.y, ctx.lse, row_w, ctx.source, opts, cdtype, need_gh, kept)
        ctx.lse = None
        grad_h = scatter_rows(gh, ctx.valid_idx, n_total).view(hshape).to(hdtype) if need_gh else None
        return grad_h, anchor_grad, None, None, None, None, None


def streamed_linear_cross_entropy(hidden: torch.Tensor, source: ChunkSource, labels: torch.Tensor,
                                  opts: LCEOptions, anchor: Optional[torch.Tensor] = None,
                                  cdtype: Optional[torch.dtype] = None, reuse: str = "off") -> torch.Tensor:
    """The loss of ``linear_cross_entropy`` with the weight streamed from ``source``.

    ``anchor`` is a requires-grad scalar that makes backward run (and hence the weight gradients
    reach the source) even when ``hidden`` needs no gradient. ``reuse`` (``on``/``off``/``auto``, see
    :func:`keeps_rows`): the backward uses the chunks the forward fetched instead of fetching them again.
    """
    if hidden.shape[-1] != source.dim:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the head's dim {source.dim}")
    if anchor is None:
        anchor = torch.zeros((), requires_grad=True)
    if cdtype is None:
        dev = hidden.device.type
        cdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    return _StreamedLinearCrossEntropy.apply(hidden, anchor, labels, source, opts.validate(), cdtype, reuse)


class _StreamedLogits(torch.autograd.Function):
    """``hidden @ W.T`` with ``W`` streamed from a source, differentiable: the model computes its own loss.

    Forward writes the logits chunk by chunk; backward fetches every chunk again, adds ``g_c @ W_c`` to the
    hidden gradient and hands ``g_c.T @ h`` to ``source.add_grad_``. The memory is the logits' own (the caller
    asked for them) plus one chunk of rows.
    """

    @staticmethod
    def forward(ctx, hidden, anchor, source, chunk_rows, cdtype):
        h = hidden.reshape(-1, hidden.shape[-1]).to(cdtype)
        vocab = source.vocab_size
        out = torch.empty(h.shape[0], vocab, dtype=cdtype, device=hidden.device)
        chunks = _chunks(vocab, min(chunk_rows, vocab))
        for i, (lo, hi) in enumerate(chunks):
            if i + 1 < len(chunks):
                source.prefetch(*chunks[i + 1], hidden.device, cdtype)
            out[:, lo:hi] = torch.mm(h, source.fetch(lo, hi, hidden.device, cdtype).t())
        ctx.source, ctx.chunk_rows, ctx.cdtype = source, chunk_rows, cdtype
        ctx.anchor = (anchor.device, anchor.dtype)
        ctx.save_for_backward(hidden)
        return out.view(*hidden.shape[:-1], vocab)

    @staticmethod
    def backward(ctx, grad_out):
        (hidden,) = ctx.saved_tensors
        source, cdtype = ctx.source, ctx.cdtype
        vocab, d = source.vocab_size, hidden.shape[-1]
        adev, adtype = ctx.anchor
        anchor_grad = torch.zeros((), dtype=adtype, device=adev) if ctx.needs_input_grad[1] else None
        with torch.autocast(grad_out.device.type, enabled=False):
            h = hidden.reshape(-1, d).to(cdtype)
            g = grad_out.reshape(-1, vocab).to(cdtype)
            gh = torch.zeros(h.shape[0], d, dtype=stat_dtype(cdtype), device=h.device) \
                if ctx.needs_input_grad[0] else None
            chunks = _chunks(vocab, min(ctx.chunk_rows, vocab))
            for i, (lo, hi) in enumerate(chunks):
                if i + 1 < len(chunks):
                    source.prefetch(*chunks[i + 1], h.device, cdtype)
                g_c = g[:, lo:hi]
                if gh is not None:
                    gh += mm_f32(g_c, source.fetch(lo, hi, h.device, cdtype))
                source.add_grad_(lo, hi, mm_f32(g_c.t(), h))
        grad_h = gh.view(hidden.shape).to(hidden.dtype) if gh is not None else None
        return grad_h, anchor_grad, None, None, None


class _StreamedWeight(torch.autograd.Function):
    """The whole ``[V, d]`` weight of a source as one tensor, for code that reads ``lm_head.weight`` and computes
    with it itself (TRL's fused LM head, Liger's and Cut CE's losses); its gradient goes to ``source.add_grad_``
    chunk by chunk. It holds the table on the device once, in the compute dtype, as a dense head would."""

    @staticmethod
    def forward(ctx, anchor, source, chunk_rows, device, dtype):
        ctx.source, ctx.chunk_rows = source, chunk_rows
        ctx.anchor = (anchor.device, anchor.dtype)
        return source.fetch(0, source.vocab_size, device, dtype)

    @staticmethod
    def backward(ctx, grad):
        adev, adtype = ctx.anchor
        anchor_grad = torch.zeros((), dtype=adtype, device=adev) if ctx.needs_input_grad[0] else None
        if grad is not None:
            for lo, hi in _chunks(ctx.source.vocab_size, min(ctx.chunk_rows, ctx.source.vocab_size)):
                ctx.source.add_grad_(lo, hi, grad[lo:hi].float())
        return anchor_grad, None, None, None, None


def streamed_weight(source: ChunkSource, chunk_rows: int, anchor: torch.Tensor, device, dtype) -> torch.Tensor:
    """``source``'s whole table on ``device`` in ``dtype``; under grad mode differentiable (gradients to
    ``source.add_grad_``). It is no ZeRO-3 partitioned parameter and says it is gathered (``ds_status``), so a
    caller's gather helper (TRL's ``maybe_gather_lm_head_ctx``) leaves it alone instead of failing."""
    if torch.is_grad_enabled():
        w = _StreamedWeight.apply(anchor, source, int(chunk_rows), torch.device(device), dtype)
    else:
        w = source.fetch(0, source.vocab_size, device, dtype)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    w.ds_status = ZeroParamStatus.AVAILABLE
    return w


def streamed_logits(hidden: torch.Tensor, source: ChunkSource, chunk_rows: int, anchor: torch.Tensor,
                    cdtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Differentiable logits ``hidden @ W.T`` with ``W`` from ``source`` (gradients to ``source.add_grad_``).

    ``anchor`` is a requires-grad scalar that makes backward run even when ``hidden`` needs no gradient.
    """
    if hidden.shape[-1] != source.dim:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the head's dim {source.dim}")
    if cdtype is None:
        dev = hidden.device.type
        cdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    return _StreamedLogits.apply(hidden, anchor, source, int(chunk_rows), cdtype)
