"""Carry the norm of row-sparse gradients into DeepSpeed's own global-norm computation.

DeepSpeed computes the global gradient norm (for clipping and the fp16 overflow check) inside a
different optimizer class for each ZeRO stage and precision. Rather than patch each of them, the
sharded modules hand DeepSpeed one small ordinary parameter, the *carrier*, whose gradient has the
same 2-norm as the accumulated sparse gradients. DeepSpeed then clips and overflow-checks the union
of dense and sparse gradients through its normal code path, in every stage.

How the carrier gets its gradient: the sharded embedding's autograd function takes a zero scalar
"anchor" produced by ``_Carrier`` from the carrier parameter. Autograd runs ``_Carrier.backward``
after the embedding's backward (it is upstream), when this micro-batch's sparse rows are already
accumulated. It returns the *increment* of the sparse norm since the last micro-batch, so that
DeepSpeed's own accumulation of the carrier gradient telescopes to exactly the norm at the
accumulation boundary. At the boundary the sparse gradients are first combined across data-parallel
ranks, so every rank sends the same total and DeepSpeed's averaging keeps it.

The norm is spread over ``CARRIER_ELEMENTS`` elements (each ``norm / sqrt(n)``) so that a
loss-scaled fp16 norm does not overflow a single fp16 element.

The carrier is engine plumbing, not part of the model: its value is never read, so it is kept out of
the module's ``state_dict`` (a saved model has the model's own keys only) and its absence from a
loaded state dict is not a missing key.
"""
from __future__ import annotations

import math

import torch
from torch import nn

CARRIER_ELEMENTS = 4096
CARRIER_NAME = "maximus_norm_carrier"


class _Carrier(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier, runtime):
        ctx.runtime = runtime
        ctx.shape = carrier.shape
        ctx.dtype = carrier.dtype
        return torch.zeros((), dtype=torch.float32, device=carrier.device)

    @staticmethod
    def backward(ctx, grad):
        inc = ctx.runtime.on_sparse_backward_done()
        value = inc / math.sqrt(ctx.shape.numel())
        if torch.is_tensor(value):  # a device scalar: spread without reading it on the host
            return value.to(grad.device, ctx.dtype).expand(ctx.shape).contiguous(), None
        return torch.full(ctx.shape, value, dtype=ctx.dtype, device=grad.device), None


def attach_carrier(module: nn.Module, runtime) -> nn.Parameter:
    """Register the carrier on ``module`` (a sharded module) and route its grad anchor through it."""
    param = nn.Parameter(torch.zeros(CARRIER_ELEMENTS))
    module.register_parameter(CARRIER_NAME, param)
    module.register_state_dict_post_hook(_drop_carrier)
    module.register_load_state_dict_post_hook(_carrier_not_missing)

    def anchor():
        return _Carrier.apply(getattr(module, CARRIER_NAME), runtime)

    module.set_grad_anchor(anchor)
    return param


def _drop_carrier(module, state_dict, prefix, local_metadata) -> None:
    state_dict.pop(prefix + CARRIER_NAME, None)


def _carrier_not_missing(module, incompatible_keys) -> None:
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if k.rsplit(".", 1)[-1] != CARRIER_NAME]
