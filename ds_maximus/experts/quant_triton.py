"""Triton kernels: ``y = x @ dequantize(W)^T`` for a few tokens (decode), dequantizing inside the GEMM.

The gemv kernel (8-, 4- and 2-bit codes in power-of-two groups; the default where it applies) is memory-bound
by design: each loop step of a program loads ``BLOCK_N`` rows x ``step_bytes`` contiguous packed bytes (several
groups: ``GROUPS_PER_STEP``), the rows' ``[BLOCK_N, GROUPS_PER_STEP]`` scales and offsets, and decodes each byte's
codes as planes; the loop is software-pipelined (``num_stages`` steps in flight) so that enough bytes are in
flight to approach HBM bandwidth. Where the output rows alone give too few programs (an expert's down projection,
few rows and a long K) the columns are split over programs (split-K) and the splits' partial sums added in order
afterwards: deterministic, no atomics. The launch (row tile, step, warps, stages, split-K) is one of
:data:`GEMV_CONFIGS`, the fastest for the shape, timed on the shape's first call in the process
(:func:`quant_matmul`'s ``config`` picks one instead; ``python -m benchmarks.sweep_quant_gemv`` times them all).

The loop kernel (any width, 3 bits included):
each program owns ``BLOCK_N`` output rows of ``W`` and walks the columns ``BLOCK_K`` at a time: it loads the packed
bytes of its rows (``BLOCK_K * bits / 8`` a row, the layout of :mod:`ds_maximus.experts.quant`: code ``c`` of a
row starts at bit ``c * bits``), their fp16 scales and offsets, decodes the codes to fp32 in registers
(``code * scale + zero``), and accumulates ``x[:, k] * w[n, k]`` in fp32 for all tokens. No bf16 copy of the
weight is materialised: the only bytes read from memory are the packed form's. Imported only where triton and a
CUDA device exist (the gemv kernel also runs in Triton's CPU interpreter, ``TRITON_INTERPRET=1``); tested against
:func:`ds_maximus.experts.quant.dequantize` by ``tests/experts/test_quant.py``.
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

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


def _quant_gemv_kernel(x_ptr, packed_ptr, scales_ptr, zeros_ptr, y_ptr, T, N, K, row_bytes, groups, k_per_split,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                       GROUPS_PER_STEP: tl.constexpr):
    # GROUPS_PER_STEP groups a step: BLOCK_N rows x STEP_BYTES contiguous bytes loaded whole (coalesced, enough
    # bytes in flight a program; the loop is software-pipelined over num_stages), the rows' [BLOCK_N,
    # GROUPS_PER_STEP] scales and offsets loaded once a step; each byte's PER_BYTE codes decoded as PER_BYTE planes,
    # each multiplied with the x columns it holds. Program (n, t, s) covers columns [s * k_per_split, ...) and
    # writes its partial sums to y[s] (split-K; the caller adds the splits in order: deterministic, no atomics).
    PER_BYTE: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER_BYTE
    STEP_BYTES: tl.constexpr = GROUPS_PER_STEP * NB
    STEP_K: tl.constexpr = GROUPS_PER_STEP * GROUP
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_g = tl.arange(0, GROUPS_PER_STEP)
    offs_b = tl.arange(0, STEP_BYTES)
    mask_n = offs_n < N
    mask_t = offs_t < T
    row_ptrs = packed_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
    sz_off = offs_n.to(tl.int64)[:, None] * groups
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)     # rows first: a row reduction adds in without a shuffle
    # one token (decode: a token an expert): elementwise partial sums in the weight tile's own layout, reduced once
    # after the loop; a [1, BLOCK_N, STEP_BYTES] product would move the dequantized tile through shared memory
    acc1 = tl.zeros((BLOCK_N, STEP_BYTES), dtype=tl.float32)
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in tl.range(k_begin, k_end, STEP_K):
        # the plan makes STEP_K divide K and k_per_split: every step is whole, so the loads need only the row mask
        # (constant along a row: the byte loads vectorize) and a step's first byte is a multiple of STEP_BYTES
        g = k0 // GROUP + offs_g
        s = tl.load(scales_ptr + sz_off + g[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)  # [BN, GPS]
        z = tl.load(zeros_ptr + sz_off + g[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
        byte0 = tl.multiple_of(k0 // PER_BYTE, STEP_BYTES)
        byts = tl.load(row_ptrs + (byte0 + offs_b)[None, :], mask=mask_n[:, None],
                       other=0).to(tl.int32)                                   # [BLOCK_N, STEP_BYTES]
        for j in tl.static_range(PER_BYTE):
            codes = ((byts >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            if GROUPS_PER_STEP == 1:
                w = codes * s + z                                              # [BLOCK_N, NB] fp32
            else:
                w3 = tl.reshape(codes, (BLOCK_N, GROUPS_PER_STEP, NB))
                w = tl.reshape(w3 * s[:, :, None] + z[:, :, None], (BLOCK_N, STEP_BYTES))
            if BLOCK_T == 1:
                x1 = tl.load(x_ptr + pid_t * K + k0 + offs_b * PER_BYTE + j).to(tl.float32)   # [STEP_BYTES]
                acc1 += w * x1[None, :]
            else:
                # several tokens: a static loop over the tile's tokens, each a row reduction of the same weight tile
                for t in tl.static_range(BLOCK_T):
                    tok = pid_t * BLOCK_T + t
                    xt = tl.load(x_ptr + tok * K + k0 + offs_b * PER_BYTE + j, mask=tok + 0 * offs_b < T,
                                 other=0.0).to(tl.float32)                    # [STEP_BYTES]
                    part = tl.sum(w * xt[None, :], axis=1)                    # [BLOCK_N]
                    acc += tl.where((tl.arange(0, BLOCK_T) == t)[None, :], part[:, None], 0.0)
    if BLOCK_T == 1:
        acc += tl.sum(acc1, axis=1)[:, None]
    tl.store(y_ptr + pid_s * T * N + offs_t[None, :] * N + offs_n[:, None], acc,
             mask=mask_n[:, None] & mask_t[None, :])


if triton is not None:
    _quant_matmul_kernel = triton.jit(_quant_matmul_kernel)
    _quant_gemv_kernel = triton.jit(_quant_gemv_kernel)


# a program's product tile ``BLOCK_T x BLOCK_N x BLOCK_K`` (loop kernel; gemv: its token loop's live values scale the
# same way) lives in registers: at most this many fp32 values (64 a thread at 4 warps), so a larger token tile gets
# fewer output rows
TILE_ELEMS = 8192
#: the gemv kernel's token tile at most (more tokens run more tiles)
GEMV_MAX_BLOCK_T = 16


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of the gemv kernel; :data:`GEMV_CONFIGS` lists those the tuner times.

    ``block_n``: output rows a program (at most: a larger token tile gets fewer, :data:`TILE_ELEMS` per 4 warps of
    ``BLOCK_T x BLOCK_N x step_bytes``); ``step_bytes``: packed bytes of a row loaded a loop step (whole groups:
    ``GROUPS_PER_STEP`` is ``step_bytes / group bytes``, at least 1, halved until it divides the row's groups);
    ``num_warps``; ``num_stages`` (loop steps in flight, software pipelining); ``programs_per_sm``: the columns are
    split over programs (split-K) until the grid has about this many programs a multiprocessor, for shapes whose
    rows alone leave SMs idle.

    >>> GemvConfig(32, 128, 4, 3, 4).plan(tokens=1, rows=4096, cols=14336, bits=4, group_size=64, sms=132)
    GemvPlan(block_t=1, block_n=32, groups_per_step=4, split=5, k_per_split=3072)
    """

    block_n: int
    step_bytes: int
    num_warps: int
    num_stages: int
    programs_per_sm: int

    def plan(self, tokens: int, rows: int, cols: int, bits: int, group_size: int, sms: int) -> "GemvPlan":
        """The launch shape of this configuration for one product (see :class:`GemvPlan`)."""
        block_t = min(GEMV_MAX_BLOCK_T, _next_pow2(tokens))
        group_bytes = group_size * bits // 8
        groups = cols // group_size
        gps = _floor_pow2(max(1, self.step_bytes // group_bytes))
        while groups % gps:          # whole steps only: the kernel's loads then need no column mask
            gps //= 2
        # registers: BLOCK_T x BLOCK_N x step bytes products at most TILE_ELEMS per 4 warps, counted twice for 2-bit
        # codes (four planes a byte); the row tile shrinks first (down to 8 rows), then the step
        budget = TILE_ELEMS * self.num_warps // 4 // (2 if bits == 2 else 1)
        fit = _floor_pow2(max(1, budget // (block_t * gps * group_bytes)))
        block_n = max(8, min(self.block_n, _next_pow2(rows), fit))
        while gps > 1 and block_t * block_n * gps * group_bytes > budget:
            gps //= 2
        programs = _cdiv(rows, block_n) * _cdiv(tokens, block_t)
        steps = _cdiv(groups, gps)
        split = max(1, min(steps, _cdiv(self.programs_per_sm * sms, programs)))
        k_per_split = _cdiv(steps, split) * gps * group_size
        return GemvPlan(block_t, block_n, gps, _cdiv(cols, k_per_split), k_per_split)


@dataclass(frozen=True)
class GemvPlan:
    """A gemv launch: token tile, row tile, groups a loop step, and the split-K (``split`` programs along the
    columns, ``k_per_split`` columns each, a multiple of the step; their partial sums added in order)."""

    block_t: int
    block_n: int
    groups_per_step: int
    split: int
    k_per_split: int


#: the configurations the gemv tuner times on the first product of a shape (and the CPU-interpreter tests check):
#: wide row tiles with a cache line a row for many rows, narrow ones with longer steps for few rows, and more
#: programs (split-K) where the rows are few
GEMV_CONFIGS = (
    GemvConfig(block_n=32, step_bytes=128, num_warps=4, num_stages=3, programs_per_sm=4),
    GemvConfig(block_n=64, step_bytes=128, num_warps=4, num_stages=3, programs_per_sm=2),
    GemvConfig(block_n=16, step_bytes=128, num_warps=4, num_stages=4, programs_per_sm=8),
    GemvConfig(block_n=64, step_bytes=256, num_warps=8, num_stages=2, programs_per_sm=2),
    GemvConfig(block_n=32, step_bytes=256, num_warps=8, num_stages=3, programs_per_sm=4),
    GemvConfig(block_n=16, step_bytes=256, num_warps=4, num_stages=3, programs_per_sm=8),
    GemvConfig(block_n=128, step_bytes=64, num_warps=8, num_stages=4, programs_per_sm=2),
    GemvConfig(block_n=8, step_bytes=512, num_warps=4, num_stages=2, programs_per_sm=16),
)

# the tuner's choice a (device, rows, cols, token tile, bits, group) key: timed once a process
_TUNED: Dict[Tuple, GemvConfig] = {}


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gemv_fits(q: QuantizedTensor) -> bool:
    """The group-a-step kernel serves whole-byte codes (8, 4, 2 bits) in power-of-two groups of at least 16."""
    g = q.group_size
    return q.bits in (8, 4, 2) and g >= 16 and g & (g - 1) == 0


def _launch_gemv(x: torch.Tensor, q: QuantizedTensor, config: GemvConfig, sms: int,
                 compile_only: bool = False) -> torch.Tensor:
    """``x @ dequantize(q)^T`` (fp32) by the gemv kernel in one configuration; no argument checks (the caller's).

    ``sms`` (multiprocessors) sets the split-K. ``compile_only``: compile the launch (or find it in the cache)
    without running it, and return ``y`` unwritten (a sweep compiles every launch first, in parallel). Under
    ``TRITON_INTERPRET=1`` (set before triton is imported) the kernel runs in Triton's interpreter on CPU
    tensors: the tests' path where no GPU is."""
    T, cols = x.shape
    rows = q.shape[0]
    p = config.plan(T, rows, cols, q.bits, q.group_size, sms)
    y = torch.empty(p.split, T, rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, p.block_n), triton.cdiv(T, p.block_t), p.split)
    args = (x, q.packed, q.scales, q.zeros, y, T, rows, cols, q.packed.shape[1], cols // q.group_size, p.k_per_split)
    meta = dict(BITS=q.bits, GROUP=q.group_size, BLOCK_T=p.block_t, BLOCK_N=p.block_n,
                GROUPS_PER_STEP=p.groups_per_step, num_warps=config.num_warps, num_stages=config.num_stages)
    if compile_only:
        _quant_gemv_kernel.warmup(*args, grid=grid, **meta)
        return y[0]
    _quant_gemv_kernel[grid](*args, **meta)
    return y[0] if p.split == 1 else y.sum(0)   # the splits added in a fixed order: deterministic


def _compile_in_parallel(x: torch.Tensor, q: QuantizedTensor, configs, sms: int) -> None:
    """Compile the launches of ``configs`` on a thread pool (Triton's ``AsyncCompileMode``, where this Triton has
    it): a shape's first call then waits for about one compile, not one per configuration. Any failure leaves the
    rest to the timed calls, which compile what is missing one by one."""
    try:
        from triton import AsyncCompileMode
    except ImportError:
        return
    try:
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool, AsyncCompileMode(pool):
            for cfg in configs:
                _launch_gemv(x, q, cfg, sms, compile_only=True)
    except Exception:  # noqa: BLE001 (an optimisation only: the serial path below compiles what is missing)
        pass


def _tuned_config(x: torch.Tensor, q: QuantizedTensor, sms: int) -> GemvConfig:
    """The fastest of :data:`GEMV_CONFIGS` for this product's shape, timed on its first call (median of a few
    runs each, L2 flushed between runs by ``triton.testing.do_bench``) and kept for the process. Configurations
    that plan the same launch are timed once; during CUDA graph capture nothing is timed (the first config)."""
    T, cols = x.shape
    rows = q.shape[0]
    block_t = min(GEMV_MAX_BLOCK_T, _next_pow2(T))
    key = (x.device.index, rows, cols, block_t, q.bits, q.group_size)
    best = _TUNED.get(key)
    if best is not None:
        return best
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return GEMV_CONFIGS[0]
    from triton.testing import do_bench
    seen, candidates = set(), []
    for cfg in GEMV_CONFIGS:
        launch = (cfg.plan(T, rows, cols, q.bits, q.group_size, sms), cfg.num_warps, cfg.num_stages)
        if launch not in seen:
            seen.add(launch)
            candidates.append(cfg)
    _compile_in_parallel(x, q, candidates, sms)
    timed = []
    for cfg in candidates:
        ms = do_bench(lambda: _launch_gemv(x, q, cfg, sms), warmup=2, rep=10, return_mode="median")
        timed.append((ms, len(timed), cfg))
    best = min(timed)[2]
    _TUNED[key] = best
    return best


def quant_matmul(x: torch.Tensor, q: QuantizedTensor, block_n: Optional[int] = None, block_k: int = 64,
                 kernel: str = "auto", config: Optional[GemvConfig] = None) -> torch.Tensor:
    """``x @ dequantize(q)^T`` in fp32 on the GPU: ``x [tokens, cols]`` (any float dtype), ``q`` on the same device.

    Meant for decode (a few tokens; the tokens of a program are one tile of at most 16, more tokens run more
    tiles); fp32 accumulation, deterministic (split-K partial sums are added in order). ``kernel``: ``"gemv"``
    (several groups a step, whole bytes loaded, split-K where the rows leave SMs idle; 8-, 4- and 2-bit codes in
    power-of-two groups), ``"loop"`` (any width: each code's byte loaded on its own), ``"auto"`` (gemv where it
    applies). ``config`` (gemv): a :class:`GemvConfig`; by default the fastest of :data:`GEMV_CONFIGS` for the
    shape, timed on the shape's first call in the process. ``block_n`` (output rows a program) overrides the
    configuration's (gemv) or defaults to what fits ``TILE_ELEMS`` (loop: halved, down to 8, while the grid has
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
    sms = _sm_count(x.device)
    if kernel == "gemv" or (kernel == "auto" and _gemv_fits(q)):
        if config is None:
            config = GEMV_CONFIGS[0] if block_n else _tuned_config(x, q, sms)
        if block_n:
            config = replace(config, block_n=block_n)
        return _launch_gemv(x, q, config, sms)
    block_t = max(2, min(16, triton.next_power_of_2(T)))  # a tile of at least 2 (masked) rows
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


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
