"""``ExpertGrads``: per-expert gradients, accumulated in fp32 across micro-batches and rounds.

An expert's first bf16 gradient is kept in bf16 until a second one is added to it: bf16 to fp32 is exact, so
the values are the same, and the copy to the host and the CPU optimizer step read half the bytes (a Mixtral
expert's gradient is 352 MB instead of 704). Scaling it (the clip factor) is recorded, not applied, like a
host gradient's (below): it is applied in fp32 where the gradient is next read. Every other gradient is fp32.

At most ``max_on_device`` gradients stay on the compute device (the most recently added: the experts
just computed, still in the expert cache); older ones move to pinned CPU memory and come back to the
device the next time their expert adds to it or is stepped. Across data-parallel ranks the gradients
are averaged like DeepSpeed averages dense ones (:meth:`allreduce_`).

A gradient that moves to the host costs no CPU time on the main thread: the copy is asynchronous (an event
says when it has landed), its squared norm and finiteness are computed on the device as it leaves, and a
clipping factor (:meth:`scale_`) is only recorded for it and applied where it is next used on the device
(the step). A Mixtral expert's gradient is 704 MB of fp32: a CPU pass over many of them per step is seconds.

``max_on_device`` counts gradients as the backward makes them (bf16 in a bf16 run): one widened to fp32 by a
second micro-batch counts as two, so gradient accumulation keeps the device bytes of a single micro-batch.

A later micro-batch's gradient of an expert whose sum waits on the host brings the sum back to the device (fp32),
is added there, and the sum goes out again (fp32). Adding on the host instead saves link bytes but costs host memory
bandwidth, which the split step is short of: it measured slower (docs/bench/moe_training.md).

    >>> import torch
    >>> g = ExpertGrads(torch.device("cpu"), max_on_device=2)
    >>> g.add(3, torch.ones(4)); g.add(3, torch.ones(4)); g.add(1, torch.zeros(4))
    >>> g.uids(), float(g.norm_sq())
    ([1, 3], 16.0)
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ds_maximus.partition.transfer import CudaTransfer


class ExpertGrads:
    """uid -> flat gradient, fp32 or a single bf16 one (on the compute device, or on the CPU after an eviction)."""

    def __init__(self, device: torch.device, max_on_device: int):
        self.device = torch.device(device)
        self.max_on_device = int(max_on_device)
        self.g: Dict[int, Tensor] = {}
        self._recent: "collections.OrderedDict[int, None]" = collections.OrderedDict()  # uids on the device
        self._left: Dict[int, Tuple[object, Tensor, Tensor]] = {}  # host uid -> (copy event, |g|^2, finite)
        self._factor: Dict[int, float] = {}  # uid -> pending scale (host gradients, and bf16 ones)
        self.moved_to_host = 0
        self._out: Optional[CudaTransfer] = None  # the copies out, on its write-back stream (made when first needed)
        self._unit = 0  # bytes of a gradient as the backward makes it: the unit of max_on_device

    def __bool__(self) -> bool:
        return bool(self.g)

    def __contains__(self, uid: int) -> bool:
        return uid in self.g

    def uids(self) -> List[int]:
        return sorted(self.g)

    def on_host(self, uid: int) -> bool:
        return uid in self._left

    def add(self, uid: int, grad: Tensor) -> None:
        """Accumulate ``grad`` (flat, any float dtype, on the compute device) into expert ``uid``."""
        cur = self.g.get(uid)
        if grad.device.type != "cpu":
            if not self._unit:
                self._unit = grad.element_size() * grad.numel()
            self._make_room(uid, cur, grad)
        if cur is None:  # a copy: grad may be a view of a round's whole gradient buffer
            self.g[uid] = grad.clone() if grad.dtype == torch.bfloat16 else grad.to(torch.float32, copy=True)
        elif cur.device != grad.device:
            self.g[uid] = self._take(uid, grad.device).add_(grad)  # in use again: back on the device
        else:
            if uid in self._left:  # a CPU run's host-held sum, added to in place: its recorded norm would go stale
                cur = self.g[uid] = self._take(uid, cur.device)
            if cur.dtype != torch.float32:  # widened, its pending scale applied: fp32 from here on
                cur = self.g[uid] = self.get(uid)
                self._factor.pop(uid, None)
            cur.add_(grad)
        if grad.device.type != "cpu":
            self._recent[uid] = None
            self._recent.move_to_end(uid)
            while self._recent and self._device_units() > self.max_on_device:
                self._to_host(self._recent.popitem(last=False)[0])

    def _make_room(self, uid: int, cur: Optional[Tensor], grad: Tensor) -> None:
        """Move older gradients out *before* ``uid``'s grows on the device, so the device never holds more
        than ``max_on_device`` units, not even for the moment between an allocation and the eviction it forces
        (that moment is enough to run a large expert shape out of memory)."""
        if cur is None:  # a new copy: bf16 as it comes, anything else widened to fp32
            extra = self._units(grad.numel(), 2 if grad.dtype == torch.bfloat16 else 4)
        elif cur.device != grad.device:  # a host sum comes back in fp32
            extra = self._units(cur.numel(), 4)
        elif cur.dtype != torch.float32:  # widened: the bf16 one and its fp32 copy, for a moment
            extra = self._units(cur.numel(), 4)
        else:
            extra = 0
        if not extra:
            return
        if uid in self._recent:
            self._recent.move_to_end(uid)
        while len(self._recent) > (uid in self._recent) and self._device_units() + extra > self.max_on_device:
            self._to_host(self._recent.popitem(last=False)[0])

    def _units(self, numel: int, itemsize: int) -> float:
        return max(1.0, numel * itemsize / self._unit)

    def device_bytes(self) -> Dict[str, int]:
        """Bytes on the compute device: the gradients kept there."""
        return {"expert gradients": sum(self.g[u].numel() * self.g[u].element_size() for u in self._recent)}

    def _device_units(self) -> float:
        """Device gradients in units of one as the backward makes it (an fp32 sum in a bf16 run counts two)."""
        return sum(max(1.0, self.g[u].element_size() * self.g[u].numel() / self._unit) for u in self._recent)

    def _out_transfer(self, device: torch.device) -> CudaTransfer:
        if self._out is None:
            self._out = CudaTransfer(device, timing=False, write_back=True)
        return self._out

    def factor(self, uid: int) -> float:
        """The scale still to apply to ``uid``'s stored gradient (1.0 unless it waits on the host or is bf16)."""
        return self._factor.get(uid, 1.0)

    def raw(self, uid: int) -> Tensor:
        """``uid``'s stored gradient as it is, fp32 or bf16 (a host one may still be landing: use it on the
        device's stream, or call :meth:`get` with a device); scale it by :meth:`factor`."""
        return self.g[uid]

    def get(self, uid: int, device: Optional[torch.device] = None) -> Tensor:
        """``uid``'s gradient in fp32, scaled (a copy when it was waiting on the host with a pending factor,
        or was bf16)."""
        t = self.g[uid]
        if uid in self._left:
            dev = torch.device(device) if device is not None else t.device
            if dev.type == "cpu":
                self._landed(uid)
            else:
                self.ready(uid, torch.cuda.current_stream(dev))
            out = t.to(dev, non_blocking=True).float()  # a bf16 one moves as bf16 and widens where it lands
        else:
            out = (t if device is None else t.to(device, non_blocking=True)).float()
        f = self._factor.get(uid, 1.0)
        return out if f == 1.0 else (out.mul_(f) if out is not t else out * f)

    def _to_host(self, uid: int) -> None:
        t = self.g[uid]
        norm_sq, finite = _dot(t), torch.isfinite(t).all()  # on the device, before it leaves
        host, ev = t, None                                           # a CPU run: already there
        if t.is_cuda:  # on the write-back stream: the backward's kernels do not queue behind the copy
            host, ev = self._out_transfer(t.device).to_host(t)  # into pinned memory, after what wrote t
        self.g[uid] = host
        self._left[uid] = (ev, norm_sq, finite)
        self.moved_to_host += 1

    def ready(self, uid: int, stream) -> None:
        """Make CUDA ``stream`` wait until host gradient ``uid`` has landed (before a copy of it back in)."""
        left = self._left.get(uid)
        if left is not None and left[0] is not None:
            stream.wait_event(left[0])

    def _landed(self, uid: int) -> None:
        ev = self._left[uid][0]
        if ev is not None:
            ev.synchronize()

    def _take(self, uid: int, device: torch.device) -> Tensor:
        """Bring host gradient ``uid`` back to ``device`` with its pending factor applied."""
        out = self.get(uid, device)
        self._left.pop(uid, None)
        self._factor.pop(uid, None)
        return out

    def pop(self, uid: int, device: Optional[torch.device] = None) -> Tensor:
        """Remove and return ``uid``'s gradient (on ``device`` when given): the step consumes them one by one."""
        t = self.get(uid, device)
        self.drop(uid)
        return t

    def take_to_host(self, uid: int) -> Tuple[Tensor, float, object]:
        """Remove ``uid``'s gradient and hand it over on the host: ``(tensor, factor to apply, event)``; a
        device one is copied out asynchronously (wait on the event, if any, before reading the tensor)."""
        if uid not in self._left:
            self._to_host(uid)
        t, (ev, _, _), f = self.g[uid], self._left[uid], self._factor.get(uid, 1.0)
        self.drop(uid)
        return t, f, ev

    def drop(self, uid: int) -> None:
        """Forget ``uid``'s gradient (the step has consumed it)."""
        self._recent.pop(uid, None)
        self.g.pop(uid)
        self._left.pop(uid, None)
        self._factor.pop(uid, None)

    def norm_sq(self) -> Tensor:
        """Sum of squares of every gradient (one device sync for all of them)."""
        parts = []
        for u, t in self.g.items():
            f2 = self._factor.get(u, 1.0) ** 2
            parts.append((self._left[u][1] if u in self._left else _dot(t)).double() * f2)
        if not parts:
            return torch.zeros((), dtype=torch.float32)
        return torch.stack([p.to(parts[0].device) for p in parts]).sum().float().cpu()

    def scale_(self, factor: float) -> None:
        """Scale every gradient: fp32 ones on the device in place; host and bf16 ones only record the factor
        (applied in fp32 where they are read: the step, :meth:`get`), so a bf16 one stays 2 bytes a parameter."""
        for u, t in self.g.items():
            if u in self._left or t.dtype != torch.float32:
                self._factor[u] = self._factor.get(u, 1.0) * factor
            else:
                t.mul_(factor)

    def finite(self) -> bool:
        flags = [self._left[u][2] if u in self._left else torch.isfinite(t).all() for u, t in self.g.items()]
        if not flags:
            return True
        return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())

    def clear(self) -> None:
        self.g.clear()
        self._recent.clear()
        self._left.clear()
        self._factor.clear()

    def allreduce_(self, num_uids: int, group=None) -> None:
        """Average over the data-parallel ``group``: the union of experts with gradient on any rank,
        zeros where a rank has none (what DeepSpeed's dense all-reduce does for an expert's grad)."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        world = dist.get_world_size(group)
        dev = self._comm_device()
        have = torch.zeros(num_uids, dtype=torch.int32, device=dev)
        if self.g:
            have[torch.tensor(self.uids(), device=dev)] = 1
        dist.all_reduce(have, group=group)
        numel = None
        for t in self.g.values():
            numel = t.numel()
            break
        union = [int(u) for u in torch.nonzero(have).flatten().tolist()]
        if not union:
            return
        if numel is None:  # this rank has none: learn the size from the others
            n = torch.zeros(1, dtype=torch.long, device=dev)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
            numel = int(n)
        else:
            n = torch.tensor([numel], dtype=torch.long, device=dev)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        for u in union:
            t = self._take(u, dev) if u in self.g else torch.zeros(numel, dtype=torch.float32, device=dev)
            dist.all_reduce(t, group=group)
            t.div_(world)
            self.g[u] = t if dev.type == "cpu" or self.device.type == dev.type else t.to(self.device)
            if self.g[u].device.type != "cpu" and u not in self._recent:
                self._to_host(u)  # keep the device budget: reduced gradients wait on the host

    def _comm_device(self) -> torch.device:
        import torch.distributed as dist
        backend = dist.get_backend()
        return self.device if backend == "nccl" else torch.device("cpu")


def _dot(t: Tensor) -> Tensor:
    """``t . t`` in fp32 (a bf16 gradient is widened first: the same value as its fp32 copy would give)."""
    t = t.float()
    return torch.dot(t, t)
