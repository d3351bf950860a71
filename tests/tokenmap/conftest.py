"""Shared fixtures: a BPE tokenizer trained on ``pydoc_data.topics`` and a tiny random Llama."""
import os

import pytest

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def corpus_texts():
    """The corpus: every paragraph of the standard library's pydoc topics (real, Zipfian English + code)."""
    from pydoc_data.topics import topics
    out = []
    for key in sorted(topics):
        out += [p + "\n" for p in topics[key].split("\n\n") if p.strip()]
    return out


def train_tokenizer(vocab_size=3000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A </s> $B",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A transformers-saved fast tokenizer folder (tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast
    d = tmp_path_factory.mktemp("tok")
    hf = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>", pad_token="<pad>")
    hf.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "topics.txt"
    p.write_text("".join(corpus_texts()), encoding="utf-8")
    return str(p)


@pytest.fixture(scope="session")
def token_map_dir(tiny_tokenizer_dir, corpus_file, tmp_path_factory):
    from ds_maximus.tokenmap import TokenMap
    d = str(tmp_path_factory.mktemp("tm") / "tokenmap")
    TokenMap.build(tiny_tokenizer_dir, [corpus_file], progress=False).save(d)
    return d


def make_llama(path, vocab_size, tie=False, seed=0):
    """A tiny random-weight LlamaForCausalLM saved with save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def llama_dir(tiny_tokenizer_dir, tmp_path_factory):
    from tokenizers import Tokenizer
    V = Tokenizer.from_file(os.path.join(tiny_tokenizer_dir, "tokenizer.json")).get_vocab_size()
    d = tmp_path_factory.mktemp("llama") / "model"
    make_llama(d, V)
    return str(d)
