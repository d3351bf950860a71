"""``linear_cross_entropy``: ``F.cross_entropy(softcap(hidden @ weight.T), labels)`` without the logits.

The algorithm (resident weight, 3 GEMMs)
-----------------------------------------
The gradient of a token's loss needs that token's log-sum-exp over the *whole* vocabulary. Walking
the vocabulary once in chunks for all tokens (online log-sum-exp) and again in backward costs 4
GEMMs (logits twice). Instead the tokens are cut into blocks of ``T`` tokens; for each block:

1. ``buf[T, V] = h_b @ W.T`` (GEMM 1, one large cuBLAS call, compute dtype);
2. walking ``buf`` in ``chunk_rows``-wide vocab tiles: online log-sum-exp, the label's logit and the
   row sum (label smoothing), all in fp32 -> the block's per-token losses;
3. again per tile, ``buf`` is overwritten in place with ``d loss / d logits`` (fp32 math, stored in
   the compute dtype, scaled by the token's weight: ``1/n_valid`` for mean, ``1`` for sum);
4. ``grad_h[b] = buf @ W`` (GEMM 2, K = V, fp32 accumulation inside cuBLAS) and
   ``grad_W += buf.T @ h_b`` (GEMM 3, accumulated over blocks).

So the gradient is computed in the forward pass (when anything needs a gradient) and backward only
scales it by ``grad_output``, as Liger-Kernel does; ``reduction="none"`` (per-token ``grad_output``)
and fp16 (whose range cannot hold ``softmax / n`` before the loss scale is applied) instead
recompute in backward with ``grad_output`` folded into the token weights (4 GEMMs in all). Tokens whose label is
``ignore_index`` are dropped before any GEMM. Under ``torch.no_grad`` only GEMM 1 runs.

Memory bound (beyond the inputs and the returned gradients ``grad_h [N, d]``, ``grad_W [V, d]``):
``T * V`` elements of the compute dtype for ``buf`` (``T`` from ``block_bytes``, default 512 MiB, or
``token_block``), one gathered ``[T, d]`` token block, fp32 ``[T]`` vectors; the eager tile math adds
two fp32 ``[T, chunk_rows]`` temporaries (none when compiled on CUDA). Ignored tokens are skipped by
gathering each block's valid rows, so no compacted copy of ``hidden`` or ``grad_h`` exists.
``grad_W`` is accumulated over token blocks in the weight's dtype (each block's product in fp32
inside the GEMM, then one rounding per block); ``fp32_weight_grad=True`` accumulates in an fp32
``[V, d]`` buffer instead (``4 V d`` bytes more). For V=262144, d=4096, N=16384 in bf16: buf 512 MiB
(T=1024), grad_W 2 GiB, grad_h 128 MiB: about 2.65 GiB over the inputs, of which the returned gradients
are 2.1 GiB. The default of 512 MiB (T=1024) is faster than 256 MiB (T=512): the grad_W GEMM is twice as
deep and grad_W is re-read half as often (measured: docs/bench/code_history.md).

Why not vocab-outer: a two-pass walk over vocab chunks (forward: log-sum-exp; backward: logits again,
then both gradients) needs 4 GEMMs; computing ``grad_W`` for a vocab chunk needs every token's final
log-sum-exp, so with 3 GEMMs the gradient of a whole token block must be formed at once, hence the
``[T, V]`` buffer and ``grad_W`` accumulated over blocks. Streamed heads (weight not resident, see
``lm_head_stream.py``) use the vocab-outer order so each chunk crosses PCIe once per pass.
``chunk_rows`` is the vocab width of each tile of the element-wise passes here, and the unit of
streaming there.

Notes: the loss is returned in fp32. An all-ignored batch gives loss 0 and zero gradients
(``F.cross_entropy`` would give NaN for ``mean``). Labels outside ``[0, V)`` that are not
``ignore_index`` raise ``IndexError``.

Example::

    >>> import torch
    >>> from ds_maximus.vocab import linear_cross_entropy
    >>> h = torch.randn(6, 8, requires_grad=True); w = torch.randn(50, 8, requires_grad=True)
    >>> y = torch.tensor([1, 4, -100, 49, 0, 7])
    >>> loss = linear_cross_entropy(h, w, y, chunk_rows=16)
    >>> ref = torch.nn.functional.cross_entropy(h @ w.T, y)
    >>> bool(torch.allclose(loss, ref, rtol=1e-5)); loss.backward()
    True
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ds_maximus.vocab.lm_head_tiles import KERNELS

_REDUCTIONS = ("mean", "sum", "none")
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class LCEOptions:
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    logit_softcap: Optional[float] = None
    chunk_rows: int = 16384          # vocab rows per tile (and per streamed chunk)
    token_block: Optional[int] = None  # tokens per block; None: from block_bytes
    block_bytes: int = 512 * MIB     # budget of the [T, V] (or [T, chunk_rows]) logits buffer
    fp32_weight_grad: bool = False   # accumulate grad_W over token blocks in fp32

    def validate(self) -> "LCEOptions":
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} is not allowed; use one of {_REDUCTIONS}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing={self.label_smoothing} must lie in [0, 1]")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap={self.logit_softcap} must be > 0 (or None for no softcap)")
        if self.chunk_rows < 1 or (self.token_block is not None and self.token_block < 1) or self.block_bytes < 1:
            raise ValueError(f"chunk_rows={self.chunk_rows}, token_block={self.token_block}, "
                             f"block_bytes={self.block_bytes} must be positive")
        return self


def token_block_for(n: int, width: int, elem_bytes: int, opts: LCEOptions) -> int:
    """Tokens per block so that a ``[T, width]`` buffer fits ``opts.block_bytes`` (or ``token_block``)."""
    if opts.token_block is not None:
        return max(1, min(n, opts.token_block))
    t = max(1, opts.block_bytes // max(1, width * elem_bytes))
    if t >= 256:
        t = t // 128 * 128  # GEMM-friendly
    return max(1, min(n, t))


def compute_dtype(hidden: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    """The GEMM dtype: autocast's when autocast is on, else the weight's."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight_dtype


def prepare(hidden: torch.Tensor, labels: torch.Tensor, vocab_size: int, opts: LCEOptions):
    """Flatten, validate labels, drop ignored tokens.

    Returns ``(h [N, d], valid_idx [n] or None when all N are valid, y [n], n)``; one host sync.
    """
    d = hidden.shape[-1]
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])} (hidden is {tuple(hidden.shape)})")
    h = hidden.reshape(-1, d)
    y = labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    valid = y != opts.ignore_index
    bad = valid & ((y < 0) | (y >= vocab_size))
    n_valid, n_bad = torch.stack([valid.sum(), bad.sum()]).tolist()
    if n_bad:
        first = int(y[bad][0])
        raise IndexError(f"label {first} is out of range for a vocabulary of {vocab_size} rows "
                         f"({n_bad} such labels); labels must lie in [0, {vocab_size}) or equal "
                         f"ignore_index={opts.ignore_index}")
    if n_valid == h.shape[0]:
        return h, None, y, n_valid
    idx = valid.nonzero().squeeze(1)
    return h, idx, y.index_select(0, idx), n_valid


def token_losses(m, l, tgt, ssum, vocab_size: int, opts: LCEOptions):
    """Per-token loss from the merged statistics; also returns the log-sum-exp."""
    lse = m + torch.log(l)
    eps = opts.label_smoothing
    loss = lse - (1.0 - eps) * tgt
    if eps:
        loss = loss - (eps / vocab_size) * ssum
    return loss, lse


def reduce_loss(loss_tok, n_total: int, valid_idx, labels_shape, opts: LCEOptions):
    n = loss_tok.shape[0]
    if opts.reduction == "none":
        if valid_idx is None:
            return loss_tok.view(labels_shape)
        out = loss_tok.new_zeros(n_total)
        return out.index_copy_(0, valid_idx, loss_tok).view(labels_shape)
    total = loss_tok.sum()
    return total / n if (opts.reduction == "mean" and n) else total


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 (fp64 for fp64) result, without fp32 copies of the inputs where cuBLAS allows."""
    if a.dtype in (torch.float32, torch.float64):
        return torch.mm(a, b)
    if a.is_cuda and _OUT_DTYPE_OK.get(a.device.type, True):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except Exception:
            _OUT_DTYPE_OK[a.device.type] = False
    return torch.mm(a, b).float()


_OUT_DTYPE_OK: dict = {}


def _acc_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool, chunk_rows: int):
    """``acc (=|+=) a @ b``; ``acc`` may be fp32 while a, b are half precision (then per row chunk)."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    for lo in range(0, acc.shape[0], chunk_rows):
        hi = min(acc.shape[0], lo + chunk_rows)
        part = mm_f32(a[lo:hi], b)
        if first:
            acc[lo:hi].copy_(part)
        else:
            acc[lo:hi].add_(part)


def block_pass(h_all, idx, w, y, row_w, opts: LCEOptions, need_gh: bool, need_gw: bool, gw_dtype: torch.dtype):
    """The resident 3-GEMM algorithm (see the module docstring) over the valid tokens only.

    ``h_all [N, d]`` (any float dtype), ``idx [n]`` the rows of the valid tokens (None: all N),
    ``w [V, d]`` in the compute dtype, ``y [n]`` their labels, ``row_w [n]`` per-token gradient
    weights or None (loss only). Each token block is gathered (and cast) on its own, and its
    ``grad_h`` rows are written straight to their places, so no compacted copy of ``hidden`` or of
    ``grad_h`` exists. Returns ``(loss_tok [n], grad_h [N, d] in the compute dtype, grad_w [V, d])``.
    """
    n = y.shape[0]
    d = h_all.shape[1]
    vocab = w.shape[0]
    cdtype = w.dtype
    rows = min(opts.chunk_rows, vocab)
    tb = token_block_for(n, vocab, w.element_size(), opts)
    dev = w.device
    eps = opts.label_smoothing
    buf = torch.empty(tb, vocab, dtype=cdtype, device=dev)
    acc = stat_dtype(cdtype)
    loss = torch.empty(n, dtype=acc, device=dev)
    grads = row_w is not None
    gh = None
    if grads and need_gh:
        gh = (torch.empty if idx is None else torch.zeros)(h_all.shape[0], d, dtype=cdtype, device=dev)
    gw = torch.empty(vocab, d, dtype=gw_dtype, device=dev) if grads and need_gw else None
    for b0 in range(0, n, tb):
        b1 = min(n, b0 + tb)
        rows_b = None if idx is None else idx[b0:b1]
        hb = (h_all[b0:b1] if rows_b is None else h_all.index_select(0, rows_b)).to(cdtype)
        yb, zb = y[b0:b1], buf[: b1 - b0]
        torch.mm(hb, w.t(), out=zb)                                   # GEMM 1
        m = torch.full((b1 - b0,), -math.inf, dtype=acc, device=dev)
        l = torch.zeros_like(m)
        tgt = torch.zeros_like(m)
        ssum = torch.zeros_like(m) if eps else None
        for lo in range(0, vocab, rows):
            hi = min(vocab, lo + rows)
            KERNELS.stats_(zb[:, lo:hi], yb - lo, opts.logit_softcap, m, l, tgt, ssum)
        loss_b, lse = token_losses(m, l, tgt, ssum, vocab, opts)
        loss[b0:b1] = loss_b
        if not grads:
            continue
        wb = row_w[b0:b1]
        for lo in range(0, vocab, rows):
            hi = min(vocab, lo + rows)
            KERNELS.grad_(zb[:, lo:hi], yb - lo, lse, wb, opts.logit_softcap, eps / vocab, 1.0 - eps)
        if gh is not None:                                            # GEMM 2
            if rows_b is None:
                torch.mm(zb, w, out=gh[b0:b1])
            else:
                gh.index_copy_(0, rows_b, torch.mm(zb, w))
        if gw is not None:
            _acc_mm_(gw, zb.t(), hb, first=(b0 == 0), chunk_rows=rows)  # GEMM 3
    return loss, gh, gw


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the tile statistics and losses: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_weights(n: int, opts: LCEOptions, dev, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n,), 1.0 / n if opts.reduction == "mean" else 1.0, dtype=dtype, device=dev)


def scatter_rows(g: torch.Tensor, valid_idx, n_total: int) -> torch.Tensor:
    if valid_idx is None:
        return g
    return g.new_zeros(n_total, g.shape[1]).index_copy_(0, valid_idx, g)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, opts: LCEOptions, cdtype: torch.dtype):
        vocab = weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, valid_idx, y, n = prepare(hidden, labels, vocab, opts)
            w = weight.to(cdtype)
            need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            ctx.meta = (hidden.shape, hidden.dtype, weight.dtype, h_all.shape[0], n, cdtype)
            ctx.stored = None
            gw_dtype = torch.float32 if (opts.fp32_weight_grad or weight.dtype == torch.float32) else cdtype
            if n == 0:
                loss_tok = torch.zeros(0, dtype=stat_dtype(cdtype), device=hidden.device)
                ctx.stored = (None, None)
            elif (need_gh or need_gw) and opts.reduction != "none" and cdtype != torch.float16:
                row_w = row_weights(n, opts, hidden.device, stat_dtype(cdtype))
                loss_tok, gh, gw = block_pass(h_all, valid_idx, w, y, row_w, opts, need_gh, need_gw, gw_dtype)
                ctx.stored = (gh, gw)
            else:
                loss_tok, _, _ = block_pass(h_all, valid_idx, w, y, None, opts, False, False, gw_dtype)
            if ctx.stored is None:
                ctx.save_for_backward(hidden, weight)
                ctx.y, ctx.valid_idx, ctx.opts, ctx.gw_dtype = y, valid_idx, opts, gw_dtype
            else:
                ctx.valid_idx = valid_idx
            return reduce_loss(loss_tok, h_all.shape[0], valid_idx, labels.shape, opts)

    @staticmethod
    def backward(ctx, grad_out):
        hshape, hdtype, wdtype, n_total, n, cdtype = ctx.meta
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.stored is not None:
                gh, gw = ctx.stored
                ctx.stored = None
                go = grad_out.to(stat_dtype(cdtype))
            else:  # recompute with grad_output folded into the token weights ("none", and fp16)
                hidden, weight = ctx.saved_tensors
                h_all = hidden.reshape(-1, hshape[-1])
                if ctx.opts.reduction == "none":
                    go_tok = grad_out.reshape(-1).to(stat_dtype(cdtype))
                    row_w = go_tok if ctx.valid_idx is None else go_tok.index_select(0, ctx.valid_idx)
                else:
                    row_w = row_weights(n, ctx.opts, grad_out.device, stat_dtype(cdtype)) * grad_out.to(
                        stat_dtype(cdtype))
                _, gh, gw = block_pass(h_all, ctx.valid_idx, weight.to(cdtype), ctx.y, row_w.contiguous(), ctx.opts,
                                       need_gh, need_gw, ctx.gw_dtype)
                go = None
            grad_h = grad_w = None
            if need_gh:
                if gh is None:
                    grad_h = torch.zeros(hshape, dtype=hdtype, device=grad_out.device)
                else:
                    if go is not None:
                        gh.mul_(go.to(gh.dtype))
                    grad_h = gh.view(hshape).to(hdtype)
            if need_gw and gw is not None:
                if go is not None:
                    gw.mul_(go.to(gw.dtype))
                grad_w = gw.to(wdtype)
            elif need_gw:
                grad_w = None  # no valid token: no gradient (autograd treats None as zero)
        return grad_h, grad_w, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         logit_softcap: Optional[float] = None, *, chunk_rows: int = 16384,
                         token_block: Optional[int] = None, block_bytes: int = 512 * MIB,
                         fp32_weight_grad: bool = False) -> torch.Tensor:
    """``F.cross_entropy(softcap(hidden @ weight.T), labels, ...)`` without materialising the logits.

    ``hidden [..., d]``, ``weight [V, d]``, ``labels [...]`` (``ignore_index`` entries are skipped);
    ``softcap(x) = c * tanh(x / c)`` with ``c = logit_softcap``. Returns an fp32 scalar (``mean``,
    ``sum``) or fp32 losses shaped like ``labels`` (``none``). See the module docstring for the
    algorithm, the memory bound, and what ``chunk_rows``, ``token_block`` and ``block_bytes`` do.
    """
    opts = LCEOptions(ignore_index, reduction, float(label_smoothing),
                      None if logit_softcap is None else float(logit_softcap), int(chunk_rows), token_block,
                      int(block_bytes), bool(fp32_weight_grad)).validate()
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [V, d] with d = hidden.shape[-1]; got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    cdtype = compute_dtype(hidden, weight.dtype)
    return _LinearCrossEntropy.apply(hidden, weight, labels, opts, cdtype)


def linear_cross_entropy_reference(hidden, weight, labels, ignore_index=-100, reduction="mean",
                                   label_smoothing=0.0, logit_softcap=None) -> torch.Tensor:
    """The plain-PyTorch reference (materialises the logits; fp32 loss)."""
    logits = hidden @ weight.T
    logits = logits.to(stat_dtype(logits.dtype))
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing).reshape(
        labels.shape if reduction == "none" else ())
