"""The partition core shared by vocabulary rows, the LM head and MoE experts, in inference and training.

``host_memory``: the host-memory planner of the slow tiers (what each tier needs, checked against free
memory, ``/dev/shm`` and NVMe space before anything is allocated) and the exact-size, pieced pinned tables.
"""
