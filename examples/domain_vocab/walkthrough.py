"""Domain vocabulary walk-through: extend a tokenizer with new terms, grow the embedding store by new
shards only, and fine-tune the new rows with ``ds_maximus.initialize`` (CPU, tiny model, seconds).

    python examples/domain_vocab/walkthrough.py --out build/domain_vocab [--vocab 2000] [--terms 2000]

Steps (each prints what it did):

1. base tokenizer: ``maximus-tokenizer build --corpus --vocab-size`` trains a small BPE on
   ``pydoc_data.topics`` and writes its frequency-ordered token map;
2. base model: a tiny random Llama saved as safetensors, ``maximus-tokenizer convert`` writes its
   embedding as a shard store (with zeroed AdamW state);
3. domain terms: identifiers of the standard library the base tokenizer splits into >= 3 pieces
   (``collections.OrderedDict.move_to_end`` ...); ``maximus-tokenizer extend --store`` appends them as
   new ids and new shards, each new row the mean of its old pieces' rows;
4. fine-tune: the model grows to the new vocabulary, its embedding is the store itself (a
   ``ShardedEmbedding`` on ``offload.device: nvme``), and a few steps of ``ds_maximus.initialize``
   (ZeRO-2, lazy sparse AdamW, no weight decay) train on sequences of the new terms;
5. check: every old shard file is byte-identical (SHA-256) and has its old mtime; new shards changed.

Returns (and prints as JSON) a summary: vocabulary sizes, shards, which changed, losses.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time

import torch

ROWS_PER_SHARD = 256


def _hashes(store_dir: str) -> dict:
    """Shard number -> (file name, SHA-256, mtime) of the file holding it (a rewrite makes a new file)."""
    out = {}
    for name in sorted(os.listdir(store_dir)):
        m = re.fullmatch(r"shard_(\d+)-[0-9a-f]+\.safetensors", name)
        if m:
            p = os.path.join(store_dir, name)
            with open(p, "rb") as f:
                out[int(m.group(1))] = (name, hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


def base_tokenizer(out: str, vocab: int) -> str:
    """A BPE tokenizer trained on the pydoc topics and its token map, by ``maximus-tokenizer build``."""
    from pydoc_data.topics import topics

    from ds_maximus.tokenmap.cli import main as maximus_tokenizer
    corpus = os.path.join(out, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for key in sorted(topics):
            f.write(topics[key].rstrip("\n") + "\n")
    tm = os.path.join(out, "tokenmap")
    if maximus_tokenizer(["build", "--corpus", corpus, "--vocab-size", str(vocab), "--out", tm, "--no-progress"]):
        raise SystemExit("maximus-tokenizer build failed")
    return tm


def domain_terms(tm_dir: str, n: int) -> list:
    """Dotted standard-library names the token map's tokenizer splits into >= 3 pieces."""
    import importlib

    from ds_maximus.tokenmap.token_map import TokenMap
    tm = TokenMap.load(tm_dir)
    seen, terms = set(), []
    for mod_name in sorted(sys.stdlib_module_names):
        if mod_name.startswith("_") or mod_name in ("antigravity", "this", "idlelib", "turtledemo", "tkinter"):
            continue
        try:
            mod = importlib.import_module(mod_name)
        except Exception:
            continue
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            term = f"{mod_name}.{attr}"
            if term in seen or not re.fullmatch(r"[A-Za-z0-9_.]+", term):
                continue
            seen.add(term)
            if len(tm.encode(term)) >= 3:
                terms.append(term)
            if len(terms) >= n:
                return terms
    return terms


def base_model(out: str, tm_dir: str, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_maximus.tokenmap.cli import main as maximus_tokenizer
    from ds_maximus.tokenmap.token_map import TokenMap
    vocab = TokenMap.load(tm_dir).vocab_size
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=128, tie_word_embeddings=False))
    raw = os.path.join(out, "base_model_raw")
    model.save_pretrained(raw, safe_serialization=True)
    ckpt, store = os.path.join(out, "base_model"), os.path.join(out, "embedding_store")
    assert maximus_tokenizer(["convert", "--model", raw, "--token-map", tm_dir, "--out", ckpt, "--store", store,
                              "--rows-per-shard", str(ROWS_PER_SHARD), "--optimizer-state", "--no-progress"]) == 0
    return ckpt, store


def fine_tune(ckpt: str, store: str, tm_dir: str, new_ids: list, steps: int, seq: int = 16, batch: int = 4):
    from transformers import LlamaForCausalLM

    import ds_maximus
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.tokenmap.token_map import TokenMap
    from ds_maximus.vocab import ShardedEmbedding
    vocab = TokenMap.load(tm_dir).vocab_size
    model = LlamaForCausalLM.from_pretrained(ckpt)
    model.resize_token_embeddings(vocab, mean_resizing=False)   # the head grows; the embedding is the store:
    emb_cfg = EmbeddingConfig(gpu_cache_rows=1024, rows_per_shard=ROWS_PER_SHARD,
                              optimizer={"type": "adamw", "mode": "lazy", "weight_decay": 0.0},
                              offload={"device": "nvme", "nvme_path": store, "cpu_cache_shards": 4,
                                       "pin_memory": False})
    model.model.embed_tokens = ShardedEmbedding(vocab, model.config.hidden_size, config=emb_cfg)  # opens it
    ds_cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
              "maximus": {"embedding": {"modules": ["model.embed_tokens"], **emb_cfg.model_dump(mode="json")}}}
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    g = torch.Generator().manual_seed(0)
    new = torch.tensor(new_ids)
    losses = []
    for _ in range(steps):
        ids = new[torch.randint(0, new.numel(), (batch, seq), generator=g)]   # a glossary of the new terms
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    model.model.embed_tokens.flush()                       # dirty rows -> their shards, atomically
    return losses


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/domain_vocab")
    ap.add_argument("--vocab", type=int, default=2000, help="base BPE vocabulary")
    ap.add_argument("--terms", type=int, default=2000, help="new domain terms")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29731")):
        os.environ.setdefault(k, v)
    from ds_maximus.tokenmap.cli import main as maximus_tokenizer
    from ds_maximus.tokenmap.token_map import TokenMap
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    tm_dir = base_tokenizer(a.out, a.vocab)
    ckpt, store = base_model(a.out, tm_dir, a.hidden)
    v0 = TokenMap.load(tm_dir).vocab_size
    print(f"[1-2] base tokenizer {v0} tokens, embedding store {store} ({time.perf_counter() - t0:.1f} s)")

    terms = domain_terms(tm_dir, a.terms)
    terms_file = os.path.join(a.out, "terms.txt")
    with open(terms_file, "w") as f:
        f.write("\n".join(terms) + "\n")
    before = _hashes(store)
    time.sleep(0.01)    # mtimes of rewritten files would differ
    assert maximus_tokenizer(["extend", "--token-map", tm_dir, "--tokens-file", terms_file, "--store", store,
                              "--no-progress"]) == 0
    v1 = TokenMap.load(tm_dir).vocab_size
    after_extend = _hashes(store)
    new_ids = list(range(v0, v1))
    print(f"[3] extended by {len(terms)} terms ({terms[0]} ...): {v0} -> {v1} tokens, shards "
          f"{len(before)} -> {len(after_extend)}")

    losses = fine_tune(ckpt, store, tm_dir, new_ids, a.steps)
    after_tune = _hashes(store)
    old = sorted(before)
    new = sorted(set(after_tune) - set(before))
    old_same = [n for n in old if after_tune.get(n) == before[n]]
    new_changed = [n for n in new if after_tune[n][:2] != after_extend[n][:2]]
    summary = {"base_vocab": v0, "vocab": v1, "terms": len(terms), "old_shards": len(old), "new_shards": len(new),
               "old_shards_untouched": len(old_same), "new_shards_trained": len(new_changed), "losses": losses,
               "seconds": round(time.perf_counter() - t0, 1)}
    print(f"[4] fine-tuned {a.steps} steps on the new terms: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"[5] old shards byte-identical with their old mtime: {len(old_same)}/{len(old)}; "
          f"new shards written by the fine-tune: {len(new_changed)}/{len(new)}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
