"""Row-block optimizer updates with exactly torch.optim's arithmetic (the references of our kernels).

Each function updates a block of rows in place. ``grad=None`` means a zero gradient: the step a
dense optimizer takes on a row the batch did not touch (weight decay, moment decay, and the
moment-driven move). Replaying those steps when a row comes back is what makes ``exact`` mode
equal dense ``torch.optim.AdamW``.

>>> import torch
>>> p, g = torch.ones(2, 3), torch.full((2, 3), 0.5)
>>> m, v = torch.zeros(2, 3), torch.zeros(2, 3)
>>> adamw_rows_(p, g, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
>>> round(p[0, 0].item(), 4)   # first Adam step moves by ~lr
0.9
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

ADAMW, ADAGRAD = 0, 1  # optimizer codes shared with the C++/CUDA kernels


def adamw_rows_(param: Tensor, grad: Optional[Tensor], exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One ``torch.optim.AdamW`` step (``foreach=False``) on a block of rows, in place.

    ``step`` is the 1-based step number after the increment (bias corrections use it).
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if grad is None:
        exp_avg.lerp_(torch.zeros_like(exp_avg), 1 - beta1)
        exp_avg_sq.mul_(beta2)
    else:
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def sparse_adam_rows_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float = 0.0) -> None:
    """One ``torch.optim.SparseAdam`` step on the touched rows (``lazy`` mode), in place.

    ``weight_decay`` (not in SparseAdam) is decoupled and applied to these rows only.
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    old_m = exp_avg.clone()
    old_v = exp_avg_sq.clone()
    upd_m = grad.sub(old_m).mul_(1 - beta1)
    exp_avg.add_(upd_m)
    upd_v = grad.pow(2).sub_(old_v).mul_(1 - beta2)
    exp_avg_sq.add_(upd_v)
    numer = upd_m.add_(old_m)
    denom = upd_v.add_(old_v).sqrt_().add_(eps)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    param.add_(-step_size * numer.div_(denom))


def adagrad_rows_(param: Tensor, grad: Optional[Tensor], state_sum: Tensor, *, step: int, lr: float, eps: float,
                  weight_decay: float, lr_decay: float = 0.0) -> None:
    """One ``torch.optim.Adagrad`` step (dense arithmetic, L2 ``weight_decay``) on a block of rows."""
    if grad is None:
        if weight_decay == 0:
            return  # a zero gradient leaves Adagrad's row unchanged
        grad = torch.zeros_like(param)
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum.addcmul_(grad, grad, value=1)
    std = state_sum.sqrt().add_(eps)
    param.addcdiv_(grad, std, value=-clr)
