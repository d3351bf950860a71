"""Missed experts computed on the host: ``"moe": {"cpu_compute": "misses" | "auto"}``.

In a decode step a layer routes each token to ``top_k`` experts; those not resident in the layer's GPU slots would
each be copied whole over the link to serve one or two tokens. :class:`HostExpertCompute` instead computes them
where they live, from the CPU tier's weights (the ``maximus_expert_cpu`` op: fp32 accumulation, OpenMP over rows),
while the GPU computes the resident ones. ``misses`` sends every missed expert to the host; ``auto`` only those
routed at most ``cpu_compute_max_tokens`` tokens (a prefill's crowded experts go to the GPU, whose GEMM wins
once the copy is shared by many tokens).

The result equals the GPU path's within fp32-accumulation tolerances: the host computes each expert's
SwiGLU in fp32 from the same weights (exact, or the quantized tier's packed form, decoded in the op), scales it by
the same routing weight, and adds it into the layer's output in the model's dtype (the order of the additions
differs from the eager loop's).

Works with fused SwiGLU experts (``gate_up_proj`` ``[2F, H]`` with the gate rows first, ``down_proj``
``[H, F]``, SiLU, no biases: Mixtral, Qwen2-MoE, Qwen3-MoE) on a CPU tier; anything else is refused with a
:class:`~ds_maximus.errors.ConfigError`.

>>> import torch
>>> from ds_maximus.config import ExpertCPUCompute
>>> h = HostExpertCompute.__new__(HostExpertCompute)
>>> h.mode, h.max_tokens = ExpertCPUCompute.AUTO, 2
>>> h.choose(used=[0, 3, 5], counts=[1, 0, 0, 4, 0, 2], resident=[0])
[5]
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ds_maximus.config import ExpertCPUCompute
from ds_maximus.errors import ConfigError
from ds_maximus.experts.quant import QuantizedTensor
from ds_maximus.ops import expert_cpu

# expert_cpu is used as a module, its names read at call time: ops.expert_cpu imports experts.quant, so this
# module can be reached while ops.expert_cpu is still initialising

_SILU = ("SiLU", "SiLUActivation")


class HostExpertCompute:
    """Computes a layer's routed, non-resident experts on the host from the CPU tier (see the module docstring).

    ``store``: the expert store (its ``host_view(uid)`` is the expert's flat CPU-tier buffer); ``num_experts``
    per layer; ``mode`` and ``max_tokens`` from the ``moe`` section.
    """

    def __init__(self, store, num_experts: int, mode: ExpertCPUCompute, max_tokens: int = 8):
        self.store = store
        self.layout = store.layout  # ExpertLayout, or QuantizedExpertLayout (moe.quant)
        self.num_experts = int(num_experts)
        self.mode = ExpertCPUCompute(mode)
        self.max_tokens = int(max_tokens)
        self.experts_computed = 0  # experts computed on the host
        self.tokens_computed = 0   # (token, expert) pairs computed on the host

    @staticmethod
    def check_supported(store, original, form) -> None:
        """Raise ``ConfigError`` unless experts of module ``original`` can be computed on the host."""
        name = type(original).__name__
        if store.host_view(0) is None:
            raise ConfigError("moe.cpu_compute needs the experts' tier in CPU memory (offload.device: cpu); with an "
                              "NVMe tier set cpu_compute to \"off\"")
        if form.is_transposed or form.has_bias:
            raise ConfigError(f"moe.cpu_compute supports fused SwiGLU experts without biases; {name} stores "
                              f"{'transposed ' if form.is_transposed else ''}projections"
                              f"{' with biases' if form.has_bias else ''}: set cpu_compute to \"off\"")
        act = type(getattr(original, "act_fn", None)).__name__
        if act not in _SILU:
            raise ConfigError(f"moe.cpu_compute computes SiLU-gated experts; {name} uses {act}: set cpu_compute "
                              f"to \"off\"")
        if set(store.layout.names) != {"gate_up_proj", "down_proj"}:
            raise ConfigError(f"moe.cpu_compute needs experts made of gate_up_proj and down_proj; {name} has "
                              f"{sorted(store.layout.names)}: set cpu_compute to \"off\"")

    def choose(self, used: Sequence[int], counts: Sequence[int], resident: Sequence[int]) -> List[int]:
        """The experts of ``used`` to compute on the host: not in ``resident``, and under ``auto`` routed at most
        ``max_tokens`` tokens (``counts[e]``: the layer's (token, k) pairs routed to expert ``e``)."""
        if self.mode == ExpertCPUCompute.OFF:
            return []
        res = set(resident)
        missed = [e for e in used if e not in res]
        if self.mode == ExpertCPUCompute.AUTO:
            missed = [e for e in missed if counts[e] <= self.max_tokens]
        return missed

    def weights(self, uid: int) -> Tuple[expert_cpu.Weight, expert_cpu.Weight, expert_cpu.Weight]:
        """``(w1, w3, w2)`` of expert ``uid``: views of its CPU-tier buffer (gate rows, up rows, down); with
        ``moe.quant`` three :class:`~ds_maximus.experts.quant.QuantizedTensor` of the packed form, which the op
        decodes row by row."""
        flat = self.store.host_view(uid)
        gate_up = self.layout.view(flat, "gate_up_proj")
        ffn = gate_up.shape[0] // 2
        if isinstance(gate_up, QuantizedTensor):
            return gate_up.rows(0, ffn), gate_up.rows(ffn, 2 * ffn), self.layout.view(flat, "down_proj")
        return gate_up[:ffn], gate_up[ffn:], self.layout.view(flat, "down_proj")

    def forward(self, group: int, hidden: Tensor, top_k_weights: Tensor, experts: Sequence[int],
                where: Dict[int, Tuple[List[int], List[int]]]) -> Tensor:
        """Sum over ``experts`` of each expert's routing-weighted output, fp32 ``[tokens, hidden]`` on the host.

        ``hidden`` and ``top_k_weights`` are the layer's (any device: copied once to the host); ``where[e]`` the
        ``(top_k_pos, token_idx)`` host lists of expert ``e``'s pairs.
        """
        x = hidden.detach().to("cpu", torch.float32)
        rw = top_k_weights.detach().to("cpu", torch.float32)
        out = torch.zeros_like(x)
        for e in experts:
            pos, tok = where[e]
            t = torch.tensor(tok, dtype=torch.long)
            y = expert_cpu.swiglu(x[t], *self.weights(group * self.num_experts + e))
            out.index_add_(0, t, y * rw[t, torch.tensor(pos, dtype=torch.long), None])
            self.experts_computed += 1
            self.tokens_computed += len(tok)
        return out

    def stats(self) -> dict:
        return {"cpu_experts": self.experts_computed, "cpu_expert_tokens": self.tokens_computed}

    def reset_stats(self) -> None:
        self.experts_computed = self.tokens_computed = 0
