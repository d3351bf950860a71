"""The partition core shared by vocabulary rows, the LM head and MoE experts, in inference and training.

- ``cache``: the swappable-partition cache (``groups x slots`` of a device table, write-back or read-only):
  ``PartitionCache`` moves rows in batches, ``SlotCache`` one flat entry (an expert) per slot.
- ``transfer``: the one transfer engine (side copy streams, events, pinned staging, UVA row copies).
- ``speculation``: prefetch jobs and staged guesses.
- ``policy``: the slot map and its eviction policies (LRU/LFU), pinning and counters.
- ``tier`` / ``store_tier``: the slow tiers behind a cache (pinned CPU, NVMe through the shard store).
- ``host_memory``: the host-memory planner of the slow tiers (what each tier needs, checked against free
  memory, ``/dev/shm`` and NVMe space before anything is allocated) and the exact-size, pieced pinned tables.

>>> from ds_maximus.partition import PartitionCache, SlotMap, TensorTier
"""
from ds_maximus.partition.cache import CacheCore, PartitionCache, SlotCache, TrafficCounters  # noqa: F401
from ds_maximus.partition.policy import Assignment, CacheCounters, SlotMap  # noqa: F401
from ds_maximus.partition.tier import TensorTier, Tier  # noqa: F401
