"""extend: new tokens become new ids and new shards; existing shard files stay byte-identical."""
import hashlib
import json
import os
import shutil

import pytest
import torch

from ds_maximus.errors import TokenMapError
from ds_maximus.store import ShardStore
from ds_maximus.tokenmap import MultiTokenMap, TokenMap

NEW = ["acetylsalicylicum", "ibuprofenate", "zolpidemix"]


def _digests(store):
    return [hashlib.sha256(open(store.shard_path(i), "rb").read()).hexdigest() for i in range(store.num_shards)]


@pytest.fixture
def tm_and_store(tmp_path, token_map_dir):
    d = tmp_path / "tm"
    shutil.copytree(token_map_dir, d)
    tm = TokenMap.load(str(d))
    gen = torch.Generator().manual_seed(0)
    store = ShardStore.create(str(tmp_path / "store"), tm.vocab_size, 8, rows_per_shard=1024,
                              state_names=("exp_avg",), loader=False,
                              init=lambda lo, hi: {"weight": torch.randn(hi - lo, 8, generator=gen)})
    return tm, store


def test_extend_appends_ids_and_shards(tm_and_store):
    tm, store = tm_and_store
    V, before, old_files = tm.vocab_size, _digests(store), [store.shard_info(i).file for i in range(store.num_shards)]
    pieces = [tm.encode(t) for t in NEW]
    assert all(len(p) > 1 for p in pieces)
    table = store.read_all()
    ids = tm.extend(NEW, stores=[store], progress=False)
    assert ids == [V, V + 1, V + 2] and tm.vocab_size == V + 3

    again = ShardStore.open(store.path, loader=False)
    assert again.vocab_size == V + 3 and again.num_shards == 4
    assert [again.shard_info(i).file for i in range(3)] == old_files
    assert _digests(again)[:3] == before  # every old shard byte-identical
    new_rows = again.read_all()[V:]
    for k, p in enumerate(pieces):
        assert torch.allclose(new_rows[k], table[p].mean(0))
    assert not again.read_all("exp_avg")[V:].any()

    tm2 = TokenMap.load(tm.path)  # saved in place
    assert tm2.vocab_size == V + 3 and tm2.meta["extended_tokens"] == NEW
    text = "Take zolpidemix or ibuprofenate, not acetylsalicylicum."
    enc = tm2.encode(text)
    assert set(ids) <= set(enc) and tm2.decode(enc) == text
    assert tm2.hf_tokenizer()(text, add_special_tokens=False)["input_ids"] == enc
    assert tm2.to_new(torch.tensor(ids)).tolist() == ids
    cfg = json.load(open(os.path.join(tm2.tokenizer_dir, "tokenizer_config.json")))
    if "added_tokens_decoder" in cfg:
        assert cfg["added_tokens_decoder"][str(V + 2)]["content"] == NEW[2]


@pytest.mark.parametrize("tokens,match", [
    (["newtokx", "newtokx"], "duplicate"),
    (["the", "newtokx"], "already in the vocabulary"),
    (["<s>"], "already in the vocabulary"),
    ([], "no tokens"),
    (["  "], "non-blank"),
])
def test_bad_extend_changes_nothing(tm_and_store, tokens, match):
    tm, store = tm_and_store
    before = _digests(store)
    meta = open(os.path.join(tm.path, "token_map.json")).read()
    with pytest.raises(TokenMapError, match=match):
        tm.extend(tokens, stores=[store], progress=False)
    assert _digests(ShardStore.open(store.path, loader=False)) == before
    assert open(os.path.join(tm.path, "token_map.json")).read() == meta and tm.vocab_size == 3000


def test_extend_refuses_foreign_store(tm_and_store, tmp_path):
    tm, _ = tm_and_store
    other = ShardStore.create(str(tmp_path / "other"), 100, 8, loader=False)
    with pytest.raises(TokenMapError, match="100 rows"):
        tm.extend(["newtokx"], stores=[other], progress=False)


def test_multi_token_map(tm_and_store, tmp_path, tiny_tokenizer_dir):
    tm, store = tm_and_store
    texts = [f"line {i}: import os, sys; os.path.join(a, b)\n" for i in range(200)]
    code = TokenMap.build(tiny_tokenizer_dir, texts=texts, progress=False).save(str(tmp_path / "code_tm"))
    code_store = ShardStore.create(str(tmp_path / "code_store"), code.vocab_size, 8, rows_per_shard=2048,
                                   loader=False)
    multi = MultiTokenMap()
    multi.add("prose", tm, stores=[store])
    multi.add("code", code, stores=[code_store.path])
    assert multi.names == ["code", "prose"] and "code" in multi and len(multi) == 2
    # the same text gets different ids under the two maps; each decodes it back
    t = "import os"
    assert multi["code"].encode(t) != multi["prose"].encode(t)
    assert multi.select("code").decode(multi["code"].encode(t)) == t
    with pytest.raises(TokenMapError, match="no token map named 'x'"):
        multi["x"]
    with pytest.raises(TokenMapError, match="exists already"):
        multi.add("code", code)
    with pytest.raises(TokenMapError, match="rows"):
        MultiTokenMap().add("bad", code, stores=[ShardStore.create(str(tmp_path / "b"), 7, 8, loader=False).path])
    multi.save(str(tmp_path / "multi"))
    loaded = MultiTokenMap.load(str(tmp_path / "multi"))
    code_digests = _digests(code_store)
    loaded.extend("prose", ["zolpidemix"], progress=False)
    assert loaded["prose"].vocab_size == 3001 and loaded.stores("prose", loader=False)[0].vocab_size == 3001
    assert loaded["code"].vocab_size == 3000 and _digests(loaded.stores("code", loader=False)[0]) == code_digests
