"""Group-wise affine quantization of expert weights: the packed form of the quantized expert tier.

A weight ``W [rows, cols]`` is cut, row by row, into groups of ``group_size`` consecutive columns. Each group
``g`` stores a scale ``s_g`` and an offset ``z_g`` (the weight value that code 0 stands for, the group's
zero point in weight units) and one ``bits``-bit code ``q`` per weight, so that::

    W[r, c] ~= q[r, c] * s_g + z_g          (in fp32, g = (r, c // group_size))

``z_g`` is the group minimum rounded down to fp16 and ``s_g`` the group range over ``2**bits - 1`` rounded up to
fp16, so every weight lies on the grid's span and ``|W - dequantize(quantize(W))| <= s_g / 2`` in each group (up to
fp32 rounding of the dequantization), with no clamping. Scales and offsets are fp16 (4 bytes a group: 0.5 bits a
weight at ``group_size`` 64).

**Packing** (one layout for every width): each run of 8 consecutive codes of a row is one little-endian word of
``8 * bits`` bits stored in ``bits`` bytes, code ``j`` in bits ``[j * bits, (j + 1) * bits)``. So 8 bits is one
byte a code; 4 bits is two a byte (low nibble first); 2 bits is four a byte; 3 bits is 8 codes in 3 bytes. A row
of ``cols`` codes takes ``cols * bits / 8`` bytes, rows are contiguous, and the ``c``-th code of a row starts at
bit ``c * bits`` of it: a kernel finds any group's bytes without a table. ``cols`` must be a multiple of
``group_size``, and ``group_size`` a multiple of 8 (a group is whole bytes).

:func:`dequantize` is the plain-PyTorch reference the C++ (``ops.expert_cpu``) and Triton
(``experts.quant_triton``) kernels are tested against.

>>> import torch
>>> w = torch.linspace(-1, 1, 16).reshape(1, 16)
>>> q = quantize(w, bits=4, group_size=8)
>>> q.packed.shape, q.scales.shape, q.nbytes
(torch.Size([1, 8]), torch.Size([1, 2]), 16)
>>> bool(((dequantize(q) - w).abs() <= q.scales.float().repeat_interleave(8, 1) / 2).all())
True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
from torch import Tensor

#: code widths the tier supports
SUPPORTED_BITS = (8, 4, 3, 2)
#: codes per packed word: a run of 8 codes is ``bits`` whole bytes for every supported width
CODES_PER_WORD = 8
_FP16_MAX = 65504.0


@dataclass
class QuantizedTensor:
    """One quantized weight: ``packed`` codes (uint8 ``[rows, cols * bits / 8]``), fp16 ``scales`` and ``zeros``
    (``[rows, cols / group_size]``), the original ``shape`` and dtype, ``bits`` and ``group_size``."""

    packed: Tensor
    scales: Tensor
    zeros: Tensor
    shape: Tuple[int, int]
    bits: int
    group_size: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Bytes of the packed form (codes, scales and offsets): what the tier holds and the link moves."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros))

    def to(self, device, non_blocking: bool = False) -> "QuantizedTensor":
        """The same tensor with its three parts on ``device``."""
        parts = (t.to(device, non_blocking=non_blocking) for t in (self.packed, self.scales, self.zeros))
        return QuantizedTensor(*parts, shape=self.shape, bits=self.bits, group_size=self.group_size, dtype=self.dtype)

    def rows(self, start: int, stop: int) -> "QuantizedTensor":
        """Rows ``start:stop`` as views (a row's codes, scales and offsets are its own: no re-quantization).

        >>> q = quantize(torch.randn(6, 16), 4, 8)
        >>> torch.equal(dequantize(q.rows(2, 5)), dequantize(q)[2:5])
        True
        """
        return QuantizedTensor(self.packed[start:stop], self.scales[start:stop], self.zeros[start:stop],
                               (stop - start, self.shape[1]), self.bits, self.group_size, self.dtype)


def check_layout(shape, bits: int, group_size: int) -> None:
    """Raise ``ValueError`` (what is wrong and what is allowed) unless a ``shape`` weight can be quantized."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"quantization bits={bits} is not supported; use one of {SUPPORTED_BITS}")
    if group_size <= 0 or group_size % CODES_PER_WORD:
        raise ValueError(f"quantization group_size={group_size} must be a positive multiple of {CODES_PER_WORD} "
                         f"(a group is whole packed words); e.g. 64 or 128")
    if len(shape) != 2:
        raise ValueError(f"can only quantize a 2-D weight [rows, cols]; got shape {tuple(shape)}")
    if shape[1] % group_size:
        raise ValueError(f"a weight with {shape[1]} columns cannot be cut into groups of {group_size}; use a "
                         f"group_size that divides {shape[1]}")


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes ``[rows, cols]`` (each ``< 2**bits``, ``cols % 8 == 0``) into uint8 ``[rows, cols*bits/8]``.

    >>> pack(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]), 3).tolist()
    [[209, 88, 31]]
    """
    rows, cols = codes.shape
    c = codes.to(torch.int64).reshape(rows, cols // CODES_PER_WORD, CODES_PER_WORD)
    shifts = torch.arange(CODES_PER_WORD, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1, keepdim=True)  # disjoint bit fields: the sum is an or
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).reshape(rows, cols * bits // 8)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack`: uint8 ``[rows, cols*bits/8]`` -> int64 codes ``[rows, cols]``.

    >>> unpack(torch.tensor([[209, 88, 31]], dtype=torch.uint8), 3).tolist()
    [[1, 2, 3, 4, 5, 6, 7, 0]]
    """
    rows, nbytes = packed.shape
    b = packed.to(torch.int64).reshape(rows, nbytes // bits, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(CODES_PER_WORD, device=packed.device, dtype=torch.int64) * bits
    return ((word >> shifts) & ((1 << bits) - 1)).reshape(rows, nbytes // bits * CODES_PER_WORD)


def _round_fp16(x: Tensor, up: bool) -> Tensor:
    """``x`` (fp32) in fp16, rounded toward +inf (``up``) or -inf, so the fp16 value bounds ``x``."""
    h = x.to(torch.float16)
    wrong = (h.float() < x) if up else (h.float() > x)
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(h, toward), h)


def quantize(w: Tensor, bits: int, group_size: int = 64) -> QuantizedTensor:
    """Quantize a 2-D weight ``w`` group-wise (see the module docstring); the math runs in fp32 on ``w``'s device.

    Raises ``ValueError`` for an unsupported width or group size, a column count ``group_size`` does not divide,
    or weights beyond fp16's range (the offsets are fp16).
    """
    check_layout(w.shape, bits, group_size)
    rows, cols = w.shape
    wf = w.detach().float().reshape(rows, cols // group_size, group_size)
    lo, hi = wf.amin(-1), wf.amax(-1)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError("cannot quantize a weight with inf or nan entries")
    if max(-lo.min().item(), hi.max().item()) > _FP16_MAX / 2:
        raise ValueError(f"weights beyond +-{_FP16_MAX / 2:g} cannot be quantized with fp16 scales and offsets")
    levels = (1 << bits) - 1
    zeros = _round_fp16(lo, up=False)
    scales = _round_fp16((hi - zeros.float()) / levels, up=True)
    # a constant group (range 0 at fp16's offset): any positive scale, every code 0
    scales = torch.where(scales > 0, scales, torch.full_like(scales, 2.0 ** -24))
    codes = torch.round((wf - zeros.float()[..., None]) / scales.float()[..., None]).clamp_(0, levels)
    return QuantizedTensor(pack(codes.reshape(rows, cols), bits), scales, zeros, (rows, cols), bits, group_size,
                           w.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The reference: ``codes * scale + zero`` in fp32 (two roundings, no fused multiply-add), in ``dtype``."""
    rows, cols = q.shape
    codes = unpack(q.packed, q.bits).float().reshape(rows, cols // q.group_size, q.group_size)
    w = codes * q.scales.float()[..., None]
    w = w + q.zeros.float()[..., None]
    return w.reshape(rows, cols).to(dtype)


def linear(x: Tensor, q: QuantizedTensor) -> Tensor:
    """``x @ dequantize(q)^T`` in fp32 (``x [tokens, cols]``), on ``x``'s device: on CUDA the Triton kernel
    (:func:`ds_maximus.experts.quant_triton.quant_matmul`: the codes are decoded inside the GEMM, no dequantized
    weight is made), elsewhere the reference (dequantize, then matmul in fp32).

    >>> q = quantize(torch.randn(4, 16), 8, 16)
    >>> x = torch.randn(2, 16)
    >>> torch.equal(linear(x, q), x @ dequantize(q).t())
    True
    """
    if x.is_cuda:
        from ds_maximus.experts.quant_triton import quant_matmul
        return quant_matmul(x, q)
    return x.float() @ dequantize(q).t()


def swiglu_reference(x: Tensor, w1, w3, w2) -> Tensor:
    """A SwiGLU expert, ``(silu(x @ w1^T) * (x @ w3^T)) @ w2^T``, in fp32 from plain or quantized weights
    (``w1``, ``w3``: ``[ffn, hidden]``; ``w2``: ``[hidden, ffn]``); the reference of the expert kernels."""
    def f32(w):
        return dequantize(w) if isinstance(w, QuantizedTensor) else w.float()

    xf = x.float()
    h = torch.nn.functional.silu(xf @ f32(w1).t()) * (xf @ f32(w3).t())
    return h @ f32(w2).t()
