"""Counters of expert training: experts moved per step, bytes, stall ms, cache hit rate, routing histogram.

"Moved" counts the traffic between the CPU tier and the compute device: experts loaded into the
expert cache (demand + prefetch, compute dtype), the optimizer's staging of masters and moments
(``optimizer_device: compute``) or of gradients (``cpu``), and refreshes of resident slots after an
update. On a CPU-only run the same traffic is counted (it is what would cross PCIe).

    >>> s = ExpertTrainStats(num_layers=1, num_experts=4)
    >>> s.route(0, [3, 0, 1, 0]); s.as_dict(None)["routing"]
    [[3, 0, 1, 0]]
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch


@dataclasses.dataclass
class _Step:
    experts_loaded: int = 0
    bytes_loaded: int = 0
    experts_stepped: int = 0
    bytes_step: int = 0
    bytes_refresh: int = 0
    caught_up: int = 0
    stall_ms: float = 0.0
    step_ms: float = 0.0
    step_wait_ms: float = 0.0  # the forward's (and this step's) host wait for the last step's updates
    hits: int = 0
    lookups: int = 0


class ExpertTrainStats:
    def __init__(self, num_layers: int, num_experts: int):
        self.routing = torch.zeros(num_layers, num_experts, dtype=torch.long)       # cumulative tokens
        self.step_routing = torch.zeros(num_layers, num_experts, dtype=torch.long)  # this step's
        self.steps = 0
        self.experts_stepped = 0
        self.bytes_step = 0
        self.bytes_refresh = 0
        self.caught_up = 0
        self.cpu_step_share: Optional[float] = None  # optimizer_device split: the share stepped on the CPU
        self.step_wait_ms = 0.0      # split: host time waiting for a step's updates (cumulative)
        self.overlapped_layers = 0   # split: layers whose forward began while the last step still ran
        self.split_sides: Optional[tuple] = None  # split: the last finished step's (CPU ms, device ms, experts each)
        self.step_parts_ms: Optional[tuple] = None  # the last sparse_step's host ms: (finish, cache sync, issue)
        self.last = _Step()
        self._mark = {"loads": 0, "bytes": 0, "stall": 0.0, "hits": 0, "lookups": 0, "stepped": 0,
                      "bytes_step": 0, "refresh": 0, "caught": 0, "wait": 0.0}

    def route(self, group: int, counts: List[int]) -> None:
        c = torch.tensor(counts, dtype=torch.long)
        self.routing[group] += c
        self.step_routing[group] += c

    def add_step_traffic(self, experts: int, nbytes: int) -> None:
        """``experts`` more experts updated; ``nbytes`` of state (staged in and out) or gradient moved."""
        self.experts_stepped += experts
        self.bytes_step += nbytes

    def end_step(self, cache, step_ms: float) -> None:
        s = cache.stats()
        loads = s["demand_misses"] + s["prefetch_issued"]
        m = self._mark
        self.last = _Step(experts_loaded=loads - m["loads"], bytes_loaded=s["bytes_moved"] - m["bytes"],
                          experts_stepped=self.experts_stepped - m["stepped"],
                          bytes_step=self.bytes_step - m["bytes_step"],
                          bytes_refresh=self.bytes_refresh - m["refresh"], caught_up=self.caught_up - m["caught"],
                          stall_ms=s["stall_ms"] - m["stall"], step_ms=step_ms,
                          step_wait_ms=self.step_wait_ms - m["wait"],
                          hits=s["demand_hits"] - m["hits"], lookups=s["demand_lookups"] - m["lookups"])
        self._mark = {"loads": loads, "bytes": s["bytes_moved"], "stall": s["stall_ms"], "hits": s["demand_hits"],
                      "lookups": s["demand_lookups"], "stepped": self.experts_stepped, "bytes_step": self.bytes_step,
                      "refresh": self.bytes_refresh, "caught": self.caught_up, "wait": self.step_wait_ms}
        self.last_routing = self.step_routing.clone()
        self.step_routing.zero_()
        self.steps += 1

    def as_dict(self, cache: Optional[object]) -> dict:
        out = dict(cache.stats()) if cache is not None else {}
        last = dataclasses.asdict(self.last)
        last["bytes_moved"] = last["bytes_loaded"] + last["bytes_step"] + last["bytes_refresh"]
        last["hit_rate"] = last["hits"] / last["lookups"] if last["lookups"] else 0.0
        last["routing"] = getattr(self, "last_routing", self.step_routing).tolist()
        if self.cpu_step_share is not None:
            last["cpu_step_share"] = self.cpu_step_share
        if self.step_parts_ms is not None:
            last["step_parts_ms"] = dict(zip(("finish", "sync", "issue"), self.step_parts_ms))
        if self.split_sides is not None:
            last["split_sides"] = dict(zip(("cpu_ms", "device_ms", "cpu_experts", "device_experts"), self.split_sides))
        out.update({"steps": self.steps, "experts_stepped": self.experts_stepped, "bytes_step": self.bytes_step,
                    "bytes_refresh": self.bytes_refresh, "caught_up": self.caught_up,
                    "step_wait_ms": self.step_wait_ms, "overlapped_layers": self.overlapped_layers,
                    "routing": self.routing.tolist(), "last_step": last})
        return out

    def line(self) -> str:
        s = self.last
        return (f"moved {s.experts_loaded} experts ({s.bytes_loaded / 2**20:.1f} MiB) + step {s.experts_stepped} "
                f"experts ({(s.bytes_step + s.bytes_refresh) / 2**20:.1f} MiB), hit rate "
                f"{s.hits / s.lookups if s.lookups else 0.0:.2f}, stall {s.stall_ms:.1f} ms, step {s.step_ms:.1f} ms"
                + (f", {s.step_wait_ms:.1f} ms waiting for the last step" if s.step_wait_ms else "")
                + (f" (CPU share {self.cpu_step_share:.2f})" if self.cpu_step_share is not None else "")
                + (" (last split step: CPU {:.0f} ms for {} experts, device {:.0f} ms for {})".format(
                    self.split_sides[0], self.split_sides[2], self.split_sides[1], self.split_sides[3])
                   if self.split_sides is not None else ""))
