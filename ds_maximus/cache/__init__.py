"""The generic swappable-partition cache (vocab rows, MoE experts): slots, LRU/LFU, pinning, stats.

>>> from ds_maximus.cache import PartitionCache, SlotMap, TensorTier
"""
from ds_maximus.cache.partition_cache import PartitionCache, TrafficCounters  # noqa: F401
from ds_maximus.cache.policy import Assignment, CacheCounters, SlotMap  # noqa: F401
from ds_maximus.cache.tier import TensorTier, Tier  # noqa: F401
