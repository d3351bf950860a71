"""convert: the permuted checkpoint computes the same logits (up to the permutation) on the same text."""
import json
import os

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaForCausalLM

from ds_maximus.errors import TokenMapError
from ds_maximus.store import ShardStore
from ds_maximus.tokenmap import ADAMW_STATE_NAMES, TokenMap, convert_checkpoint

from .conftest import make_llama

TEXT = "The with statement is used to wrap the execution of a block with methods defined by a context manager."


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_same_logits_up_to_permutation(tmp_path, tiny_tokenizer_dir, token_map_dir, tie):
    tm = TokenMap.load(token_map_dir)
    src = tmp_path / "src"
    orig = make_llama(src, tm.vocab_size, tie=tie)
    summary = convert_checkpoint(str(src), token_map_dir, str(tmp_path / "out"), rows_per_shard=1000,
                                 state_names=ADAMW_STATE_NAMES, progress=False)
    assert set(summary["permuted_tensors"]) == ({"model.embed_tokens.weight"} if tie else
                                                {"model.embed_tokens.weight", "lm_head.weight"})
    conv = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()

    old_tok = Tokenizer.from_file(os.path.join(tiny_tokenizer_dir, "tokenizer.json"))
    new_tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))  # the tokenizer travels with the model
    old_ids = old_tok.encode(TEXT).ids
    new_ids = new_tok(TEXT)["input_ids"]
    assert new_ids == tm.to_new(torch.tensor(old_ids)).tolist()
    a, b = _logits(orig, old_ids), _logits(conv, new_ids)
    assert torch.allclose(b, a[:, tm.new_to_old], atol=1e-5, rtol=1e-5)
    assert torch.equal(b.argmax(-1), tm.old_to_new[a.argmax(-1)])
    assert new_tok.decode(new_ids, skip_special_tokens=True) == TEXT

    # special-token ids of the config follow the map
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == tuple(
        int(tm.old_to_new[i]) for i in (1, 2, 3))

    store = ShardStore.open(summary["store"], loader=False)
    assert (store.vocab_size, store.dim, store.dtype, store.num_shards) == (tm.vocab_size, 64, torch.float32, 3)
    assert store.state_names == ("exp_avg", "exp_avg_sq")
    assert torch.equal(store.read_all(), conv.model.embed_tokens.weight.detach().float())
    assert not store.read_all("exp_avg_sq").any()
    store.verify()


def test_vocab_size_mismatch(tmp_path, token_map_dir):
    tm = TokenMap.load(token_map_dir)
    make_llama(tmp_path / "small", tm.vocab_size - 10)
    with pytest.raises(TokenMapError, match=r"vocab size mismatch.*2990 rows.*3000 tokens"):
        convert_checkpoint(str(tmp_path / "small"), tm, str(tmp_path / "o1"), progress=False)
    big = make_llama(tmp_path / "big", tm.vocab_size + 64)
    with pytest.raises(TokenMapError, match="allow-padded-vocab"):
        convert_checkpoint(str(tmp_path / "big"), tm, str(tmp_path / "o2"), progress=False)
    convert_checkpoint(str(tmp_path / "big"), tm, str(tmp_path / "o2"), allow_padded_vocab=True, progress=False)
    conv = LlamaForCausalLM.from_pretrained(str(tmp_path / "o2"))
    w0, w1 = big.model.embed_tokens.weight, conv.model.embed_tokens.weight
    assert torch.equal(w1[tm.vocab_size:], w0[tm.vocab_size:])  # padding rows keep their place
    assert torch.equal(w1[:tm.vocab_size], w0[tm.new_to_old])


def test_bad_checkpoints(tmp_path, token_map_dir):
    with pytest.raises(TokenMapError, match="no config.json"):
        convert_checkpoint(str(tmp_path), token_map_dir, str(tmp_path / "o"), progress=False)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 3000}))
    with pytest.raises(TokenMapError, match="no safetensors checkpoint"):
        convert_checkpoint(str(tmp_path), token_map_dir, str(tmp_path / "o"), progress=False)
