"""Expert math on cached slots, op for op the same as the HF experts implementations.

``transformers`` 5.x computes fused experts (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F], or
GPT-OSS's transposed form with biases: :mod:`ds_maximus.experts.adapters.projection`) with one of
``eager`` (a loop over hit experts, ``index_add_``), ``grouped_mm`` (rows sorted by expert, one
grouped GEMM per projection, a reshape-sum over top-k) or ``batched_mm`` (one bmm over per-pair
gathered weights). Each function below repeats the same ops in the same order on the
slot buffers of :class:`ExpertCache`, so logits equal the un-offloaded model's: the only change is
*where* an expert's weight is read from. When a layer needs more experts than it has slots (a batch's decode step,
a prefill), experts are processed in rounds of at most ``slots_per_layer`` (:meth:`ExpertComputeContext.rounds`):
the experts already resident (or staged by a right guess) first, so a round never evicts an expert a later round
of the same layer would hit, then the rest in ascending id. Every row's GEMM is still the original one, and
every reduction too: the eager loop adds the experts' outputs in ascending id whatever order they were
computed in. Slots of the quantized tier (``moe.quant``: packed codes, scales and offsets) are computed by
:func:`packed_forward`, the eager loop's arithmetic a round at a time: each projection of all the round's experts
in one launch on CUDA (:func:`ds_maximus.experts.quant_triton.quant_matmul_grouped`, the codes decoded inside the
GEMM), the gate and the routing weights over all the round's rows at once (element-wise: the same numbers as per
expert), each expert's rows added in ascending id as the eager loop adds them. A fine-grained model runs ~10
small experts a layer, where per-expert launches, not bytes, would set the speed.

No function here makes the host wait for the GPU: the routing arrives as host lists (``pairs``: the
flattened ``top_k_index``, fetched in the layer's one sync), and the index tensors built from it go to
the device through pinned memory, or come from a cache of those already there (:func:`round_index`). The
host thus queues a layer's expert GEMMs behind their loads and runs on to the next layer's attention and router
while the loads are in flight.

    >>> # used by OffloadedExperts.forward; see tests/experts/test_offload_generate.py
"""
from __future__ import annotations

import functools
from typing import Callable, List, Sequence

import torch

from ds_maximus.experts import quant
from ds_maximus.experts.adapters.projection import FusedExpertsForm, batched_linear, eager_linear, grouped_linear
from ds_maximus.experts.quant_triton import MMA_CONFIG
from ds_maximus.ops import to_device

# a round's index tensor (rows, top-k positions, starts, slot offsets) of at most this many entries is kept on the
# device by value: a batch-1 decode has a few dozen distinct ones, so after the first tokens a round copies nothing
ROUND_INDEX_CACHED = 64


@functools.lru_cache(maxsize=4096)
def _cached_index(values: tuple, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.long), device)


def round_index(values: List[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` (read only: callers never write it): short ones from a cache of
    tensors already there, the rest copied (to a GPU through pinned memory)."""
    if len(values) <= ROUND_INDEX_CACHED:
        return _cached_index(tuple(values), device)
    return to_device(torch.tensor(values, dtype=torch.long), device)


def rounds(experts: Sequence[int], size: int) -> List[List[int]]:
    """Split ascending expert ids into chunks of at most ``size``."""
    return [list(experts[i:i + size]) for i in range(0, len(experts), size)]


class ExpertComputeContext:
    """What the compute functions need: the cache, the layer's group, the layout and the gate fn."""

    def __init__(self, cache, group: int, apply_gate: Callable[[torch.Tensor], torch.Tensor], num_experts: int,
                 form: FusedExpertsForm = FusedExpertsForm()):
        self.cache = cache
        self.group = group
        self.layout = cache.layout
        self.apply_gate = apply_gate
        self.num_experts = num_experts
        self.form = form

    # the layer's prefetch of the next layer's guesses: run once, after the first round's expert work is queued
    # (its demand loads went to the copy stream first, and the GPU starts on the round before the host spends time
    # on guesses: staging a head, or reading a guess from NVMe)
    after_first_round: Callable[[], None] | None = None
    needed: Sequence[int] | None = None  # every expert of the layer's rounds (guesses for others are dropped)

    def rounds(self, used: Sequence[int]) -> List[List[int]]:
        """``used`` (ascending) in rounds of at most the layer's slots: resident experts (and the staged guess)
        first, the rest after, each part ascending. Sets ``needed`` to that order (the first round is its
        prefix, which is how the cache counts the overflow)."""
        size = self.cache.slots_of(self.group)
        if len(used) <= size:
            order = list(used)
        else:
            have = set(self.cache.resident(self.group))
            have.update(self.cache.staged_ids(self.group))  # a staged guess only moves its rest: first rounds
            order = [e for e in used if e in have] + [e for e in used if e not in have]
        self.needed = order
        return rounds(order, size)

    def acquire(self, chunk: Sequence[int]) -> List[int]:
        return self.cache.acquire(self.group, chunk, self.needed)

    def round_done(self) -> None:
        """A round's work is queued and its slots released: the first time, run ``after_first_round``."""
        hook, self.after_first_round = self.after_first_round, None
        if hook is not None:
            hook()

    def stacked(self, name: str) -> torch.Tensor:
        return self.layout.stacked_view(self.cache.slot_buffer(self.group), name)

    def stacked_bias(self, name: str):
        """The slots' ``<name>_bias`` [S, out], or None for experts without biases."""
        return self.stacked(name + "_bias") if self.form.has_bias else None

    def flat(self, slot: int) -> torch.Tensor:
        return self.cache.slot(self.group, slot)


def _pairs_of(pairs: Sequence[int], k: int, experts: Sequence[int]):
    """For each expert, ``(top_k_pos, token_idx)`` host lists of its (token, k) pairs, in the order of
    ``torch.where(one_hot(top_k_index).permute(2, 1, 0)[e])``: by k position, then by token."""
    n = len(pairs) // k
    want = set(experts)
    out = {e: ([], []) for e in experts}
    for pos in range(k):
        for t in range(n):
            e = pairs[t * k + pos]
            if e in want:
                out[e][0].append(pos)
                out[e][1].append(t)
    return out


def _expert_linear(ctx: ExpertComputeContext, x: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
    """One projection of one expert from its (exact) slot: the HF eager ``linear``."""
    lay = ctx.layout
    bias = lay.view(flat, name + "_bias") if ctx.form.has_bias else None
    return eager_linear(x, lay.view(flat, name), bias, ctx.form)


def eager_forward(ctx: ExpertComputeContext, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, used: Sequence[int], pairs: Sequence[int]) -> torch.Tensor:
    """The ``eager`` loop: experts in ascending id, ``index_add_`` into a zero tensor (exact slots; packed ones:
    :func:`packed_forward`)."""
    final = torch.zeros_like(hidden)
    where = _pairs_of(pairs, top_k_index.size(-1), used)
    chunks = ctx.rounds(used)
    ascending = ctx.needed == sorted(ctx.needed)
    held = {}  # computed out of ascending order: added once every expert is done, in ascending id
    for chunk in chunks:
        slots = ctx.acquire(chunk)
        try:
            for e, s in zip(chunk, slots):
                top_k_pos, token_idx = round_index(where[e][0] + where[e][1], hidden.device).view(2, -1)
                cur = hidden[token_idx]
                flat = ctx.flat(s)
                h = ctx.apply_gate(_expert_linear(ctx, cur, flat, "gate_up_proj"))
                h = _expert_linear(ctx, h, flat, "down_proj")
                h = h * top_k_weights[token_idx, top_k_pos, None]
                if ascending:
                    final.index_add_(0, token_idx, h.to(final.dtype))
                else:
                    held[e] = (token_idx, h)
        finally:
            ctx.cache.release(ctx.group, slots)
        ctx.round_done()
    for e in sorted(held):
        token_idx, h = held[e]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


# Rounds whose experts have one row each (batch-1 decode) run the one-row gemv (quant_triton.decode_config), faster
# than the token-tile kernel at every width measured (docs/bench/moe_offload.md); False: the token-tile kernel
# (benchmarks/bench_moe_offload.py --decode-gemv tile, for comparison).
DECODE_GEMV = True
# The tensor-core kernel's launch for rounds whose experts have several rows (a prefill, a batch's decode), where
# quant_triton.mma_fits; None: the token-tile kernel (benchmarks/bench_moe_offload.py --round-mma off, for
# comparison). Faster than the token-tile kernel at every row count measured (docs/bench/moe_offload.md).
ROUND_MMA = MMA_CONFIG


def _packed_linear(ctx: ExpertComputeContext, x: torch.Tensor, name: str, slots: Sequence[int],
                   starts: Sequence[int], meta: torch.Tensor, max_rows: int) -> torch.Tensor:
    """One projection of a round's experts from their packed slots, ``x``'s rows ``starts[i]:starts[i + 1]``
    through the expert in ``slots[i]``: ``x @ dequantize(W)^T`` accumulated in fp32 and rounded to ``x``'s dtype, as
    a plain model holding the dequantized weights computes it. On
    CUDA with whole-byte codes one launch for the round (``meta``: the starts, then each slot's byte offset, on the
    device); elsewhere each expert by :func:`ds_maximus.experts.quant.linear`."""
    from ds_maximus.experts.quant_triton import gemv_fits
    lay = ctx.layout
    if x.is_cuda and gemv_fits(lay.bits, lay.group_size):
        from ds_maximus.experts.quant_triton import decode_config, quant_matmul_grouped
        y = quant_matmul_grouped(x, ctx.cache.slot_buffer(ctx.group), lay.parts[name], lay.base.shapes[name],
                                 lay.bits, lay.group_size, meta, len(slots), max_rows,
                                 config=decode_config(lay.bits) if DECODE_GEMV else None, mma=ROUND_MMA)
    else:
        y = torch.cat([quant.linear(x[starts[i]:starts[i + 1]], lay.view(ctx.flat(s), name))
                       for i, s in enumerate(slots)])
    return y.to(x.dtype)


def packed_forward(ctx: ExpertComputeContext, hidden: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, used: Sequence[int], pairs: Sequence[int]) -> torch.Tensor:
    """Packed (quantized) slots: the eager loop's numbers, a round at a time. A round's rows (each expert's tokens
    in the eager loop's order, expert after expert) and the layout of its slots go to the device in one copy; one
    gather; each projection of all its experts in one call (:func:`_packed_linear`); the gate and the routing
    weights over all its rows; then each expert's rows added in ascending id."""
    where = _pairs_of(pairs, top_k_index.size(-1), used)
    chunks = ctx.rounds(used)
    ascending = ctx.needed == sorted(ctx.needed)
    # one token in one round (batch-1 decode): its rows summed in ascending id with the same bf16 adds, no buffer
    one_token = hidden.shape[0] == 1 and len(chunks) == 1 and ascending
    final = None if one_token else torch.zeros_like(hidden)
    held = {}  # computed out of ascending order: added once every expert is done, in ascending id
    numel = ctx.layout.numel
    for chunk in chunks:
        slots = ctx.acquire(chunk)
        try:
            starts = [0]
            for e in chunk:
                starts.append(starts[-1] + len(where[e][1]))
            R = starts[-1]
            token_idx = [t for e in chunk for t in where[e][1]]
            top_k_pos = [p for e in chunk for p in where[e][0]]
            idx = round_index(token_idx + top_k_pos + starts + [s * numel for s in slots], hidden.device)
            tok, pos, meta = idx[:R], idx[R:2 * R], idx[2 * R:]
            most = max(b - a for a, b in zip(starts, starts[1:]))
            h = _packed_linear(ctx, hidden[tok], "gate_up_proj", slots, starts, meta, most)
            h = _packed_linear(ctx, ctx.apply_gate(h), "down_proj", slots, starts, meta, most)
            h = (h * top_k_weights[tok, pos, None]).to(hidden.dtype)
            if one_token:
                final = h[0:1]
                for r in range(1, R):
                    final = final + h[r:r + 1]
            else:
                for i, e in enumerate(chunk):
                    rows = slice(starts[i], starts[i + 1])
                    if ascending:
                        final.index_add_(0, tok[rows], h[rows])
                    else:
                        held[e] = (tok[rows], h[rows])
        finally:
            ctx.cache.release(ctx.group, slots)
        ctx.round_done()
    for e in sorted(held):
        token_idx, h = held[e]
        final.index_add_(0, token_idx, h)
    return final


def grouped_forward(ctx: ExpertComputeContext, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, used: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """The ``grouped_mm`` path: rows sorted by expert, grouped GEMMs over the slot stack, reshape-sum."""
    device = hidden.device
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden.shape
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    x_g = hidden[perm // num_top_k]
    w_g = sample_weights[perm]
    starts = [0] * (ctx.num_experts + 1)
    for e in range(ctx.num_experts):
        starts[e + 1] = starts[e] + counts[e]
    n_slots = ctx.cache.slots_of(ctx.group)
    gate_up, down = ctx.stacked("gate_up_proj"), ctx.stacked("down_proj")
    gate_up_b, down_b = ctx.stacked_bias("gate_up_proj"), ctx.stacked_bias("down_proj")
    tr = ctx.form.is_transposed
    proj_out = None
    for chunk in ctx.rounds(used):
        slots = ctx.acquire(chunk)
        try:
            per_slot = [0] * n_slots
            by_slot = sorted(zip(slots, chunk))
            for s, e in by_slot:
                per_slot[s] = counts[e]
            lo, hi = starts[chunk[0]], starts[chunk[-1] + 1]
            # one slice when the slots are in the chunk's order and no other routed expert's rows lie between
            in_order = [e for _, e in by_slot] == list(chunk) and hi - lo == sum(counts[e] for e in chunk)
            if in_order:
                rows = slice(lo, hi)
            else:
                rows = to_device(torch.cat([torch.arange(starts[e], starts[e + 1]) for _, e in by_slot]), device)
            offs = to_device(torch.tensor(per_slot, dtype=torch.int32).cumsum(0, dtype=torch.int32), device)
            row_slot = None  # each row's slot: its bias row, as the module gathers bias[expert_ids]
            if gate_up_b is not None:
                row_slot = to_device(torch.repeat_interleave(torch.arange(n_slots), torch.tensor(per_slot)), device)
            h = grouped_linear(x_g[rows], gate_up, offs, gate_up_b[row_slot] if row_slot is not None else None, tr)
            h = ctx.apply_gate(h)
            h = grouped_linear(h, down, offs, down_b[row_slot] if row_slot is not None else None, tr)
            if proj_out is None:
                proj_out = h.new_empty((x_g.shape[0], h.shape[1]))
            proj_out[rows] = h
        finally:
            ctx.cache.release(ctx.group, slots)
        ctx.round_done()
    weighted_out = proj_out * w_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=device)
    weighted_out = weighted_out[inv_perm]
    final = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final.to(hidden.dtype)


def batched_forward(ctx: ExpertComputeContext, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, used: Sequence[int], pairs: Sequence[int]) -> torch.Tensor:
    """The ``batched_mm`` path: per-pair gathered weights and bmm, reshape-sum over top-k."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden.shape
    x = hidden.repeat_interleave(num_top_k, dim=0)
    sample_weights = top_k_weights.reshape(-1)
    gate_up, down = ctx.stacked("gate_up_proj"), ctx.stacked("down_proj")
    gate_up_b, down_b = ctx.stacked_bias("gate_up_proj"), ctx.stacked_bias("down_proj")
    tr = ctx.form.is_transposed
    proj_out = None
    for chunk in ctx.rounds(used):
        slots = ctx.acquire(chunk)
        try:
            slot_of = dict(zip(chunk, slots))
            hit = [(i, slot_of[e]) for i, e in enumerate(pairs) if e in slot_of]  # the pairs of this round
            rows, sel = to_device(torch.tensor(hit, dtype=torch.long).t().contiguous(), hidden.device)  # one copy
            h = batched_linear(x[rows], gate_up[sel], gate_up_b[sel] if gate_up_b is not None else None, tr)
            h = ctx.apply_gate(h)
            h = batched_linear(h, down[sel], down_b[sel] if down_b is not None else None, tr)
            if proj_out is None:
                proj_out = h.new_empty((x.shape[0], h.shape[1]))
            proj_out[rows] = h
        finally:
            ctx.cache.release(ctx.group, slots)
        ctx.round_done()
    weighted_out = proj_out * sample_weights.unsqueeze(-1)
    final = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final.to(hidden.dtype)
