"""On-disk shard store: shard files, ``shard_index.json``, checksums, atomic reads and writes.

>>> from ds_maximus.store import ShardStore
"""
from ds_maximus.store.format import ALIGN_BYTES
from ds_maximus.store.index import INDEX_NAME, ShardInfo, StoreIndex
from ds_maximus.store.shard_store import ShardStore, default_loader

__all__ = ["ShardStore", "ShardInfo", "StoreIndex", "INDEX_NAME", "ALIGN_BYTES", "default_loader"]
