"""Checkpoints and whole-expert views of an ``ExpertTrainer`` (a mixin, like the embedding's
``ShardedStateMixin``): every one of these first waits for a step still running, and brings every expert to the
current step (exact mode), so what is saved or exported is what dense AdamW would hold.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from ds_maximus.errors import ConfigError


class ExpertStateMixin:
    """``maximus_state_dict`` round trips and ``expert_tensors`` / ``load_expert_tensors``."""

    # -- checkpoints ----------------------------------------------------------------------------------
    def _catch_up_all(self) -> None:
        self.finish_step()
        if self.row_optimizer.lazy or self.row_optimizer.step == 0:
            return
        self.cache.synchronize()
        uids = torch.arange(self.num_uids)
        lag = self.row_optimizer.lagging(uids)
        if bool(lag.any()):
            self._catch_up_uids(uids[lag])

    def maximus_state_dict(self) -> dict:
        """fp32 masters + optimizer state of every expert (brought to the current step) + step counters."""
        self._catch_up_all()
        self.flush()
        return {"format_version": 1, "layers": self.num_layers, "num_experts": self.num_experts,
                "numel": self.numel, "names": list(self.store.master_layout.names),
                "tensors": self.store.state(), "optimizer": self.row_optimizer.state_dict()}

    def load_maximus_state_dict(self, d: dict) -> None:
        got = (d["layers"], d["num_experts"], d["numel"])
        if got != (self.num_layers, self.num_experts, self.numel):
            raise ConfigError(f"checkpoint experts are {got[0]} layers x {got[1]} experts x {got[2]} elements, this "
                              f"model has {self.num_layers} x {self.num_experts} x {self.numel}; load a checkpoint "
                              "of the same MoE architecture")
        missing = [n for n in self.store.names if n not in d["tensors"]]
        if missing:
            raise ConfigError(f"checkpoint lacks expert optimizer tensors {missing}; was it saved with another "
                              "moe.optimizer.type?")
        self.flush()
        self.grads.clear()
        self.store.load_state(d["tensors"])
        self.row_optimizer.load_state_dict(d["optimizer"])
        self._build_cache()

    # -- whole experts (export) -----------------------------------------------------------------------
    def expert_tensors(self, group: int) -> Dict[str, Tensor]:
        """Layer ``group``'s experts as stacked tensors ``{name: [E, ...]}`` (fp32, current step)."""
        self._catch_up_all()
        lay = self.store.master_layout
        out = {n: torch.empty(self.num_experts, *lay.shapes[n]) for n in lay.names}
        for e in range(self.num_experts):
            flat = self.store.master_row(group * self.num_experts + e)
            for n in lay.names:
                out[n][e].copy_(lay.view(flat, n))
        return out

    def load_expert_tensors(self, group: int, tensors: Dict[str, Tensor]) -> None:
        """Overwrite layer ``group``'s masters from stacked tensors (optimizer state kept)."""
        self.flush()
        self.store.write_layer(group * self.num_experts, tensors)
        self.row_optimizer.last_step[group * self.num_experts:(group + 1) * self.num_experts] = \
            self.row_optimizer.step
        self._build_cache()

