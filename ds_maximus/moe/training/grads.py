"""``ExpertGrads``: per-expert fp32 gradients, accumulated across micro-batches and rounds.

At most ``max_on_device`` gradients stay on the compute device (the most recently added: the experts
just computed, still in the expert cache); older ones move to pinned CPU memory and come back to the
device the next time their expert adds to it or is stepped. Across data-parallel ranks the gradients
are averaged like DeepSpeed averages dense ones (:meth:`allreduce_`).

    >>> import torch
    >>> g = ExpertGrads(torch.device("cpu"), max_on_device=2)
    >>> g.add(3, torch.ones(4)); g.add(3, torch.ones(4)); g.add(1, torch.zeros(4))
    >>> g.uids(), float(g.norm_sq())
    ([1, 3], 16.0)
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional

import torch
from torch import Tensor


class ExpertGrads:
    """uid -> flat fp32 gradient (on the compute device, or on the CPU after an eviction)."""

    def __init__(self, device: torch.device, max_on_device: int):
        self.device = torch.device(device)
        self.max_on_device = int(max_on_device)
        self.g: Dict[int, Tensor] = {}
        self._recent: "collections.OrderedDict[int, None]" = collections.OrderedDict()  # uids on the device
        self.moved_to_host = 0

    def __bool__(self) -> bool:
        return bool(self.g)

    def __contains__(self, uid: int) -> bool:
        return uid in self.g

    def uids(self) -> List[int]:
        return sorted(self.g)

    def add(self, uid: int, grad: Tensor) -> None:
        """Accumulate ``grad`` (flat, any float dtype, on the compute device) into expert ``uid``."""
        cur = self.g.get(uid)
        if cur is None:
            self.g[uid] = grad.to(torch.float32, copy=True)
        elif cur.device != grad.device:
            self.g[uid] = cur.to(grad.device).add_(grad)  # in use again: back on the device
        else:
            cur.add_(grad)
        if grad.device.type != "cpu":
            self._recent[uid] = None
            self._recent.move_to_end(uid)
            while len(self._recent) > self.max_on_device:
                self._to_host(self._recent.popitem(last=False)[0])

    def get(self, uid: int, device: Optional[torch.device] = None) -> Tensor:
        t = self.g[uid]
        return t if device is None else t.to(device, non_blocking=True)

    def _to_host(self, uid: int) -> None:
        t = self.g[uid]
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(t)
        self.g[uid] = host
        self.moved_to_host += 1

    def pop(self, uid: int, device: Optional[torch.device] = None) -> Tensor:
        """Remove and return ``uid``'s gradient (on ``device`` when given): the step consumes them one by one."""
        self._recent.pop(uid, None)
        t = self.g.pop(uid)
        return t if device is None else t.to(device, non_blocking=True)

    def norm_sq(self) -> Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for t in self.g.values():
            total += float(torch.dot(t, t))
        return total.float()

    def scale_(self, factor: float) -> None:
        for t in self.g.values():
            t.mul_(factor)

    def finite(self) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in self.g.values())

    def clear(self) -> None:
        self.g.clear()
        self._recent.clear()

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
            t = self.g[u].to(dev) if u in self.g else torch.zeros(numel, dtype=torch.float32, device=dev)
            dist.all_reduce(t, group=group)
            t.div_(world)
            self.g[u] = t if dev.type == "cpu" or self.device.type == dev.type else t.to(self.device)
            if self.g[u].device.type != "cpu" and u not in self._recent:
                self._to_host(u)  # keep the device budget: reduced gradients wait on the host

    def _comm_device(self) -> torch.device:
        import torch.distributed as dist
        backend = dist.get_backend()
        return self.device if backend == "nccl" else torch.device("cpu")
