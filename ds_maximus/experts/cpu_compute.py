"""Missed experts computed on the host: ``"moe": {"cpu_compute": "misses" | "auto"}``.

In a decode step a layer routes each token to ``top_k`` experts; those not resident in the layer's GPU slots would
each be copied whole over the link to serve one or two tokens. :class:`HostExpertCompute` instead computes them
where they live, from the CPU tier's weights (the ``maximus_expert_cpu`` op: fp32 accumulation, OpenMP over rows),
while the GPU computes the resident ones. ``misses`` sends every missed expert to the host; ``auto`` only those
routed at most ``cpu_compute_max_tokens`` tokens (a prefill's crowded experts go to the GPU, whose GEMM wins
once the copy is shared by many tokens), and on a CUDA device it splits those light misses between the host and
the link (:func:`balance`): the link loads some into free slots, where they stay for later tokens, while the host
computes the rest, so that both sides finish together. The two sides' costs are estimates: one pinned copy of an
expert for the link, timed as the tier is made; for the host the median of a few experts, timed once the tier is
filled (:meth:`HostExpertCompute.calibrate`), then the running mean of its measured seconds per expert (each
measurement counted at most twice the mean). A mean that keeps the host idle is sampled again: after ``EXPLORE``
layers in a row whose light misses all went over the link, one of them goes to the host (a first estimate taken
while the host was busy would otherwise stand for the rest of the run).

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
>>> h.mode, h.max_tokens, h.link_s = ExpertCPUCompute.AUTO, 2, None
>>> h.choose(used=[0, 3, 5], counts=[1, 0, 0, 4, 0, 2], resident=[0])
[5]
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ds_maximus.config import ExpertCPUCompute
from ds_maximus.errors import ConfigError
from ds_maximus.experts.quant import QuantizedTensor
from ds_maximus.ops import expert_cpu

# expert_cpu is used as a module, its names read at call time: ops.expert_cpu imports experts.quant, so this
# module can be reached while ops.expert_cpu is still initialising

_SILU = ("SiLU", "SiLUActivation")
HOST_GBPS_PRIOR = 20.0  # host seconds per expert before the first one is measured: its bytes at this rate
EMA = 0.2               # weight of the newest measurement in the host's running mean
SPIKE = 2.0             # a measurement counts at most this many times the running mean (one preempted call must not
                        # turn auto away from the host for the rest of the run)
EXPLORE = 32            # layers in a row with light misses but none on the host, after which one goes to the host
HOST_SAMPLES = 4        # experts timed (after a warm-up call) for the host's first estimate; their median counts


def balance(light: Sequence[int], counts: Sequence[int], free_slots: int, host_s: float, link_s: float,
            link_busy_s: float = 0.0, staged: Optional[int] = None, staged_frac: float = 1.0) -> List[int]:
    """Of the light misses ``light``, those the host computes; the others go over the link into slots.

    Greedy over two sides that run at once, the staged guess first (only the rest of it crosses the link,
    ``staged_frac`` of an expert), then the experts with more tokens: each goes where it finishes sooner,
    the link's load of ``link_s`` seconds (after ``link_busy_s`` already queued) or the host's ``host_s``,
    and the link takes at most ``free_slots`` experts.

    >>> balance([0, 1, 2, 3], [1, 1, 1, 1], free_slots=4, host_s=1.0, link_s=1.0)
    [1, 3]
    >>> balance([0, 1, 2, 3], [1, 1, 1, 1], free_slots=1, host_s=1.0, link_s=0.1)
    [1, 2, 3]
    >>> balance([0, 5], [1, 0, 0, 0, 0, 1], free_slots=2, host_s=1.0, link_s=3.0, staged=5, staged_frac=0.2)
    [0]
    """
    host_t, link_t, n_link, on_host = 0.0, float(link_busy_s), 0, []
    for e in sorted(light, key=lambda e: (e != staged, -counts[e], e)):
        c_link = link_s * (staged_frac if e == staged else 1.0)
        if n_link < free_slots and link_t + c_link <= host_t + host_s:
            link_t += c_link
            n_link += 1
        else:
            host_t += host_s
            on_host.append(e)
    return sorted(on_host)


class HostExpertCompute:
    """Computes a layer's routed, non-resident experts on the host from the CPU tier (see the module docstring).

    ``store``: the expert store (its ``host_view(uid)`` is the expert's flat CPU-tier buffer); ``num_experts``
    per layer; ``mode`` and ``max_tokens`` from the ``moe`` section.
    """

    def __init__(self, store, num_experts: int, mode: ExpertCPUCompute, max_tokens: int = 8, device=None):
        self.store = store
        self.layout = store.layout  # ExpertLayout, or QuantizedExpertLayout (moe.quant)
        self.num_experts = int(num_experts)
        self.mode = ExpertCPUCompute(mode)
        self.max_tokens = int(max_tokens)
        self.experts_computed = 0  # experts computed on the host
        self.tokens_computed = 0   # (token, expert) pairs computed on the host
        self.host_s = self.layout.nbytes / (HOST_GBPS_PRIOR * 1e9)  # host seconds per expert (running mean)
        # auto's split between host and link needs a link: on a CUDA device, one copy timed now, before the tier
        # fills (timed after it, the copy ran at half the decode's rate)
        self.link_s: Optional[float] = None
        self.device = torch.device(device) if device is not None else None
        self._idle = 0  # auto's layers in a row with light misses, none of them sent to the host
        if self._timed():
            self.link_s = self._time_link(self.device)

    def _timed(self) -> bool:
        return self.device is not None and self.device.type == "cuda" and self.mode == ExpertCPUCompute.AUTO

    def calibrate(self) -> None:
        """Auto's first host estimate, on a CUDA device: call once the tier holds the experts (the timing then reads
        them as a decode does, and nothing else fills the tier meanwhile)."""
        if self._timed():
            self.host_s = self._time_host()

    def _time_link(self, device: torch.device) -> float:
        """Seconds of one expert's pinned host-to-device copy (the faster of two, after a warm-up)."""
        src = self.store.host_view(0)
        dst = torch.empty_like(src, device=device)
        torch.cuda.synchronize(device)
        best = float("inf")
        for i in range(3):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            if i:
                best = min(best, time.perf_counter() - t0)
        return best

    def _time_host(self) -> float:
        """Seconds of one token through one expert on the host, the median over ``HOST_SAMPLES`` different experts
        after a warm-up call (each read from memory, as a decode's miss is): auto's first estimate, which the
        running mean then follows (a fixed prior far from the host's speed would keep auto from ever trying the
        host, and so from ever measuring it)."""
        n = min(self.store.num_uids, HOST_SAMPLES + 1)
        experts = [self.weights(uid) for uid in range(n)]
        x = torch.zeros(1, experts[0][0].shape[1])
        times = []
        for w in experts:
            t0 = time.perf_counter()
            expert_cpu.swiglu(x, *w)
            times.append(time.perf_counter() - t0)
        times = sorted(times[1:] if n > 1 else times)
        return times[len(times) // 2]

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

    def choose(self, used: Sequence[int], counts: Sequence[int], resident: Sequence[int],
               slots: Optional[int] = None, staged: Optional[int] = None, staged_frac: float = 1.0) -> List[int]:
        """The experts of ``used`` to compute on the host: not in ``resident``, and under ``auto`` routed at most
        ``max_tokens`` tokens (``counts[e]``: the layer's (token, k) pairs routed to expert ``e``); with a link
        (CUDA) and the layer's ``slots``, auto gives the link the share of those that :func:`balance` picks
        (``staged``: the expert whose first ``1 - staged_frac`` is already staged on the device)."""
        if self.mode == ExpertCPUCompute.OFF:
            return []
        res = set(resident)
        missed = [e for e in used if e not in res]
        if self.mode == ExpertCPUCompute.AUTO:
            light = [e for e in missed if counts[e] <= self.max_tokens]
            if slots is None or self.link_s is None:
                return light
            crowded = len(missed) - len(light)   # these go over the link whatever the split
            free = int(slots) - (len(used) - len(missed)) - crowded
            on_host = balance(light, counts, max(0, free), self.host_s, self.link_s, crowded * self.link_s,
                              staged, staged_frac)
            if on_host or not light:
                self._idle = 0
                return on_host
            self._idle += 1
            if self._idle < EXPLORE:
                return on_host
            self._idle = 0  # sample the host again: the lightest miss, the staged guess last (its head has crossed)
            return [min(light, key=lambda e: (e == staged, counts[e], e))]
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
            t0 = time.perf_counter()
            pos, tok = where[e]
            t = torch.tensor(tok, dtype=torch.long)
            y = expert_cpu.swiglu(x[t], *self.weights(group * self.num_experts + e))
            out.index_add_(0, t, y * rw[t, torch.tensor(pos, dtype=torch.long), None])
            self.host_s += EMA * (min(time.perf_counter() - t0, SPIKE * self.host_s) - self.host_s)
            self.experts_computed += 1
            self.tokens_computed += len(tok)
        return out

    def stats(self) -> dict:
        """Experts and (token, expert) pairs computed on the host; the split's cost estimates, ms an expert."""
        return {"cpu_experts": self.experts_computed, "cpu_expert_tokens": self.tokens_computed,
                "cpu_ms_per_expert": self.host_s * 1e3,
                "link_ms_per_expert": self.link_s * 1e3 if self.link_s is not None else None}

    def reset_stats(self) -> None:
        self.experts_computed = self.tokens_computed = 0
