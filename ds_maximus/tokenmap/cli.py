"""``maximus-tokenizer``: build, extend, convert and inspect token maps.

    maximus-tokenizer build   --tokenizer TOK_DIR --corpus a.txt b.jsonl --out tokenmap/
    maximus-tokenizer build   --corpus a.txt --vocab-size 32000 [--tokenizer-model bpe|unigram] --out tokenmap/
    maximus-tokenizer convert --model hf_ckpt/ --token-map tokenmap/ --out ckpt_mapped/ [--optimizer-state]
    maximus-tokenizer extend  --token-map tokenmap/ --tokens aspirin ibuprofen --store ckpt_mapped/embedding_store
    maximus-tokenizer inspect --token-map tokenmap/ [--store DIR] [--corpus held_out.txt] [--k 1024 4096] [--json]

Without ``--tokenizer``, ``build`` first trains a new tokenizer on the corpus
(:mod:`ds_maximus.tokenmap.train`) and keeps it, with its original ids, in ``OUT/source_tokenizer/``.
``extend`` also rewrites the tokenizer of every checkpoint ``convert`` wrote from the token map, so no
``tokenizer.json`` is left at the old vocabulary size.

Errors are reported as one ``error:`` line (exit status 2), never as a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional

from ds_maximus.errors import MaximusError
from ds_maximus.tokenmap.train import TokenizerModel

DEFAULT_VOCAB_SIZE = 32000
SOURCE_TOKENIZER_DIR = "source_tokenizer"  # the trained tokenizer (original ids) inside the token map folder


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="maximus-tokenizer", description="Frequency-ordered token maps for ds_maximus.")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="count a corpus and write a token map with its rewritten tokenizer "
                                     "(training a new tokenizer on the corpus when --tokenizer is not given)")
    b.add_argument("--tokenizer", help="folder with tokenizer.json (or the file itself); without it a new "
                                       "tokenizer is trained on the corpus (--tokenizer-model, --vocab-size)")
    b.add_argument("--corpus", required=True, nargs="+", help="text files (.txt lines, .jsonl) or folders of them")
    b.add_argument("--tokenizer-model", choices=[m.value for m in TokenizerModel], default=None,
                   help="tokenizer model to train without --tokenizer (default bpe: byte-level BPE)")
    b.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary size of the trained tokenizer without --tokenizer (default {DEFAULT_VOCAB_SIZE})")
    b.add_argument("--out", required=True, help="token map folder to write")
    b.add_argument("--batch-size", type=int, default=1024, help="texts per encode_batch call")
    b.add_argument("--text-key", default="text", help="field of .jsonl records holding the text")
    b.add_argument("--sample-by", default="line", choices=("line", "paragraph", "document"),
                   help="how text files split into texts")

    e = sub.add_parser("extend", help="append new tokens as new ids (and new shards of the stores)")
    e.add_argument("--token-map", required=True)
    e.add_argument("--tokens", nargs="*", default=[], help="new tokens")
    e.add_argument("--tokens-file", help="file with one new token per line")
    e.add_argument("--store", nargs="*", default=[], help="shard stores to grow with the new rows")
    e.add_argument("--single-word", action="store_true", help="match new tokens only as whole words")

    c = sub.add_parser("convert", help="permute an HF safetensors checkpoint to a token map and write its store")
    c.add_argument("--model", required=True, help="HF checkpoint folder (config.json + safetensors)")
    c.add_argument("--token-map", required=True)
    c.add_argument("--out", required=True, help="folder of the converted checkpoint")
    c.add_argument("--store", help="shard store folder (default: OUT/embedding_store)")
    c.add_argument("--rows-per-shard", type=int, default=32768)
    c.add_argument("--optimizer-state", action="store_true", help="add zeroed AdamW state (exp_avg, exp_avg_sq)")
    c.add_argument("--allow-padded-vocab", action="store_true",
                   help="accept a checkpoint with more rows than the token map (padding rows stay at the end)")

    i = sub.add_parser("inspect", help="sizes, shards, top tokens and coverage of a token map")
    i.add_argument("--token-map", required=True)
    i.add_argument("--store", help="shard store to describe")
    i.add_argument("--corpus", nargs="*", help="held-out corpus to measure coverage on")
    i.add_argument("--k", type=int, nargs="*", help="coverage cut-offs (rows)")
    i.add_argument("--top", type=int, default=20)
    i.add_argument("--text-key", default="text")
    i.add_argument("--sample-by", default="line", choices=("line", "paragraph", "document"))
    i.add_argument("--json", action="store_true", help="print the report as JSON")

    for s in (b, e, c, i):
        s.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _build(a) -> dict:
    from ds_maximus.errors import TokenMapError
    from ds_maximus.tokenmap.corpus import corpus_files
    from ds_maximus.tokenmap.token_map import TokenMap
    corpus_files(a.corpus)  # a missing path fails here, before any training or counting
    tokenizer = a.tokenizer
    if tokenizer is None:
        from ds_maximus.tokenmap.train import save_tokenizer, train_tokenizer
        model, vocab = a.tokenizer_model or TokenizerModel.BPE.value, a.vocab_size or DEFAULT_VOCAB_SIZE
        t0 = time.perf_counter()
        tok = train_tokenizer(a.corpus, vocab, model, text_key=a.text_key, sample_by=a.sample_by,
                              progress=not a.no_progress)
        tokenizer = save_tokenizer(tok, os.path.join(a.out, SOURCE_TOKENIZER_DIR))
        print(f"trained a {model} tokenizer of {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.2f} s "
              f"-> {tokenizer}")
    elif a.tokenizer_model is not None or a.vocab_size is not None:
        raise TokenMapError("--tokenizer-model and --vocab-size train a new tokenizer, which --tokenizer replaces; "
                            "pass either --tokenizer or --tokenizer-model/--vocab-size")
    t0 = time.perf_counter()
    tm = TokenMap.build(tokenizer, a.corpus, batch_size=a.batch_size, progress=not a.no_progress,
                        text_key=a.text_key, sample_by=a.sample_by)
    dt = time.perf_counter() - t0
    tm.save(a.out)
    n = tm.meta["corpus_tokens"]
    print(f"token map: {tm.vocab_size} tokens ({tm.num_special} special), {n} corpus tokens in {dt:.2f} s "
          f"({n / dt:,.0f} tokens/s); coverage of the first 1024 rows: {tm.coverage(1024):.4f}")
    print(f"wrote {a.out} (rewritten tokenizer in {tm.tokenizer_dir})")
    return {"vocab_size": tm.vocab_size, "corpus_tokens": n, "seconds": dt}


def _extend(a) -> dict:
    from ds_maximus.store import ShardStore
    from ds_maximus.tokenmap.token_map import TokenMap
    tokens = list(a.tokens)
    if a.tokens_file:
        with open(a.tokens_file, encoding="utf-8") as f:
            tokens += [ln.rstrip("\n") for ln in f if ln.strip()]
    tm = TokenMap.load(a.token_map)
    stores = [ShardStore.open(s, loader=False) for s in a.store]
    ids = tm.extend(tokens, stores=stores, progress=not a.no_progress, single_word=a.single_word)
    print(f"added {len(ids)} tokens as ids [{ids[0]}, {ids[-1]}]; vocabulary now {tm.vocab_size}"
          + (f"; grew {len(stores)} store(s)" if stores else ""))
    for d in tm.meta.get("converted_checkpoints", []):
        print(f"rewrote the tokenizer of the converted checkpoint {d} ({tm.vocab_size} tokens; its weights keep "
              f"their rows until the model is resized: model.resize_token_embeddings({tm.vocab_size}))")
    return {"ids": ids}


def _convert(a) -> dict:
    from ds_maximus.tokenmap.convert import ADAMW_STATE_NAMES, convert_checkpoint
    s = convert_checkpoint(a.model, a.token_map, a.out, store_dir=a.store, rows_per_shard=a.rows_per_shard,
                           state_names=ADAMW_STATE_NAMES if a.optimizer_state else (),
                           allow_padded_vocab=a.allow_padded_vocab, progress=not a.no_progress)
    print(f"permuted {s['permuted_tensors']} -> {s['out_dir']}; store {s['store']}: {s['num_shards']} shards, "
          f"V={s['vocab_size']}, dim={s['dim']}")
    return s


def _inspect(a) -> dict:
    from ds_maximus.tokenmap.report import format_report, inspect_token_map
    rep = inspect_token_map(a.token_map, store=a.store, corpus=a.corpus or None, ks=a.k, top=a.top,
                            text_key=a.text_key, progress=not a.no_progress, sample_by=a.sample_by)
    print(json.dumps(rep, indent=1, ensure_ascii=False) if a.json else format_report(rep))
    return rep


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    try:
        {"build": _build, "extend": _extend, "convert": _convert, "inspect": _inspect}[a.cmd](a)
    except (MaximusError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
