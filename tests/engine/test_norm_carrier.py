"""The norm carrier's gradient: the sparse norm's increment spread over its elements, whether the runtime hands it
over as a float or as a device scalar (a GPU module's norm, read without a host wait)."""
import math

import pytest
import torch
from torch import nn

from ds_maximus.engine.norm_carrier import CARRIER_ELEMENTS, attach_carrier


class _Module(nn.Module):
    def set_grad_anchor(self, fn):
        self.anchor = fn


class _Runtime:
    def __init__(self, increments):
        self.increments = list(increments)

    def on_sparse_backward_done(self):
        return self.increments.pop(0)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_carrier_gradient_sums_the_increments_to_the_norm(as_tensor):
    increments = [3.0, 1.0] if not as_tensor else [torch.tensor(3.0, dtype=torch.float64), torch.tensor(1.0)]
    m = _Module()
    carrier = attach_carrier(m, _Runtime(increments))
    for _ in range(2):  # two micro-batches: DeepSpeed's accumulation of the carrier's gradient telescopes
        m.anchor().backward()
    assert carrier.grad.dtype == torch.float32 and carrier.grad.shape == (CARRIER_ELEMENTS,)
    assert torch.allclose(carrier.grad, torch.full((CARRIER_ELEMENTS,), 4.0 / math.sqrt(CARRIER_ELEMENTS)))
    assert float(carrier.grad.norm()) == pytest.approx(4.0)
