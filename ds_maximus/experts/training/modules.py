"""The thin modules that stand in the model for trained experts (no parameters: the trainer owns them).

* :class:`TrainedFusedExperts` replaces a transformers 5.x fused experts module (``block.experts``):
  same call ``(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``, the ``grouped_mm`` path's
  ops with the expert GEMMs done per round on cached experts.
* :class:`TrainedModuleExperts` replaces DeepSpeed-MoE's ``Experts`` (``moe.deepspeed_moe.experts``):
  same call ``(dispatched [G, E, C, d])``; experts the gate routed no token to output zeros (their
  capacity slots are all empty; DeepSpeed multiplies them by a zero combine weight).
"""
from __future__ import annotations

import torch
from torch import nn

from ds_maximus.ops import count_ids


class _TrainedExperts(nn.Module):
    def __init__(self, trainer, group: int):
        super().__init__()
        self.group = group
        self.__dict__["trainer"] = trainer  # not a submodule: the trainer is shared by every layer

    def set_grad_anchor(self, fn) -> None:
        """The norm carrier lives on layer 0's module; its anchor is taken in layer 0's forward."""
        self.trainer.set_grad_anchor(fn)

    def _apply(self, fn, recurse=True):
        probe = fn(torch.zeros(1, dtype=self.trainer.out_dtype, device=self.trainer.compute_device))
        self.trainer.place(probe.device, probe.dtype if probe.is_floating_point() else None)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        t = self.trainer
        return f"layer={self.group}, experts={t.num_experts}, slots={t.cache.slots_of(self.group)}"

    # the experts appear in the model's state_dict under their original names (a complete HF / DeepSpeed
    # checkpoint from model.state_dict() or save_pretrained), current to the last step
    def _expert_items(self, stacked):
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        stacked = self.trainer.expert_tensors(self.group)
        for key, t in self._expert_items(stacked):
            destination[prefix + key] = t.to(self.trainer.out_dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        shapes = {n: (self.trainer.num_experts, *sh) for n, sh in self.trainer.store.master_layout.shapes.items()}
        empty = {n: torch.empty(sh) for n, sh in shapes.items()}
        keys = [k for k, _ in self._expert_items(empty)]
        present = [k for k in keys if prefix + k in state_dict]
        if present and len(present) == len(keys):
            stacked = self._stack_loaded({k: state_dict[prefix + k] for k in keys}, shapes)
            if isinstance(stacked, str):
                error_msgs.append(f"{prefix}: {stacked}")
            else:
                self.trainer.load_expert_tensors(self.group, stacked)
        elif strict:
            missing_keys.extend(prefix + k for k in keys if prefix + k not in state_dict)
        rest = {k: v for k, v in state_dict.items() if not (k.startswith(prefix) and k[len(prefix):] in keys)}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class TrainedFusedExperts(_TrainedExperts):
    """Drop-in for an HF fused experts module; weights, gradients and optimizer state live in the trainer."""

    def __init__(self, trainer, group: int, original: nn.Module):
        super().__init__(trainer, group)
        self.num_experts = trainer.num_experts
        self.act_fn = getattr(original, "act_fn", None)
        self.__dict__["_original"] = original  # config and _apply_gate; its weights were removed

    def _expert_items(self, stacked):
        return list(stacked.items())  # gate_up_proj [E, 2F, H], down_proj [E, H, F]

    def _stack_loaded(self, tensors, shapes):
        for n, t in tensors.items():
            if tuple(t.shape) != shapes[n]:
                return f"size mismatch for {n}: checkpoint {tuple(t.shape)}, model {shapes[n]}"
        return {n: t.detach().float().cpu() for n, t in tensors.items()}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        t = self.trainer
        E = self.num_experts
        num_tokens, hidden_dim = hidden_states.shape
        num_top_k = top_k_index.size(-1)
        if hidden_states.dtype != t.out_dtype or hidden_states.device != t.compute_device:
            t.place(hidden_states.device, hidden_states.dtype)
        expert_ids = top_k_index.reshape(-1)
        counts = count_ids(expert_ids, E).tolist()  # the one host sync of the layer
        used = t.begin_layer(self.group, counts, hidden_states.detach())
        sample_weights = top_k_weights.reshape(-1)
        _, perm = torch.sort(expert_ids)
        x_g = hidden_states[perm // num_top_k]
        w_g = sample_weights[perm]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        pieces = []
        for chunk in t.rounds(used, self.group):
            rows = x_g[starts[chunk[0]]:starts[chunk[-1] + 1]]
            pieces.append(t.round(self.group, chunk, [counts[e] for e in chunk], rows))
        proj_out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        weighted_out = proj_out * w_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
        weighted_out = weighted_out[inv_perm]
        final = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        return final.to(hidden_states.dtype)


class TrainedModuleExperts(_TrainedExperts):
    """Drop-in for DeepSpeed-MoE's ``Experts``; reads the routing from its ``MOELayer`` (``exp_counts``)."""

    def __init__(self, trainer, group: int, moe_layer: nn.Module):
        super().__init__(trainer, group)
        self.num_local_experts = trainer.num_experts
        self.__dict__["_moe_layer"] = moe_layer

    def _expert_items(self, stacked):
        return [(f"deepspeed_experts.{e}.{n}", t[e]) for e in range(self.num_local_experts) for n, t in stacked.items()]

    def _stack_loaded(self, tensors, shapes):
        out = {}
        for n, sh in shapes.items():
            parts = [tensors[f"deepspeed_experts.{e}.{n}"] for e in range(self.num_local_experts)]
            if any(tuple(p.shape) != sh[1:] for p in parts):
                return f"size mismatch for expert parameter {n}: model {sh[1:]}"
            out[n] = torch.stack([p.detach().float().cpu() for p in parts])
        return out

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        t = self.trainer
        E = t.num_experts
        if inputs.dtype != t.out_dtype or inputs.device != t.compute_device:
            t.place(inputs.device, inputs.dtype)
        counts = [int(c) for c in self._moe_layer.exp_counts.reshape(-1).tolist()]
        used = t.begin_layer(self.group, counts, getattr(self._moe_layer, "maximus_input", None))
        outs = [None] * E
        for chunk in t.rounds(used, self.group):
            idx = torch.tensor(chunk, device=inputs.device)
            y = t.round(self.group, chunk, [counts[e] for e in chunk], inputs.index_select(1, idx))
            for i, e in enumerate(chunk):
                outs[e] = y[:, i:i + 1]
        zero = None
        for e in range(E):
            if outs[e] is None:
                if zero is None:
                    zero = inputs.new_zeros(inputs.shape[0], 1, *inputs.shape[2:])
                outs[e] = zero
        return torch.cat(outs, dim=1)
