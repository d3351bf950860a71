"""ShardStore: layout, round trips, growth, and every way a store can be damaged."""
import errno
import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ds_maximus.errors import ShardStoreError
from ds_maximus.store import ALIGN_BYTES, INDEX_NAME, ShardStore
from ds_maximus.store import format as fmt


def _init(dim, states=()):
    def init(lo, hi):
        w = torch.arange(lo, hi, dtype=torch.float32)[:, None] + torch.arange(dim) / 100
        out = {"weight": w}
        for k, s in enumerate(states):
            out[s] = w * (k + 2)
        return out
    return init


def _digests(store):
    return {i: hashlib.sha256(open(store.shard_path(i), "rb").read()).hexdigest() for i in range(store.num_shards)}


@pytest.fixture
def store(tmp_path):
    return ShardStore.create(str(tmp_path / "s"), vocab_size=37, dim=6, rows_per_shard=16,
                             state_names=("exp_avg", "exp_avg_sq"), init=_init(6, ("exp_avg", "exp_avg_sq")),
                             loader=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,rps", [(1, 4), (37, 16), (64, 16), (100, 7)])
def test_round_trip_and_layout(tmp_path, dtype, vocab, rps):
    dim = 5
    ShardStore.create(str(tmp_path / "s"), vocab, dim, dtype=dtype, rows_per_shard=rps,
                      state_names=("m",), init=_init(dim, ("m",)), loader=False)
    s2 = ShardStore.open(str(tmp_path / "s"), loader=False)
    assert (s2.vocab_size, s2.dim, s2.dtype, s2.rows_per_shard, s2.state_names) == (vocab, dim, dtype, rps, ("m",))
    assert s2.num_shards == -(-vocab // rps)
    ref = _init(dim, ("m",))(0, vocab)
    full = s2.read_all()
    assert full.dtype == dtype and torch.equal(full, ref["weight"].to(dtype))
    assert torch.equal(s2.read_all("m"), ref["m"].to(dtype))
    for i, t in s2.iter_shards():
        lo, hi = s2.shard_range(i)
        info = s2.shard_info(i)
        assert info.data_offset % ALIGN_BYTES == 0 and info.data_offset >= ALIGN_BYTES
        # any safetensors tool opens the file and sees the same tensors
        st = load_file(s2.shard_path(i))
        assert list(t) == ["weight", "m"] and set(st) == {"weight", "m"}
        assert torch.equal(st["weight"], t["weight"]) and t["weight"].shape == (hi - lo, dim)
        path, off, nb = s2.tensor_location(i, "m")
        with open(path, "rb") as f:
            f.seek(off)
            assert f.read(nb) == t["m"].contiguous().view(torch.uint8).numpy().tobytes()


def test_index_fields(store):
    d = json.load(open(os.path.join(store.path, INDEX_NAME)))
    assert d["format_version"] == 1 and d["vocab_size"] == 37 and d["dim"] == 6 and d["dtype"] == "float32"
    assert d["rows_per_shard"] == 16 and d["state_names"] == ["exp_avg", "exp_avg_sq"]
    assert [(s["lo"], s["hi"]) for s in d["shards"]] == [(0, 16), (16, 32), (32, 37)]
    for s in d["shards"]:
        assert s["bytes"] == os.path.getsize(os.path.join(store.path, s["file"]))
        assert s["checksum"].startswith("crc32:") and s["access_count"] == 0


def test_shard_of_and_ranges(store):
    rows = torch.tensor([0, 15, 16, 31, 32, 36, 5])
    assert store.shard_of(rows).tolist() == [0, 0, 1, 1, 2, 2, 0]
    with pytest.raises(IndexError, match="37"):
        store.shard_of(torch.tensor([37]))
    with pytest.raises(IndexError, match="3 shards"):
        store.read_shard(3)
    assert torch.equal(store.read_rows(torch.tensor([36, 0, 17])), store.read_all()[[36, 0, 17]])


def test_write_shard_keeps_others_and_states(store):
    before = _digests(store)
    old_file = store.shard_path(1)
    old_m = store.read_shard(1)["exp_avg"].clone()
    store.write_shard(1, {"weight": torch.full((16, 6), 7.0)})
    assert not os.path.exists(old_file)
    after = _digests(store)
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    re = ShardStore.open(store.path, loader=False).read_shard(1)
    assert torch.equal(re["weight"], torch.full((16, 6), 7.0)) and torch.equal(re["exp_avg"], old_m)
    assert store.verify()["orphans"] == []
    with pytest.raises(ShardStoreError, match="shape"):
        store.write_shard(2, {"weight": torch.zeros(16, 6)})
    with pytest.raises(ShardStoreError, match="unknown tensors"):
        store.write_shard(0, {"bogus": torch.zeros(16, 6)})


def test_append_shards_grows_without_touching_old(store):
    before = _digests(store)
    new = torch.randn(20, 6)
    ids = store.append_shards({"weight": new})
    assert ids == [3, 4] and store.vocab_size == 57
    assert [store.shard_range(i) for i in ids] == [(37, 53), (53, 57)]
    again = ShardStore.open(store.path, loader=False)
    after = _digests(again)
    assert all(after[i] == before[i] for i in before)
    assert torch.equal(again.read_all()[37:], new)
    assert torch.equal(again.read_all("exp_avg")[37:], torch.zeros(20, 6))
    assert again.shard_of(torch.tensor([36, 37, 56])).tolist() == [2, 3, 4]
    again.verify()


def test_access_counts_persist(store):
    store.read_shard(0)
    store.read_shard(0)
    store.read_shard(2)
    store.flush_index()
    assert ShardStore.open(store.path, loader=False).access_counts() == [2, 0, 1]


# ---- damage -----------------------------------------------------------------------------------
def test_missing_shard_file(store):
    os.unlink(store.shard_path(1))
    with pytest.raises(ShardStoreError, match=r"shard_000001-.*missing") as e:
        store.read_shard(1)
    assert e.value.path == store.shard_path(1)
    with pytest.raises(ShardStoreError, match="1 of 3 shards"):
        store.verify()
    store.read_shard(0)  # the rest is still readable


def test_truncated_shard_file(store):
    path = store.shard_path(0)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(ShardStoreError, match="torn"):
        store.read_shard(0)


def test_torn_header(store):
    path = store.shard_path(2)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)  # absurd header length, same file size
    assert os.path.getsize(path) == size
    with pytest.raises(ShardStoreError, match="torn or corrupt"):
        store.read_shard(2)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"{{{")
    with pytest.raises(ShardStoreError, match="corrupt"):
        store.read_shard(2)


def test_corrupt_data_checksum(store):
    path = store.shard_path(1)
    off = store.shard_info(1).data_offset + 100
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(ShardStoreError, match="checksum") as e:
        store.read_shard(1)
    assert path in str(e.value)
    store.read_shard(1, verify=False)  # skippable for speed
    ShardStore.open(store.path, loader=False, verify_checksums=False).read_shard(1)


def test_index_points_to_missing_file(store):
    p = os.path.join(store.path, INDEX_NAME)
    d = json.load(open(p))
    d["shards"][2]["file"] = "shard_000002-0badf11e.safetensors"
    json.dump(d, open(p, "w"))
    s = ShardStore.open(store.path, loader=False)
    with pytest.raises(ShardStoreError, match="shard_000002-0badf11e.safetensors.*missing"):
        s.read_shard(2)


def test_bad_index(tmp_path, store):
    with pytest.raises(ShardStoreError, match="does not exist"):
        ShardStore.open(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardStoreError, match="shard_index.json is missing"):
        ShardStore.open(str(tmp_path / "empty"))
    p = os.path.join(store.path, INDEX_NAME)
    d = json.load(open(p))
    d["shards"][1]["lo"] = 17
    json.dump(d, open(p, "w"))
    with pytest.raises(ShardStoreError, match="shard 1 has range"):
        ShardStore.open(store.path)
    open(p, "w").write('{"format": "ds_maximus.shard_store", "format_ver')
    with pytest.raises(ShardStoreError, match="corrupt"):
        ShardStore.open(store.path)
    with pytest.raises(ShardStoreError, match="already holds"):
        ShardStore.create(store.path, 4, 4)


def test_header_dtype_mismatch_with_index(store, tmp_path):
    other = ShardStore.create(str(tmp_path / "o"), 37, 6, dtype=torch.float16, rows_per_shard=16,
                              state_names=("exp_avg", "exp_avg_sq"), loader=False)
    p = os.path.join(store.path, INDEX_NAME)
    d = json.load(open(p))
    import shutil
    shutil.copy(other.shard_path(0), os.path.join(store.path, "shard_000000-f0e1d2c3.safetensors"))
    d["shards"][0].update(file="shard_000000-f0e1d2c3.safetensors", bytes=other.shard_info(0).bytes,
                          data_offset=other.shard_info(0).data_offset)
    json.dump(d, open(p, "w"))
    with pytest.raises(ShardStoreError, match="'bytes'"):  # the index's own sizes disagree with its dtype
        ShardStore.open(store.path, loader=False)
    d["shards"][0]["bytes"] = store.shard_info(0).bytes  # the index consistent, the file not
    json.dump(d, open(p, "w"))
    with pytest.raises(ShardStoreError, match="torn|does not match"):
        ShardStore.open(store.path, loader=False).read_shard(0)


def test_disk_full_leaves_store_intact(store, monkeypatch):
    before = _digests(store)
    ref = store.read_all()
    real = fmt._write_all

    def full_disk(fd, buf):
        real(fd, memoryview(buf).cast("B")[:1000])  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fmt, "_write_all", full_disk)
    with pytest.raises(ShardStoreError, match="disk full") as e:
        store.write_shard(0, {"weight": torch.zeros(16, 6)})
    assert "intact" in str(e.value)
    with pytest.raises(ShardStoreError, match="disk full"):
        store.append_shards({"weight": torch.zeros(3, 6)})
    monkeypatch.setattr(fmt, "_write_all", real)
    s = ShardStore.open(store.path, loader=False)
    assert _digests(s) == before and torch.equal(s.read_all(), ref) and s.vocab_size == 37
    assert s.verify()["orphans"] == []


def test_remove_orphans(store):
    dead = ".shard_000001-0123abcd.safetensors.tmp-99999999-abc"  # a pid above any pid_max: no such writer
    live = f".shard_000001-0123abcd.safetensors.tmp-{os.getpid()}-abc"  # a writer that still runs
    stale = "shard_000001-89abcdef.safetensors"  # a shard file the index does not name
    for name in (dead, live, stale, "user_notes.safetensors"):
        open(os.path.join(store.path, name), "wb").write(b"junk")
    assert store.verify()["orphans"] == sorted([dead, live, stale])
    assert store.remove_orphans() == sorted([dead, stale])
    assert store.verify()["orphans"] == [live]
    assert os.path.exists(os.path.join(store.path, "user_notes.safetensors"))  # not the store's: kept
