"""shard_index.json and shard headers are validated before any read or write.

The regression case of the safe-loading issue: a shard's ``"file"`` set to ``"../victim.txt"`` made
``write_shard`` delete a file outside the store. Now ``ShardStore.open`` refuses the index, naming the
field, and the file outside survives.
"""
import json
import os
import struct

import pytest
import torch

from ds_maximus.errors import ShardStoreError
from ds_maximus.store import INDEX_NAME, ShardStore


@pytest.fixture
def store(tmp_path):
    def init(lo, hi):
        return {"weight": torch.arange(lo, hi, dtype=torch.float32)[:, None].expand(-1, 6)}
    return ShardStore.create(str(tmp_path / "s"), 37, 6, rows_per_shard=16, state_names=("exp_avg",), loader=False,
                             init=init)


def _edit_index(store, fn):
    p = os.path.join(store.path, INDEX_NAME)
    d = json.load(open(p))
    fn(d)
    with open(p, "w") as f:
        json.dump(d, f)


@pytest.mark.parametrize("name", ["../victim.txt", "/abs/victim.txt", "sub/shard_000000-00000000.safetensors",
                                  "..", "", "shard_000000-00000000.safetensors/../../victim.txt"])
def test_traversal_file_name_is_refused_and_victim_survives(store, tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    _edit_index(store, lambda d: d["shards"][0].update(file=name))
    with pytest.raises(ShardStoreError, match="shard file name"):
        ShardStore.open(store.path, loader=False)
    for attempt in (lambda s: s.write_shard(0, {"weight": torch.zeros(16, 6)}), lambda s: s.read_shard(0)):
        with pytest.raises(ShardStoreError):
            attempt(ShardStore.open(store.path, loader=False))
    assert victim.read_text() == "keep me"


def test_symlinked_shard_file_outside_the_store_is_refused(store, tmp_path):
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(open(store.shard_path(0), "rb").read())
    live = ShardStore.open(store.path, loader=False)  # opened before the swap: checked again at use
    path = store.shard_path(0)
    os.unlink(path)
    os.symlink(victim, path)
    with pytest.raises(ShardStoreError, match="outside the store"):
        ShardStore.open(store.path, loader=False)
    with pytest.raises(ShardStoreError, match="outside the store"):
        live.read_shard(0)
    live.write_shard(0, {"weight": torch.zeros(16, 6), "exp_avg": torch.zeros(16, 6)})
    assert victim.exists() and not os.path.islink(live.shard_path(0))  # the link was replaced, not followed


@pytest.mark.parametrize("field,value", [
    ("vocab_size", -1), ("vocab_size", "37"), ("vocab_size", 1 << 62), ("vocab_size", True), ("dim", 0),
    ("dim", 2.5), ("rows_per_shard", None), ("dtype", "complex64"), ("dtype", 7), ("state_names", "exp_avg"),
    ("state_names", ["weight"]), ("state_names", ["../x"]), ("format_version", True), ("format_version", 2),
    ("shards", {}),
])
def test_top_level_fields_are_checked(store, field, value):
    _edit_index(store, lambda d: d.update({field: value}))
    with pytest.raises(ShardStoreError, match=field if field != "format_version" else "format version"):
        ShardStore.open(store.path, loader=False)


@pytest.mark.parametrize("field,value", [
    ("bytes", 10 << 30), ("bytes", -5), ("data_offset", 17), ("data_offset", 1 << 40), ("checksum", 5),
    ("checksum", "md5:00"), ("access_count", -1), ("access_count", 1e30), ("id", 3), ("hi", "16"),
])
def test_shard_fields_are_checked(store, field, value):
    _edit_index(store, lambda d: d["shards"][1].update({field: value}))
    with pytest.raises(ShardStoreError, match="shard 1"):
        ShardStore.open(store.path, loader=False)


def test_missing_and_duplicate_entries(store):
    _edit_index(store, lambda d: d["shards"][1].pop("checksum"))
    with pytest.raises(ShardStoreError, match="'checksum' is missing"):
        ShardStore.open(store.path, loader=False)
    _edit_index(store, lambda d: d["shards"][1].update(checksum="crc32:00000000", file=d["shards"][0]["file"]))
    with pytest.raises(ShardStoreError, match="named by two shards"):
        ShardStore.open(store.path, loader=False)


def _rewrite_header(path, fn):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    fn(head)
    body = json.dumps(head).encode()
    body += b" " * (n - len(body))
    assert len(body) == n
    with open(path, "wb") as f:
        f.write(raw[:8] + body + raw[8 + n:])


@pytest.mark.parametrize("edit", [
    lambda h: h["weight"].update(dtype="Q9"),
    lambda h: h["weight"].update(shape=[16, -6]),
    lambda h: h["weight"].update(shape=[1 << 40, 1 << 40]),
    lambda h: h["weight"].update(data_offsets=[0, 1 << 50]),
    lambda h: h["weight"].update(data_offsets=[5, 1]),
    lambda h: h["weight"].update(data_offsets="0-384"),
    lambda h: h.update(__metadata__=[1, 2]),
    lambda h: h.update(weight=7),
])
def test_header_entries_are_checked(store, edit):
    _rewrite_header(store.shard_path(0), edit)
    with pytest.raises(ShardStoreError, match="corrupt header|torn|does not match"):
        ShardStore.open(store.path, loader=False).read_shard(0, verify=False)


def test_header_length_beyond_the_file(store):
    path = store.shard_path(0)
    raw = bytearray(open(path, "rb").read())
    raw[:8] = struct.pack("<Q", len(raw))  # declares more header than the file holds
    open(path, "wb").write(raw)
    with pytest.raises(ShardStoreError, match="header length"):
        ShardStore.open(store.path, loader=False).read_shard(0)
