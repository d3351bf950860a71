"""TokenMap.build: frequency order, counts, and a rewritten tokenizer that speaks the new ids."""
import json
import os

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from ds_maximus.errors import TokenMapError
from ds_maximus.tokenmap import TokenMap

from .conftest import SPECIALS, corpus_texts

ODD_TEXTS = ["", " ", "\n\n\t", "héllo wörld — ünïcode ✓ 🚀 中文", "def f(x):\n    return x ** 2  # sq",
             "<s> literal specials </s> <pad>", "a" * 500, "   leading and trailing   "]


@pytest.fixture(scope="module")
def tm(token_map_dir):
    return TokenMap.load(token_map_dir)


@pytest.fixture(scope="module")
def old(tiny_tokenizer_dir):
    return Tokenizer.from_file(os.path.join(tiny_tokenizer_dir, "tokenizer.json"))


def test_order_and_maps(tm, old):
    V = old.get_vocab_size()
    assert tm.vocab_size == V == 3000 and tm.num_special == 4
    assert torch.equal(tm.old_to_new[tm.new_to_old], torch.arange(V))
    assert sorted(tm.new_to_old.tolist()) == list(range(V))
    # special tokens keep the lowest ids, in their old order
    assert [tm.tokenizer.id_to_token(i) for i in range(4)] == SPECIALS
    c = tm.counts[4:]
    assert bool((c[:-1] >= c[1:]).all()) and int(c[0]) > 0


def test_counts_are_exact(tm, old, corpus_file):
    counts = np.zeros(tm.vocab_size, dtype=np.int64)
    for t in open(corpus_file, encoding="utf-8").readlines():  # .txt files: one text per line
        for i in old.encode(t, add_special_tokens=False).ids:
            counts[i] += 1
    assert np.array_equal(tm.counts.numpy(), counts[tm.new_to_old.numpy()])
    assert tm.meta["corpus_tokens"] == counts.sum()


def test_rewritten_tokenizer_emits_new_ids_and_round_trips(tm, old):
    texts = corpus_texts() + ODD_TEXTS
    for a, b, t in zip(old.encode_batch(texts), tm.tokenizer.encode_batch(texts), texts):
        assert b.ids == tm.to_new(torch.tensor(a.ids, dtype=torch.long)).tolist(), t[:40]
        assert tm.decode(b.ids) == old.decode(a.ids, skip_special_tokens=False)
        assert tm.tokenizer.decode(b.ids) == old.decode(a.ids)
    for t in texts:  # byte-level BPE: decode(encode(x)) is x itself
        assert tm.decode(tm.encode(t)) == t
    # the post-processor's <s> is the remapped id
    assert tm.tokenizer.encode("hi").ids[0] == int(tm.old_to_new[1])


def test_transformers_loads_the_rewritten_tokenizer(tm, old):
    hf = tm.hf_tokenizer()
    text = "The with statement is used to wrap the execution of a block."
    ids = hf(text)["input_ids"]
    assert ids == tm.tokenizer.encode(text).ids
    assert hf.decode(ids, skip_special_tokens=True) == text
    assert hf.convert_tokens_to_ids("<pad>") == hf.pad_token_id == int(tm.old_to_new[3])
    cfg = json.load(open(os.path.join(tm.tokenizer_dir, "tokenizer_config.json")))
    assert {int(k): v["content"] for k, v in cfg.get("added_tokens_decoder", {}).items()} == \
        {int(tm.old_to_new[i]): s for i, s in enumerate(SPECIALS)} or "added_tokens_decoder" not in cfg


def test_save_load_round_trip(tm, tmp_path):
    tm.save(str(tmp_path / "again"))
    tm2 = TokenMap.load(str(tmp_path / "again"))
    assert torch.equal(tm2.old_to_new, tm.old_to_new) and torch.equal(tm2.counts, tm.counts)
    assert tm2.encode("x = [i for i in range(3)]") == tm.encode("x = [i for i in range(3)]")
    assert tm2.meta == tm.meta


def test_corpus_kinds_agree(tiny_tokenizer_dir, corpus_file, tmp_path, tm):
    texts = corpus_texts()[:300]
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    a = TokenMap.build(tiny_tokenizer_dir, texts=(t for t in texts), progress=False)  # a one-shot generator
    b = TokenMap.build(tiny_tokenizer_dir, [str(jl)], progress=False, text_key="body")
    assert torch.equal(a.counts, b.counts) and torch.equal(a.new_to_old, b.new_to_old)
    with pytest.raises(TokenMapError, match="'text'"):
        TokenMap.build(tiny_tokenizer_dir, [str(jl)], progress=False)


def test_sample_by(tmp_path):
    from ds_maximus.tokenmap.corpus import iter_texts
    p = tmp_path / "t.txt"
    p.write_text("a\n  b\n\nc\n\n\nd")
    assert list(iter_texts([str(p)])) == ["a\n", "  b\n", "\n", "c\n", "\n", "\n", "d"]
    assert list(iter_texts([str(p)], sample_by="paragraph")) == ["a\n  b\n", "c\n", "d"]
    assert list(iter_texts(str(p), sample_by="document")) == ["a\n  b\n\nc\n\n\nd"]
    with pytest.raises(TokenMapError, match="sample_by"):
        list(iter_texts(str(p), sample_by="word"))


@pytest.mark.parametrize("texts", [[], ["", ""], "EMPTY_FILE"])
def test_empty_corpus(tiny_tokenizer_dir, tmp_path, texts):
    if texts == "EMPTY_FILE":
        (tmp_path / "e.txt").write_text("")
        kw = {"corpus": [str(tmp_path / "e.txt")]}
    else:
        kw = {"texts": texts}
    with pytest.raises(TokenMapError, match="corpus is empty"):
        TokenMap.build(tiny_tokenizer_dir, progress=False, **kw)


def test_bad_tokenizer_inputs(tmp_path, corpus_file, tiny_tokenizer_dir):
    with pytest.raises(TokenMapError, match="no tokenizer.json"):
        TokenMap.build(str(tmp_path), [corpus_file], progress=False)
    with pytest.raises(TokenMapError, match="not a Hugging Face fast tokenizer"):
        TokenMap.build(object(), [corpus_file], progress=False)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        TokenMap.build(tiny_tokenizer_dir, str(tmp_path / "nope.txt"), progress=False)
    with pytest.raises(TokenMapError, match="not a token map"):
        TokenMap.load(str(tmp_path))


def _wordpiece():
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus_texts()[:400], trainers.WordPieceTrainer(
        vocab_size=800, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    return tok


def _unigram():
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus_texts()[:400], trainers.UnigramTrainer(
        vocab_size=600, special_tokens=["<pad>", "<unk>"], unk_token="<unk>", show_progress=False))
    return tok


@pytest.mark.parametrize("make", [_wordpiece, _unigram], ids=["wordpiece", "unigram"])
def test_other_model_types(make):
    old = make()
    texts = corpus_texts()[400:700]
    tm = TokenMap.build(old, texts=texts, progress=False)  # build self-checks 256 texts; check the rest here too
    for t in texts + ODD_TEXTS[3:]:
        a, b = old.encode(t), tm.tokenizer.encode(t)
        assert b.ids == tm.to_new(torch.tensor(a.ids, dtype=torch.long)).tolist()
        assert tm.decode(b.ids) == old.decode(a.ids, skip_special_tokens=False)
        assert tm.tokenizer.decode(b.ids) == old.decode(a.ids)
    assert tm.num_special in (2, 4)
    assert all(tm.tokenizer.id_to_token(i).startswith(("[", "<")) for i in range(tm.num_special))


def test_unigram_scores_survive_the_json_round_trip_exactly():
    """tokenizers' Rust JSON parser reads -7.6145106463098715 one ulp off; a rewritten Unigram tokenizer then
    broke exact Viterbi ties ("=" + "=" * 15 against "=" * 15 + "=") differently from the one it came from
    (the flaky case of test_other_model_types[unigram]). Rebuilt from the Python floats, every score is exact."""
    import json

    from tokenizers import models

    from ds_maximus.tokenmap.tokenizer_json import tokenizer_from_json
    vocab = [("<unk>", 0.0), ("=", -5.372414213484765), ("=" * 15, -7.6145106463098715), ("a", -3.0)]
    tok = Tokenizer(models.Unigram(vocab, 0, False))
    # (tokenizers 0.23.3 reads this score back as -7.614510646309872 through Tokenizer.from_str)
    ours = json.loads(tokenizer_from_json(json.loads(tok.to_str())).to_str())["model"]["vocab"]
    assert [tuple(x) for x in ours] == vocab
