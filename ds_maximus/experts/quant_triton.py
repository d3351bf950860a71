"""Triton kernel: ``y = x @ dequantize(W)^T`` for a few tokens (decode), dequantizing inside the GEMM.

Each program owns ``BLOCK_N`` output rows of ``W`` and walks the columns ``BLOCK_K`` at a time: it loads the packed
bytes of its rows (``BLOCK_K * bits / 8`` a row, the layout of :mod:`ds_maximus.experts.quant`: code ``c`` of a
row starts at bit ``c * bits``), their fp16 scales and offsets, decodes the codes to fp32 in registers
(``code * scale + zero``), and accumulates ``x[:, k] * w[n, k]`` in fp32 for all tokens. No bf16 copy of the
weight is materialised: the only bytes read from memory are the packed form's. Imported only where triton and a
CUDA device exist; tested against :func:`ds_maximus.experts.quant.dequantize` by ``tests/experts/test_quant.py``
(a ``gpu`` test).
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_maximus.experts.quant import QuantizedTensor

try:  # the module imports anywhere (doctest collection walks the package); the kernel needs triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - hosts without triton
    triton = None


def _quant_matmul_kernel(x_ptr, packed_ptr, scales_ptr, zeros_ptr, y_ptr, T, N, K, row_bytes, groups,
                         BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_n = offs_n < N
    mask_t = offs_t < T
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        # code c of row n: bits [c * BITS, (c + 1) * BITS) of the row's little-endian bit string; it lies within
        # the 2 bytes from byte (c * BITS) // 8 for BITS <= 8 (a 3-bit code may straddle two bytes)
        bit = offs_k * BITS
        byte = bit // 8
        shift = bit % 8
        m2 = mask_n[:, None] & mask_k[None, :]
        base = packed_ptr + offs_n[:, None] * row_bytes + byte[None, :]
        lo = tl.load(base, mask=m2, other=0).to(tl.int32)
        if BITS == 3:
            hi_mask = m2 & ((byte[None, :] + 1) < row_bytes)
            hi = tl.load(base + 1, mask=hi_mask, other=0).to(tl.int32)
            word = lo | (hi << 8)
        else:
            word = lo
        codes = ((word >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        g = offs_k // GROUP
        gp = offs_n[:, None] * groups + g[None, :]
        s = tl.load(scales_ptr + gp, mask=m2, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + gp, mask=m2, other=0.0).to(tl.float32)
        w = codes * s + z                                                   # [BLOCK_N, BLOCK_K] fp32
        x = tl.load(x_ptr + offs_t[:, None] * K + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)                               # [BLOCK_T, BLOCK_K]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + offs_t[:, None] * N + offs_n[None, :], acc, mask=mask_t[:, None] & mask_n[None, :])


if triton is not None:
    _quant_matmul_kernel = triton.jit(_quant_matmul_kernel)


# a program's product tile ``BLOCK_T x BLOCK_N x BLOCK_K`` lives in registers: at most this many fp32 values (64 a
# thread at 4 warps), so a larger token tile gets fewer output rows
TILE_ELEMS = 8192


def quant_matmul(x: torch.Tensor, q: QuantizedTensor, block_n: Optional[int] = None, block_k: int = 64
                 ) -> torch.Tensor:
    """``x @ dequantize(q)^T`` in fp32 on the GPU: ``x [tokens, cols]`` (any float dtype), ``q`` on the same device.

    Meant for decode (a few tokens; the tokens of a program are one ``BLOCK_T <= 16`` tile, more tokens run more
    tiles); fp32 accumulation. ``block_n`` (output rows a program) defaults to what fits ``TILE_ELEMS``, halved
    (down to 8) while the grid has fewer than 4 programs a multiprocessor.
    """
    if triton is None:
        raise ImportError("quant_matmul needs triton (pip install triton, on a host with a CUDA GPU)")
    if not (x.is_cuda and q.packed.is_cuda):
        raise ValueError("quant_matmul runs on CUDA tensors; use ds_maximus.ops.expert_cpu on the host")
    rows, cols = q.shape
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [tokens, {cols}], got {tuple(x.shape)}")
    x = x.contiguous()
    T = x.shape[0]
    y = torch.empty(T, rows, dtype=torch.float32, device=x.device)
    block_t = max(2, min(16, triton.next_power_of_2(T)))  # a tile of at least 2 (masked) rows
    if block_n is None:
        block_n = max(8, min(32, TILE_ELEMS // (block_t * block_k)))
        # few output rows (an expert's down projection: hidden rows, a long K) would leave SMs idle: smaller tiles
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        while block_n > 8 and triton.cdiv(rows, block_n) * triton.cdiv(T, block_t) < 4 * sms:
            block_n //= 2
    grid = (triton.cdiv(rows, block_n), triton.cdiv(T, block_t))
    _quant_matmul_kernel[grid](x, q.packed, q.scales, q.zeros, y, T, rows, cols, q.packed.shape[1],
                               cols // q.group_size, BITS=q.bits, GROUP=q.group_size, BLOCK_T=block_t,
                               BLOCK_N=block_n, BLOCK_K=block_k)
    return y
