"""``shard_index.json``: what a shard store holds, shard by shard.

The index names the format version, vocabulary size, row width, dtype, rows per shard, the
optimizer-state tensor names, and per shard its row range, file, byte size, data offset, checksum
and access count. It is written atomically, after the shard files it names.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import List, Tuple

from ds_maximus.errors import ShardStoreError
from ds_maximus.store.format import atomic_write, dtype_from_name

INDEX_NAME = "shard_index.json"
FORMAT_NAME = "ds_maximus.shard_store"
FORMAT_VERSION = 1


@dataclasses.dataclass
class ShardInfo:
    """One shard: rows ``[lo, hi)`` in ``file`` (relative to the store folder)."""

    id: int
    lo: int
    hi: int
    file: str
    bytes: int
    data_offset: int
    checksum: str
    access_count: int = 0

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclasses.dataclass
class StoreIndex:
    vocab_size: int
    dim: int
    dtype: str
    rows_per_shard: int
    state_names: Tuple[str, ...]
    shards: List[ShardInfo]
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = {"format": FORMAT_NAME, "format_version": self.format_version, "vocab_size": self.vocab_size,
             "dim": self.dim, "dtype": self.dtype, "rows_per_shard": self.rows_per_shard,
             "state_names": list(self.state_names), "shards": [dataclasses.asdict(s) for s in self.shards]}
        return json.dumps(d, indent=1)

    def save(self, folder: str) -> None:
        atomic_write(os.path.join(folder, INDEX_NAME), [self.to_json().encode()])

    @classmethod
    def load(cls, folder: str) -> "StoreIndex":
        path = os.path.join(folder, INDEX_NAME)
        if not os.path.isdir(folder):
            raise ShardStoreError(f"shard store folder {folder} does not exist; create it with "
                                  "ShardStore.create(...) or `maximus-tokenizer convert`", folder)
        try:
            with open(path, "rb") as f:
                d = json.loads(f.read().decode())
        except FileNotFoundError:
            raise ShardStoreError(f"{path} is missing: {folder} is not a shard store (or its index was lost); "
                                  "create it with ShardStore.create(...)", path) from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardStoreError(f"{path} is corrupt ({e}); restore it from a backup", path) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise ShardStoreError(f"{path} is not a ds_maximus shard index (format={d.get('format') if isinstance(d, dict) else None!r})", path)
        if d.get("format_version") != FORMAT_VERSION:
            raise ShardStoreError(f"{path} has format version {d.get('format_version')}; this ds_maximus reads "
                                  f"version {FORMAT_VERSION}; upgrade ds_maximus or rebuild the store", path)
        try:
            shards = [ShardInfo(**s) for s in d["shards"]]
            idx = cls(int(d["vocab_size"]), int(d["dim"]), str(d["dtype"]), int(d["rows_per_shard"]),
                      tuple(d["state_names"]), shards)
        except (KeyError, TypeError, ValueError) as e:
            raise ShardStoreError(f"{path} is missing or has a wrong field ({type(e).__name__}: {e})", path) from None
        dtype_from_name(idx.dtype)
        idx.check(path)
        return idx

    def check(self, path: str) -> None:
        """The shards tile ``[0, vocab_size)`` in order, with no gap or overlap."""
        pos = 0
        for i, s in enumerate(self.shards):
            if s.id != i or s.lo != pos or s.hi <= s.lo:
                raise ShardStoreError(f"{path}: shard {i} has range [{s.lo}, {s.hi}) (id {s.id}); expected to start "
                                      f"at row {pos} with id {i}; the index is corrupt", path)
            pos = s.hi
        if pos != self.vocab_size:
            raise ShardStoreError(f"{path}: shards cover {pos} rows but vocab_size is {self.vocab_size}", path)
