"""Token maps and the MoE expert file are checked before use (the cases the fuzz test draws from, named)."""
import json
import os

import pytest
import torch

from ds_maximus.errors import ConfigError, TokenMapError


@pytest.fixture
def token_map_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ds_maximus.tokenmap.token_map import TokenMap
    words = [f"w{i}" for i in range(30)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>"] + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [" ".join(words[: 1 + i % 30]) for i in range(40)]
    return TokenMap.build(tok, texts=texts, progress=False).save(str(tmp_path / "tm")).path


def _edit_meta(folder, **kw):
    from ds_maximus.tokenmap.token_map import META_FILE
    p = os.path.join(folder, META_FILE)
    d = json.load(open(p))
    d.update(kw)
    json.dump(d, open(p, "w"))


@pytest.mark.parametrize("field,value", [("vocab_size", "31"), ("vocab_size", -1), ("vocab_size", True),
                                         ("base_vocab_size", 10**9), ("num_special", 99), ("format_version", True),
                                         ("extended_tokens", ["x"]), ("converted_checkpoints", "/tmp"),
                                         ("corpus_tokens", 1.5)])
def test_token_map_meta_fields_are_checked(token_map_dir, field, value):
    from ds_maximus.tokenmap.token_map import TokenMap
    TokenMap.load(token_map_dir)
    _edit_meta(token_map_dir, **{field: value})
    with pytest.raises(TokenMapError, match=field if field != "format_version" else "format"):
        TokenMap.load(token_map_dir)


def test_token_map_maps_must_be_a_permutation(token_map_dir):
    from safetensors.torch import load_file, save_file

    from ds_maximus.tokenmap.token_map import MAPS_FILE, TokenMap
    p = os.path.join(token_map_dir, MAPS_FILE)
    maps = load_file(p)
    bad = dict(maps, new_to_old=torch.zeros_like(maps["new_to_old"]))  # every new id to old id 0
    save_file(bad, p)
    with pytest.raises(TokenMapError, match="inverse permutations"):
        TokenMap.load(token_map_dir)
    save_file(dict(maps, counts=maps["counts"].int()), p)
    with pytest.raises(TokenMapError, match="'counts' must be int64"):
        TokenMap.load(token_map_dir)
    open(p, "wb").write(b"\xff" * 64)
    with pytest.raises(TokenMapError, match="not a readable safetensors"):
        TokenMap.load(token_map_dir)


def test_expert_file_is_never_written_through_a_link(tmp_path):
    from ds_maximus.experts.expert_store import FileExpertStore
    from ds_maximus.experts.layout import ExpertLayout
    lay = ExpertLayout.from_stacked({"w": torch.zeros(2, 4, 4)}, num_experts=2)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    os.symlink(victim, tmp_path / "experts.bin")
    with pytest.raises(ConfigError, match="symlink"):
        FileExpertStore(lay, 2, str(tmp_path / "experts.bin"))
    assert victim.read_bytes() == b"keep me"
    victim_dir = tmp_path / "victim_dir"  # the store is a folder: a link to another folder is refused too
    victim_dir.mkdir()
    (victim_dir / "shard_index.json").write_text("keep me")
    os.symlink(victim_dir, tmp_path / "experts")
    with pytest.raises(ConfigError, match="symlink"):
        FileExpertStore(lay, 2, str(tmp_path / "experts"))
    assert os.listdir(victim_dir) == ["shard_index.json"] and (victim_dir / "shard_index.json").read_text() == "keep me"

    store = FileExpertStore(lay, 2, str(tmp_path / "real.bin"))
    store.write(1, {"w": torch.ones(4, 4)})
    assert float(lay.view(store.read(1), "w").sum()) == 16.0
    for uid in (2, -1):
        with pytest.raises(IndexError, match="out of range"):
            store.write(uid, {"w": torch.ones(4, 4)})
        with pytest.raises(IndexError, match="out of range"):
            store.read(uid)
    # nothing was written past the table: two experts on disk, one shard file each
    assert store.num_written == 2 and store.backing.store.verify()["bytes"] == 2 * store.record_bytes
