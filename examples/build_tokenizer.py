"""From a text corpus to an exported model: tokenizer + token map, converted checkpoint, training, export.

    python examples/build_tokenizer.py --out build/token_path [--vocab 4000] [--steps 4]   # CPU, ~1 min

The README's path, one command per stage (run here in-process; each is also a shell command):

1. corpus: the standard library's pydoc topics (real English and code) -> ``OUT/corpus.txt``;
2. ``maximus-tokenizer build --corpus OUT/corpus.txt --vocab-size 4000 --out OUT/tokenmap`` trains a
   byte-level BPE on the corpus and writes its frequency-ordered token map (hot tokens get small ids);
3. a model with that vocabulary (here a tiny random Llama, saved as safetensors), then
   ``maximus-tokenizer convert --model OUT/base --token-map OUT/tokenmap --out OUT/converted``
   permutes its embedding and head rows to the token map and writes the tokenizer beside them;
4. training: ``ds_maximus.initialize`` on the converted model with ``embedding.token_map_dir`` set,
   a few steps on the corpus encoded by the converted checkpoint's tokenizer, then
   ``engine.save_checkpoint(OUT/ckpt)``;
5. ``maximus-export OUT/ckpt OUT/hf --token-map OUT/tokenmap``: an ordinary Hugging Face folder;
   loaded without ds_maximus it gives the trained model's logits.

Prints one line per stage and ends with a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """What the deepspeed launcher would set, for a one-process run."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(k, v)


def write_corpus(path: str) -> str:
    from pydoc_data.topics import topics
    with open(path, "w", encoding="utf-8") as f:
        for key in sorted(topics):
            f.write(topics[key].rstrip("\n") + "\n")
    return path


def base_model(path: str, vocab: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def train(converted: str, tm_dir: str, corpus: str, ckpt: str, steps: int, seq: int = 64, micro: int = 4):
    """A few steps of ds_maximus.initialize on the converted model; returns (engine, losses)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ds_maximus
    tok = AutoTokenizer.from_pretrained(converted)  # the token map's ids, written beside the weights
    with open(corpus, encoding="utf-8") as f:
        ids = torch.tensor(tok(f.read())["input_ids"])
    batches = ids[: steps * micro * seq].view(steps, micro, seq)
    model = AutoModelForCausalLM.from_pretrained(converted)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": 2},
           # "modules" names the embedding to swap: this tiny vocabulary is below the size swapped by default
           "maximus": {"embedding": {"modules": ["model.embed_tokens"], "token_map_dir": tm_dir,
                                     "gpu_cache_rows": 1024},
                       "logging": {"interval_steps": max(1, steps)}}}
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for b in batches:
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(ckpt)
    engine.module.config.save_pretrained(ckpt)  # config.json beside the checkpoint, for maximus-export
    return engine, losses


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/token_path")
    ap.add_argument("--vocab", type=int, default=4000, help="vocabulary size of the trained tokenizer")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args(argv)
    _single_process_env()
    import torch

    from ds_maximus.integrations.export_cli import main as maximus_export
    from ds_maximus.tokenmap.cli import main as maximus_tokenizer
    from ds_maximus.tokenmap.token_map import TokenMap

    def run(cli, *args):
        if cli([*args]) != 0:
            raise SystemExit(f"failed: {' '.join(args)}")

    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    p = {k: os.path.join(a.out, k) for k in ("corpus.txt", "tokenmap", "base", "converted", "ckpt", "hf")}
    write_corpus(p["corpus.txt"])
    print(f"[1] corpus: {p['corpus.txt']} ({os.path.getsize(p['corpus.txt']):,} bytes)")

    run(maximus_tokenizer, "build", "--corpus", p["corpus.txt"], "--vocab-size", str(a.vocab), "--out", p["tokenmap"],
        "--no-progress")
    tm = TokenMap.load(p["tokenmap"])
    print(f"[2] tokenizer + token map: {tm.vocab_size} tokens, the first 1024 ids cover {tm.coverage(1024):.1%} "
          "of the corpus")

    base_model(p["base"], tm.vocab_size, a.hidden)
    run(maximus_tokenizer, "convert", "--model", p["base"], "--token-map", p["tokenmap"], "--out", p["converted"],
        "--no-progress")
    print(f"[3] converted checkpoint: {p['converted']}")

    engine, losses = train(p["converted"], p["tokenmap"], p["corpus.txt"], p["ckpt"], a.steps)
    print(f"[4] trained {a.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; checkpoint {p['ckpt']}")

    run(maximus_export, p["ckpt"], p["hf"], "--token-map", p["tokenmap"])
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf, tok = AutoModelForCausalLM.from_pretrained(p["hf"]).eval(), AutoTokenizer.from_pretrained(p["hf"])
    text = "The with statement is used to wrap the execution of a block."
    ids = torch.tensor([tok(text)["input_ids"]])
    m = engine.module.eval()
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - m(input_ids=ids).logits.float()).abs().max().item()
    same_ids = ids[0].tolist() == tm.encode(text, add_special_tokens=True)
    print(f"[5] exported {p['hf']}: loads without ds_maximus, logits within {diff:.2e} of the trained model's, "
          f"its tokenizer gives the token map's ids: {same_ids}")
    summary = {"vocab": tm.vocab_size, "coverage_1024": tm.coverage(1024), "losses": losses,
               "max_logit_diff": diff, "tokenizer_ids_match": same_ids,
               "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
