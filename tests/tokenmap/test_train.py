"""maximus-tokenizer build without --tokenizer: a new BPE / Unigram tokenizer trained on the corpus."""
import os

import pytest
import torch

from ds_maximus.errors import TokenMapError
from ds_maximus.tokenmap import TokenMap
from ds_maximus.tokenmap.cli import main
from ds_maximus.tokenmap.train import train_tokenizer

from .conftest import corpus_texts

SAMPLES = ["The with statement is used to wrap the execution of a block.", "x = [i ** 2 for i in range(10)]",
           "héllo wörld ✓"]


@pytest.mark.parametrize("model,vocab", [("bpe", 2000), ("unigram", 800)])
def test_build_trains_a_tokenizer_then_its_token_map(tmp_path, capsys, corpus_file, model, vocab):
    out = str(tmp_path / "tm")
    rc = main(["build", "--corpus", corpus_file, "--tokenizer-model", model, "--vocab-size", str(vocab),
               "--out", out, "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and f"trained a {model} tokenizer of {vocab} tokens" in text
    from transformers import AutoTokenizer
    src = AutoTokenizer.from_pretrained(os.path.join(out, "source_tokenizer"))
    tm = TokenMap.load(out)
    assert tm.vocab_size == len(src) == vocab and tm.num_special == 4
    assert [tm.tokenizer.id_to_token(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert tm.meta["model_type"] == {"bpe": "BPE", "unigram": "Unigram"}[model]
    # the token map orders the trained vocabulary by the same corpus's counts
    c = tm.counts[4:]
    assert bool((c[:-1] >= c[1:]).all()) and int(c[0]) > 0
    hf = tm.hf_tokenizer()
    for s in SAMPLES:
        ids = hf(s)["input_ids"]
        assert ids[0] == hf.bos_token_id == int(tm.old_to_new[1])  # bos first, as Llama's tokenizer
        assert ids[1:] == tm.to_new(torch.tensor(src(s)["input_ids"][1:])).tolist()
        if model == "bpe":  # byte-level: every text round-trips exactly
            assert hf.decode(ids, skip_special_tokens=True) == s


def test_train_from_texts_and_its_errors(tmp_path, capsys, corpus_file, tiny_tokenizer_dir):
    tok = train_tokenizer(texts=corpus_texts()[:300], vocab_size=400, progress=False)
    assert tok.get_vocab_size() == 400 and tok.encode("the").tokens[0] == "<s>"
    with pytest.raises(TokenMapError, match="at least 260"):
        train_tokenizer(texts=["abc"], vocab_size=100, progress=False)
    with pytest.raises(TokenMapError, match="allowed: \\['bpe', 'unigram'\\]"):
        train_tokenizer(texts=["abc"], vocab_size=1000, model="wordpiece", progress=False)
    with pytest.raises(TokenMapError, match="corpus is empty"):
        train_tokenizer(texts=["", "  \n"], vocab_size=1000, progress=False)
    rc = main(["build", "--tokenizer", tiny_tokenizer_dir, "--vocab-size", "500", "--corpus", corpus_file,
               "--out", str(tmp_path / "tm"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "either --tokenizer or --tokenizer-model/--vocab-size" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    rc = main(["build", "--corpus", str(empty), "--out", str(tmp_path / "tm"), "--no-progress"])
    assert rc == 2 and "corpus is empty" in capsys.readouterr().err
