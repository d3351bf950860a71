"""``shard_index.json``: what a shard store holds, shard by shard.

The index names the format version, vocabulary size, row width, dtype, rows per shard, the
optimizer-state tensor names, and per shard its row range, file, byte size, data offset, checksum
and access count. It is written atomically, after the shard files it names.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import List, Tuple

from ds_maximus.errors import ShardStoreError
from ds_maximus.store.format import ALIGN_BYTES, DTYPE_NAMES, MAX_HEADER_BYTES, atomic_write

INDEX_NAME = "shard_index.json"
FORMAT_NAME = "ds_maximus.shard_store"
FORMAT_VERSION = 1

# Bounds of a real index; a value outside them is corruption or tampering, refused before use.
MAX_INDEX_BYTES = 1 << 30  # bytes of shard_index.json
MAX_ROWS = 1 << 40  # rows of a table
MAX_DIM = 1 << 24  # row width (elements)
MAX_STATE_NAMES = 16
MAX_COUNT = (1 << 63) - 1  # access counts (int64)
SHARD_FILE_RE = re.compile(r"shard_[0-9]{6,12}-[0-9a-f]{8}\.safetensors")  # what ShardStore names its files
CHECKSUM_RE = re.compile(r"crc32:[0-9a-f]{8}")
STATE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


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
        """Read and validate ``<folder>/shard_index.json``: every field's type and range, every file name,
        before any shard file is touched (see :func:`validate_index`)."""
        path = os.path.join(folder, INDEX_NAME)
        if not os.path.isdir(folder):
            raise ShardStoreError(f"shard store folder {folder} does not exist; create it with "
                                  "ShardStore.create(...) or `maximus-tokenizer convert`", folder)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_INDEX_BYTES:
                    raise ShardStoreError(f"{path} is {size} bytes, more than any real index ({MAX_INDEX_BYTES}); "
                                          "it is corrupt: restore it from a backup", path)
                d = json.loads(f.read().decode())
        except FileNotFoundError:
            raise ShardStoreError(f"{path} is missing: {folder} is not a shard store (or its index was lost); "
                                  "create it with ShardStore.create(...)", path) from None
        except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, or a number of over 4300 digits
            raise ShardStoreError(f"{path} is corrupt ({type(e).__name__}: {e}); restore it from a backup",
                                  path) from None
        return validate_index(d, folder, path)

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


# ---- validation --------------------------------------------------------------------------------------
_SHARD_KEYS = {f.name for f in dataclasses.fields(ShardInfo)}


def _field(d: dict, key: str, where: str, path: str):
    if key not in d:
        raise ShardStoreError(f"{path}: {where}field {key!r} is missing; the index is corrupt, restore it from a "
                              "backup or rebuild the store", path)
    return d[key]


def _int(d: dict, key: str, lo: int, hi: int, where: str, path: str) -> int:
    v = _field(d, key, where, path)
    if type(v) is not int or not lo <= v <= hi:  # bool is an int subclass: refused too
        raise ShardStoreError(f"{path}: {where}field {key!r} is {v!r:.80}; it must be an integer in [{lo}, {hi}]; "
                              "the index is corrupt, restore it from a backup or rebuild the store", path)
    return v


def _str(d: dict, key: str, pattern, where: str, path: str) -> str:
    v = _field(d, key, where, path)
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise ShardStoreError(f"{path}: {where}field {key!r} is {v!r:.80}; it must match {pattern.pattern!r}; "
                              "the index is corrupt, restore it from a backup or rebuild the store", path)
    return v


def shard_file_path(folder: str, name: str, index_path: str) -> str:
    """``<folder>/<name>`` for a shard file named in the index, refused unless ``name`` is a plain store file
    name and the path stays inside ``folder`` after resolving symlinks."""
    if not isinstance(name, str) or not SHARD_FILE_RE.fullmatch(name):
        raise ShardStoreError(f"{index_path}: shard file name {name!r:.80} is not a store file name (it must match "
                              f"{SHARD_FILE_RE.pattern!r}: no folders, no '..'); the index is corrupt or was "
                              "tampered with: restore it or rebuild the store", index_path)
    path = os.path.join(folder, name)
    real_folder = os.path.realpath(folder)
    if os.path.dirname(os.path.realpath(path)) != real_folder:
        raise ShardStoreError(f"shard file {path} resolves to {os.path.realpath(path)}, outside the store "
                              f"{real_folder} (a symlink); replace it with the shard file itself or rebuild the "
                              "store", path)
    return path


def validate_index(d, folder: str, path: str) -> StoreIndex:
    """A :class:`StoreIndex` from parsed JSON ``d``, every field checked for type and range.

    Raises ShardStoreError naming the field. Checked: format and version, sizes, dtype, state names,
    and per shard its id, row range, file name (a plain store file name inside ``folder``), byte size
    (exactly the header plus the rows of every tensor), data offset (4096-aligned, within the header
    bound), checksum and access count; file names are unique and the shards tile ``[0, vocab_size)``.
    """
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ShardStoreError(f"{path} is not a ds_maximus shard index (format={got!r:.80}); expected "
                              f"{FORMAT_NAME!r}", path)
    version = d.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise ShardStoreError(f"{path} has format version {version!r:.80}; this ds_maximus reads version "
                              f"{FORMAT_VERSION}; upgrade ds_maximus or rebuild the store", path)
    vocab = _int(d, "vocab_size", 0, MAX_ROWS, "", path)
    dim = _int(d, "dim", 1, MAX_DIM, "", path)
    rps = _int(d, "rows_per_shard", 1, MAX_ROWS, "", path)
    dtype = _field(d, "dtype", "", path)
    if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
        raise ShardStoreError(f"{path}: field 'dtype' is {dtype!r:.80}; allowed: {sorted(DTYPE_NAMES)}", path)
    itemsize = DTYPE_NAMES[dtype].itemsize
    names = _field(d, "state_names", "", path)
    if (not isinstance(names, list) or len(names) > MAX_STATE_NAMES
            or not all(isinstance(n, str) and STATE_NAME_RE.fullmatch(n) for n in names)
            or len(set(names)) != len(names) or "weight" in names):
        raise ShardStoreError(f"{path}: field 'state_names' is {names!r:.120}; it must be a list of at most "
                              f"{MAX_STATE_NAMES} unique names matching {STATE_NAME_RE.pattern!r}, without 'weight'",
                              path)
    raw = _field(d, "shards", "", path)
    if not isinstance(raw, list) or len(raw) > vocab:
        raise ShardStoreError(f"{path}: field 'shards' must be a list of at most vocab_size={vocab} entries; "
                              f"got {type(raw).__name__} of {len(raw) if isinstance(raw, list) else '-'}", path)
    n_tensors = 1 + len(names)
    shards, files = [], set()
    for i, s in enumerate(raw):
        where = f"shard {i}: "
        if not isinstance(s, dict) or set(s) - _SHARD_KEYS:
            extra = sorted(set(s) - _SHARD_KEYS) if isinstance(s, dict) else type(s).__name__
            raise ShardStoreError(f"{path}: {where}entry must be an object with fields {sorted(_SHARD_KEYS)}; "
                                  f"unexpected: {extra!r:.120}", path)
        sid = _int(s, "id", i, i, where, path)
        lo = _int(s, "lo", 0, vocab, where, path)
        hi = _int(s, "hi", 0, vocab, where, path)
        if lo != (shards[-1].hi if shards else 0) or hi <= lo:
            raise ShardStoreError(f"{path}: shard {i} has range [{lo}, {hi}); expected to start at row "
                                  f"{shards[-1].hi if shards else 0} and hold at least one row; the index is corrupt",
                                  path)
        fname = _field(s, "file", where, path)
        shard_file_path(folder, fname, path)
        if fname in files:
            raise ShardStoreError(f"{path}: {where}file {fname!r} is named by two shards; the index is corrupt", path)
        files.add(fname)
        offset = _int(s, "data_offset", ALIGN_BYTES, 8 + MAX_HEADER_BYTES + ALIGN_BYTES, where, path)
        if offset % ALIGN_BYTES:
            raise ShardStoreError(f"{path}: {where}field 'data_offset' is {offset}; it must be a multiple of "
                                  f"{ALIGN_BYTES}", path)
        want = offset + (hi - lo) * dim * itemsize * n_tensors
        nbytes = _int(s, "bytes", want, want, where, path)
        crc = _str(s, "checksum", CHECKSUM_RE, where, path)
        count = _int(s, "access_count", 0, MAX_COUNT, where, path) if "access_count" in s else 0
        shards.append(ShardInfo(sid, lo, hi, fname, nbytes, offset, crc, count))
    idx = StoreIndex(vocab, dim, dtype, rps, tuple(names), shards)
    idx.check(path)
    return idx
