"""The generic swappable-partition cache (vocab rows, MoE experts): slots, LRU/LFU, pinning, stats."""
from ds_maximus.cache.policy import Assignment, CacheCounters, SlotMap  # noqa: F401
