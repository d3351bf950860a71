"""The autograd function of one *round* of trained experts (at most ``slots_per_layer`` experts at once).

Forward acquires the round's experts from the expert cache, computes, and releases them: no
expert weight is saved for backward, only the round's input rows. Backward acquires them again
(a hit when they are still resident; a reload from the CPU tier when they were evicted meanwhile),
recomputes the round with autograd on the slot buffer, and hands the gradient of every expert's
flat buffer to the trainer, which accumulates it per expert. The extra forward of the round is the
price of never pinning an expert from forward to backward (activation checkpointing of the experts).

An *expert kind* computes a round on slot buffers, op for op as the original module does:

* :class:`FusedExpertsKind`: transformers 5.x fused experts (Mixtral, Qwen-MoE, GPT-OSS), the ``grouped_mm``
  path (rows sorted by expert, grouped GEMMs over the slot stack).
* :class:`ModuleExpertsKind`: any per-expert ``nn.Module`` (DeepSpeed-MoE's ``Experts``), called with
  ``torch.func.functional_call`` on views of the slot.

    >>> # used by ExpertTrainer; tests/experts/training/test_function.py runs a round against autograd
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Sequence

import torch
from torch import nn

from ds_maximus.experts.adapters.projection import FusedExpertsForm, grouped_linear
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.ops import to_device


class ExpertKind:
    """How the experts of one layer compute on a slot buffer ``[S, numel]`` (no state of its own)."""

    layout: ExpertLayout

    def compute(self, buf: torch.Tensor, slots: Sequence[int], counts: Sequence[int],
                x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FusedExpertsKind(ExpertKind):
    """HF fused experts: ``x`` holds the round's rows sorted by expert (``counts[i]`` rows of expert i)."""

    def __init__(self, layout: ExpertLayout, apply_gate: Callable[[torch.Tensor], torch.Tensor],
                 form: FusedExpertsForm = FusedExpertsForm()):
        self.layout = layout
        self.apply_gate = apply_gate
        self.form = form  # GPT-OSS: transposed weights with biases

    def compute(self, buf, slots, counts, x):
        n_slots = buf.shape[0]
        device = x.device
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + int(c))
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        per_slot = [0] * n_slots
        for i, s in enumerate(slots):
            per_slot[s] = int(counts[i])
        in_order = order == list(range(len(slots)))
        if not in_order:  # grouped_mm wants rows in slot order
            idx = to_device(torch.cat([torch.arange(starts[i], starts[i + 1]) for i in order]), device)
            x = x.index_select(0, idx)
        offs = to_device(torch.tensor(per_slot, dtype=torch.int32).cumsum(0, dtype=torch.int32), device)
        lay, form = self.layout, self.form
        bias = {n: None for n in ("gate_up_proj", "down_proj")}
        if form.has_bias:  # each row's bias is its slot's row, as the module gathers bias[expert_ids]
            row_slot = to_device(torch.repeat_interleave(torch.arange(n_slots), torch.tensor(per_slot)), device)
            bias = {n: lay.stacked_view(buf, n + "_bias")[row_slot] for n in bias}
        h = grouped_linear(x, lay.stacked_view(buf, "gate_up_proj"), offs, bias["gate_up_proj"], form.is_transposed)
        h = self.apply_gate(h)
        h = grouped_linear(h, lay.stacked_view(buf, "down_proj"), offs, bias["down_proj"], form.is_transposed)
        if not in_order:
            inv = torch.empty_like(idx)
            inv[idx] = torch.arange(idx.numel(), device=device)
            h = h.index_select(0, inv)
        return h


class ModuleExpertsKind(ExpertKind):
    """Per-expert modules: ``x`` is ``[G, n, C, d]`` (DeepSpeed's dispatched capacity slots of the n experts)."""

    def __init__(self, layout: ExpertLayout, template: nn.Module):
        self.layout = layout
        self.template = copy.deepcopy(template).to("meta")  # structure only; weights come from the slots

    def compute(self, buf, slots, counts, x):
        outs = []
        for i, s in enumerate(slots):
            flat = buf[s]
            params: Dict[str, torch.Tensor] = {n: self.layout.view(flat, n) for n in self.layout.names}
            out = torch.func.functional_call(self.template, params, (x[:, i:i + 1],))
            if isinstance(out, tuple):
                out = out[0]  # DeepSpeed's Experts ignores a returned bias too
            outs.append(out)
        return torch.cat(outs, dim=1)


class ExpertRound(torch.autograd.Function):
    """``y = experts(x)`` for one round; ``anchor`` (a zero scalar) orders the norm carrier after it."""

    @staticmethod
    def forward(ctx, anchor, x, trainer, group: int, experts: List[int], counts: List[int]):
        ctx.trainer, ctx.group, ctx.experts, ctx.counts = trainer, group, experts, counts
        ctx.anchor_meta = (anchor.dtype, anchor.device)
        ctx.save_for_backward(x)
        return trainer.run_round(group, experts, counts, x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        gx = ctx.trainer.backward_round(ctx.group, ctx.experts, ctx.counts, x, grad_out)
        dtype, device = ctx.anchor_meta
        return torch.zeros((), dtype=dtype, device=device), gx, None, None, None, None
