"""Timeout-guarded collectives with traffic counters.

Every maximus collective runs with ``async_op=True`` and is waited on with a deadline, so a rank that
died or never arrives makes the others raise :class:`~ds_maximus.errors.DistributedError` naming the
collective, the step and the group, instead of hanging until the process group's own (30 min) timeout.

Example::

    comm = Collectives(group=None, timeout_s=60)
    recv = comm.all_to_all("ids", send, send_splits=[2, 3], recv_splits=[1, 4])
    comm.stats()        # {"bytes_sent": ..., "bytes_recv": ..., "comm_ms": ..., "collectives": ...}

A group of one rank moves nothing: every collective returns its input (on the group's device) without calling
torch.distributed and without counting. On GPUs (NCCL) the collectives run on NCCL's own streams; one whose
result stays on the device (``defer=True``: the rows of a lookup) only orders the current stream after it, so
the host goes on queueing compute while the rows move, and its deadline is checked at the next collective or
at :meth:`Collectives.settle` (the step).
"""
from __future__ import annotations

import datetime
import math
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from ds_maximus.errors import DistributedError


def default_group():
    """DeepSpeed's data-parallel group when DeepSpeed set one up, else the default group."""
    try:
        from deepspeed.utils import groups
        g = groups._get_data_parallel_group()
        if g is not None:
            return g
    except Exception:  # DeepSpeed absent or its groups not initialised: the world group
        pass
    return dist.group.WORLD


class Collectives:
    """Collectives over one group, each guarded by ``timeout_s``; counts bytes moved and time spent."""

    def __init__(self, group=None, timeout_s: float = 600.0, device: Optional[torch.device] = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError("maximus shard modes other than 'replicated' need torch.distributed initialised "
                                   "(deepspeed.init_distributed() or the deepspeed launcher); fix: launch with "
                                   "`deepspeed --num_gpus N ...` or call deepspeed.init_distributed() first")
        self.group = group if group is not None else default_group()
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.timeout_s = float(timeout_s)
        backend = dist.get_backend(self.group)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                                 else torch.device("cpu"))
        self.on_device = self.device.type != "cpu"  # NCCL's wait() does not block the host: see _poll
        self.step = 0  # the caller's step, for error messages
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.comm_ms = 0.0
        self.calls = 0
        self._pending: List[tuple] = []  # (work, name, t0) of deferred device collectives, oldest first

    @property
    def single(self) -> bool:
        """A group of one rank: every collective is a no-op."""
        return self.world == 1

    # -- the guard ------------------------------------------------------------------------------------------
    def _wait(self, work, name: str, t0: float, waited_from: Optional[float] = None) -> None:
        """Wait for ``work`` issued at ``t0`` (the deadline runs from there); the time from ``waited_from`` (default
        ``t0``) to now counts in ``comm_ms``."""
        where = f"maximus collective '{name}' (step {self.step}, rank {self.rank} of {self.world})"
        try:
            if self.on_device:
                ok = self._poll(work, t0)
            else:
                ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # a peer closed its connection (died), or the wait timed out
            timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
            what = f"timed out after {self.timeout_s:g} s" if timed_out else f"failed: {e}"
            raise DistributedError(f"{where} {what}; another rank died or stopped calling it. fix: look at the "
                                   "other ranks' logs for the first error; raise maximus.distributed.timeout_s if "
                                   "a rank is only slow") from e
        finally:
            self.comm_ms += (time.perf_counter() - (t0 if waited_from is None else waited_from)) * 1e3
            if waited_from is None:  # a deferred one was counted when it was issued
                self.calls += 1
        if ok is False:
            raise DistributedError(f"{where} timed out after {self.timeout_s:g} s; another rank died or stopped "
                                   "calling it. fix: see the other ranks' logs; raise maximus.distributed.timeout_s")

    def _poll(self, work, t0: float) -> bool:
        """NCCL: ``wait()`` orders the current stream after the collective; the host then polls the work
        against the deadline (``wait(timeout=...)`` would sleep 1 ms between polls, a millisecond per
        collective). Returns False when the deadline passes."""
        work.wait()
        spins = 0
        while not work.is_completed():
            if time.perf_counter() - t0 > self.timeout_s:
                return False
            spins += 1
            time.sleep(0 if spins < 2000 else 1e-3)  # spin a few ms, then back off
        return True

    def settle(self) -> None:
        """Wait (against the deadline) for the deferred device collectives; a dead peer raises here."""
        while self._pending:
            work, name, t0 = self._pending.pop(0)
            self._wait(work, name, t0, waited_from=time.perf_counter())

    def _issue(self, work, name: str, t0: float, defer: bool) -> None:
        if defer and self.on_device:
            work.wait()  # the current stream waits for NCCL's; the host does not
            self._pending.append((work, name, t0))
            self.comm_ms += (time.perf_counter() - t0) * 1e3
            self.calls += 1
            return
        self.settle()
        self._wait(work, name, t0)

    # -- collectives ----------------------------------------------------------------------------------------
    def all_to_all(self, name: str, send: torch.Tensor, send_splits: List[int], recv_splits: List[int],
                   defer: bool = False) -> torch.Tensor:
        """``all_to_all_single`` with split sizes (rows of dim 0); returns the received tensor. ``defer``: the
        result is used on the device only (see the module docstring)."""
        send = send.to(self.device).contiguous()
        if self.single:
            return send
        recv = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype, device=self.device)
        row = math.prod(send.shape[1:]) * send.element_size()  # bytes per row (a rank may send none)
        self.bytes_sent += (sum(send_splits) - send_splits[self.rank]) * row
        self.bytes_recv += (sum(recv_splits) - recv_splits[self.rank]) * row
        t0 = time.perf_counter()
        work = dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=self.group, async_op=True)
        self._issue(work, name, t0, defer)
        return recv

    def exchange_counts(self, name: str, counts: torch.Tensor) -> torch.Tensor:
        """Each rank sends ``counts[j]`` to rank ``j``; returns what every rank sent to this one."""
        counts = counts.to(self.device, torch.long).contiguous()
        if self.single:
            return counts.cpu()
        recv = torch.empty_like(counts)
        self.bytes_sent += (self.world - 1) * 8
        self.bytes_recv += (self.world - 1) * 8
        t0 = time.perf_counter()
        work = dist.all_to_all_single(recv, counts, group=self.group, async_op=True)
        self._issue(work, name, t0, False)
        return recv.cpu()

    def all_reduce(self, name: str, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        out = t.to(self.device).contiguous().clone()
        if self.single:
            return out.to(t.device)
        nbytes = out.numel() * out.element_size()
        self.bytes_sent += nbytes
        self.bytes_recv += nbytes
        t0 = time.perf_counter()
        self._issue(dist.all_reduce(out, op=op, group=self.group, async_op=True), name, t0, False)
        return out.to(t.device)

    def reduce(self, name: str, t: torch.Tensor, dst_rank: int, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``t`` to group rank ``dst_rank``; returns the result there (on ``t``'s device), ``t`` elsewhere."""
        out = t.to(self.device).contiguous().clone()
        if self.single:
            return out.to(t.device)
        nbytes = out.numel() * out.element_size()
        if self.rank == dst_rank:
            self.bytes_recv += nbytes * (self.world - 1)
        else:
            self.bytes_sent += nbytes
        t0 = time.perf_counter()
        dst = dist.get_global_rank(self.group, dst_rank) if self.group is not dist.group.WORLD else dst_rank
        self._issue(dist.reduce(out, dst=dst, op=op, group=self.group, async_op=True), name, t0, False)
        return out.to(t.device) if self.rank == dst_rank else t

    def all_gather(self, name: str, t: torch.Tensor) -> List[torch.Tensor]:
        """All-gather tensors of equal shape; returns one per rank (on the input's device)."""
        if self.single:
            return [t.clone()]
        src = t.to(self.device).contiguous()
        outs = [torch.empty_like(src) for _ in range(self.world)]
        nbytes = src.numel() * src.element_size()
        self.bytes_sent += nbytes * (self.world - 1)
        self.bytes_recv += nbytes * (self.world - 1)
        t0 = time.perf_counter()
        self._issue(dist.all_gather(outs, src, group=self.group, async_op=True), name, t0, False)
        return [o.to(t.device) for o in outs]

    def broadcast(self, name: str, t: torch.Tensor, src_rank: int) -> torch.Tensor:
        """Broadcast ``t`` from group rank ``src_rank`` (in place on a device copy); returns it on ``t``'s device."""
        if self.single:
            return t
        buf = t.to(self.device).contiguous()
        nbytes = buf.numel() * buf.element_size()
        if self.rank == src_rank:
            self.bytes_sent += nbytes * (self.world - 1)
        else:
            self.bytes_recv += nbytes
        t0 = time.perf_counter()
        src = dist.get_global_rank(self.group, src_rank) if self.group is not dist.group.WORLD else src_rank
        self._issue(dist.broadcast(buf, src=src, group=self.group, async_op=True), name, t0, False)
        if buf.data_ptr() != t.data_ptr():
            t.copy_(buf)
        return t

    def stats(self) -> dict:
        return {"bytes_sent": int(self.bytes_sent), "bytes_recv": int(self.bytes_recv),
                "comm_ms": float(self.comm_ms), "collectives": int(self.calls)}
