"""maximus-tokenizer: build -> convert -> extend -> inspect, and one-line errors on bad input."""
import hashlib
import json
import os

import numpy as np
import pytest
import torch

from ds_maximus.store import ShardStore
from ds_maximus.tokenmap import TokenMap
from ds_maximus.tokenmap.cli import main


def _run(capsys, *argv):
    rc = main([*argv, "--no-progress"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_build_convert_extend_inspect(tmp_path, capsys, tiny_tokenizer_dir, corpus_file, llama_dir):
    tm_dir, out = str(tmp_path / "tm"), str(tmp_path / "conv")
    rc, text, _ = _run(capsys, "build", "--tokenizer", tiny_tokenizer_dir, "--corpus", corpus_file, "--out", tm_dir)
    assert rc == 0 and "tokens/s" in text
    tm = TokenMap.load(tm_dir)

    rc, text, err = _run(capsys, "convert", "--model", llama_dir, "--token-map", tm_dir, "--out", out,
                         "--rows-per-shard", "1024", "--optimizer-state")
    assert rc == 0, err
    store_dir = os.path.join(out, "embedding_store")
    store = ShardStore.open(store_dir, loader=False)
    assert store.num_shards == 3 and store.state_names == ("exp_avg", "exp_avg_sq")

    # inspect: the coverage it reports is the share of corpus tokens (re-encoded here) below K
    rc, text, _ = _run(capsys, "inspect", "--token-map", tm_dir, "--store", store_dir, "--corpus", corpus_file,
                       "--k", "10", "100", "1000", "--json")
    rep = json.loads(text)
    ids = np.concatenate([tm.encode_ids(open(corpus_file, encoding="utf-8").readlines())])
    for k in (10, 100, 1000):
        want = float((ids < k).mean())
        assert rep["coverage"][str(k)] == pytest.approx(want, abs=1e-12)
        assert rep["corpus_coverage"][str(k)] == pytest.approx(want, abs=1e-12)
    assert rep["sizes"]["vocab_size"] == 3000 and rep["sizes"]["corpus_tokens"] == ids.size
    assert rep["store"]["num_shards"] == 3 and rep["store"]["matches_token_map"]
    assert rep["top_tokens"][0]["id"] == 4 and rep["top_tokens"][0]["count"] == int((ids == 4).sum())
    assert sum(s["corpus_share"] for s in rep["store"]["shards"]) == pytest.approx(1.0)
    rc, text, _ = _run(capsys, "inspect", "--token-map", tm_dir, "--store", store_dir)
    assert rc == 0 and "## coverage" in text and "| 1024 |" in text

    digests = [hashlib.sha256(open(store.shard_path(i), "rb").read()).digest() for i in range(3)]
    (tmp_path / "new.txt").write_text("zolpidemix\nibuprofenate\n")
    rc, text, err = _run(capsys, "extend", "--token-map", tm_dir, "--tokens", "acetylsalicylicum",
                         "--tokens-file", str(tmp_path / "new.txt"), "--store", store_dir)
    assert rc == 0, err
    grown = ShardStore.open(store_dir, loader=False)
    assert grown.vocab_size == 3003 and grown.num_shards == 4
    assert [hashlib.sha256(open(grown.shard_path(i), "rb").read()).digest() for i in range(3)] == digests
    assert TokenMap.load(tm_dir).encode("zolpidemix") == [3001]
    # every tokenizer written from the token map follows it: the converted checkpoint's too
    assert f"rewrote the tokenizer of the converted checkpoint {os.path.abspath(out)}" in text
    from transformers import AutoTokenizer
    for d in (os.path.join(tm_dir, "tokenizer"), out):
        with open(os.path.join(d, "tokenizer.json"), encoding="utf-8") as f:
            assert len(json.load(f)["added_tokens"]) == 4 + 3, d
        hf = AutoTokenizer.from_pretrained(d)
        assert len(hf) == 3003 and hf("zolpidemix", add_special_tokens=False)["input_ids"] == [3001], d

    # bad input: one "error:" line and exit status 2
    rc, _, err = _run(capsys, "extend", "--token-map", tm_dir, "--tokens", "zolpidemix", "--store", store_dir)
    assert rc == 2 and err.startswith("error:") and "already in the vocabulary" in err
    rc, _, err = _run(capsys, "convert", "--model", llama_dir, "--token-map", tm_dir, "--out", str(tmp_path / "x"))
    assert rc == 2 and "vocab size mismatch" in err
    (tmp_path / "empty.txt").write_text("")
    rc, _, err = _run(capsys, "build", "--tokenizer", tiny_tokenizer_dir, "--corpus", str(tmp_path / "empty.txt"),
                      "--out", str(tmp_path / "tm2"))
    assert rc == 2 and "corpus is empty" in err
    rc, _, err = _run(capsys, "inspect", "--token-map", str(tmp_path / "nope"))
    assert rc == 2 and "not a token map" in err
    # a shard damaged on disk is named by inspect --store ... verify path via ShardStore
    with open(grown.shard_path(3), "r+b") as f:
        f.truncate(100)
    with pytest.raises(Exception, match="torn"):
        grown.verify()
    assert torch.is_tensor(grown.read_shard(0)["weight"])



def test_extend_finds_a_checkpoint_by_its_store(tmp_path, token_map_dir, llama_dir):
    """A checkpoint converted from an unsaved TokenMap is not in the map's record; passing its store
    to extend is enough for its tokenizer to be rewritten."""
    from ds_maximus.tokenmap import convert_checkpoint
    tm = TokenMap.load(token_map_dir)
    tm.path = None  # as built in memory: convert cannot record the checkpoint in it
    out = str(tmp_path / "conv")
    convert_checkpoint(llama_dir, tm, out, rows_per_shard=1024, progress=False)
    tm.save(str(tmp_path / "tm"))
    assert TokenMap.load(str(tmp_path / "tm")).meta.get("converted_checkpoints", []) == []
    store = ShardStore.open(os.path.join(out, "embedding_store"), loader=False)
    tm.extend(["zolpidemix"], stores=[store], progress=False)
    with open(os.path.join(out, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    assert {a["content"]: a["id"] for a in tok["added_tokens"]}["zolpidemix"] == 3000
    assert TokenMap.load(str(tmp_path / "tm")).meta["converted_checkpoints"] == [os.path.abspath(out)]
