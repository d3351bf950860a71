"""Triton kernels: ``y = x @ dequantize(W)^T`` for a few tokens (decode), dequantizing inside the GEMM.

The gemv kernel (8-, 4- and 2-bit codes in power-of-two groups; the default where it applies) steps a group at a
time: a row's scale and offset are loaded once a group, the group's bytes are loaded whole, and each byte's codes
are decoded as planes; where the output rows alone leave SMs idle (an expert's down projection) the columns are
split over programs and the splits' partial sums added in order afterwards (deterministic). The one-row gemv
(:func:`quant_matmul_grouped` with a :class:`GemvConfig`, every expert one row) never reduces inside its loop: each
byte's codes times their x columns are added elementwise into a tile shaped like the weight tile, scaled once a
group, and summed once at the end; several groups a step, the step loop pipelined. The tensor-core kernel (rounds
of several rows an expert) runs each code plane of a group as ``x . codes`` on tensor cores (the codes are exact in
bf16 and fp16) and applies the group's scale and offset to that product. The loop kernel (any width, 3 bits
included):
each program owns ``BLOCK_N`` output rows of ``W`` and walks the columns ``BLOCK_K`` at a time: it loads the packed
bytes of its rows (``BLOCK_K * bits / 8`` a row, the layout of :mod:`ds_maximus.experts.quant`: code ``c`` of a
row starts at bit ``c * bits``), their fp16 scales and offsets, decodes the codes to fp32 in registers
(``code * scale + zero``), and accumulates ``x[:, k] * w[n, k]`` in fp32 for all tokens. No bf16 copy of the
weight is materialised: the only bytes read from memory are the packed form's. Imported only where triton and a
CUDA device exist; tested against :func:`ds_maximus.experts.quant.dequantize` by ``tests/experts/test_quant.py``
(a ``gpu`` test).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

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


def _gemv_tile(x_ptr, packed_ptr, scales_ptr, zeros_ptr, offs_t, mask_t, offs_n, mask_n, offs_b, K, row_bytes, groups,
               k_begin, k_end, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_N: tl.constexpr):
    # The gemv kernels' product tile: x rows offs_t against weight rows offs_n over columns [k_begin, k_end), one
    # group a step: one scale and one offset a row, loaded once; the group's bytes of BLOCK_N rows loaded whole
    # (contiguous, coalesced); each byte's PER_BYTE codes decoded as PER_BYTE planes, each multiplied with the x
    # columns it holds. fp32 [BLOCK_T, BLOCK_N].
    PER_BYTE: tl.constexpr = 8 // BITS
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, GROUP):
        g = k0 // GROUP
        s = tl.load(scales_ptr + offs_n * groups + g, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + offs_n * groups + g, mask=mask_n, other=0.0).to(tl.float32)
        byts = tl.load(packed_ptr + offs_n[:, None] * row_bytes + (k0 // PER_BYTE + offs_b)[None, :],
                       mask=mask_n[:, None], other=0).to(tl.int32)
        for j in tl.static_range(PER_BYTE):
            codes = ((byts >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            w = codes * s[:, None] + z[:, None]                                 # [BLOCK_N, NB] fp32
            xj = tl.load(x_ptr + offs_t[:, None] * K + (k0 + offs_b * PER_BYTE + j)[None, :],
                         mask=mask_t[:, None], other=0.0).to(tl.float32)       # [BLOCK_T, NB]
            acc += tl.sum(xj[:, None, :] * w[None, :, :], axis=2)
    return acc


def _quant_gemv_kernel(x_ptr, packed_ptr, scales_ptr, zeros_ptr, y_ptr, T, N, K, row_bytes, groups, k_per_split,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    # One group a step (BLOCK_K == GROUP; the tile: _gemv_tile). Program (n, t, s) covers columns
    # [s * k_per_split, ...) and writes its partial sums to y[s] (split-K where the rows alone leave SMs idle; the
    # caller adds the splits in order).
    PER_BYTE: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER_BYTE
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_b = tl.arange(0, NB)
    mask_n = offs_n < N
    mask_t = offs_t < T
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = _gemv_tile(x_ptr, packed_ptr, scales_ptr, zeros_ptr, offs_t, mask_t, offs_n, mask_n, offs_b, K, row_bytes,
                     groups, k_begin, k_end, BITS, GROUP, BLOCK_T, BLOCK_N)
    tl.store(y_ptr + pid_s * T * N + offs_t[:, None] * N + offs_n[None, :], acc,
             mask=mask_t[:, None] & mask_n[None, :])


def _quant_gemv_grouped_kernel(x_ptr, codes_ptr, halves_ptr, meta_ptr, y_ptr, R, N, K, row_bytes, groups,
                               k_per_split, n_experts, P_OFF, S_OFF, Z_OFF, BITS: tl.constexpr,
                               GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    # The gemv kernel over the experts of one round, in one launch: program (n, e, s) is expert e's output rows
    # [n * BLOCK_N, ...) over columns [s * k_per_split, ...) for x's rows starts[e]..starts[e + 1] (a BLOCK_T tile
    # at a time). meta holds starts [n_experts + 1], then each expert's byte offset in the slot table; an expert's
    # codes, scales and offsets lie at P_OFF, S_OFF and Z_OFF from there (halves_ptr: the same table as fp16).
    PER_BYTE: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER_BYTE
    pid_n = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    r0 = tl.load(meta_ptr + pid_e).to(tl.int32)
    r1 = tl.load(meta_ptr + pid_e + 1).to(tl.int32)
    base = tl.load(meta_ptr + n_experts + 1 + pid_e)
    packed_ptr = codes_ptr + base + P_OFF
    scales_ptr = halves_ptr + (base + S_OFF) // 2
    zeros_ptr = halves_ptr + (base + Z_OFF) // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, NB)
    mask_n = offs_n < N
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for t0 in range(r0, r1, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < r1
        acc = _gemv_tile(x_ptr, packed_ptr, scales_ptr, zeros_ptr, offs_t, mask_t, offs_n, mask_n, offs_b, K,
                         row_bytes, groups, k_begin, k_end, BITS, GROUP, BLOCK_T, BLOCK_N)
        tl.store(y_ptr + pid_s * R * N + offs_t[:, None] * N + offs_n[None, :], acc,
                 mask=mask_t[:, None] & mask_n[None, :])


def _gemv1_grouped_kernel(x_ptr, codes_ptr, halves_ptr, meta_ptr, y_ptr, R, N, K, row_bytes, groups, k_per_split,
                          n_experts, P_OFF, S_OFF, Z_OFF, BITS: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_N: tl.constexpr, GPS: tl.constexpr, STAGES: tl.constexpr):
    # The one-row gemv (every expert of the round has exactly one row of x: batch-1 decode). Program (n, e, s):
    # expert e's output rows [n * BLOCK_N, ...) over columns [s * k_per_split, ...), GPS groups a step. The weight
    # tile [BLOCK_N, GPS, BPG] bytes is loaded whole; each byte's PER_BYTE codes times their x columns are added
    # elementwise into a tile of the same shape (no reduction inside the loop), scaled by the group's scale once a
    # step; the offsets' term is zero * sum(x of the group), a [BLOCK_N, GPS] tile. One reduction at the end.
    PER_BYTE: tl.constexpr = 8 // BITS
    BPG: tl.constexpr = GROUP // PER_BYTE
    STEP: tl.constexpr = GPS * BPG
    pid_n = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    r = tl.load(meta_ptr + pid_e).to(tl.int64)
    base = tl.load(meta_ptr + n_experts + 1 + pid_e)
    packed_ptr = codes_ptr + base + P_OFF
    scales_ptr = halves_ptr + (base + S_OFF) // 2
    zeros_ptr = halves_ptr + (base + Z_OFF) // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_g = tl.arange(0, GPS)
    offs_b = tl.arange(0, BPG)
    byte_begin = pid_s * (k_per_split // PER_BYTE)
    byte_end = tl.minimum(byte_begin + k_per_split // PER_BYTE, row_bytes)
    row_ptr = packed_ptr + offs_n.to(tl.int64)[:, None, None] * row_bytes
    acc = tl.zeros((BLOCK_N, GPS, BPG), dtype=tl.float32)
    acc_z = tl.zeros((BLOCK_N, GPS), dtype=tl.float32)
    for b0 in tl.range(byte_begin, byte_end, STEP, num_stages=STAGES):
        gbyte = b0 + offs_g * BPG                                             # first byte of each group [GPS]
        mask_g = gbyte < byte_end
        bcol = gbyte[:, None] + offs_b[None, :]                               # [GPS, BPG]
        m3 = mask_n[:, None, None] & mask_g[None, :, None]
        byts = tl.load(row_ptr + bcol[None, :, :], mask=m3, other=0).to(tl.int32)
        gp = offs_n[:, None] * groups + (gbyte // BPG)[None, :]
        m2 = mask_n[:, None] & mask_g[None, :]
        s = tl.load(scales_ptr + gp, mask=m2, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + gp, mask=m2, other=0.0).to(tl.float32)
        part = tl.zeros((BLOCK_N, GPS, BPG), dtype=tl.float32)
        xsum = tl.zeros((GPS, BPG), dtype=tl.float32)
        for j in tl.static_range(PER_BYTE):
            xj = tl.load(x_ptr + r * K + bcol * PER_BYTE + j, mask=mask_g[:, None], other=0.0).to(tl.float32)
            codes = ((byts >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            part += codes * xj[None, :, :]
            xsum += xj
        acc += part * s[:, :, None]
        acc_z += z * tl.sum(xsum, axis=1)[None, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc_z, axis=1)
    tl.store(y_ptr + pid_s * R * N + r * N + offs_n, y, mask=mask_n)


def _mma_grouped_kernel(x_ptr, codes_ptr, halves_ptr, meta_ptr, y_ptr, R, N, K, row_bytes, groups, n_experts, P_OFF,
                        S_OFF, Z_OFF, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    # The tensor-core kernel for rounds whose experts have several rows (a prefill, a batch's decode). Program
    # (n, e, t): expert e's output rows [n * BLOCK_N, ...) for its x rows from starts[e] + t * BLOCK_T. Codes are
    # small integers, exact in x's dtype (bf16 / fp16), so a group's x . codes runs on tensor cores with fp32
    # accumulation, one plane of each byte's codes at a time (the plane's x columns loaded with stride PER_BYTE);
    # the group's scale multiplies that product once and its offset adds zero * sum(x of the group):
    # sum_k x_k (c_k s + z) = s (x . c) + z sum_k x_k. Each weight byte is read once a token tile.
    PER_BYTE: tl.constexpr = 8 // BITS
    BPG: tl.constexpr = GROUP // PER_BYTE
    pid_n = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_t = tl.program_id(2)
    r0 = tl.load(meta_ptr + pid_e).to(tl.int32)
    r1 = tl.load(meta_ptr + pid_e + 1).to(tl.int32)
    t0 = r0 + pid_t * BLOCK_T
    if t0 < r1:
        base = tl.load(meta_ptr + n_experts + 1 + pid_e)
        packed_ptr = codes_ptr + base + P_OFF
        scales_ptr = halves_ptr + (base + S_OFF) // 2
        zeros_ptr = halves_ptr + (base + Z_OFF) // 2
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < r1
        offs_b = tl.arange(0, BPG)
        row_ptr = packed_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
        x_row = x_ptr + offs_t.to(tl.int64)[:, None] * K
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for g in tl.range(0, groups, num_stages=STAGES):
            byts = tl.load(row_ptr + (g * BPG + offs_b)[None, :], mask=mask_n[:, None], other=0).to(tl.int32)
            s = tl.load(scales_ptr + offs_n * groups + g, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + offs_n * groups + g, mask=mask_n, other=0.0).to(tl.float32)
            dot = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            xs = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for j in tl.static_range(PER_BYTE):
                xj = tl.load(x_row + (g * GROUP + offs_b * PER_BYTE + j)[None, :], mask=mask_t[:, None], other=0.0)
                cj = ((byts >> (j * BITS)) & ((1 << BITS) - 1)).to(xj.dtype)      # [BLOCK_N, BPG], exact
                dot = tl.dot(xj, tl.trans(cj), dot)
                xs += tl.sum(xj.to(tl.float32), axis=1)
            acc += dot * s[None, :] + xs[:, None] * z[None, :]
        tl.store(y_ptr + offs_t[:, None] * N + offs_n[None, :], acc, mask=mask_t[:, None] & mask_n[None, :])


if triton is not None:
    _gemv_tile = triton.jit(_gemv_tile)  # before the kernels that call it: they resolve it by its global name
    _quant_matmul_kernel = triton.jit(_quant_matmul_kernel)
    _quant_gemv_kernel = triton.jit(_quant_gemv_kernel)
    _quant_gemv_grouped_kernel = triton.jit(_quant_gemv_grouped_kernel)
    _gemv1_grouped_kernel = triton.jit(_gemv1_grouped_kernel)
    _mma_grouped_kernel = triton.jit(_mma_grouped_kernel)


# a program's product tile ``BLOCK_T x BLOCK_N x BLOCK_K`` lives in registers: at most this many fp32 values (64 a
# thread at 4 warps), so a larger token tile gets fewer output rows
TILE_ELEMS = 8192


def _split_k(cols: int, step_cols: int, programs: int, target: int) -> Tuple[int, int]:
    """``(k_per_split, splits)``: the columns split into whole steps of ``step_cols`` over enough programs that
    ``programs`` launched for the output rows reach ``target`` (at most a step a split)."""
    steps = triton.cdiv(cols, step_cols)
    split = max(1, min(steps, triton.cdiv(target, programs)))
    k_per_split = triton.cdiv(steps, split) * step_cols
    return k_per_split, triton.cdiv(cols, k_per_split)


def gemv_fits(bits: int, group_size: int) -> bool:
    """The group-a-step kernels (:func:`quant_matmul`'s gemv, :func:`quant_matmul_grouped`) serve whole-byte codes
    (8, 4, 2 bits) in power-of-two groups of at least 16."""
    return bits in (8, 4, 2) and group_size >= 16 and group_size & (group_size - 1) == 0


def _gemv_fits(q: QuantizedTensor) -> bool:
    return gemv_fits(q.bits, q.group_size)


def quant_matmul(x: torch.Tensor, q: QuantizedTensor, block_n: Optional[int] = None, block_k: int = 64,
                 kernel: str = "auto") -> torch.Tensor:
    """``x @ dequantize(q)^T`` in fp32 on the GPU: ``x [tokens, cols]`` (any float dtype), ``q`` on the same device.

    Meant for decode (a few tokens; the tokens of a program are one ``BLOCK_T <= 16`` tile, more tokens run more
    tiles); fp32 accumulation. ``kernel``: ``"gemv"`` (a group a step, whole bytes loaded, split-K where the rows
    leave SMs idle; 8-, 4- and 2-bit codes in power-of-two groups), ``"loop"`` (any width: each code's byte loaded
    on its own), ``"auto"`` (gemv where it applies). ``block_n`` (output rows a program) defaults to what fits
    ``TILE_ELEMS``; the loop kernel halves it (down to 8) while the grid has fewer than 4 programs a multiprocessor.
    """
    if triton is None:
        raise ImportError("quant_matmul needs triton (pip install triton, on a host with a CUDA GPU)")
    if not (x.is_cuda and q.packed.is_cuda):
        raise ValueError("quant_matmul runs on CUDA tensors; use ds_maximus.ops.expert_cpu on the host")
    rows, cols = q.shape
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [tokens, {cols}], got {tuple(x.shape)}")
    if kernel not in ("auto", "gemv", "loop"):
        raise ValueError(f"kernel must be 'auto', 'gemv' or 'loop', got {kernel!r}")
    if kernel == "gemv" and not _gemv_fits(q):
        raise ValueError(f"the gemv kernel needs 8-, 4- or 2-bit codes in power-of-two groups of at least 16; got "
                         f"{q.bits} bits, group {q.group_size}")
    x = x.contiguous()
    T = x.shape[0]
    block_t = max(2, min(16, triton.next_power_of_2(T)))  # a tile of at least 2 (masked) rows
    sms = _sm_count(x.device)
    if kernel == "gemv" or (kernel == "auto" and _gemv_fits(q)):
        nb = q.group_size * q.bits // 8
        bn = block_n or max(16, min(128, TILE_ELEMS // (block_t * nb)))
        programs = triton.cdiv(rows, bn) * triton.cdiv(T, block_t)
        k_per_split, split = _split_k(cols, q.group_size, programs, 2 * sms)
        y = torch.empty(split, T, rows, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(rows, bn), triton.cdiv(T, block_t), split)
        _quant_gemv_kernel[grid](x, q.packed, q.scales, q.zeros, y, T, rows, cols, q.packed.shape[1],
                                 cols // q.group_size, k_per_split, BITS=q.bits, GROUP=q.group_size,
                                 BLOCK_T=block_t, BLOCK_N=bn)
        return y[0] if split == 1 else y.sum(0)
    y = torch.empty(T, rows, dtype=torch.float32, device=x.device)
    if block_n is None:
        block_n = max(8, min(32, TILE_ELEMS // (block_t * block_k)))
        # few output rows (an expert's down projection: hidden rows, a long K) would leave SMs idle: smaller tiles
        while block_n > 8 and triton.cdiv(rows, block_n) * triton.cdiv(T, block_t) < 4 * sms:
            block_n //= 2
    grid = (triton.cdiv(rows, block_n), triton.cdiv(T, block_t))
    _quant_matmul_kernel[grid](x, q.packed, q.scales, q.zeros, y, T, rows, cols, q.packed.shape[1],
                               cols // q.group_size, BITS=q.bits, GROUP=q.group_size, BLOCK_T=block_t,
                               BLOCK_N=block_n, BLOCK_K=block_k)
    return y


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """The launch of the one-row gemv (:func:`quant_matmul_grouped` where every expert has one row): output rows a
    program (``block_n``), packed bytes of a row a step (``step_bytes``, whole groups: at least one group's bytes),
    warps, pipeline stages of the step loop, and the programs an SM that splitting K aims for where the output
    rows alone leave SMs idle (an expert's down projection)."""

    block_n: int = 64
    step_bytes: int = 128
    warps: int = 4
    stages: int = 3
    programs_per_sm: int = 2


# The one-row kernel's launch by code width (benchmarks/sweep_quant_gemv.py, docs/bench/moe_offload.md): at 4 bits
# the fastest of GEMV_CONFIGS over a Mixtral expert's two projections together on an H100; the other widths run
# DECODE_CONFIG, timed there against the token-tile kernel.
DECODE_CONFIG = GemvConfig()
DECODE_CONFIGS = {4: GemvConfig(32, 64, 4, 3, 2)}
GEMV_CONFIGS = [GemvConfig(bn, sb, w, st, pps) for bn in (32, 64, 128) for sb in (64, 128, 256) for w in (4, 8)
                for st in (2, 3) for pps in (2, 4)]


def decode_config(bits: int) -> GemvConfig:
    """The one-row kernel's launch for ``bits``-bit codes."""
    return DECODE_CONFIGS.get(bits, DECODE_CONFIG)


@dataclasses.dataclass(frozen=True)
class MmaConfig:
    """The launch of the tensor-core kernel (:func:`quant_matmul_grouped` for rounds whose experts have several
    rows): output rows a program, the largest token tile (the tile is the next power of two of the round's most
    rows an expert, 16 at least: the MMA's smallest M), pipeline stages of the group loop, warps."""

    block_n: int = 64
    max_block_t: int = 64
    stages: int = 2
    warps: int = 4


MMA_CONFIG = MmaConfig()
# the launches benchmarks/sweep_quant_gemv.py times beside MMA_CONFIG
MMA_CONFIGS = [MMA_CONFIG, MmaConfig(128, 64, 3, 8), MmaConfig(32, 32, 3, 4)]


def mma_fits(bits: int, group_size: int, dtype: torch.dtype) -> bool:
    """The tensor-core kernel serves :func:`gemv_fits` widths whose groups give each code plane at least 16 columns
    (the MMA's smallest K), with bf16 or fp16 activations (the codes are exact in both)."""
    return (gemv_fits(bits, group_size) and group_size // (8 // bits) >= 16
            and dtype in (torch.bfloat16, torch.float16))


def _mma_grouped(x, flat, meta, rows, cols, bits, group_size, n_experts, offsets, max_rows, config: MmaConfig):
    block_t = max(16, min(config.max_block_t, triton.next_power_of_2(max_rows)))
    R = x.shape[0]
    y = torch.empty(R, rows, dtype=torch.float32, device=x.device)
    p, s, z = offsets
    grid = (triton.cdiv(rows, config.block_n), n_experts, triton.cdiv(max_rows, block_t))
    _mma_grouped_kernel[grid](x, flat, flat.view(torch.float16), meta, y, R, rows, cols, cols * bits // 8,
                              cols // group_size, n_experts, p, s, z, BITS=bits, GROUP=group_size, BLOCK_T=block_t,
                              BLOCK_N=config.block_n, STAGES=config.stages, num_warps=config.warps)
    return y


def _gemv1_grouped(x, flat, meta, rows, cols, bits, group_size, n_experts, offsets, config: GemvConfig):
    per_byte = 8 // bits
    bpg = group_size // per_byte
    gps = max(1, config.step_bytes // bpg)
    step_cols = gps * group_size
    R = x.shape[0]
    programs = triton.cdiv(rows, config.block_n) * n_experts
    k_per_split, split = _split_k(cols, step_cols, programs, config.programs_per_sm * _sm_count(x.device))
    y = torch.empty(split, R, rows, dtype=torch.float32, device=x.device)
    p, s, z = offsets
    grid = (triton.cdiv(rows, config.block_n), n_experts, split)
    _gemv1_grouped_kernel[grid](x, flat, flat.view(torch.float16), meta, y, R, rows, cols, cols * bits // 8,
                                cols // group_size, k_per_split, n_experts, p, s, z, BITS=bits, GROUP=group_size,
                                BLOCK_N=config.block_n, GPS=gps, STAGES=config.stages, num_warps=config.warps)
    return y[0] if split == 1 else y.sum(0)


def quant_matmul_grouped(x: torch.Tensor, table: torch.Tensor, offsets: Tuple[int, int, int], shape: Tuple[int, int],
                         bits: int, group_size: int, meta: torch.Tensor, n_experts: int,
                         max_rows: int, config: Optional[GemvConfig] = None,
                         mma: Optional[MmaConfig] = None) -> torch.Tensor:
    """``y[r] = x[r] @ dequantize(W_e)^T`` in fp32 for the rows of each of ``n_experts`` experts, in one launch of
    the gemv kernel: a round of a quantized MoE layer, each expert's weight ``W_e`` (``shape``) read from its slot of
    ``table`` (the layer's uint8 slot table ``[slots, bytes]``, on the GPU) at the byte ``offsets`` of its codes,
    scales and offsets within a slot. ``meta`` (int64, on the GPU): ``starts`` (``n_experts + 1``: expert ``e`` owns
    ``x``'s rows ``starts[e]:starts[e + 1]``, at least one each) then each expert's byte offset in ``table`` (its
    slot times the slot's bytes). ``max_rows``: the most rows an expert has (the token tile). Whole-byte codes (8, 4,
    2 bits) in power-of-two groups of at least 16 (:func:`gemv_fits`); splits of K are added in order.

    ``config``: where every expert has one row (``max_rows == 1``, batch-1 decode), run the one-row kernel with
    that launch (:func:`decode_config`; the model's decode path passes it) instead of the token-tile kernel.
    ``mma``: where an expert has several rows (``max_rows >= 2``: a prefill, a batch's decode) and
    :func:`mma_fits`, run the tensor-core kernel with that launch (:data:`MMA_CONFIG`; the decode path passes
    ``ds_maximus.experts.compute.ROUND_MMA``) instead of the token-tile kernel.
    """
    if triton is None:
        raise ImportError("quant_matmul_grouped needs triton (pip install triton, on a host with a CUDA GPU)")
    rows, cols = shape
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [tokens, {cols}], got {tuple(x.shape)}")
    if not gemv_fits(bits, group_size):
        raise ValueError(f"the grouped kernel needs 8-, 4- or 2-bit codes in power-of-two groups of at least 16; "
                         f"got {bits} bits, group {group_size}")
    x = x.contiguous()
    flat = table.view(-1)
    if config is not None and max_rows == 1:
        return _gemv1_grouped(x, flat, meta, shape[0], cols, bits, group_size, n_experts, offsets, config)
    if mma is not None and max_rows >= 2 and mma_fits(bits, group_size, x.dtype):
        return _mma_grouped(x, flat, meta, rows, cols, bits, group_size, n_experts, offsets, max_rows, mma)
    R = x.shape[0]
    block_t = max(2, min(16, triton.next_power_of_2(max_rows)))
    nb = group_size * bits // 8
    bn = max(16, min(128, TILE_ELEMS // (block_t * nb)))
    programs = triton.cdiv(rows, bn) * n_experts
    k_per_split, split = _split_k(cols, group_size, programs, 2 * _sm_count(x.device))
    y = torch.empty(split, R, rows, dtype=torch.float32, device=x.device)
    p, s, z = offsets
    grid = (triton.cdiv(rows, bn), n_experts, split)
    _quant_gemv_grouped_kernel[grid](x, flat, flat.view(torch.float16), meta, y, R, rows, cols, cols * bits // 8,
                                     cols // group_size, k_per_split, n_experts, p, s, z, BITS=bits,
                                     GROUP=group_size, BLOCK_T=block_t, BLOCK_N=bn)
    return y[0] if split == 1 else y.sum(0)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
