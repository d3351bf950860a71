"""``ExpertCache``: MoE experts as entries of the partition core's slot cache.

The cache core (:class:`~ds_maximus.partition.cache.SlotCache`: slot maps, the ``groups x slots`` device
table, per-slot load/use events, speculation, one vocabulary of counters) knows nothing about models. This
adapter names its parts for experts: a *group* is one MoE layer, ids inside a group are expert indices, the
store addresses ``uid = layer * num_experts + expert``, and a slot holds one expert as one flat vector of
``layout.numel`` elements (:class:`~ds_maximus.experts.layout.ExpertLayout`). Inference and training use it
alike; training refreshes resident copies of updated experts with ``write_slot``.

    >>> import torch
    >>> from ds_maximus.experts.layout import ExpertLayout
    >>> from ds_maximus.experts.expert_store import CpuExpertStore
    >>> lay = ExpertLayout.from_stacked({"w": torch.zeros(4, 2, 2)}, num_experts=4)
    >>> store = CpuExpertStore(lay, num_uids=4, pin_memory=False)
    >>> for e in range(4): store.write(e, {"w": torch.full((2, 2), float(e))})
    >>> cache = ExpertCache(store, num_groups=1, num_experts=4, slots_per_group=2, device="cpu")
    >>> slots = cache.acquire(0, [3, 1]); float(lay.view(cache.slot(0, slots[0]), "w")[0, 0])
    3.0
    >>> cache.release(0, slots); cache.stats()["hit_rate"]
    0.0
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from ds_maximus.config import CachePolicy, MoEConfig
from ds_maximus.errors import CapacityError, ConfigError
from ds_maximus.experts.expert_store import ExpertStore
from ds_maximus.partition.cache import SlotCache


class ExpertCache(SlotCache):
    """Per-layer expert slots on ``device`` backed by an :class:`ExpertStore` (see the module docstring)."""

    entry_name, group_name, size_key = "experts", "layer", "moe.gpu_experts_per_layer"

    def __init__(self, store: ExpertStore, num_groups: int, num_experts: int,
                 slots_per_group: Union[int, Sequence[int]], device, policy: CachePolicy = CachePolicy.LRU,
                 transfer=None, prefetch_chunk_bytes: Optional[int] = None, stage_guesses: Union[bool, int] = False):
        # one count for every layer, or one per layer (moe.gpu_expert_total_bytes spread over the layers)
        per = [slots_per_group] * int(num_groups) if isinstance(slots_per_group, int) else list(slots_per_group)
        slots = [int(min(n, num_experts)) for n in per]
        if min(slots, default=1) < 1:
            raise CapacityError(f"the expert cache needs at least one slot per layer, got {min(per)}; raise "
                                "moe.gpu_experts_per_layer, moe.gpu_expert_bytes or moe.gpu_expert_total_bytes")
        self.layout = store.layout
        self.num_experts = int(num_experts)
        super().__init__(store, num_groups, num_experts, slots, self.layout.numel, self.layout.dtype, device,
                         policy, transfer, prefetch_chunk_bytes, stage_guesses)

    def slot(self, group: int, slot: int) -> torch.Tensor:
        """The flat buffer of one slot (see ``ExpertLayout.view``)."""
        return self.groups[group].buffer[slot]

    def stats(self) -> dict:
        """The partition cache's counters (:meth:`SlotCache.stats`) with the expert-facing names: demand
        lookups/hits/misses, prefetch precision and recall, the hits that needed no copy (``resident_hit_rate``),
        bytes by demand and by prefetch."""
        s = super().stats()
        hits, misses, used, issued = s["hits"], s["misses"], s["prefetch_used"], s["prefetch_issued"]
        s.update({
            "demand_lookups": s["lookups"], "demand_hits": hits, "demand_misses": misses,
            "prefetch_useful": used,
            "prefetch_precision": used / issued if issued else 0.0,
            "prefetch_recall": used / (used + misses) if used + misses else 0.0,
            # served by an expert already resident before its layer's routing: a used guess is a hit, but its
            # bytes crossed the link for it
            "resident_hit_rate": (hits - used) / s["lookups"] if s["lookups"] else 0.0,
            "bytes_demand": s["bytes_h2d"] - s["bytes_prefetch"],
            "gpu_stall_ms": s["stall_ms"] - s["host_stall_ms"],
            "expert_bytes": self.layout.nbytes,
            "staging_bytes": self._stage_bytes(),
            "slots_per_layer": (self.slots_per_group if len(set(self.group_slots)) == 1
                                else sum(self.group_slots) / len(self.group_slots)),
        })
        return s


def layer_slots(cfg: MoEConfig, expert_bytes: int, num_layers: int, num_experts: int) -> List[int]:
    """GPU slots of each MoE layer: ``gpu_experts_per_layer``, or ``gpu_expert_bytes // expert_bytes`` a layer, or
    ``gpu_expert_total_bytes // expert_bytes`` spread over the layers (the first of total, per-layer bytes and
    count that is set). A total that does not divide evenly gives ``remainder`` layers, spaced evenly through
    the model, one slot more; a layer never gets more slots than it has experts, nor fewer than one (a total too
    small for that is a ``ConfigError``, as the cache needs a slot a layer).

    >>> layer_slots(MoEConfig(gpu_expert_total_bytes=11 * 100), 100, 4, 8)
    [2, 3, 3, 3]
    >>> layer_slots(MoEConfig(gpu_experts_per_layer=3), 100, 4, 8)
    [3, 3, 3, 3]
    """
    if cfg.gpu_expert_total_bytes is not None:
        total = min(cfg.gpu_expert_total_bytes // expert_bytes, num_layers * num_experts)
        if total < num_layers:
            raise ConfigError(f"moe.gpu_expert_total_bytes={cfg.gpu_expert_total_bytes} holds {total} experts of "
                              f"{expert_bytes / 2**20:.1f} MiB, fewer than the model's {num_layers} MoE layers (the "
                              f"cache needs a slot a layer): give it at least {num_layers * expert_bytes} bytes",
                              "maximus.moe.gpu_expert_total_bytes")
        base, extra = divmod(total, num_layers)
        # the layers with one slot more, spread evenly: layer i gets one when floor((i+1)*extra/L) steps up
        return [base + ((i + 1) * extra // num_layers - i * extra // num_layers) for i in range(num_layers)]
    if cfg.gpu_expert_bytes is not None:
        return [max(1, cfg.gpu_expert_bytes // expert_bytes)] * num_layers
    return [cfg.gpu_experts_per_layer] * num_layers


def slot_range(slots: Sequence[int]) -> str:
    """Per-layer slot counts for a report: ``"3"``, or ``"4-5"`` when a total budget spread a remainder.

    >>> slot_range([3, 3]), slot_range([4, 5, 5])
    ('3', '4-5')
    """
    lo, hi = min(slots), max(slots)
    return str(lo) if lo == hi else f"{lo}-{hi}"
