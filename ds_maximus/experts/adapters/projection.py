"""One projection (``gate_up`` or ``down``) of HF fused experts, op for op as transformers computes it.

transformers 5.x stores fused experts in one of two forms, flagged on the module by
``use_experts_implementation``: ``[E, out, in]`` weights without biases (Mixtral, Qwen-MoE, OLMoE,
DeepSeek-V3), or transposed ``[E, in, out]`` weights with ``*_bias`` [E, out] tensors (GPT-OSS).
:class:`FusedExpertsForm` names the form; the three functions below are each experts
implementation's projection (``eager``: the module's own forward; ``grouped_mm``; ``batched_mm``),
so the expert cache, which reads weights from slot buffers instead of the module, computes the
same numbers as the module would.

    >>> import torch
    >>> form = FusedExpertsForm(is_transposed=True, has_bias=True)
    >>> form.tensor_names
    ('gate_up_proj', 'down_proj', 'gate_up_proj_bias', 'down_proj_bias')
    >>> x, w, b = torch.ones(3, 4), torch.ones(4, 2), torch.zeros(2)
    >>> eager_linear(x, w, b, form).tolist()
    [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

try:  # the same dispatch (native grouped_mm or its fallback) as the original forward
    from transformers.integrations.moe import _batched_linear as _hf_batched_linear
    from transformers.integrations.moe import _grouped_linear as _hf_grouped_linear
except ImportError:  # pragma: no cover - older/newer transformers
    _hf_grouped_linear = _hf_batched_linear = None


@dataclasses.dataclass(frozen=True)
class FusedExpertsForm:
    """How a fused experts module stores its projections."""

    is_transposed: bool = False  # weights [E, in, out] (GPT-OSS) rather than [E, out, in]
    has_bias: bool = False       # gate_up_proj_bias [E, 2F] and down_proj_bias [E, H] (GPT-OSS)

    @property
    def tensor_names(self) -> Tuple[str, ...]:
        """The module's expert tensors, each stacked over experts along dim 0."""
        names = ("gate_up_proj", "down_proj")
        return names + tuple(n + "_bias" for n in names) if self.has_bias else names


def eager_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], form: FusedExpertsForm) -> torch.Tensor:
    """One expert's projection in the module's own (``eager``) forward: ``F.linear(x, w)`` for the
    ``[out, in]`` form, ``x @ w + b`` for the transposed biased form (GPT-OSS's loop)."""
    if form.is_transposed:
        out = x @ w
    else:
        out = F.linear(x, w)
    return out + b if b is not None else out


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, b: Optional[torch.Tensor] = None,
                   is_transposed: bool = False) -> torch.Tensor:
    """The ``grouped_mm`` projection: rows sorted by group, ``w`` stacked [G, ...], ``b`` one row per input
    row (the module gathers ``bias[expert_ids]``; the cache gathers the same values from its slots)."""
    if _hf_grouped_linear is not None:
        return _hf_grouped_linear(x, w, offs, bias=b, is_transposed=is_transposed)
    out = F.grouped_mm(x.to(w.dtype), w if is_transposed else w.transpose(-2, -1), offs=offs)
    if b is not None:
        out.add_(b)
    return out


def batched_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None,
                   is_transposed: bool = False) -> torch.Tensor:
    """The ``batched_mm`` projection: one weight (and bias) per row of ``x``, gathered by the caller."""
    if _hf_batched_linear is not None:
        return _hf_batched_linear(x, w, bias=b, is_transposed=is_transposed)
    if is_transposed:
        out = torch.bmm(x.unsqueeze(1), w).squeeze(1)
    else:
        out = torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
    if b is not None:
        out.add_(b)
    return out
