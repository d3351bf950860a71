"""Seeded fuzz of every load path that reads files people share (fast: runs in CI).

* ``shard_index.json``: random field values (wrong types, huge and negative numbers, traversal names),
  missing keys, reordered or duplicated shards, whole-document and raw-byte garbage; each case opens the
  store, reads every shard and writes shard 0.
* shard files: truncations, bit flips in the header and in the data, forged header lengths.
* pickles: ``__reduce__`` payloads (zip and legacy torch formats, raw pickles of several protocols), garbage
  and truncated files, through each torch.load path (maximus state, partitioned rank files, DeepSpeed's
  files for export and resume).
* token maps: random ``token_map.json`` fields and corrupted id maps.

Every case either works or raises a clear typed error (ShardStoreError, TokenMapError, ConfigError);
no file outside the store is read through a link or written, no marker file appears, and the process's
peak memory grows by far less than a GB.
"""
import copy
import json
import os
import pickle
import random
import resource
import shutil

import pytest
import torch

from ds_maximus.errors import ConfigError, ShardStoreError, TokenMapError
from ds_maximus.store import INDEX_NAME, ShardStore

SEED = 20260
VALUES = [-1, 0, 1, 7, 16, 4096, 2**31, 2**63, 10**30, -10**30, 1.5, float("nan"), "", "x", "37", None, True, False,
          [], {}, [1, 2], {"a": 1}, "../victim.txt", "/etc/passwd", "shard_000000-00000000.safetensors",
          "shard_000000-00000000.safetensors/../../victim.txt", "..", "crc32:00000000", "float32", "F32"]
NAMES = ["../victim.txt", "../victim.safetensors", "/tmp/x.safetensors", "..", ".", "", "a/b.safetensors",
         "shard_000000-0000000.safetensors", "shard_000000-00000000.safetensors\x00",
         "SHARD_000000-00000000.safetensors"]


class Marker:
    """Unpickling this runs ``fn(*args)``: a marker file appears if any load path runs pickled code."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture
def world(tmp_path):
    """A store beside bait files outside it (``victim.txt``, a link target) and a pristine copy of the store."""
    root = tmp_path / "world"
    root.mkdir()
    (root / "victim.txt").write_text("outside the store")
    (root / "victim.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b'{"a":1}\x20' + b"\x00" * 64)

    def init(lo, hi):
        return {"weight": torch.arange(lo, hi, dtype=torch.float32)[:, None].expand(-1, 6)}
    store = ShardStore.create(str(root / "store"), 37, 6, rows_per_shard=16, state_names=("exp_avg",), init=init,
                              loader=False)
    pristine = tmp_path / "pristine"
    shutil.copytree(store.path, pristine)
    return root, store.path, pristine


def _restore(store_dir, pristine):
    shutil.rmtree(store_dir)
    shutil.copytree(pristine, store_dir)


def _exercise(store_dir):
    """Open, read every shard (checksums on), write shard 0: what a run does with a store."""
    s = ShardStore.open(store_dir, loader=False)
    for i in range(s.num_shards):
        s.read_shard(i, verify=True)
    s.write_shard(0, {n: torch.zeros(*s.read_shard(0)["weight"].shape) for n in s.tensor_names})
    s.remove_orphans()


def _mutate_index(rng, d):
    op = rng.randrange(8)
    shards = d.get("shards") if isinstance(d.get("shards"), list) else []
    if op == 0:
        d[rng.choice(["vocab_size", "dim", "dtype", "rows_per_shard", "state_names", "format_version", "shards",
                      "format"])] = rng.choice(VALUES)
    elif op == 1 and shards:
        rng.choice(shards)[rng.choice(["id", "lo", "hi", "file", "bytes", "data_offset", "checksum",
                                       "access_count"])] = rng.choice(VALUES)
    elif op == 2 and shards:
        rng.choice(shards)["file"] = rng.choice(NAMES)
    elif op == 3:
        target = rng.choice([d] + shards)
        if target:
            target.pop(rng.choice(sorted(target)))
    elif op == 4 and shards:
        rng.choice([lambda: shards.reverse(), lambda: shards.append(copy.deepcopy(shards[0])),
                    lambda: shards.pop(), lambda: shards.insert(0, copy.deepcopy(shards[-1]))])()
    elif op == 5 and shards:
        s = rng.choice(shards)
        s[rng.choice(["bytes", "data_offset", "lo", "hi"])] = rng.choice([2**40, -4096, 10**18, 1 << 62])
    elif op == 6 and shards:
        rng.choice(shards)["extra"] = 1
    else:
        d["state_names"] = rng.choice([["exp_avg", "exp_avg"], ["weight"], ["a/b"], ["x" * 200],
                                       list("abcdefghijklmnopqrstu")])
    return d


def test_fuzz_shard_index(world):
    root, store_dir, pristine = world
    rng = random.Random(SEED)
    base = json.load(open(pristine / INDEX_NAME))
    outside = open(root / "victim.txt").read(), open(root / "victim.safetensors", "rb").read()
    rss0, outcomes = _peak_rss_bytes(), {"ok": 0, "error": 0}
    for case in range(400):
        _restore(store_dir, pristine)
        if case % 25 == 24:  # not JSON, or JSON of the wrong shape
            raw = rng.choice([os.urandom(rng.randrange(1, 200)), b"[]", b"null", b'{"format": 1}', b"9" * 5000,
                              b"[" * 100000, json.dumps(base).encode()[: rng.randrange(1, 300)]])
        else:
            d = copy.deepcopy(base)
            for _ in range(rng.randrange(1, 4)):
                d = _mutate_index(rng, d)
            raw = json.dumps(d).encode()
        with open(os.path.join(store_dir, INDEX_NAME), "wb") as f:
            f.write(raw)
        try:
            _exercise(store_dir)
            outcomes["ok"] += 1
        except ShardStoreError:
            outcomes["error"] += 1
        except Exception as e:  # anything else is a bug: say which case
            pytest.fail(f"case {case}: {type(e).__name__}: {e}\nindex: {raw[:400]!r}")
        assert open(root / "victim.txt").read() == outside[0], f"case {case} wrote outside the store"
        assert open(root / "victim.safetensors", "rb").read() == outside[1]
        assert sorted(os.listdir(root)) == ["store", "victim.safetensors", "victim.txt"], f"case {case}"
    assert outcomes["error"] > 300 and outcomes["ok"] > 0, outcomes  # most mutations break it; some are harmless
    assert _peak_rss_bytes() - rss0 < 512 << 20


def test_fuzz_shard_files(world):
    root, store_dir, pristine = world
    rng = random.Random(SEED + 1)
    ref = ShardStore.open(str(pristine), loader=False)
    want = {i: ref.read_shard(i) for i in range(ref.num_shards)}
    rss0, errors = _peak_rss_bytes(), 0
    for case in range(300):
        _restore(store_dir, pristine)
        s = ShardStore.open(store_dir, loader=False)
        i = rng.randrange(s.num_shards)
        path = s.shard_path(i)
        raw = bytearray(open(path, "rb").read())
        op = rng.randrange(4)
        if op == 0:
            raw = raw[: rng.randrange(len(raw))]
        elif op == 1:  # bit flips in the header (length prefix, JSON, padding)
            for _ in range(rng.randrange(1, 9)):
                raw[rng.randrange(s.shard_info(i).data_offset)] ^= 1 << rng.randrange(8)
        elif op == 2:  # bit flips in the data
            for _ in range(rng.randrange(1, 9)):
                raw[rng.randrange(s.shard_info(i).data_offset, len(raw))] ^= 1 << rng.randrange(8)
        else:  # a forged header length
            raw[:8] = rng.choice([2**64 - 1, 2**63, len(raw), len(raw) - 7, 0, 1, 4088]).to_bytes(8, "little")
        open(path, "wb").write(raw)
        try:
            got = s.read_shard(i, verify=True)
        except ShardStoreError:
            errors += 1
            continue
        except Exception as e:
            pytest.fail(f"case {case} (op {op}): {type(e).__name__}: {e}")
        # a flip that leaves an equivalent header (a space for a tab in the padding) may read: then exactly
        assert all(torch.equal(got[n], want[i][n]) for n in got), f"case {case} read wrong data silently"
    assert errors > 250
    assert _peak_rss_bytes() - rss0 < 512 << 20


def _payloads(tmp, marker):
    """Files that must never load: pickled calls that create ``marker``, garbage, truncations."""
    evil = [Marker(open, str(marker), "w"), Marker(os.system, f"touch {marker}"),
            Marker(eval, f"open({str(marker)!r}, 'w')"), Marker(shutil.copyfile, __file__, str(marker))]
    out = []
    for k, obj in enumerate(evil):
        for fmt in ("zip", "legacy", "raw0", "raw2", "raw5"):
            p = tmp / f"evil{k}_{fmt}.pt"
            state = {"modules": {"model.embed_tokens": obj}, "steps": 1, "skipped_steps": 0, "module": obj}
            if fmt == "zip":
                torch.save(state, p)
            elif fmt == "legacy":
                torch.save(state, p, _use_new_zipfile_serialization=False)
            else:
                p.write_bytes(pickle.dumps(state, protocol=int(fmt[-1])))
            out.append(p)
    good = tmp / "good.pt"
    torch.save({"modules": {}, "steps": 1, "skipped_steps": 0, "module": {}}, good)
    raw = good.read_bytes()
    rng = random.Random(SEED + 2)
    for k in range(12):
        p = tmp / f"broken{k}.pt"
        if k < 4:
            p.write_bytes(raw[: rng.randrange(len(raw))])
        elif k < 8:
            b = bytearray(raw)
            for _ in range(8):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            p.write_bytes(bytes(b))
        else:
            p.write_bytes(os.urandom(rng.randrange(0, 4096)))
        out.append(p)
    return out


def test_fuzz_pickled_checkpoints(tmp_path):
    from ds_maximus.distributed.repartition import iter_module_states, load_partitioned_checkpoint
    from ds_maximus.integrations.export import checkpoint_state_dict
    from ds_maximus.safe_load import check_torch_file, safe_torch_load
    marker = tmp_path / "marker"
    paths = _payloads(tmp_path, marker)
    assert marker.exists() is False
    rss0, seen = _peak_rss_bytes(), 0

    def ckpt(payload, name):
        d = tmp_path / "ckpt" / "t"
        shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copyfile(payload, d / name)
        return d

    loaders = [
        lambda p: safe_torch_load(str(p)),
        lambda p: safe_torch_load(str(p), allow_deepspeed=True),
        lambda p: check_torch_file(str(p)),
        lambda p: list(iter_module_states([str(p)], "model.embed_tokens")),
        lambda p: load_partitioned_checkpoint(str(ckpt(p, "maximus_states_rank00000.pt")), {}),
        lambda p: checkpoint_state_dict(str(ckpt(p, "mp_rank_00_model_states.pt").parent), "t"),  # ZeRO-0 export
        lambda p: checkpoint_state_dict(str(ckpt(p, "zero_pp_rank_0_mp_rank_00_optim_states.pt").parent), "t"),
    ]
    for p in paths:
        for k, load in enumerate(loaders):
            try:
                load(p)
            except (ShardStoreError, ConfigError):
                seen += 1
            except Exception as e:
                pytest.fail(f"{p.name} via loader {k}: {type(e).__name__}: {e}")
            else:
                assert p.name.startswith("broken") and k >= 2, f"{p.name} via loader {k} loaded"
            assert not marker.exists(), f"{p.name} via loader {k} ran pickled code"
    assert seen > len(paths) * len(loaders) * 0.9
    assert _peak_rss_bytes() - rss0 < 512 << 20


@pytest.fixture
def token_map_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ds_maximus.tokenmap.token_map import TokenMap
    words = [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>"] + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words[: rng.randrange(1, 60)]) for _ in range(20)) for _ in range(50)]
    return TokenMap.build(tok, texts=texts, progress=False).save(str(tmp_path / "tm")).path


def test_fuzz_token_map(token_map_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from ds_maximus.tokenmap.token_map import MAPS_FILE, META_FILE, TokenMap
    pristine = tmp_path / "pristine"
    shutil.copytree(token_map_dir, pristine)
    meta = json.load(open(pristine / META_FILE))
    maps = load_file(str(pristine / MAPS_FILE))
    V = meta["vocab_size"]
    rng = random.Random(SEED + 3)
    errors = 0
    for case in range(150):
        shutil.rmtree(token_map_dir)
        shutil.copytree(pristine, token_map_dir)
        if case % 2 == 0:
            d = copy.deepcopy(meta)
            key = rng.choice(["vocab_size", "base_vocab_size", "num_special", "corpus_tokens", "extended_tokens",
                              "format_version", "format", "converted_checkpoints"])
            if rng.random() < 0.2:
                d.pop(key, None)
            else:
                d[key] = rng.choice(VALUES + [V + 1, V - 1, [1], ["a"] * 3])
            open(os.path.join(token_map_dir, META_FILE), "w").write(json.dumps(d))
        else:
            m = {k: v.clone() for k, v in maps.items()}
            name = rng.choice(sorted(m))
            m[name] = rng.choice([m[name][:-1], m[name].int(), m[name].flip(0) * 0, m[name] + V, -m[name] - 1,
                                  m[name].view(1, -1), torch.zeros(V, dtype=torch.int64)])
            if name == "counts" and rng.random() < 0.5:
                m.pop(name)
            save_file(m, os.path.join(token_map_dir, MAPS_FILE))
            if rng.random() < 0.3:
                raw = open(os.path.join(token_map_dir, MAPS_FILE), "rb").read()
                open(os.path.join(token_map_dir, MAPS_FILE), "wb").write(raw[: rng.randrange(len(raw))])
        try:
            tm = TokenMap.load(token_map_dir)
            tm.to_new(torch.arange(V))
        except TokenMapError:
            errors += 1
        except Exception as e:
            pytest.fail(f"case {case}: {type(e).__name__}: {e}")
    assert errors > 120
