"""MoE experts as swappable partitions: expert store, expert cache, speculative prefetch, HF adapters.

    >>> from ds_maximus.experts import offload_experts   # handle = offload_experts(model, ds_config)
"""
from ds_maximus.experts.expert_cache import ExpertCache  # noqa: F401
from ds_maximus.experts.expert_store import CpuExpertStore, ExpertStore, FileExpertStore  # noqa: F401
from ds_maximus.experts.layout import ExpertLayout  # noqa: F401
from ds_maximus.experts.offload import MoEOffload, OffloadedExperts, offload_experts  # noqa: F401

__all__ = ["offload_experts", "MoEOffload", "OffloadedExperts", "ExpertCache",
           "ExpertLayout", "ExpertStore", "CpuExpertStore", "FileExpertStore"]
