"""A split optimizer step that runs on into the next forward (``moe.overlap_step``).

:meth:`~ds_maximus.experts.training.step.SplitStep.run` returns once the step is queued. The CPU side's worker
thread goes on updating its experts in layer order, and the device side's pieces are queued on the
pipeline's update stream. The next forward waits for layer ``g``'s updates only when it reaches layer
``g`` (:meth:`PendingStep.await_layer`, called by ``begin_layer``):

* the host waits until the CPU side has finished the layer's experts, then refreshes their resident
  cache slots from the copy the op wrote;
* the compute stream and the expert cache's load stream wait on the device side's event for the layer
  (recorded after the layer's last piece is updated, its slots refreshed and its copies written back).

So the end of one step overlaps with the next step's forward layer by layer, and every expert is still
computed with updated (the results are the synchronous step's, bit for bit). Anything else that reads
the experts (the next step, checkpoints, exports) first waits for all of it (:meth:`PendingStep.finish`).
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional

import torch


class PendingStep:
    """One step's experts still being updated: per layer, the CPU side's completion and the device side's."""

    def __init__(self, parts, num_layers: int, num_experts: int):
        self.parts = parts  # the step's StepParts: the store and cache whose copies are refreshed
        self.num_layers, self.num_experts = num_layers, num_experts
        self.cpu_done = [threading.Event() for _ in range(num_layers)]
        self.gpu_done: List[Optional[object]] = [None] * num_layers  # CUDA events (None: nothing queued)
        self.cpu_uids: Dict[int, List[int]] = {}  # layer -> experts stepped by the CPU side
        self.awaited: set = set()
        self.future = None           # the CPU side's worker (returns its seconds)
        self.dev_events = None       # (start, end) CUDA timing events of the device side
        self.dev_s: Optional[float] = None  # the device side's seconds when it ran synchronously
        self.n_cpu = self.n_dev = 0
        self.share = 0.5
        self.wait_s = 0.0            # host seconds spent waiting in await_layer / finish
        self.error: Optional[BaseException] = None  # the CPU side's, raised to whoever waits for a layer

    # -- the CPU side (worker thread) -------------------------------------------------------------
    def cpu_reached(self, uid: int) -> None:
        """The CPU side starts on expert ``uid``: every layer before it is done."""
        for g in range(uid // self.num_experts):
            self.cpu_done[g].set()

    def cpu_finished(self) -> None:
        for ev in self.cpu_done:
            ev.set()

    # -- the device side ----------------------------------------------------------------------------
    def layer_queued(self, layer: int, event) -> None:
        """The device side's last piece of ``layer`` is queued; ``event`` follows its write-back."""
        self.gpu_done[layer] = event

    # -- waiting ------------------------------------------------------------------------------------
    def ready(self, layer: int) -> bool:
        """Whether waiting for ``layer`` would not block the host."""
        return layer in self.awaited or self.cpu_done[layer].is_set()

    def await_layer(self, layer: int) -> bool:
        """Make layer ``layer``'s updated experts usable by what is queued next (see module docstring); False
        when that was done already."""
        if layer in self.awaited:
            return False
        t0 = time.perf_counter()
        self.cpu_done[layer].wait()
        if self.error is not None:  # the tier may hold half-updated experts: no forward goes on with them
            raise RuntimeError(f"the expert optimizer step failed on the CPU side: {self.error!r}") from self.error
        self.awaited.add(layer)
        parts = self.parts
        for u in self.cpu_uids.get(layer, ()):  # resident slots: refreshed from the copy the op wrote
            parts.refresh_slot(u, parts.store.host_view(u))
        ev = self.gpu_done[layer]
        if ev is not None:
            torch.cuda.current_stream(parts.cache.device).wait_event(ev)
            parts.cache.transfer.wait_event(ev)
        self.wait_s += time.perf_counter() - t0
        return True

    def finish(self) -> tuple:
        """Wait for every layer and the worker; returns ``(cpu seconds, device seconds)`` of the two sides."""
        for g in range(self.num_layers):
            self.await_layer(g)
        t0 = time.perf_counter()
        t_cpu = self.future.result() if self.future is not None else 0.0
        t_dev = self.dev_s or 0.0
        if self.dev_events is not None:
            start, end = self.dev_events
            end.synchronize()
            t_dev = start.elapsed_time(end) / 1e3
        self.wait_s += time.perf_counter() - t0
        return t_cpu, t_dev
