"""The optimizer step of trained experts: each expert is one row of the row optimizer.

Three ways, by ``moe.optimizer_device`` and the tier:

* in place on the CPU tier (``cpu``, tier in memory): the fused row-update op runs on the tier's own
  masters and moments; only the gradient came from the device;
* staged (``compute``, or an NVMe tier): masters and moments go to the step device in pieces of at most
  ``moe.step_chunk_bytes`` (with the gradient), are updated there and come back; a piece is part of
  one expert when an expert is larger than the budget (AdamW is elementwise), else a few experts;
* split (``split``, tier in memory): both at once: a worker thread steps a share of the experts in place
  on the CPU tier (the op runs without the GIL) while this thread streams the rest through the device.
  Gradients already waiting on the host go to the CPU side first. The share follows the two sides'
  measured time per expert so that they finish together (or is fixed by ``moe.cpu_step_share``). With
  ``moe.overlap_step`` the step returns once queued and the next forward waits for each layer's experts
  when it reaches them (:mod:`~ds_maximus.experts.training.pending`).

After an expert is updated, its compute copies (the shadow in the CPU tier and a resident cache slot)
are refreshed, so no stale copy is ever used.

On a CUDA step device the pieces are pipelined over three streams: piece ``i + 1`` is loaded (H2D)
while piece ``i`` is updated and piece ``i - 1`` goes back (D2H: fp32 master and moments, and the compute
copy cast on the device, so the shadow costs 2 bytes a parameter and no CPU time); two buffer sets
alternate, and the host waits once, at the end of the step. The link is the limit: a Mixtral expert's
step moves 16 bytes per parameter in (14 when its gradient is a single bf16 one, see ``grads``) and 14 out.
Experts whose master and moments live on the device (``moe.gpu_state_experts``) are stepped there first, on
the same stream, with none of that state moving: only a host gradient in and the compute copy out.
The row op parallelises over rows, so an expert's flat buffer is viewed as ``numel / sub`` sub-rows that
share the expert's step bookkeeping.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import torch

from ds_maximus.experts.training.pending import PendingStep

STATE_BYTES = 4  # fp32 masters, moments and gradients


def _views(t: torch.Tensor, sub: int) -> torch.Tensor:
    return t.reshape(-1, sub)


def _update_in_place(tr, uid: int, grad: torch.Tensor, grad_scale: float = 1.0) -> None:
    """AdamW of expert ``uid`` with ``grad * grad_scale`` (flat, CPU) on the in-memory tier's own master and
    moments; the tier's compute copy (shadow) of the expert is written in the same pass."""
    opt, t, sub = tr.row_optimizer, tr.store._tier.tensors, tr.sub
    k = tr.numel // sub
    shadow = tr.store.shadow  # in memory: [num_uids, numel] like the tables, or None (fp32 compute)
    opt.update(_views(t["weight"], sub), [_views(t[n], sub) for n in opt.state_names],
               uid * k + torch.arange(k), _views(grad, sub), torch.full((k,), uid, dtype=torch.long),
               grad_scale=grad_scale, shadow=None if shadow is None else _views(shadow, sub))


def step_in_place(tr, uids: List[int]) -> None:
    """Update ``uids`` on the in-memory CPU tier itself (gradients brought to the CPU), one expert at a time."""
    for u in uids:
        _update_in_place(tr, u, tr.grads.pop(u, torch.device("cpu")))
        tr.refresh_slot(u, tr.store.host_view(u))  # the compute copy the op just wrote (bf16: half the bytes)
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
    # pieces of one size: with a short last piece (a 22M-element expert in 16M + 6M) the next expert's first piece
    # waited for this one's first piece to go back, in the CUDA pipeline's other buffer set
    n, subs = -(-tr.numel // piece), tr.numel // tr.sub
    bounds = [k * subs // n * tr.sub for k in range(n + 1)]  # widths differ by at most one sub-row
    for u in uids:
        for lo, hi in zip(bounds, bounds[1:]):
            yield [u], lo, hi


def step_staged(tr, uids: List[int], dev: torch.device) -> None:
    """Update ``uids`` on ``dev``, streaming masters/moments/gradients through in budgeted pieces (on a
    CUDA device pipelined; on the CPU, i.e. an NVMe tier stepped beside it, one piece after another)."""
    if dev.type == "cuda":
        return _step_staged_cuda(tr, uids, dev)
    store = tr.store
    names = store.names
    host = None
    host_uids: List[int] = []
    for part, lo, hi in _pieces(tr, uids):
        if part != host_uids:  # the host rows of these experts (views of the tier, or copies from NVMe)
            _write_back(tr, host_uids, host)
            host_uids = part
            host = _host_rows(tr, part)
        width = hi - lo
        staged = {}
        for n in names:
            buf = torch.empty(len(part), width, device=dev)
            for i in range(len(part)):
                buf[i].copy_(host[n][i][lo:hi], non_blocking=True)
            staged[n] = buf
        last = hi == tr.numel
        g = torch.stack([tr.grads.get(u, dev)[lo:hi] for u in part])
        _update_piece(tr, staged, g, part, width, last)
        for n in names:
            for i in range(len(part)):
                host[n][i][lo:hi].copy_(staged[n][i], non_blocking=True)
        for i, u in enumerate(part):
            tr.refresh(u, staged["weight"][i], offset=lo)
        tr.counters.add_step_traffic(len(part) if last else 0, STATE_BYTES * width * len(part))  # the gradient
        if last:
            for u in part:
                tr.grads.drop(u)
    _write_back(tr, host_uids, host)


def _piece_rows(tr, part: List[int], width: int):
    """The row op's ``(slots, ids)`` for experts ``part`` staged as ``[len(part), width]``: sub-rows in order."""
    return torch.arange(len(part) * (width // tr.sub)), torch.tensor(part).repeat_interleave(width // tr.sub)


def _update_rows(opt, weights, states, slots, grad, rows, experts: List[int], last: bool, index=None) -> None:
    """``opt.update`` of one piece of ``experts``; unless it is their ``last`` piece, their step bookkeeping is put
    back, so that the next piece starts from the same step state (AdamW is elementwise)."""
    ids = torch.tensor(experts)
    before = opt.last_step.index_select(0, ids)
    opt.update(weights, states, slots, grad, rows, index=index)
    if not last:
        opt.last_step.index_copy_(0, ids, before)


def _update_piece(tr, staged, grad, part: List[int], width: int, last: bool, index=None, rows=None) -> None:
    """AdamW on elements ``[lo, lo + width)`` of experts ``part``, staged as ``[len(part), width]`` rows
    (``rows``: their :func:`_piece_rows` when made already; ``index``: its ``RowOptimizer.device_index``)."""
    opt, sub = tr.row_optimizer, tr.sub
    slots, ids = rows if rows is not None else _piece_rows(tr, part, width)
    _update_rows(opt, _views(staged["weight"], sub), [_views(staged[n], sub) for n in opt.state_names],
                 slots, _views(grad, sub), ids, part, last, index)


def _step_resident(tr, uids: List[int], dev: torch.device, copy_stream=None) -> None:
    """AdamW of experts whose master and state live on the compute device (``moe.gpu_state_experts``), on the
    current stream: only a gradient waiting on the host comes in, and the compute copy goes out to the CPU tier's
    (shadow, or the master itself for fp32 compute), on ``copy_stream`` when given. A resident slot is refreshed
    on the device."""
    if not uids:
        return
    store, opt, sub = tr.store, tr.row_optimizer, tr.sub
    t, k = store.device_tables, tr.numel // sub
    weights, states = _views(t["weight"], sub), [_views(t[n], sub) for n in opt.state_names]
    piece = max(sub, (tr.cfg.moe.step_chunk_bytes // STATE_BYTES) // sub * sub)  # fp32 gradient widened at once
    grad_bytes = 0
    for u in uids:
        i, ids = store.resident[u], torch.tensor([u])
        raw, f = tr.grads.raw(u), tr.grads.factor(u)
        grad_bytes += raw.element_size() * tr.numel if raw.device != dev else 0
        if dev.type == "cuda":
            tr.grads.ready(u, torch.cuda.current_stream(dev))
        for lo in range(0, tr.numel, piece):  # the gradient in fp32, scaled, as the staged pipeline steps it
            hi = min(lo + piece, tr.numel)
            g = raw[lo:hi].to(dev, non_blocking=True).float()  # a bf16 one crosses as bf16, widens on the device
            g = g * f if f != 1.0 else g
            n = (hi - lo) // sub
            _update_rows(opt, weights, states, i * k + lo // sub + torch.arange(n), g.view(n, sub), ids.repeat(n),
                         [u], hi == tr.numel)
        host = store.host_view(u)
        copy = t["weight"][i] if host.dtype == torch.float32 else t["weight"][i].to(host.dtype)
        tr.refresh_slot(u, copy)
        if copy_stream is not None:
            copy_stream.wait_stream(torch.cuda.current_stream(dev))
            copy.record_stream(copy_stream)
            with torch.cuda.stream(copy_stream):
                host.copy_(copy, non_blocking=True)
        else:
            host.copy_(copy, non_blocking=dev.type == "cuda")
        if raw.is_cuda and copy_stream is not None:  # read by the queued update: its memory waits for it
            raw.record_stream(torch.cuda.current_stream(dev))
        tr.grads.drop(u)
    store.mark_device_newer(uids)
    tr.counters.add_step_traffic(len(uids), grad_bytes + len(uids) * tr.numel * store.host_view(uids[0]).element_size())


class _Pipeline:
    """The CUDA step's streams and its two buffer sets (kept on the trainer between steps)."""

    def __init__(self, dev: torch.device, names, elems: int, low_dtype):
        self.dev, self.elems = dev, elems
        self.load = torch.cuda.Stream(dev)
        self.store = torch.cuda.Stream(dev)
        self.update = torch.cuda.Stream(dev)  # the updates of a step that overlaps the next forward
        self.bufs = [{n: torch.empty(elems, device=dev) for n in (*names, "grad")} for _ in range(2)]
        self.low = [torch.empty(elems, dtype=low_dtype, device=dev) if low_dtype is not None else None
                    for _ in range(2)]
        self.freed = [None, None]  # per set: event after its D2H copies (the next load into it waits)
        self.grad_low = [None, None]  # per set: bf16 staging of host gradients kept in bf16 (made when needed)

    def grad_stage(self, k: int, n: int) -> torch.Tensor:
        """Set ``k``'s bf16 buffer of ``n`` elements: a host bf16 gradient lands here and widens on the device
        (a host-to-device ``copy_`` that changes dtype would convert on the host, in pageable memory)."""
        if self.grad_low[k] is None:
            self.grad_low[k] = torch.empty(self.elems, dtype=torch.bfloat16, device=self.dev)
        return self.grad_low[k][:n]


def _pipeline(tr, dev: torch.device, names, piece: int) -> _Pipeline:
    low = tr.store.shadow.dtype if tr.store.shadow is not None else None
    if low is None and tr.cache.layout.dtype != torch.float32:
        low = tr.cache.layout.dtype
    p = getattr(tr, "_step_pipeline", None)
    if p is None or p.dev != dev or p.elems < piece or set(p.bufs[0]) != {*names, "grad"} or \
            (p.low[0].dtype if p.low[0] is not None else None) != low:
        tr._step_pipeline = p = _Pipeline(dev, names, piece, low)
    return p


def _step_staged_cuda(tr, uids: List[int], dev: torch.device, pending: Optional[PendingStep] = None) -> None:
    """The pipelined step (module docstring). With ``pending`` (the split step), the updates run on the
    pipeline's own stream and nothing waits here: ``pending`` gets an event per layer and the timing events."""
    names = tr.store.names
    resident, staged = tr.store.partition(uids)
    pieces = list(_pieces(tr, staged))
    elems = max((len(part) * (hi - lo) for part, lo, hi in pieces), default=tr.sub)
    pl = _pipeline(tr, dev, names, elems)
    main = torch.cuda.current_stream(dev)
    compute = main if pending is None else pl.update
    if pending is not None:
        compute.wait_stream(main)  # the backward's gradients and their clip scaling
        start = torch.cuda.Event(enable_timing=True)
        start.record(compute)
        last_piece = {u // tr.num_experts: i for i, (part, _, _) in enumerate(pieces) for u in part}
    pl.load.wait_stream(main)  # the backward's gradients, and those still landing on the host
    with torch.cuda.stream(compute):
        _step_resident(tr, resident, dev, copy_stream=pl.store)
        if pending is not None:  # layers stepped on the device with no piece to stage: done after these copies
            ev = pl.store.record_event()
            for layer in sorted({u // tr.num_experts for u in resident} - set(last_piece)):
                pending.layer_queued(layer, ev)
        host, host_uids = _pipelined_pieces(tr, pl, pieces, compute, pending, last_piece if pending else None)
    if pending is not None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(pl.store)
        pending.dev_events = (start, end)
        return
    pl.store.synchronize()  # host rows and shadows are read by the CPU (catch-up, checkpoints) and loads
    compute.wait_stream(pl.store)
    _write_back(tr, host_uids, host)


def _pipelined_pieces(tr, pl, pieces, compute, pending, last_piece):
    store, grads, names = tr.store, tr.grads, tr.store.names
    host, host_uids = None, []
    for i, (part, lo, hi) in enumerate(pieces):
        if part != host_uids:
            if host_uids and not store.in_memory:  # NVMe: these rows' D2H must land before the write
                pl.store.synchronize()
                _write_back(tr, host_uids, host)
            host_uids, host = part, _host_rows(tr, part)
        k, width, n = i % 2, hi - lo, len(part)
        buf = {name: b[:n * width].view(n, width) for name, b in pl.bufs[k].items()}
        with torch.cuda.stream(pl.load):
            if pl.freed[k] is not None:
                pl.load.wait_event(pl.freed[k])
            rows = _piece_rows(tr, part, width)
            index = tr.row_optimizer.device_index(*rows, pl.dev)  # ahead of the rows
            index[0].record_stream(compute)  # made on this stream, read by the update (one buffer for both)
            for name in names:
                for j in range(n):
                    buf[name][j].copy_(host[name][j][lo:hi], non_blocking=True)
            for j, u in enumerate(part):
                if grads.on_host(u):
                    grads.ready(u, pl.load)
                    src = grads.raw(u)[lo:hi]
                    if src.dtype != torch.float32:
                        src = pl.grad_stage(k, n * width)[j * width:(j + 1) * width].copy_(src, non_blocking=True)
                    buf["grad"][j].copy_(src, non_blocking=True)
        compute.wait_stream(pl.load)
        for j, u in enumerate(part):  # device-resident gradients are copied here, on the compute stream
            if not grads.on_host(u):
                buf["grad"][j].copy_(grads.raw(u)[lo:hi])
            if grads.factor(u) != 1.0:
                buf["grad"][j].mul_(grads.factor(u))
        last = hi == tr.numel
        _update_piece(tr, buf, buf["grad"], part, width, last, index, rows)
        low = None
        if pl.low[k] is not None:
            low = pl.low[k][:n * width].view(n, width)
            low.copy_(buf["weight"])
        copy = low if low is not None else buf["weight"]
        for j, u in enumerate(part):  # a resident slot is refreshed on the device
            tr.refresh_slot(u, copy[j], lo)
        pl.store.wait_stream(compute)
        with torch.cuda.stream(pl.store):
            for name in names:
                for j in range(n):
                    host[name][j][lo:hi].copy_(buf[name][j], non_blocking=True)
            if store.shadow is not None:
                for j, u in enumerate(part):
                    store.shadow[u][lo:hi].copy_(low[j], non_blocking=True)
            pl.freed[k] = pl.store.record_event()
        moved = 2 * len(names) * STATE_BYTES + (low.element_size() if store.shadow is not None else 0)
        grad_bytes = sum(grads.raw(u).element_size() for u in part)  # fp32, or a single bf16 gradient
        tr.counters.add_step_traffic(n if last else 0, (moved * n + grad_bytes) * width)
        if pending is not None:
            for layer in sorted({u // tr.num_experts for u in part}):
                if last_piece[layer] == i:
                    pending.layer_queued(layer, pl.freed[k])
        if last:
            for u in part:
                g = grads.raw(u)
                if pending is not None and g.is_cuda:  # read by the queued update: its memory waits for it
                    g.record_stream(compute)  # (a pinned host one is tracked by the host allocator itself)
                grads.drop(u)
    return host, host_uids


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


def _cpu_share(tr, uids: List[int], share: float) -> List[int]:
    """The experts the CPU side steps: ``share`` of them, those whose gradient already waits on the host first
    (a device one would cross the link out, a host one stepped on the device back in), never one whose state lives
    on the device (``moe.gpu_state_experts``). The same whether or not the step overlaps the next forward: the
    backward ends at layer 0, so the device keeps layer 0's gradients and steps them first, and the CPU side goes
    up from the lowest layer of the rest, the order the forward needs them in. (Taking the share in every layer
    alike, session 13's overlapped step, sent gradients across the link twice; on the H200 it took 1463 against
    1183 ms a step on the fine-grained shape, 1594 against 1326 on the Mixtral one, in one call.)"""
    n_cpu = int(round(len(uids) * share))
    movable = tr.store.partition(uids)[1]  # moe.gpu_state_experts: always the device's
    return sorted(sorted(movable, key=lambda u: (not tr.grads.on_host(u), u))[:n_cpu])


def step_split(tr, uids: List[int], dev: torch.device) -> PendingStep:
    """Start updating ``uids``: a share on the CPU tier in a worker thread, the rest staged through ``dev``.
    Returns the step still running (see :mod:`~ds_maximus.experts.training.pending`); ``tr`` finishes it."""
    share = tr.cfg.moe.cpu_step_share
    if share is None:
        share = 0.5 if tr.cpu_step_share is None else tr.cpu_step_share
    cpu_uids = _cpu_share(tr, uids, share)
    dev_uids = sorted(set(uids) - set(cpu_uids))
    pending = PendingStep(tr.num_layers, tr.num_experts)
    pending.share, pending.n_cpu, pending.n_dev = share, len(cpu_uids), len(dev_uids)
    for u in cpu_uids:
        pending.cpu_uids.setdefault(u // tr.num_experts, []).append(u)
    items = [(u, *tr.grads.take_to_host(u)) for u in cpu_uids]
    if tr._step_pool is None:
        tr._step_pool = ThreadPoolExecutor(1, thread_name_prefix="maximus-expert-step")
    if items:
        pending.future = tr._step_pool.submit(_cpu_side, tr, items, pending)
    else:
        pending.cpu_finished()
    if dev_uids and dev.type == "cuda":
        _step_staged_cuda(tr, dev_uids, dev, pending)
    elif dev_uids:
        t0 = time.perf_counter()
        resident, staged = tr.store.partition(dev_uids)
        _step_resident(tr, resident, dev)
        step_staged(tr, staged, dev)
        pending.dev_s = time.perf_counter() - t0
    tr.counters.add_step_traffic(len(cpu_uids), sum(g.element_size() for _, g, _, _ in items) * tr.numel)
    tr.counters.cpu_step_share = share
    return pending


def rebalance(tr, pending: PendingStep, t_cpu: float, t_dev: float) -> None:
    """A finished split step measured both sides: the share that makes them finish together next time."""
    if tr.cfg.moe.cpu_step_share is not None or not pending.n_cpu or not pending.n_dev:
        return
    per_cpu, per_dev = t_cpu / pending.n_cpu, t_dev / pending.n_dev
    balanced = per_dev / (per_cpu + per_dev)  # n_cpu * per_cpu == n_dev * per_dev
    # the first measurement is taken whole, later ones are averaged in against noise (averaged from 0.5,
    # the share was still 0.3 after the H200 run's 3 steps, and the GPU side waited on the CPU side)
    if tr.cpu_step_share is not None:
        balanced = 0.5 * pending.share + 0.5 * balanced
    tr.cpu_step_share = min(0.95, max(0.05, balanced))


def _cpu_side(tr, items, pending: PendingStep) -> float:
    """Worker thread: AdamW of each ``(uid, grad, clip factor, event)`` in place on the CPU tier, its shadow
    written in the same pass (one pass over the expert's state: the factor and the bf16 cast had been two more).
    Layers are signalled done to ``pending`` as the experts go by (in uid order, i.e. layer order)."""
    t0 = time.perf_counter()
    try:
        for u, g, f, ev in items:
            pending.cpu_reached(u)
            if ev is not None:
                ev.synchronize()
            _update_in_place(tr, u, g, grad_scale=f)
    except BaseException as e:  # raised to the thread that waits for a layer, before it reads any expert
        pending.error = e
        raise
    finally:
        pending.cpu_finished()
    return time.perf_counter() - t0
