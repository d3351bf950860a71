"""Python face of the ``maximus_expert_cpu`` op: a SwiGLU expert computed on the host for a few tokens.

The op (``csrc/expert_cpu``) reads each weight row once and takes its dot products with every token with fp32
sums in a fixed order (a result does not depend on the thread count); OpenMP splits the rows over the host's cores
and the calls run without the GIL. Where the host has AVX512-BF16 (checked at run time; :func:`kernel_isa`), bf16
and quantized weights (:mod:`ds_maximus.experts.quant`: codes are integers, exact in bf16) take ``vdpbf16ps`` dot
products, whose products are exact, against x split into bf16 ``hi + lo`` (one product a weight when x is exactly
bf16, as a bf16 model's hidden state is; two otherwise, ~16 bits of x), a quantized group adding
``scale * dot(codes, x) + zero * sum(x)`` (the codes decoded in registers: :func:`quant_decode`). Elsewhere, and
for fp32 weights, rows are decoded a chunk at a time to fp32 in L1. One token through an expert reads the expert
once from host memory, which is what lets a missed expert be computed where it lives instead of being copied to
the GPU.

The op is built (JIT, cached) and loaded once per process. There is no fallback: where it cannot be built,
every call raises :class:`ds_maximus.errors.OpBuildError` with the compiler's log and the fix. The plain-PyTorch
reference is :func:`ds_maximus.experts.quant.swiglu_reference`.

>>> import torch
>>> x = torch.ones(1, 8)
>>> w1 = w3 = torch.full((16, 8), 0.5, dtype=torch.bfloat16)
>>> w2 = torch.full((8, 16), 0.25, dtype=torch.bfloat16)
>>> y = swiglu(x, w1, w3, w2)
>>> torch.allclose(y, swiglu_reference(x, w1, w3, w2)), y.dtype
(True, torch.float32)
"""
from __future__ import annotations

import functools
from typing import Union

import torch
from torch import Tensor

from ds_maximus.experts.quant import (
    QuantizedTensor,
    check_layout,
    swiglu_reference,  # noqa: F401  (the reference, re-exported)
)

Weight = Union[Tensor, QuantizedTensor]


@functools.lru_cache(maxsize=None)
def load_op():
    """The loaded op; raises :class:`~ds_maximus.errors.OpBuildError` (log and fix) when it cannot be built."""
    from ds_maximus.ops import builder
    return builder("expert_cpu", "ExpertCPUBuilder").load(verbose=False)


def _x(x: Tensor) -> Tensor:
    return x.detach().to("cpu", torch.float32).contiguous()


# The op checks its arguments too, but a bad argument is refused here first, with the same message: on some
# toolchains (a compiler other than torch's) the C++ exception that the op would raise aborts the process while
# torch captures its backtrace through the op's frames, where it should become a Python error.
def _check_weight(w: Weight, name: str):
    """``(rows, cols)`` of a weight the op can read; a RuntimeError naming what is wrong otherwise."""
    if isinstance(w, QuantizedTensor):
        check_layout(w.shape, w.bits, w.group_size)  # what quantize() accepted (ValueError otherwise)
        rows, cols = (int(n) for n in w.shape)
        groups = (rows, cols // w.group_size)
        for part, shape, dtype in (("packed", (rows, cols * w.bits // 8), torch.uint8),
                                   ("scales", groups, torch.float16), ("zeros", groups, torch.float16)):
            t = getattr(w, part)
            if t.device.type != "cpu" or t.dim() != 2 or tuple(t.shape) != shape or t.dtype != dtype:
                raise RuntimeError(f"{name}: {part} must be a 2-D {dtype} CPU tensor of shape {shape}, got "
                                   f"{tuple(t.shape)} {t.dtype} on {t.device}")
        return rows, cols
    if not isinstance(w, Tensor) or w.device.type != "cpu" or w.dim() != 2:
        got = f"{tuple(w.shape)} on {w.device}" if isinstance(w, Tensor) else type(w).__name__
        raise RuntimeError(f"{name} must be a contiguous 2-D CPU tensor, got {got}")
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise RuntimeError(f"{name} must be bfloat16 or float32, got {w.dtype}")
    return int(w.shape[0]), int(w.shape[1])


def _check_x(x: Tensor, cols: int) -> None:
    if x.dim() != 2:
        raise RuntimeError(f"x must be 2-D [tokens, features], got shape {tuple(x.shape)}")
    if x.shape[1] != cols:
        raise RuntimeError(f"x has {x.shape[1]} features, the weight {cols}")


def _parts(w: QuantizedTensor):
    return [w.packed.contiguous(), w.scales.contiguous(), w.zeros.contiguous()]


def linear(x: Tensor, w: Weight) -> Tensor:
    """``x @ w^T`` in fp32 (``x [tokens, cols]``; ``w [rows, cols]``: bf16, fp32 or quantized), on the host."""
    _check_x(x, _check_weight(w, "w")[1])
    op = load_op()
    if isinstance(w, QuantizedTensor):
        return op.linear_quant(_x(x), *_parts(w), w.bits, w.group_size)
    return op.linear_dense(_x(x), w.detach().contiguous())


def swiglu(x: Tensor, w1: Weight, w3: Weight, w2: Weight) -> Tensor:
    """One SwiGLU expert, ``(silu(x @ w1^T) * (x @ w3^T)) @ w2^T``, in fp32 on the host.

    ``x [tokens, hidden]`` (any float dtype, any device: it is copied to the host as fp32); ``w1``, ``w3``
    ``[ffn, hidden]`` and ``w2 [hidden, ffn]``, all three plain CPU tensors of one dtype (bf16 or fp32) or all
    three :class:`~ds_maximus.experts.quant.QuantizedTensor` of one width and group size. Returns fp32
    ``[tokens, hidden]`` on the host.
    """
    quant = [isinstance(w, QuantizedTensor) for w in (w1, w3, w2)]
    if any(quant):
        if not all(quant) or len({(w.bits, w.group_size) for w in (w1, w3, w2)}) != 1:
            raise TypeError("swiglu takes three plain weights or three quantized weights of one bits and group_size")
    elif len({w1.dtype, w3.dtype, w2.dtype}) != 1:
        raise TypeError(f"w1, w3 and w2 must share a dtype; got {w1.dtype}, {w3.dtype}, {w2.dtype}")
    (r1, c1), (r3, c3), (r2, c2) = (_check_weight(w, n) for w, n in ((w1, "w1"), (w3, "w3"), (w2, "w2")))
    if not (r1 == r3 and c1 == c3 and r2 == c1 and c2 == r1):
        raise RuntimeError(f"expert shapes disagree: w1 [{r1}, {c1}], w3 [{r3}, {c3}], w2 [{r2}, {c2}]; expected "
                           "w1, w3 [ffn, hidden] and w2 [hidden, ffn]")
    _check_x(x, c1)
    op = load_op()
    if any(quant):
        return op.swiglu_quant(_x(x), _parts(w1), _parts(w3), _parts(w2), w1.bits, w1.group_size, w1.shape[0])
    return op.swiglu_dense(_x(x), *(w.detach().contiguous() for w in (w1, w3, w2)))


def kernel_isa() -> str:
    """The path this host runs: ``"avx512_bf16"`` (bf16 dot products) or ``"fp32"`` (a host without AVX512-BF16,
    or ``MAXIMUS_EXPERT_CPU_FP32=1`` in the environment when the op first loads)."""
    return load_op().kernel_isa()


def quant_decode(bits: int, group_size: int) -> str:
    """How the op decodes ``bits``-wide codes in groups of ``group_size``: ``"words"`` (4- and 2-bit codes a 16-bit
    word at a time, a shift and a bit-select a vector, at group sizes that tile 64-byte blocks of codes),
    ``"lookup"`` (a byte-table lookup) or ``"fp32"`` (the fp32 path)."""
    return load_op().quant_decode(bits, group_size)


def max_threads() -> int:
    """The OpenMP team size the op shares with torch (``torch.get_num_threads()``: ``OMP_NUM_THREADS``, else the
    host's cores)."""
    return load_op().omp_max_threads()


def threads_per_call() -> int:
    """Threads one call runs on: :func:`max_threads` less one per 8 (14 of 16), so that another runnable host thread
    (a CUDA wait spinning on its core) never shares a core with the call's team, which waits for its slowest
    thread, and so would last a scheduler time slice (``scripts/gpu/probe_host_table.py``,
    docs/bench/moe_offload.md)."""
    return load_op().threads_per_call()


def set_dynamic_rows(on: bool) -> None:
    """Spread a call's row blocks over the OpenMP team dynamically (``True``, the default: about 8 chunks a thread,
    taken as threads come free) or in equal static shares (``False``). Static shares make a call last as long as
    its slowest thread; each row's sums are the same either way. For comparisons
    (``scripts/gpu/probe_host_table.py``)."""
    load_op().set_dynamic_rows(bool(on))
