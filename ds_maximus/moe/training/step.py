"""The optimizer step of trained experts: each expert is one row of the row optimizer.

Two ways, by ``moe.optimizer_device`` and the tier:

* in place on the CPU tier (``cpu``, tier in memory): the fused row-update op runs on the tier's own
  masters and moments; only the gradient came from the device;
* staged (``compute``, or an NVMe tier): masters and moments go to the step device in pieces of at most
  ``moe.step_chunk_bytes`` (with the gradient), are updated there and come back; a piece is part of
  one expert when an expert is larger than the budget (AdamW is elementwise), else a few experts.

After an expert is updated, its compute copies (the shadow in the CPU tier and a resident cache slot)
are refreshed, so no stale copy is ever used. The row op parallelises over rows, so an expert's flat
buffer is viewed as ``numel / sub`` sub-rows that share the expert's step bookkeeping.
"""
from __future__ import annotations

from typing import List

import torch

STATE_BYTES = 4  # fp32 masters, moments and gradients


def _views(t: torch.Tensor, sub: int) -> torch.Tensor:
    return t.reshape(-1, sub)


def step_in_place(tr, uids: List[int]) -> None:
    """Update ``uids`` on the in-memory CPU tier itself (gradients brought to the CPU)."""
    opt, t = tr.row_optimizer, tr.store._tier.tensors
    ids = torch.tensor(uids)
    k = tr.numel // tr.sub
    g = torch.stack([tr.grads.pop(u, torch.device("cpu")) for u in uids])
    opt.update(_views(t["weight"], tr.sub), [_views(t[n], tr.sub) for n in opt.state_names],
               (ids[:, None] * k + torch.arange(k)).flatten(), _views(g, tr.sub), ids.repeat_interleave(k))
    for u in uids:
        tr.refresh(u, t["weight"][u])
    tr.counters.add_step_traffic(len(uids), STATE_BYTES * tr.numel * len(uids))


def _pieces(tr, uids: List[int]):
    """``(uids, lo, hi)`` pieces within the staging budget (element ranges are multiples of ``tr.sub``)."""
    per_elem = STATE_BYTES * (len(tr.store.names) + 1)
    piece = max(tr.sub, (tr.cfg.moe.step_chunk_bytes // per_elem) // tr.sub * tr.sub)
    if piece >= tr.numel:
        n = max(1, piece // tr.numel)
        for i in range(0, len(uids), n):
            yield uids[i:i + n], 0, tr.numel
        return
    for u in uids:
        for lo in range(0, tr.numel, piece):
            yield [u], lo, min(lo + piece, tr.numel)


def step_staged(tr, uids: List[int], dev: torch.device) -> None:
    """Update ``uids`` on ``dev``, streaming masters/moments/gradients through in budgeted pieces."""
    opt, store = tr.row_optimizer, tr.store
    names = store.names
    sub = tr.sub
    host = None
    host_uids: List[int] = []
    for part, lo, hi in _pieces(tr, uids):
        if part != host_uids:  # the host rows of these experts (views of the tier, or copies from NVMe)
            _write_back(tr, host_uids, host)
            host_uids = part
            host = _host_rows(tr, part)
        ids = torch.tensor(part)
        width = hi - lo
        staged = {}
        for n in names:
            buf = torch.empty(len(part), width, device=dev)
            for i in range(len(part)):
                buf[i].copy_(host[n][i][lo:hi], non_blocking=True)
            staged[n] = buf
        last = hi == tr.numel
        g = torch.stack([tr.grads.get(u)[lo:hi].to(dev, non_blocking=True) for u in part])
        before = opt.last_step.index_select(0, ids)
        opt.update(_views(staged["weight"], sub), [_views(staged[n], sub) for n in opt.state_names],
                   torch.arange(len(part) * (width // sub)), _views(g, sub), ids.repeat_interleave(width // sub))
        if not last:  # the next piece of these experts starts from the same step state
            opt.last_step.index_copy_(0, ids, before)
        for n in names:
            for i in range(len(part)):
                host[n][i][lo:hi].copy_(staged[n][i], non_blocking=True)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the host rows feed the next loads
        for i, u in enumerate(part):
            tr.refresh(u, staged["weight"][i], offset=lo)
        moved = 2 * STATE_BYTES * width * len(names) if dev.type != "cpu" else STATE_BYTES * width
        tr.counters.add_step_traffic(len(part) if last else 0, moved * len(part))
        if last:
            for u in part:
                tr.grads.pop(u)
    _write_back(tr, host_uids, host)


def _host_rows(tr, part: List[int]):
    store = tr.store
    if store.in_memory:
        t = store._tier.tensors
        return {n: [t[n][u] for u in part] for n in store.names}
    rows = store.read_rows(torch.tensor(part), pin=True)
    return {n: list(rows[n]) for n in store.names}


def _write_back(tr, part: List[int], host) -> None:
    if not part or tr.store.in_memory:
        return
    tr.store.write_rows(torch.tensor(part), {n: torch.stack(v) for n, v in host.items()})
