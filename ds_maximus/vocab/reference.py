"""Plain-PyTorch references of every ``maximus_row_ops`` kernel.

The C++ (CPU) and CUDA ops must match these: gather bit for bit, the segment reduce bit for bit
on CPU (same summation order: token order within an id), the row update within fp32 rounding.
They are also the fallback when the op cannot be built (a logged warning says so).

>>> import torch
>>> table = torch.arange(12.).view(4, 3)
>>> gather_ref(table, torch.tensor([2, 0]), torch.tensor([1, 1, 0]), torch.float32).tolist()
[[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ds_maximus.optim.sparse_adamw import ADAGRAD, ADAMW, adagrad_rows_, adamw_rows_, sparse_adam_rows_


def gather_ref(table: Tensor, slots: Tensor, inverse: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``out[n] = table[slots[inverse[n]]]`` cast to ``out_dtype`` ([N, d])."""
    return table.index_select(0, slots.index_select(0, inverse)).to(out_dtype)


def segment_reduce_ref(grad: Tensor, inverse: Tensor, num_unique: int) -> Tensor:
    """Row-sparse gradient: ``out[u] = sum of grad[n] over n with inverse[n] == u``, fp32 ([U, d])."""
    out = torch.zeros(num_unique, grad.shape[1], dtype=torch.float32, device=grad.device)
    if grad.shape[0]:
        order = torch.argsort(inverse, stable=True)  # token order within an id, like the op
        out.index_add_(0, inverse.index_select(0, order), grad.index_select(0, order).float())
    return out


def row_update_ref(weight: Tensor, states: List[Tensor], slots: Tensor, grads: Optional[Tensor],
                   last_step: Optional[Tensor], *, step: int, lr_hist: Optional[Tensor],
                   wd_hist: Optional[Tensor], lr: float, weight_decay: float, beta1: float, beta2: float,
                   eps: float, optimizer: int = ADAMW, lazy: bool = False) -> None:
    """Fused sparse optimizer on rows ``slots`` of ``weight``/``states`` (in place).

    ``exact`` (``lazy=False``): first replay, for each row, the zero-gradient steps
    ``last_step[r]+1 ..`` (up to ``step-1`` with ``grads``, up to ``step`` without), with the lr and
    weight decay of each step from ``lr_hist[k]``/``wd_hist[k]``; then take step ``step`` with
    ``grads`` (lr ``lr``, decay ``weight_decay``). ``lazy``: only the gradient step (SparseAdam
    for AdamW; Adagrad on touched rows), no replay.
    """
    def run(rows: Tensor, g: Optional[Tensor], k: int, k_lr: float, k_wd: float) -> None:
        p = weight.index_select(0, rows)
        st = [s.index_select(0, rows) for s in states]
        if optimizer == ADAMW:
            if lazy:
                sparse_adam_rows_(p, g, st[0], st[1], step=k, lr=k_lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=k_wd)
            else:
                adamw_rows_(p, g, st[0], st[1], step=k, lr=k_lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=k_wd)
        elif optimizer == ADAGRAD:
            adagrad_rows_(p, g, st[0], step=k, lr=k_lr, eps=eps, weight_decay=k_wd)
        else:
            raise AssertionError(f"unknown optimizer code {optimizer}")
        weight.index_copy_(0, rows, p)
        for s, v in zip(states, st):
            s.index_copy_(0, rows, v)

    if slots.numel() == 0:
        return
    if not lazy:
        end = step - 1 if grads is not None else step
        last = last_step.to(slots.device)
        first = int(last.min()) + 1
        for k in range(first, end + 1):
            active = last < k
            if bool(active.any()):
                run(slots[active], None, k, float(lr_hist[k]), float(wd_hist[k]))
    if grads is not None:
        run(slots, grads.float(), step, lr, weight_decay)


def grad_sum_ref(out: Tensor, base: Tensor, factor: float, add: Tensor):
    """``out = base * factor + add`` in fp32 as torch does it on a device (``base`` may be ``out``); returns
    ``(sum of out ** 2, every element finite)``."""
    return grad_sum_parts_ref(out, base, factor, [add])


def grad_sum_parts_ref(out: Tensor, base: Tensor, factor: float, adds: List[Tensor]):
    """``out = base * factor + adds[0] + adds[1] + ...`` in fp32, one ``add_`` after another as a device sums
    micro-batch gradients (``base`` may be ``out``); returns ``(sum of out ** 2, every element finite)``."""
    out.copy_(base)
    if factor != 1.0:
        out.mul_(factor)
    for add in adds:
        out.add_(add)
    return float(torch.dot(out.double(), out.double())), bool(torch.isfinite(out).all())
