"""Train a small BPE tokenizer on the standard library's pydoc topics, then build its token map.

    python examples/build_tokenizer.py --out build/example_tokenmap [--vocab 4000]

Writes OUT/base_tokenizer/ (the trained tokenizer, transformers format), OUT/corpus.txt and
OUT/tokenmap/ (frequency-ordered token map with the rewritten tokenizer), by running
``maximus-tokenizer build`` then ``maximus-tokenizer inspect``. Takes a few seconds on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import sys


def train_bpe(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/example_tokenmap")
    ap.add_argument("--vocab", type=int, default=4000)
    a = ap.parse_args(argv)
    from pydoc_data.topics import topics
    from transformers import PreTrainedTokenizerFast

    from ds_maximus.tokenmap.cli import main as maximus_tokenizer

    os.makedirs(a.out, exist_ok=True)
    corpus = os.path.join(a.out, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for key in sorted(topics):
            f.write(topics[key].rstrip("\n") + "\n")
    with open(corpus, encoding="utf-8") as f:
        texts = f.readlines()
    base = os.path.join(a.out, "base_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=train_bpe(texts, a.vocab), unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<pad>").save_pretrained(base)
    print(f"trained a {a.vocab}-token BPE tokenizer -> {base}")
    tm = os.path.join(a.out, "tokenmap")
    rc = maximus_tokenizer(["build", "--tokenizer", base, "--corpus", corpus, "--out", tm])
    if rc == 0:
        rc = maximus_tokenizer(["inspect", "--token-map", tm, "--k", "256", "1024", str(a.vocab), "--top", "10"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
