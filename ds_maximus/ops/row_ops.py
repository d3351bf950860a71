"""Python face of the ``maximus_row_ops`` ops (CPU C++/OpenMP and CUDA).

Each op is built (JIT, cached) and loaded once per process. Calls pick the CUDA op for CUDA
tensors and the CPU op otherwise; when an op cannot be built here, the plain-PyTorch reference
(:mod:`ds_maximus.vocab.reference`) runs instead and a warning is logged once.

>>> import torch
>>> from ds_maximus.ops import row_ops as ops
>>> ops.gather(torch.eye(3), torch.tensor([2]), torch.tensor([0, 0]), torch.float32).tolist()
[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
"""
from __future__ import annotations

import logging
import os
import threading
from typing import List, Optional

import torch
from torch import Tensor

from ds_maximus.vocab import reference as ref

logger = logging.getLogger("ds_maximus")

_ops = {}
_lock = threading.Lock()
_DISABLE_ENV = "MAXIMUS_ROW_OPS_REFERENCE"  # "1": always use the PyTorch reference


def load_op(kind: str = "cpu"):
    """The loaded op for ``kind`` ("cpu" or "cuda"), or ``None`` when it cannot be built (warned once)."""
    if os.environ.get(_DISABLE_ENV) == "1":
        return None
    with _lock:
        if kind not in _ops:
            _ops[kind] = _build(kind)
        return _ops[kind]


def _build(kind: str):
    from ds_maximus.ops import builder
    cls = "RowOpsCUDABuilder" if kind == "cuda" else "RowOpsBuilder"
    try:
        return builder("row_ops", cls).load(verbose=False)
    except Exception as e:  # OpBuildError, missing compiler, ...
        logger.warning("maximus_row_ops%s op unavailable (%s); using the PyTorch reference, "
                       "which is slower. Fix: %s", "_cuda" if kind == "cuda" else "",
                       str(e).splitlines()[0][:300], getattr(e, "fix", "see the build log"))
        return None


def op_for(t: Tensor):
    return load_op("cuda" if t.is_cuda else "cpu")


def host_op():
    """The op for host-side work (the slot map): the CUDA op where there is a GPU (it serves CPU tensors
    too, so no second build), else the CPU op; ``None`` when neither builds."""
    op = load_op("cuda") if torch.cuda.is_available() else None
    return op if op is not None else load_op("cpu")


def gather(table: Tensor, slots: Tensor, inverse: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``out[n] = table[slots[inverse[n]]]`` in ``out_dtype`` (one fused kernel)."""
    op = op_for(table)
    if op is None or table.dtype != torch.float32:
        return ref.gather_ref(table, slots, inverse, out_dtype)
    out = torch.empty(inverse.numel(), table.shape[1], dtype=out_dtype, device=table.device)
    op.gather(table, slots, inverse, out)
    return out


def segment_reduce(grad: Tensor, inverse: Tensor, num_unique: int, order: Optional[Tensor] = None,
                   offsets: Optional[Tensor] = None) -> Tensor:
    """Sum ``grad`` rows per unique id (token order within an id) into fp32 ``[num_unique, d]``.

    CUDA: ``order`` (token positions sorted stably by id) and ``offsets`` ([U + 1] segment starts),
    when the caller has them (the lookup's :class:`~ds_maximus.vocab.function.BatchPlanner`), save a sort.
    """
    op = op_for(grad)
    if op is None:
        return ref.segment_reduce_ref(grad, inverse, num_unique)
    grad = grad.contiguous()
    out = torch.empty(num_unique, grad.shape[1], dtype=torch.float32, device=grad.device)
    if grad.is_cuda:
        if order is None or offsets is None:
            order = torch.argsort(inverse, stable=True)
            sorted_inv = inverse.index_select(0, order)
            # segment starts by binary search (bincount would sync the host to size its output)
            offsets = torch.searchsorted(sorted_inv, torch.arange(num_unique + 1, device=grad.device))
        op.segment_reduce(grad, order, offsets, out)
    else:
        op.segment_reduce_cpu(grad, inverse, out)
    return out


def grad_sum(out: Tensor, base: Tensor, factor: float, add: Tensor):
    """Host tensors: ``out = base * factor + add`` elementwise in fp32 (``base`` fp32, bf16 or fp16, and may be
    ``out``; the device's roundings), in one pass that also returns ``(sum of out ** 2, every element finite)``.

    Bad arguments raise ``ValueError`` here, before the op: a ``TORCH_CHECK`` thrown by the op (it runs without the
    GIL) crashes the process with a segmentation fault, as an unchecked ``batch_plan`` call does."""
    return grad_sum_parts(out, base, factor, [add])


def grad_sum_parts(out: Tensor, base: Tensor, factor: float, adds: List[Tensor]):
    """:func:`grad_sum` of several parts: ``out = base * factor + adds[0] + adds[1] + ...``, each addition rounded
    in fp32 in the order given (the bits of adding them one micro-batch at a time), in one pass over memory."""
    _check_grad_sum(out, base, adds)
    op = host_op()
    if op is None:
        return ref.grad_sum_parts_ref(out, base, factor, adds)
    return op.grad_sum_parts(out, base.contiguous(), float(factor), [a.contiguous() for a in adds])


def _check_grad_sum(out: Tensor, base: Tensor, adds: List[Tensor]) -> None:
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if any(t.is_cuda for t in (out, base, *adds)):
        raise ValueError("grad_sum adds host tensors: out, base and every part must be CPU tensors")
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"grad_sum: out must be contiguous float32, got {out.dtype}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    if base.dtype not in floats or any(a.dtype not in floats for a in adds):
        raise ValueError(f"grad_sum: base and parts must be float32, bfloat16 or float16, got {base.dtype} and "
                         f"{[a.dtype for a in adds]}")
    if len({a.dtype for a in adds}) > 1:
        raise ValueError(f"grad_sum: the parts must share one dtype, got {[a.dtype for a in adds]}")
    if any(t.numel() != out.numel() for t in (base, *adds)):
        raise ValueError(f"grad_sum: out, base and parts differ in size "
                         f"({out.numel()}, {base.numel()}, {[a.numel() for a in adds]})")


def row_update(weight: Tensor, states: List[Tensor], slots: Tensor, grads: Optional[Tensor],
               last_step: Optional[Tensor], *, step: int, lr_hist: Optional[Tensor], wd_hist: Optional[Tensor],
               lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
               optimizer: int = ref.ADAMW, lazy: bool = False, grad_scale: float = 1.0,
               shadow: Optional[Tensor] = None) -> None:
    """Fused exact-replay + optimizer step on rows ``slots`` (see :func:`reference.row_update_ref`).

    CPU tensors may also take ``grad_scale`` (the gradient step uses ``grads * grad_scale``) and ``shadow``
    (a tensor shaped like ``weight`` in bf16/fp16/fp32 that receives the updated rows, cast), both in the
    same pass over the rows. ``grads`` is fp32 or bf16 (the CPU op reads bf16 as it is: bf16 to fp32 is exact).
    """
    fused = grad_scale != 1.0 or shadow is not None
    if fused and weight.is_cuda:
        raise ValueError("row_update: grad_scale and shadow are for CPU tensors (scale a GPU gradient first)")
    op = op_for(weight)
    if op is None or slots.numel() == 0:
        g = None if grads is None else grads.float()  # itself when fp32: scaled into a copy only when asked
        ref.row_update_ref(weight, states, slots.to(weight.device), g if grad_scale == 1.0 or g is None
                           else g * grad_scale, last_step, step=step, lr_hist=lr_hist,
                           wd_hist=wd_hist, lr=lr, weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                           eps=eps, optimizer=optimizer, lazy=lazy)
        if shadow is not None and slots.numel():
            shadow.index_copy_(0, slots, weight.index_select(0, slots).to(shadow.dtype))
        return
    dev = weight.device
    empty_f, empty_d, empty_l = _empties(dev)
    s1 = states[1] if len(states) > 1 else empty_f
    from ds_maximus.ops import to_device_pair
    d_slots, d_last = to_device_pair(slots, last_step, dev)
    if grads is not None:  # the CPU op reads bf16 gradients as they are (half the bytes of an fp32 copy)
        keep = grads.dtype == torch.bfloat16 and not weight.is_cuda
        grads = (grads if keep else grads.float()).contiguous()
    args = (weight, states[0], s1, d_slots, grads if grads is not None else empty_f,
            d_last if d_last is not None else empty_l,
            lr_hist if lr_hist is not None else empty_d, wd_hist if wd_hist is not None else empty_d,
            int(step), float(lr), float(weight_decay), float(beta1), float(beta2), float(eps),
            int(optimizer), bool(lazy), grads is not None)
    if fused:
        op.row_update_scaled(*args, float(grad_scale), shadow if shadow is not None else empty_f)
    else:
        op.row_update(*args)


_EMPTIES = {}


def _empties(dev: torch.device):
    """Empty fp32, fp64 and int64 tensors on ``dev`` (the op's "absent" arguments), made once per device."""
    if dev not in _EMPTIES:
        _EMPTIES[dev] = tuple(torch.empty(0, dtype=t, device=dev) for t in (torch.float32, torch.float64, torch.long))
    return _EMPTIES[dev]
