"""The optimizer step of trained experts: each expert is one row of the row optimizer.

Three variants, by ``moe.optimizer_device`` and the tier, each an object over :class:`StepParts` (the store,
the gradients, the row optimizer, the expert cache of compute copies and the traffic counters), held by the
trainer:

* :class:`InPlaceStep` (``cpu``, tier in memory): the fused row-update op runs on the tier's own
  masters and moments; only the gradient came from the device;
* :class:`StagedStep` (``compute``, or an NVMe tier): masters and moments go to the step device in pieces of at
  most ``moe.step_chunk_bytes`` (with the gradient), are updated there and come back through the partition
  core's :class:`~ds_maximus.partition.staged_update.StagedUpdate`; a piece is part of one expert when an expert
  is larger than the budget (AdamW is elementwise), else a few experts;
* :class:`SplitStep` (``split``, tier in memory): both at once: a worker thread steps a share of the experts in
  place on the CPU tier (the op runs without the GIL) while this thread streams the rest through the device.
  Gradients already waiting on the host go to the CPU side first. The share follows the two sides'
  measured time per expert so that they finish together (or is fixed by ``moe.cpu_step_share``). With
  ``moe.overlap_step`` the step returns once queued and the next forward waits for each layer's experts
  when it reaches them (:mod:`~ds_maximus.experts.training.pending`).

After an expert is updated, its compute copies (the shadow in the CPU tier and a resident cache slot)
are refreshed, so no stale copy is ever used.

On a CUDA step device the pieces are pipelined over the staged update's three streams: piece ``i + 1`` is
loaded (H2D) while piece ``i`` is updated and piece ``i - 1`` goes back (D2H: fp32 master and moments, and the
compute copy cast on the device, so the shadow costs 2 bytes a parameter and no CPU time); two buffer sets
alternate, and the host waits once, at the end of the step. The link is the limit: a Mixtral expert's
step moves 16 bytes per parameter in (14 when its gradient is a single bf16 one, see ``grads``) and 14 out.
Experts whose master and moments live on the device (``moe.gpu_state_experts``) are stepped there first, on
the same stream, with none of that state moving: only a host gradient in and the compute copy out.
The row op parallelises over rows, so an expert's flat buffer is viewed as ``numel / sub`` sub-rows that
share the expert's step bookkeeping.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

from ds_maximus.experts.training.pending import PendingStep
from ds_maximus.partition.staged_update import StagedUpdate, device_with_index

STATE_BYTES = 4  # fp32 masters, moments and gradients


def _views(t: torch.Tensor, sub: int) -> torch.Tensor:
    return t.reshape(-1, sub)


@dataclasses.dataclass
class StepParts:
    """What an expert step works on: the trainer's store, gradients, row optimizer, counters and cache, and the
    experts' geometry (``numel`` elements each, stepped as sub-rows of ``sub``). ``cache`` is the expert cache of
    compute copies; the trainer sets it again whenever it builds a new one."""

    store: object            # ExpertTrainStore
    grads: object            # ExpertGrads
    optimizer: object        # RowOptimizer
    counters: object         # ExpertTrainStats
    num_layers: int
    num_experts: int
    numel: int
    sub: int
    step_chunk_bytes: int    # moe.step_chunk_bytes: the staging budget of one piece
    cache: object = None     # ExpertCache

    def refresh_slot(self, uid: int, src: torch.Tensor, offset: int = 0) -> None:
        """If ``uid`` is resident, overwrite its cache slot from element ``offset`` with ``src``."""
        if self.cache.write_slot(uid // self.num_experts, uid % self.num_experts, src, offset):
            self.counters.bytes_refresh += src.numel() * self.cache.layout.nbytes // self.numel

    def refresh(self, uid: int, master: torch.Tensor, offset: int = 0) -> None:
        """Elements ``offset:`` of ``uid``'s master were updated to ``master``: refresh the shadow and, when
        resident, the cache slot (so no stale copy is ever computed with)."""
        self.store.refresh(uid, master, offset)
        self.refresh_slot(uid, master, offset)


class ExpertStep:
    """One way to run the optimizer step of the experts with gradient (``uids``) on ``dev``."""

    def __init__(self, parts: StepParts):
        self.parts = parts

    def run(self, uids: List[int], dev: torch.device) -> Optional[PendingStep]:
        """Update ``uids`` and refresh their copies; a step still running is returned (``None``: done)."""
        raise NotImplementedError

    def device_bytes(self) -> int:
        """Bytes this variant holds on the compute device between steps."""
        return 0


class InPlaceStep(ExpertStep):
    """AdamW on the in-memory CPU tier itself (gradients brought to the CPU), one expert at a time."""

    def update(self, uid: int, grad: torch.Tensor, grad_scale: float = 1.0) -> None:
        """AdamW of expert ``uid`` with ``grad * grad_scale`` (flat, CPU) on the in-memory tier's own master and
        moments; the tier's compute copy (shadow) of the expert is written in the same pass."""
        p = self.parts
        opt, t, sub = p.optimizer, p.store.tables, p.sub
        k = p.numel // sub
        shadow = p.store.shadow  # in memory: [num_uids, numel] like the tables, or None (fp32 compute)
        opt.update(_views(t["weight"], sub), [_views(t[n], sub) for n in opt.state_names],
                   uid * k + torch.arange(k), _views(grad, sub), torch.full((k,), uid, dtype=torch.long),
                   grad_scale=grad_scale, shadow=None if shadow is None else _views(shadow, sub))

    def run(self, uids: List[int], dev: torch.device = torch.device("cpu")) -> None:
        p = self.parts
        for u in uids:
            self.update(u, p.grads.pop(u, torch.device("cpu")))
            p.refresh_slot(u, p.store.host_view(u))  # the compute copy the op just wrote (bf16: half the bytes)
        p.counters.add_step_traffic(len(uids), STATE_BYTES * p.numel * len(uids))


def pieces(parts: StepParts, uids: List[int]):
    """``(uids, lo, hi)`` pieces within the staging budget (element ranges are multiples of ``parts.sub``)."""
    numel, sub = parts.numel, parts.sub
    per_elem = STATE_BYTES * (len(parts.store.names) + 1)
    piece = max(sub, (parts.step_chunk_bytes // per_elem) // sub * sub)
    if piece >= numel:
        n = max(1, piece // numel)
        for i in range(0, len(uids), n):
            yield uids[i:i + n], 0, numel
        return
    # pieces of one size: with a short last piece (a 22M-element expert in 16M + 6M) the next expert's first piece
    # waited for this one's first piece to go back, in the CUDA pipeline's other buffer set
    n, subs = -(-numel // piece), numel // sub
    bounds = [k * subs // n * sub for k in range(n + 1)]  # widths differ by at most one sub-row
    for u in uids:
        for lo, hi in zip(bounds, bounds[1:]):
            yield [u], lo, hi


def _update_rows(opt, weights, states, slots, grad, rows, experts: List[int], last: bool, index=None) -> None:
    """``opt.update`` of one piece of ``experts``; unless it is their ``last`` piece, their step bookkeeping is put
    back, so that the next piece starts from the same step state (AdamW is elementwise)."""
    ids = torch.tensor(experts)
    before = opt.last_step.index_select(0, ids)
    opt.update(weights, states, slots, grad, rows, index=index)
    if not last:
        opt.last_step.index_copy_(0, ids, before)


class StagedStep(ExpertStep):
    """AdamW on a step device, the state streamed through it in budgeted pieces (module docstring): pipelined on a
    CUDA device, one piece after another on the CPU (an NVMe tier stepped beside it)."""

    def __init__(self, parts: StepParts):
        super().__init__(parts)
        self.pipeline: Optional[StagedUpdate] = None
        self._names = None

    def device_bytes(self) -> int:
        return 0 if self.pipeline is None or not self.pipeline.cuda else self.pipeline.device_bytes()

    def _pipeline(self, dev: torch.device) -> StagedUpdate:
        """The pipeline of ``dev``, kept between steps (its streams and staging buffers). Compared with its index:
        the pipeline holds ``cuda:N``, and a plain ``cuda`` compared unequal, which would build a new pipeline
        (new streams, new buffers) at every step."""
        dev = device_with_index(dev)
        if self.pipeline is None or self.pipeline.device != dev:
            self.pipeline = StagedUpdate(dev)
        return self.pipeline

    def _low_dtype(self) -> Optional[torch.dtype]:
        """The compute dtype the updated masters are cast to on the device (``None``: the fp32 master is it)."""
        p = self.parts
        low = p.store.shadow.dtype if p.store.shadow is not None else None
        if low is None and p.cache.layout.dtype != torch.float32:
            low = p.cache.layout.dtype
        return low

    def _piece_rows(self, part: List[int], width: int):
        """The row op's ``(slots, ids)`` for experts ``part`` staged as ``[len(part), width]``: sub-rows in order."""
        sub = self.parts.sub
        return torch.arange(len(part) * (width // sub)), torch.tensor(part).repeat_interleave(width // sub)

    def _update_piece(self, staged, grad, part: List[int], width: int, last: bool, index=None, rows=None) -> None:
        """AdamW on elements ``[lo, lo + width)`` of experts ``part``, staged as ``[len(part), width]`` rows
        (``rows``: their :meth:`_piece_rows` when made already; ``index``: its ``RowOptimizer.device_index``)."""
        opt, sub = self.parts.optimizer, self.parts.sub
        slots, ids = rows if rows is not None else self._piece_rows(part, width)
        _update_rows(opt, _views(staged["weight"], sub), [_views(staged[n], sub) for n in opt.state_names],
                     slots, _views(grad, sub), ids, part, last, index)

    def step_resident(self, uids: List[int], dev: torch.device, copy_stream=None) -> None:
        """AdamW of experts whose master and state live on the compute device (``moe.gpu_state_experts``), on the
        current stream: only a gradient waiting on the host comes in, and the compute copy goes out to the CPU
        tier's (shadow, or the master itself for fp32 compute), on ``copy_stream`` when given. A resident slot is
        refreshed on the device."""
        if not uids:
            return
        p = self.parts
        store, opt, sub, numel = p.store, p.optimizer, p.sub, p.numel
        t, k = store.device_tables, numel // sub
        weights, states = _views(t["weight"], sub), [_views(t[n], sub) for n in opt.state_names]
        piece = max(sub, (p.step_chunk_bytes // STATE_BYTES) // sub * sub)  # fp32 gradient widened at once
        grad_bytes = 0
        for u in uids:
            i, ids = store.resident[u], torch.tensor([u])
            raw, f = p.grads.raw(u), p.grads.factor(u)
            grad_bytes += raw.element_size() * numel if raw.device != dev else 0
            if dev.type == "cuda":
                p.grads.ready(u, torch.cuda.current_stream(dev))
            for lo in range(0, numel, piece):  # the gradient in fp32, scaled, as the staged pipeline steps it
                hi = min(lo + piece, numel)
                g = raw[lo:hi].to(dev, non_blocking=True).float()  # a bf16 one crosses as bf16, widens on the device
                g = g * f if f != 1.0 else g
                n = (hi - lo) // sub
                _update_rows(opt, weights, states, i * k + lo // sub + torch.arange(n), g.view(n, sub),
                             ids.repeat(n), [u], hi == numel)
            host = store.host_view(u)
            copy = t["weight"][i] if host.dtype == torch.float32 else t["weight"][i].to(host.dtype)
            p.refresh_slot(u, copy)
            if copy_stream is not None:
                copy_stream.wait_stream(torch.cuda.current_stream(dev))
                copy.record_stream(copy_stream)
                with torch.cuda.stream(copy_stream):
                    host.copy_(copy, non_blocking=True)
            else:
                host.copy_(copy, non_blocking=dev.type == "cuda")
            if raw.is_cuda and copy_stream is not None:  # read by the queued update: its memory waits for it
                raw.record_stream(torch.cuda.current_stream(dev))
            p.grads.drop(u)
        store.mark_device_newer(uids)
        p.counters.add_step_traffic(len(uids),
                                    grad_bytes + len(uids) * numel * store.host_view(uids[0]).element_size())

    def run(self, uids: List[int], dev: torch.device, pending: Optional[PendingStep] = None) -> None:
        """Update ``uids`` on ``dev``. With ``pending`` (the split step, CUDA), the updates run on the pipeline's
        own stream and nothing waits here: ``pending`` gets an event per layer and the timing events."""
        p = self.parts
        resident, staged = p.store.partition(uids)
        todo = list(pieces(p, staged))
        pl = self._pipeline(dev)
        cuda = dev.type == "cuda"
        if not cuda:
            self.step_resident(resident, dev)
            host, host_uids = self._stream_pieces(pl, todo, None, None, None)
            self._write_back(host_uids, host)
            return
        main = torch.cuda.current_stream(dev)
        compute = main if pending is None else pl.update
        last_piece = None
        if pending is not None:
            compute.wait_stream(main)  # the backward's gradients and their clip scaling
            start = torch.cuda.Event(enable_timing=True)
            start.record(compute)
            last_piece = {u // p.num_experts: i for i, (part, _, _) in enumerate(todo) for u in part}
        pl.load.wait_stream(main)  # the backward's gradients, and those still landing on the host
        with torch.cuda.stream(compute):
            self.step_resident(resident, dev, copy_stream=pl.store)
            if pending is not None:  # layers stepped on the device with no piece to stage: done after these copies
                ev = pl.store.record_event()
                for layer in sorted({u // p.num_experts for u in resident} - set(last_piece)):
                    pending.layer_queued(layer, ev)
            host, host_uids = self._stream_pieces(pl, todo, compute, pending, last_piece)
        if pending is not None:
            pending.dev_events = (start, pl.end(enable_timing=True))
            return
        pl.synchronize()  # host rows and shadows are read by the CPU (catch-up, checkpoints) and loads
        compute.wait_stream(pl.store)
        self._write_back(host_uids, host)

    def _stream_pieces(self, pl: StagedUpdate, todo, compute, pending, last_piece):
        """Each piece through ``pl``: state and gradient in, the update on ``compute``, state and compute copy out.
        Returns the host rows of the last experts (an NVMe tier's copies, written back by the caller)."""
        p = self.parts
        store, grads, names, numel = p.store, p.grads, p.store.names, p.numel
        dev, cuda = pl.device, pl.cuda
        low_dtype = self._low_dtype()
        elems = max((len(part) * (hi - lo) for part, lo, hi in todo), default=p.sub)
        host, host_uids = None, []
        for k, (i, (part, lo, hi)) in pl.pieces(enumerate(todo)):
            if part != host_uids:
                if host_uids and not store.in_memory:  # NVMe: these rows' D2H must land before the write
                    pl.synchronize()
                    self._write_back(host_uids, host)
                host_uids, host = part, self._host_rows(part)
            width, n = hi - lo, len(part)
            buf = {name: pl.buffer(k, name, elems)[:n * width].view(n, width) for name in (*names, "grad")}
            low = None if low_dtype is None else pl.buffer(k, "low", elems, low_dtype)[:n * width].view(n, width)
            rows, index = self._piece_rows(part, width), None
            with pl.loading(k):
                if cuda:
                    index = p.optimizer.device_index(*rows, dev)  # ahead of the rows
                    index[0].record_stream(compute)  # made on this stream, read by the update (one buffer for both)
                for name in names:
                    for j in range(n):
                        buf[name][j].copy_(host[name][j][lo:hi], non_blocking=cuda)
                for j, u in enumerate(part):
                    if not cuda:
                        buf["grad"][j].copy_(grads.get(u, dev)[lo:hi])  # in fp32, scaled
                    elif grads.on_host(u):
                        grads.ready(u, pl.load)
                        src = grads.raw(u)[lo:hi]
                        if src.dtype != torch.float32:  # lands in bf16 and widens on the device (a host-to-device
                            # copy that changes dtype would convert on the host, in pageable memory)
                            stage = pl.buffer(k, "grad_bf16", elems, torch.bfloat16)[:n * width]
                            src = stage[j * width:(j + 1) * width].copy_(src, non_blocking=True)
                        buf["grad"][j].copy_(src, non_blocking=True)
            with pl.updating(compute):
                if cuda:
                    for j, u in enumerate(part):  # device-resident gradients are copied here, on the compute stream
                        if not grads.on_host(u):
                            buf["grad"][j].copy_(grads.raw(u)[lo:hi])
                        if grads.factor(u) != 1.0:
                            buf["grad"][j].mul_(grads.factor(u))
                last = hi == numel
                self._update_piece(buf, buf["grad"], part, width, last, index, rows)
                if low is not None:
                    low.copy_(buf["weight"])
                copy = low if low is not None else buf["weight"]
                for j, u in enumerate(part):  # a resident slot is refreshed on the device
                    p.refresh_slot(u, copy[j], lo)
            with pl.storing(k):
                for name in names:
                    for j in range(n):
                        host[name][j][lo:hi].copy_(buf[name][j], non_blocking=cuda)
                if store.shadow is not None:
                    for j, u in enumerate(part):
                        store.shadow[u][lo:hi].copy_(low[j], non_blocking=cuda)
            if cuda:
                moved = 2 * len(names) * STATE_BYTES + (low.element_size() if store.shadow is not None else 0)
                grad_bytes = sum(grads.raw(u).element_size() for u in part)  # fp32, or a single bf16 gradient
                p.counters.add_step_traffic(n if last else 0, (moved * n + grad_bytes) * width)
            else:  # nothing crosses a link: the gradient's bytes
                p.counters.add_step_traffic(n if last else 0, STATE_BYTES * width * n)
            if pending is not None:
                for layer in sorted({u // p.num_experts for u in part}):
                    if last_piece[layer] == i:
                        pending.layer_queued(layer, pl.freed[k])
            if last:
                for u in part:
                    g = grads.raw(u)
                    if pending is not None and g.is_cuda:  # read by the queued update: its memory waits for it
                        g.record_stream(compute)  # (a pinned host one is tracked by the host allocator itself)
                    grads.drop(u)
        return host, host_uids

    def _host_rows(self, part: List[int]) -> Dict[str, List[torch.Tensor]]:
        store = self.parts.store
        if store.in_memory:
            t = store.tables
            return {n: [t[n][u] for u in part] for n in store.names}
        rows = store.read_rows(torch.tensor(part), pin=True)
        return {n: list(rows[n]) for n in store.names}

    def _write_back(self, part: List[int], host) -> None:
        store = self.parts.store
        if not part or store.in_memory:
            return
        store.write_rows(torch.tensor(part), {n: torch.stack(v) for n, v in host.items()})


class SplitStep(ExpertStep):
    """A share of the experts stepped in place on the CPU tier by a worker thread, the rest staged through the
    device at the same time (module docstring); ``fixed_share``: ``moe.cpu_step_share`` (``None``: measured)."""

    def __init__(self, parts: StepParts, in_place: InPlaceStep, staged: StagedStep,
                 fixed_share: Optional[float] = None):
        super().__init__(parts)
        self.in_place, self.staged = in_place, staged
        self.fixed_share = fixed_share
        self.share: Optional[float] = None  # the measured share of the CPU side
        self._pool: Optional[ThreadPoolExecutor] = None

    def cpu_share(self, uids: List[int], share: float) -> List[int]:
        """The experts the CPU side steps: ``share`` of them, those whose gradient already waits on the host first
        (a device one would cross the link out, a host one stepped on the device back in), never one whose state
        lives on the device (``moe.gpu_state_experts``). The same whether or not the step overlaps the next
        forward: the backward ends at layer 0, so the device keeps layer 0's gradients and steps them first, and
        the CPU side goes up from the lowest layer of the rest, the order the forward needs them in. (Taking the
        share in every layer alike sent gradients across the link twice, and the step took longer.)"""
        p = self.parts
        n_cpu = int(round(len(uids) * share))
        movable = p.store.partition(uids)[1]  # moe.gpu_state_experts: always the device's
        return sorted(sorted(movable, key=lambda u: (not p.grads.on_host(u), u))[:n_cpu])

    def run(self, uids: List[int], dev: torch.device) -> PendingStep:
        """Start updating ``uids``: a share on the CPU tier in a worker thread, the rest staged through ``dev``.
        Returns the step still running (see :mod:`~ds_maximus.experts.training.pending`); the trainer finishes
        it and hands its times to :meth:`rebalance`."""
        p = self.parts
        share = self.fixed_share
        if share is None:
            share = 0.5 if self.share is None else self.share
        cpu_uids = self.cpu_share(uids, share)
        dev_uids = sorted(set(uids) - set(cpu_uids))
        pending = PendingStep(p, p.num_layers, p.num_experts)
        pending.share, pending.n_cpu, pending.n_dev = share, len(cpu_uids), len(dev_uids)
        for u in cpu_uids:
            pending.cpu_uids.setdefault(u // p.num_experts, []).append(u)
        items = [(u, *p.grads.take_to_host(u)) for u in cpu_uids]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="maximus-expert-step")
        if items:
            pending.future = self._pool.submit(self._cpu_side, items, pending)
        else:
            pending.cpu_finished()
        if dev_uids and dev.type == "cuda":
            self.staged.run(dev_uids, dev, pending)
        elif dev_uids:
            t0 = time.perf_counter()
            self.staged.run(dev_uids, dev)
            pending.dev_s = time.perf_counter() - t0
        p.counters.add_step_traffic(len(cpu_uids), sum(g.element_size() for _, g, _, _ in items) * p.numel)
        p.counters.cpu_step_share = share
        return pending

    def rebalance(self, pending: PendingStep, t_cpu: float, t_dev: float) -> None:
        """A finished split step measured both sides: the share that makes them finish together next time."""
        if self.fixed_share is not None or not pending.n_cpu or not pending.n_dev:
            return
        per_cpu, per_dev = t_cpu / pending.n_cpu, t_dev / pending.n_dev
        balanced = per_dev / (per_cpu + per_dev)  # n_cpu * per_cpu == n_dev * per_dev
        # the first measurement is taken whole, later ones are averaged in against noise (averaged from 0.5,
        # the share stayed far from the balance for several steps, and the GPU side waited on the CPU side)
        if self.share is not None:
            balanced = 0.5 * pending.share + 0.5 * balanced
        self.share = min(0.95, max(0.05, balanced))

    def _cpu_side(self, items, pending: PendingStep) -> float:
        """Worker thread: AdamW of each ``(uid, grad, clip factor, event)`` in place on the CPU tier, its shadow
        written in the same pass (one pass over the expert's state: the factor and the bf16 cast had been two
        more). Layers are signalled done to ``pending`` as the experts go by (in uid order, i.e. layer order)."""
        t0 = time.perf_counter()
        try:
            for u, g, f, ev in items:
                pending.cpu_reached(u)
                if ev is not None:
                    ev.synchronize()
                self.in_place.update(u, g, grad_scale=f)
        except BaseException as e:  # raised to the thread that waits for a layer, before it reads any expert
            pending.error = e
            raise
        finally:
            pending.cpu_finished()
        return time.perf_counter() - t0
