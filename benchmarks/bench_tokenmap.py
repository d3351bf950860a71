"""TokenMap build throughput (tokens/s) beside plain tokenizer encode throughput on the same corpus.

    python -m benchmarks.bench_tokenmap [--repeat N] [--vocab 4000]

Peers, all on the standard library's ``pydoc_data.topics`` (one text per paragraph line) with a BPE
tokenizer trained on it: ``encode_batch`` (the tokenizer alone, ids discarded), ``encode loop``
(one ``encode`` call per text), and ``TokenMap.build`` (counting + ordering + rewrite + self-check).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks.harness import Bench


def _corpus():
    from pydoc_data.topics import topics
    return [ln for key in sorted(topics) for ln in topics[key].splitlines(keepends=True) if ln.strip()]


def _tokenizer(texts, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return tok


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--copies", type=int, default=2, help="corpus copies (a bigger corpus)")
    a = ap.parse_args(argv)
    from ds_maximus.tokenmap import TokenMap
    from ds_maximus.tokenmap.corpus import encode_ids

    texts = _corpus() * a.copies
    tok = _tokenizer(texts[: len(texts) // a.copies], a.vocab)
    n_tokens = int(encode_ids(tok, texts).size)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "corpus.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(texts)
        tok.save(os.path.join(d, "tokenizer.json"))
        bench = Bench("tokenmap", dtype="-", sizes={"texts": len(texts), "tokens": n_tokens, "V": a.vocab},
                      notes=f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}, "
                            f"{os.cpu_count()} CPUs; tokens/s = corpus tokens / median time")

        def rate(r):
            if r.ms:
                r.extra["tokens/s"] = f"{n_tokens / (r.ms / 1e3):,.0f}"
            return r

        rate(bench.measure("encode_batch (tokenizer alone)", lambda: tok.encode_batch(texts),
                           warmup=1, repeat=a.repeat))
        rate(bench.measure("encode loop (1 call per text)", lambda: [tok.encode(t) for t in texts],
                           warmup=0, repeat=1))
        rate(bench.measure("TokenMap.build (file corpus)",
                           lambda: TokenMap.build(os.path.join(d, "tokenizer.json"), [path], progress=False),
                           warmup=1, repeat=a.repeat))
        rate(bench.measure("TokenMap.build (list of strings)",
                           lambda: TokenMap.build(tok, texts=texts, progress=False), warmup=0, repeat=a.repeat))
        bench.report(baseline="encode_batch (tokenizer alone)")


if __name__ == "__main__":
    sys.exit(main())
