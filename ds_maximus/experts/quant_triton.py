"""Triton kernels: ``y = x @ dequantize(W)^T`` for a few tokens (decode), dequantizing inside the GEMM.

The gemv kernel (8-, 4- and 2-bit codes in power-of-two groups; the default where it applies) steps a group at a
time: a row's scale and offset are loaded once a group, the group's bytes are loaded whole, and each byte's codes
are decoded as planes; where the output rows alone leave SMs idle (an expert's down projection) the columns are
split over programs and the splits' partial sums added in order afterwards (deterministic). The loop kernel (any
width, 3 bits included):
each program owns ``BLOCK_N`` output rows of ``W`` and walks the columns ``BLOCK_K`` at a time: it loads the packed
bytes of its rows (``BLOCK_K * bits / 8`` a row, the layout of :mod:`ds_maximus.experts.quant`: code ``c`` of a
row starts at bit ``c * bits``), their fp16 scales and offsets, decodes the codes to fp32 in registers
(``code * scale + zero``), and accumulates ``x[:, k] * w[n, k]`` in fp32 for all tokens. No bf16 copy of the
weight is materialised: the only bytes read from memory are the packed form's. Imported only where triton and a
CUDA device exist; tested against :func:`ds_maximus.experts.quant.dequantize` by ``tests/experts/test_quant.py``
(a ``gpu`` test).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
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


def _gemv_tile(x_ptr, packed_ptr, scales_ptr, zeros_ptr, offs_t, mask_t, offs_n, mask_n, K, row_bytes, groups,
               k_begin, k_end, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_N: tl.constexpr, GPS: tl.constexpr):
    # The gemv kernels' product tile: x rows offs_t against weight rows offs_n over columns [k_begin, k_end), GPS
    # groups a step (the caller makes every step whole: k_begin and k_end are multiples of GPS * GROUP): the rows'
    # [BLOCK_N, GPS] scales and offsets, then the step's bytes of BLOCK_N rows loaded whole (contiguous, coalesced);
    # each byte's PER_BYTE codes decoded as PER_BYTE planes, each multiplied with the x columns it holds. One token
    # (BLOCK_T == 1, decode) accumulates elementwise in the weight tile's own layout and reduces across lanes once
    # after the loop (a [1, BLOCK_N, STEP_BYTES] product each step would move the dequantized tile through shared
    # memory and shuffle each step); more tokens add a [BLOCK_T, BLOCK_N] product each plane. fp32
    # [BLOCK_T, BLOCK_N].
    PER_BYTE: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER_BYTE
    STEP_BYTES: tl.constexpr = GPS * NB
    STEP_K: tl.constexpr = GPS * GROUP
    offs_b = tl.arange(0, STEP_BYTES)
    offs_g = tl.arange(0, GPS)
    row_ptrs = packed_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
    sz_off = offs_n.to(tl.int64)[:, None] * groups
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, STEP_BYTES), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, STEP_K):
        g = k0 // GROUP + offs_g
        s = tl.load(scales_ptr + sz_off + g[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)  # [BN, GPS]
        z = tl.load(zeros_ptr + sz_off + g[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
        byts = tl.load(row_ptrs + (k0 // PER_BYTE + offs_b)[None, :], mask=mask_n[:, None],
                       other=0).to(tl.int32)                                   # [BLOCK_N, STEP_BYTES]
        for j in tl.static_range(PER_BYTE):
            codes = ((byts >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            if GPS == 1:
                w = codes * s + z                                              # [BLOCK_N, NB] fp32
            else:
                w = tl.reshape(tl.reshape(codes, (BLOCK_N, GPS, NB)) * s[:, :, None] + z[:, :, None],
                               (BLOCK_N, STEP_BYTES))
            cols = k0 + offs_b * PER_BYTE + j
            if BLOCK_T == 1:
                x1 = tl.load(x_ptr + offs_t.to(tl.int64) * K + cols, mask=mask_t, other=0.0).to(tl.float32)
                acc1 += w * x1[None, :]
            else:
                xj = tl.load(x_ptr + offs_t.to(tl.int64)[:, None] * K + cols[None, :], mask=mask_t[:, None],
                             other=0.0).to(tl.float32)                         # [BLOCK_T, STEP_BYTES]
                acc += tl.sum(xj[:, None, :] * w[None, :, :], axis=2)
    if BLOCK_T == 1:
        acc += tl.sum(acc1, axis=1)[None, :]
    return acc


def _quant_gemv_kernel(x_ptr, packed_ptr, scales_ptr, zeros_ptr, y_ptr, T, N, K, row_bytes, groups, k_per_split,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                       GPS: tl.constexpr):
    # GPS groups a step (the tile: _gemv_tile). Program (n, t, s) covers columns [s * k_per_split, ...) and writes
    # its partial sums to y[s] (split-K where the rows alone leave SMs idle; the caller adds the splits in order).
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_n = offs_n < N
    mask_t = offs_t < T
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = _gemv_tile(x_ptr, packed_ptr, scales_ptr, zeros_ptr, offs_t, mask_t, offs_n, mask_n, K, row_bytes,
                     groups, k_begin, k_end, BITS, GROUP, BLOCK_T, BLOCK_N, GPS)
    tl.store(y_ptr + pid_s * T * N + offs_t[:, None] * N + offs_n[None, :], acc,
             mask=mask_t[:, None] & mask_n[None, :])


def _quant_gemv_grouped_kernel(x_ptr, codes_ptr, halves_ptr, meta_ptr, y_ptr, R, N, K, row_bytes, groups,
                               k_per_split, n_experts, P_OFF, S_OFF, Z_OFF, BITS: tl.constexpr,
                               GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                               GPS: tl.constexpr):
    # The gemv kernel over the experts of one round, in one launch: program (n, e, s) is expert e's output rows
    # [n * BLOCK_N, ...) over columns [s * k_per_split, ...) for x's rows starts[e]..starts[e + 1] (a BLOCK_T tile
    # at a time). meta holds starts [n_experts + 1], then each expert's byte offset in the slot table; an expert's
    # codes, scales and offsets lie at P_OFF, S_OFF and Z_OFF from there (halves_ptr: the same table as fp16).
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
    mask_n = offs_n < N
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for t0 in range(r0, r1, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < r1
        acc = _gemv_tile(x_ptr, packed_ptr, scales_ptr, zeros_ptr, offs_t, mask_t, offs_n, mask_n, K,
                         row_bytes, groups, k_begin, k_end, BITS, GROUP, BLOCK_T, BLOCK_N, GPS)
        tl.store(y_ptr + pid_s * R * N + offs_t[:, None] * N + offs_n[None, :], acc,
                 mask=mask_t[:, None] & mask_n[None, :])


def _quant_dot_grouped_kernel(x_ptr, codes_ptr, halves_ptr, meta_ptr, y_ptr, R, N, K, row_bytes, groups,
                              n_experts, P_OFF, S_OFF, Z_OFF, BITS: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_F32: tl.constexpr):
    # Many rows an expert (a prefill, a large batch): tensor-core products of x (bf16 or fp16) with the codes
    # themselves, which are small integers and exact in x's dtype, a group at a time; the group's scale and offset
    # are applied after the product: x . (c * s + z) = s * (x . c) + z * sum(x), per output row and group, in fp32.
    # Program (n, e) is expert e's output rows [n * BLOCK_N, ...) over all of K, for x's rows starts[e]..starts[e + 1]
    # a BLOCK_T tile at a time (meta and the slot layout as in the grouped gemv kernel).
    PER_BYTE: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER_BYTE
    pid_n = tl.program_id(0)
    pid_e = tl.program_id(1)
    r0 = tl.load(meta_ptr + pid_e).to(tl.int32)
    r1 = tl.load(meta_ptr + pid_e + 1).to(tl.int32)
    base = tl.load(meta_ptr + n_experts + 1 + pid_e)
    packed_ptr = codes_ptr + base + P_OFF
    scales_ptr = halves_ptr + (base + S_OFF) // 2
    zeros_ptr = halves_ptr + (base + Z_OFF) // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_b = tl.arange(0, NB)
    row_ptrs = packed_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
    sz_off = offs_n.to(tl.int64) * groups
    for t0 in range(r0, r1, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < r1
        x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * K
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, GROUP):
            g = k0 // GROUP
            s = tl.load(scales_ptr + sz_off + g, mask=mask_n, other=0.0).to(tl.float32)     # [BLOCK_N]
            z = tl.load(zeros_ptr + sz_off + g, mask=mask_n, other=0.0).to(tl.float32)
            byts = tl.load(row_ptrs + (k0 // PER_BYTE + offs_b)[None, :], mask=mask_n[:, None],
                           other=0).to(tl.int32)                                       # [BLOCK_N, NB]
            part = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            xsum = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for j in tl.static_range(PER_BYTE):
                xj = tl.load(x_rows + (k0 + offs_b * PER_BYTE + j)[None, :], mask=mask_t[:, None],
                             other=0.0)                                                # [BLOCK_T, NB]
                if EXACT_F32:  # Triton's interpreter (its dot of bf16 operands is wrong): the same math in fp32
                    codes = ((byts >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
                    part = tl.dot(xj.to(tl.float32), tl.trans(codes), part, input_precision="ieee")
                else:
                    codes = ((byts >> (j * BITS)) & ((1 << BITS) - 1)).to(xj.dtype)   # exact integers
                    part = tl.dot(xj, tl.trans(codes), part)
                xsum += tl.sum(xj.to(tl.float32), axis=1)
            acc += part * s[None, :] + xsum[:, None] * z[None, :]
        tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * N + offs_n[None, :], acc,
                 mask=mask_t[:, None] & mask_n[None, :])


if triton is not None:
    _gemv_tile = triton.jit(_gemv_tile)  # before the kernels that call it: they resolve it by its global name
    _quant_matmul_kernel = triton.jit(_quant_matmul_kernel)
    _quant_gemv_kernel = triton.jit(_quant_gemv_kernel)
    _quant_gemv_grouped_kernel = triton.jit(_quant_gemv_grouped_kernel)
    _quant_dot_grouped_kernel = triton.jit(_quant_dot_grouped_kernel)


# kernels run by Triton's CPU interpreter (the tests' path where no GPU is)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# a program's product tile ``BLOCK_T x BLOCK_N x BLOCK_K`` lives in registers: at most this many fp32 values (64 a
# thread at 4 warps), so a larger token tile gets fewer output rows
TILE_ELEMS = 8192


@dataclass(frozen=True)
class GemvConfig:
    """A launch of the gemv kernels (:func:`quant_matmul`'s gemv, :func:`quant_matmul_grouped`).

    ``block_n``: output rows a program (at most: ``block_n x step_bytes`` per token of the tile fits
    :data:`TILE_ELEMS` per 4 warps, counted twice for 2-bit codes, four planes a byte; the row tile shrinks first,
    down to 8 rows, then the step); ``step_bytes``: packed bytes of a row loaded a loop step (whole groups, halved
    until the step divides the row's groups); ``num_warps``; ``num_stages`` (loop steps in flight); ``programs_per_sm``:
    the columns are split over programs (split-K, added in order) until the grid has about this many programs a
    multiprocessor, for shapes whose rows alone leave SMs idle (an expert's down projection).

    >>> GemvConfig(64, 128, 4, 3, 2).plan(block_t=1, rows=4096, cols=14336, bits=4, group_size=64, programs=2,
    ...                                   sms=132)
    (64, 4, 3, 4864)
    """

    block_n: int = 64
    step_bytes: int = 128
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2

    def plan(self, block_t: int, rows: int, cols: int, bits: int, group_size: int, programs: int,
             sms: int) -> Tuple[int, int, int, int]:
        """``(block_n, groups a step, split, columns a split)`` of one launch; ``programs``: the grid's programs
        besides the row tiles (the token tiles, or the round's experts)."""
        group_bytes = group_size * bits // 8
        groups = cols // group_size
        gps = _floor_pow2(max(1, self.step_bytes // group_bytes))
        while groups % gps:          # whole steps only: a split's columns are whole steps
            gps //= 2
        budget = TILE_ELEMS * self.num_warps // 4 // (2 if bits == 2 else 1)
        fit = _floor_pow2(max(1, budget // (block_t * gps * group_bytes)))
        block_n = max(8, min(self.block_n, _next_pow2(rows), fit))
        while gps > 1 and block_t * block_n * gps * group_bytes > budget:
            gps //= 2
        steps = groups // gps
        split = max(1, min(steps, _cdiv(self.programs_per_sm * sms, _cdiv(rows, block_n) * programs)))
        k_per_split = _cdiv(steps, split) * gps * group_size
        return block_n, gps, _cdiv(cols, k_per_split), k_per_split


#: the one-token launch (decode: a token an expert): the configuration a tuner of an earlier gemv kernel picked for
#: Mixtral's int4 projections on the H200 (``docs/bench/moe_offload.md``); ``benchmarks/sweep_quant_gemv.py`` times
#: it against the list below
DECODE_CONFIG = GemvConfig(block_n=64, step_bytes=128, num_warps=4, num_stages=3, programs_per_sm=2)
#: the candidates ``benchmarks/sweep_quant_gemv.py`` times
GEMV_CONFIGS = (
    DECODE_CONFIG,
    GemvConfig(block_n=32, step_bytes=128, num_warps=4, num_stages=3, programs_per_sm=4),
    GemvConfig(block_n=16, step_bytes=128, num_warps=4, num_stages=4, programs_per_sm=8),
    GemvConfig(block_n=64, step_bytes=256, num_warps=8, num_stages=2, programs_per_sm=2),
    GemvConfig(block_n=32, step_bytes=256, num_warps=8, num_stages=3, programs_per_sm=4),
    GemvConfig(block_n=16, step_bytes=256, num_warps=4, num_stages=3, programs_per_sm=8),
    GemvConfig(block_n=128, step_bytes=64, num_warps=8, num_stages=4, programs_per_sm=2),
    GemvConfig(block_n=8, step_bytes=512, num_warps=4, num_stages=2, programs_per_sm=16),
)


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(block_t: int, rows: int, cols: int, bits: int, group_size: int, programs: int, device,
            config: Optional[GemvConfig]) -> Tuple[int, int, int, int, dict]:
    """``(block_n, groups a step, split, columns a split, launch options)``: ``config``'s plan, else
    :data:`DECODE_CONFIG` for one token a tile, else a group a step with as many rows as fit :data:`TILE_ELEMS`
    and the columns split until the grid has 2 programs a multiprocessor."""
    sms = _sm_count(device)
    if config is None and block_t == 1:
        config = DECODE_CONFIG
    if config is not None:
        return (*config.plan(block_t, rows, cols, bits, group_size, programs, sms),
                dict(num_warps=config.num_warps, num_stages=config.num_stages))
    nb = group_size * bits // 8
    bn = max(16, min(128, TILE_ELEMS // (block_t * nb)))
    steps = cols // group_size
    split = max(1, min(steps, triton.cdiv(2 * sms, triton.cdiv(rows, bn) * programs)))
    k_per_split = triton.cdiv(steps, split) * group_size
    return bn, 1, triton.cdiv(cols, k_per_split), k_per_split, {}


def gemv_fits(bits: int, group_size: int) -> bool:
    """The group-a-step kernels (:func:`quant_matmul`'s gemv, :func:`quant_matmul_grouped`) serve whole-byte codes
    (8, 4, 2 bits) in power-of-two groups of at least 16."""
    return bits in (8, 4, 2) and group_size >= 16 and group_size & (group_size - 1) == 0


#: an expert's rows in a round from which :func:`quant_matmul_grouped` takes the tensor-core kernel
DOT_MIN_ROWS = 16


def dot_fits(bits: int, group_size: int, dtype: torch.dtype, max_rows: int) -> bool:
    """Whether :func:`quant_matmul_grouped` takes the tensor-core kernel: whole-byte codes whose group holds at least
    16 bytes (a code plane of a group is one product of K >= 16), rows in bf16 or fp16 (the codes are exact there),
    and at least :data:`DOT_MIN_ROWS` rows for some expert.

    >>> dot_fits(4, 64, torch.bfloat16, 512), dot_fits(4, 64, torch.bfloat16, 1), dot_fits(4, 64, torch.float32, 512)
    (True, False, False)
    """
    return (gemv_fits(bits, group_size) and group_size * bits // 8 >= 16 and dtype in (torch.bfloat16, torch.float16)
            and max_rows >= DOT_MIN_ROWS)


def _gemv_fits(q: QuantizedTensor) -> bool:
    return gemv_fits(q.bits, q.group_size)


def quant_matmul(x: torch.Tensor, q: QuantizedTensor, block_n: Optional[int] = None, block_k: int = 64,
                 kernel: str = "auto", config: Optional[GemvConfig] = None) -> torch.Tensor:
    """``x @ dequantize(q)^T`` in fp32 on the GPU: ``x [tokens, cols]`` (any float dtype), ``q`` on the same device.

    Meant for decode (a few tokens; the tokens of a program are one ``BLOCK_T <= 16`` tile, more tokens run more
    tiles); fp32 accumulation. ``kernel``: ``"gemv"`` (whole bytes loaded, several groups a step for one token,
    split-K where the rows leave SMs idle; 8-, 4- and 2-bit codes in power-of-two groups), ``"loop"`` (any width:
    each code's byte loaded on its own), ``"auto"`` (gemv where it applies). ``config`` (gemv): a
    :class:`GemvConfig`, by default :data:`DECODE_CONFIG` for one token. ``block_n`` (output rows a program)
    overrides the gemv's plan, or defaults to what fits ``TILE_ELEMS`` (loop: halved, down to 8, while the grid has
    fewer than 4 programs a multiprocessor).
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
    if kernel == "gemv" or (kernel == "auto" and _gemv_fits(q)):
        block_t = min(16, triton.next_power_of_2(T))
        if block_n is not None:
            config = replace(config or (DECODE_CONFIG if block_t == 1 else GemvConfig(step_bytes=1)),
                             block_n=block_n)
        bn, gps, split, k_per_split, opts = _launch(block_t, rows, cols, q.bits, q.group_size,
                                                    triton.cdiv(T, block_t), x.device, config)
        y = torch.empty(split, T, rows, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(rows, bn), triton.cdiv(T, block_t), split)
        _quant_gemv_kernel[grid](x, q.packed, q.scales, q.zeros, y, T, rows, cols, q.packed.shape[1],
                                 cols // q.group_size, k_per_split, BITS=q.bits, GROUP=q.group_size,
                                 BLOCK_T=block_t, BLOCK_N=bn, GPS=gps, **opts)
        return y[0] if split == 1 else y.sum(0)   # the splits added in a fixed order: deterministic
    block_t = max(2, min(16, triton.next_power_of_2(T)))  # a tile of at least 2 (masked) rows
    sms = _sm_count(x.device)
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


def quant_matmul_grouped(x: torch.Tensor, table: torch.Tensor, offsets: Tuple[int, int, int], shape: Tuple[int, int],
                         bits: int, group_size: int, meta: torch.Tensor, n_experts: int,
                         max_rows: int, config: Optional[GemvConfig] = None,
                         dot: Optional[bool] = None) -> torch.Tensor:
    """``y[r] = x[r] @ dequantize(W_e)^T`` in fp32 for the rows of each of ``n_experts`` experts, in one launch of
    the gemv kernel: a round of a quantized MoE layer, each expert's weight ``W_e`` (``shape``) read from its slot of
    ``table`` (the layer's uint8 slot table ``[slots, bytes]``, on the GPU) at the byte ``offsets`` of its codes,
    scales and offsets within a slot. ``meta`` (int64, on the GPU): ``starts`` (``n_experts + 1``: expert ``e`` owns
    ``x``'s rows ``starts[e]:starts[e + 1]``, at least one each) then each expert's byte offset in ``table`` (its
    slot times the slot's bytes). ``max_rows``: the most rows an expert has (the token tile; one row, a decode step
    at batch 1, takes :data:`DECODE_CONFIG` unless ``config`` names another). Whole-byte codes (8, 4, 2 bits) in
    power-of-two groups of at least 16 (:func:`gemv_fits`); splits of K are added in order. ``dot``: rows through the
    tensor-core kernel (:func:`dot_fits`: by default where an expert has at least :data:`DOT_MIN_ROWS` rows of bf16
    or fp16, a prefill's or a large batch's round), or through the gemv kernel (``False``).
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
    R = x.shape[0]
    if dot is None:
        dot = dot_fits(bits, group_size, x.dtype, max_rows)
    elif dot and not dot_fits(bits, group_size, x.dtype, DOT_MIN_ROWS):
        raise ValueError(f"the tensor-core kernel needs bf16 or fp16 rows and groups of at least 16 bytes a code "
                         f"plane; got {x.dtype}, {bits} bits, group {group_size}")
    if dot:
        block_t = 16 if max_rows < 32 else 32 if max_rows < 64 else 64
        bn = 128 if rows >= 128 else max(16, triton.next_power_of_2(rows))
        y = torch.empty(R, rows, dtype=torch.float32, device=x.device)
        flat = table.view(-1)
        p, s, z = offsets
        grid = (triton.cdiv(rows, bn), n_experts)
        _quant_dot_grouped_kernel[grid](x, flat, flat.view(torch.float16), meta, y, R, rows, cols, cols * bits // 8,
                                        cols // group_size, n_experts, p, s, z, BITS=bits, GROUP=group_size,
                                        BLOCK_T=block_t, BLOCK_N=bn, EXACT_F32=_INTERPRETED,
                                        num_warps=4 if block_t < 64 else 8)
        return y
    block_t = min(16, triton.next_power_of_2(max_rows))
    bn, gps, split, k_per_split, opts = _launch(block_t, rows, cols, bits, group_size, n_experts, x.device, config)
    y = torch.empty(split, R, rows, dtype=torch.float32, device=x.device)
    flat = table.view(-1)
    p, s, z = offsets
    grid = (triton.cdiv(rows, bn), n_experts, split)
    _quant_gemv_grouped_kernel[grid](x, flat, flat.view(torch.float16), meta, y, R, rows, cols, cols * bits // 8,
                                     cols // group_size, k_per_split, n_experts, p, s, z, BITS=bits,
                                     GROUP=group_size, BLOCK_T=block_t, BLOCK_N=bn, GPS=gps, **opts)
    return y[0] if split == 1 else y.sum(0)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
