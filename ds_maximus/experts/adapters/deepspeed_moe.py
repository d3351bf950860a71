"""DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``): find its layers and their experts.

A ``MoE`` holds ``deepspeed_moe`` (a ``MOELayer``: a ``TopKGate`` router with weight ``gate.wg``
[E, d], and ``experts``: DeepSpeed's ``Experts``, a ``ModuleList`` of E copies of the user's expert
module). Every expert has the same parameters, so they stack into one :class:`ExpertLayout`.

For training, :func:`hide_from_engine` swaps each ``MoE`` for :class:`MaximusDeepSpeedMoE`, which runs
the same forward: the experts left DeepSpeed (they live in the expert tier), so its native-MoE
handling (expert parameter groups, expert-parallel all-reduce, and the ZeRO-3 refusal of native MoE)
must not apply to what remains (the gate and any residual MLP are ordinary dense parameters).

Example (tests/experts/training/test_equality.py trains one)::

    from deepspeed.moe.layer import MoE
    net = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=1))
    [(i.name, i.num_experts, i.top_k) for i in find_deepspeed_moe_layers(net)]   # [('0', 4, 1)]
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Dict, List

import torch
from torch import nn

from ds_maximus.errors import ConfigError


@dataclasses.dataclass
class DeepSpeedMoEInfo:
    name: str
    moe: nn.Module          # deepspeed.moe.layer.MoE
    layer: nn.Module        # its MOELayer
    num_experts: int
    top_k: int

    @property
    def experts(self) -> nn.ModuleList:
        return self.layer.experts.deepspeed_experts

    def expert_tensors(self) -> Dict[str, torch.Tensor]:
        """Every expert parameter stacked along dim 0: ``{param name: [E, ...]}``."""
        per = [dict(m.named_parameters()) for m in self.experts]
        return {n: torch.stack([p[n].detach() for p in per]) for n in per[0]}


def find_deepspeed_moe_layers(model: nn.Module) -> List[DeepSpeedMoEInfo]:
    """Every ``deepspeed.moe.layer.MoE`` of ``model``, in module order."""
    layer_mod = sys.modules.get("deepspeed.moe.layer")
    if layer_mod is None:  # not imported: the model cannot hold one (and importing DeepSpeed prints)
        return []
    MoE = layer_mod.MoE
    found = []
    for name, mod in model.named_modules():
        if not isinstance(mod, MoE):
            continue
        layer = mod.deepspeed_moe
        if mod.ep_size != 1:
            raise ConfigError(f"DeepSpeed MoE layer '{name}' has ep_size={mod.ep_size}; trained experts as swappable "
                              "partitions need ep_size=1 (every rank holds every expert in its CPU tier)")
        if getattr(layer, "use_tutel", False):
            raise ConfigError(f"DeepSpeed MoE layer '{name}' uses Tutel; build it with use_tutel=False")
        for m in layer.experts.deepspeed_experts:
            if any(True for _ in m.buffers()):
                raise ConfigError(f"DeepSpeed MoE layer '{name}': experts with buffers are not supported")
        found.append(DeepSpeedMoEInfo(name, mod, layer, int(mod.num_experts), int(layer.gate.k)))
    return found


class MaximusDeepSpeedMoE(nn.Module):
    """Stands in for a ``deepspeed.moe.layer.MoE`` whose experts are trained by maximus; same forward."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.deepspeed_moe = moe.deepspeed_moe
        self.use_residual = moe.use_residual
        if self.use_residual:
            self.mlp = moe.mlp
            self.coefficient = moe.coefficient
        for attr in ("ep_size", "num_experts", "num_local_experts", "expert_group_name",
                     "enable_expert_tensor_parallelism"):
            setattr(self, attr, getattr(moe, attr))

    def forward(self, hidden_states, used_token=None):
        from deepspeed.moe.layer import MoE
        return MoE.forward(self, hidden_states, used_token)


def hide_from_engine(model: nn.Module, infos: List[DeepSpeedMoEInfo]) -> None:
    """Replace each ``MoE`` of ``infos`` in its parent by a :class:`MaximusDeepSpeedMoE`."""
    for info in infos:
        parent, leaf = model, info.name
        if "." in info.name:
            path, leaf = info.name.rsplit(".", 1)
            parent = model.get_submodule(path)
        if info.name == "":
            raise ConfigError("the model itself is a DeepSpeed MoE layer; wrap it in a module")
        setattr(parent, leaf, MaximusDeepSpeedMoE(info.moe))
