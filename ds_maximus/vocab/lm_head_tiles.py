"""Element-wise math of one ``[tokens, vocab rows]`` logits tile of the streamed cross-entropy.

A tile holds ``z = hidden_block @ weight_chunk.T`` in the compute dtype (bf16/fp16/fp32). Two
functions work on it, always in fp32 internally:

* :func:`tile_stats_` folds the tile into running per-token ``(max, sum exp(s - max), s[label],
  sum_j s_j)`` (an online log-sum-exp), where ``s = softcap(z)``;
* :func:`tile_grad_` overwrites the tile with ``d loss / d z`` times a per-token weight, given the
  token's final log-sum-exp.

With label smoothing ``eps`` over ``V`` classes the per-token loss is
``lse - (1 - eps) * s[y] - eps / V * sum_j s_j`` (what ``F.cross_entropy`` computes) and its gradient
is ``softmax(s) - (1 - eps) * onehot(y) - eps / V``, times ``1 - tanh(z / c)^2`` under a softcap ``c``.

On CUDA both functions are compiled with ``torch.compile`` (one fused read of the tile for the
statistics, one read + one write for the gradient) when Triton is importable; set
``DS_MAXIMUS_LCE_COMPILE=0`` to force the eager versions (which need two ``[T, R]`` fp32
temporaries), ``=force`` to compile on any device (CPU tests of the compiled path). A compile
failure falls back to eager once, with a warning.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Tuple

import torch

log = logging.getLogger(__name__)


def _softcapped(z: torch.Tensor, cap: Optional[float]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    s = z if z.dtype == torch.float64 else z.float()
    if cap is None:
        return s, None
    t = torch.tanh(s / cap)
    return t * cap, t


def tile_stats_(z: torch.Tensor, labels_local: torch.Tensor, cap: Optional[float], m: torch.Tensor,
                l: torch.Tensor, tgt: torch.Tensor, ssum: Optional[torch.Tensor]) -> None:
    """Fold one tile into the running per-token statistics (all ``[T]``, fp32, updated in place).

    ``m``/``l``: running max and sum of ``exp(s - m)`` (online log-sum-exp); ``tgt``: the label's
    ``s``; ``ssum``: the row sum of ``s`` (label smoothing) or None. ``labels_local`` are the labels
    minus the chunk's first row (out of ``[0, R)``: the label is not in this chunk).
    """
    s, _ = _softcapped(z, cap)
    rows = s.shape[1]
    m_c = s.amax(dim=1)
    l_c = torch.exp(s - m_c[:, None]).sum(dim=1)
    m_new = torch.maximum(m, m_c)
    l.copy_(l * torch.exp(m - m_new) + l_c * torch.exp(m_c - m_new))
    m.copy_(m_new)
    inside = (labels_local >= 0) & (labels_local < rows)
    idx = labels_local.clamp(0, rows - 1)[:, None]
    tgt.add_(torch.where(inside, s.gather(1, idx).squeeze(1), torch.zeros((), dtype=s.dtype, device=s.device)))
    if ssum is not None:
        ssum.add_(s.sum(dim=1))


def tile_grad_(z: torch.Tensor, labels_local: torch.Tensor, lse: torch.Tensor, row_weight: torch.Tensor,
               cap: Optional[float], smooth_over_v: float, one_minus_eps: float) -> torch.Tensor:
    """Overwrite the tile ``z`` with ``row_weight[:, None] * d loss / d z`` (in z's dtype); returns z."""
    s, t = _softcapped(z, cap)
    rows = s.shape[1]
    g = torch.exp(s - lse[:, None])
    if smooth_over_v:
        g = g - smooth_over_v
    inside = (labels_local >= 0) & (labels_local < rows)
    idx = labels_local.clamp(0, rows - 1)[:, None]
    hit = (-one_minus_eps) * inside.to(g.dtype)[:, None]
    g = g.scatter_add(1, idx, hit)
    if t is not None:
        g = g * (1.0 - t * t)
    g = g * row_weight[:, None]
    z.copy_(g)
    return z


def _raise_recompile_limit(limit: int = 64) -> None:
    """Tiles come in a few shapes (full/last chunk x full/last block): allow their recompiles."""
    try:
        import torch._dynamo
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), limit))
    except Exception:  # an older/newer dynamo without these knobs: keep its default
        pass


class _Kernels:
    """The tile functions for one device type: compiled on CUDA when possible, eager otherwise."""

    def __init__(self):
        self._compiled = {}
        self._broken = False

    def _want_compile(self, device: torch.device) -> bool:
        mode = os.environ.get("DS_MAXIMUS_LCE_COMPILE", "1")
        if self._broken or mode == "0":
            return False
        if mode == "force":          # any device (tests run the compiled path on CPU with inductor's C++ backend)
            return True
        if device.type != "cuda":
            return False
        try:
            import triton  # noqa: F401
        except Exception:
            return False
        return True

    def _call(self, name: str, fn: Callable, device: torch.device, *args):
        if self._want_compile(device):
            try:
                if name not in self._compiled:
                    _raise_recompile_limit()
                    # dynamic after a 1st recompile (the last chunk or token block): the first shape's static kernel
                    # rounds other low bits than the dynamic one (a process's first step differed from later ones on
                    # 174 of 40,000 rows of a tied head, <= 1.2e-5), but dynamic=True from the first call measured
                    # 5-19% slower (bench_lm_head; docs/bench/peft_vocab.md)
                    self._compiled[name] = torch.compile(fn, fullgraph=True)
                return self._compiled[name](*args)
            except Exception as e:  # a broken toolchain must not break training: fall back once
                log.warning("ds_maximus: torch.compile of the LM-head tile math failed (%s: %s); "
                            "using eager kernels (slower, more temporary memory)", type(e).__name__, e)
                self._broken = True
        return fn(*args)

    def stats_(self, z, labels_local, cap, m, l, tgt, ssum):
        return self._call("stats", tile_stats_, z.device, z, labels_local, cap, m, l, tgt, ssum)

    def grad_(self, z, labels_local, lse, row_weight, cap, smooth_over_v, one_minus_eps):
        return self._call("grad", tile_grad_, z.device, z, labels_local, lse, row_weight, cap,
                          smooth_over_v, one_minus_eps)


KERNELS = _Kernels()
