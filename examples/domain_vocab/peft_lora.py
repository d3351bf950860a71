"""LoRA on the blocks, the whole vocabulary trained, new domain terms added: the PEFT workflow under ds_maximus.

    python examples/domain_vocab/peft_lora.py --out build/peft_lora [--vocab 2000] [--terms 64] [--steps 8]

1. a BPE tokenizer trained (``tokenizers``) on the ``pydoc_data.topics`` text, and a tiny random-weight
   Gemma-3-shaped model (``Gemma3ForCausalLM``: tied, scaled embeddings, soft-capped logits) saved as the base;
2. domain terms: identifiers of the text the tokenizer splits into >= 3 pieces, added as new tokens;
3. LoRA on every projection (``ensure_weight_tying=True``: the head stays tied to the trained embedding),
   ``ds_maximus.resize_token_embeddings`` grows the tables, each new row the mean of its old pieces' rows;
4. ``ds_maximus.initialize``: the embedding rows become a maximus row store (exact sparse AdamW, a GPU row
   cache smaller than the vocabulary), the loss is streamed (no full logits); a few steps train on CPU;
5. ``ds_maximus.save_peft`` writes an ordinary PEFT folder; plain ``transformers`` + ``peft`` reload it onto the
   base resized to the new vocabulary, get the same logits, and ``merge_and_unload()`` gives them again.

Prints a JSON summary (sizes, losses, the reload's largest logit difference) as its last line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def corpus() -> list:
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


def base_tokenizer(texts, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<unk>", "<bos>",
                                                                                       "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>")


def domain_terms(texts, tok, n: int) -> list:
    """The ``n`` most frequent identifiers (``a_b``, ``a.b``) the base tokenizer splits into >= 3 pieces."""
    counts: dict = {}
    for t in texts:
        for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+|[a-z]+_[a-z_]+", t):
            counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    return [w for w in ranked if len(tok.encode(w, add_special_tokens=False)) >= 3][:n]


def gemma3(vocab: int, seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=64,
        final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        attn_implementation="eager"))


def batches(texts, tok, terms, steps: int, batch: int, seqlen: int):
    """Windows of the text around the domain terms (so the new rows get gradients)."""
    chunks = [t for t in texts if any(w in t for w in terms)] or texts
    ids = torch.tensor(tok("\n".join(chunks), add_special_tokens=False)["input_ids"])
    n = ids.numel() // seqlen
    windows = ids[: n * seqlen].view(n, seqlen)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    out = []
    for s in range(steps):
        pick = windows[order[(s * batch + torch.arange(batch)) % n]]
        out.append({"input_ids": pick, "labels": pick})
    return out


def ds_config(vocab: int, cache_rows: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
            "maximus": {"embedding": {"min_rows": vocab, "gpu_cache_rows": cache_rows,
                                      "optimizer": {"mode": "exact"}, "new_row_init": "mean_of_pieces"},
                        "lm_head": {"enabled": True, "chunk_rows": 512},
                        "logging": {"interval_steps": 10**6}}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--terms", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=64)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541", "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    import ds_maximus
    from ds_maximus.vocab.resize import pieces_of

    texts = corpus()
    tok = base_tokenizer(texts, a.vocab)                                               # 1
    base_vocab = len(tok)
    base_dir = os.path.join(a.out, "base")
    gemma3(base_vocab).save_pretrained(base_dir)
    print(f"base tokenizer {base_vocab} tokens; base model -> {base_dir}", file=sys.stderr)

    terms = domain_terms(texts, tok, a.terms)                                          # 2
    pieces = pieces_of(terms, tok)
    tok.add_tokens(terms)
    print(f"{len(terms)} domain terms added ({terms[:3]} ...)", file=sys.stderr)

    with warnings.catch_warnings():                                                    # 3
        warnings.simplefilter("ignore")
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", modules_to_save=["embed_tokens"],
            ensure_weight_tying=True))
    cfg = ds_config(len(tok), cache_rows=max(64, len(tok) // 8))
    ds_maximus.resize_token_embeddings(model, len(tok), pieces=pieces, config=cfg)

    engine, *_ = ds_maximus.initialize(model=model, config=cfg,                        # 4
                                       model_parameters=[q for q in model.parameters() if q.requires_grad])
    losses = []
    for b in batches(texts, tok, terms, a.steps, 2, a.seqlen):
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        losses.append(round(float(loss.detach()), 4))
    print(f"losses {losses}", file=sys.stderr)

    adapter = ds_maximus.save_peft(engine, os.path.join(a.out, "adapter"))            # 5
    tok.save_pretrained(adapter)
    probe = torch.tensor([tok.encode(" ".join(terms[:8]), add_special_tokens=False)[:32]])
    engine.module.eval()
    with torch.no_grad():
        ours = engine.module(input_ids=probe).logits.float()
        plain_base = AutoModelForCausalLM.from_pretrained(base_dir)
        plain_base.resize_token_embeddings(len(tok), mean_resizing=False)  # rows come from the adapter
        plain = PeftModel.from_pretrained(plain_base, adapter).eval()
        reloaded = plain(input_ids=probe).logits.float()
        merged = plain.merge_and_unload()(input_ids=probe).logits.float()
    summary = {"base_vocab": base_vocab, "vocab": len(tok), "terms": len(terms), "losses": losses,
               "reload_max_abs_diff": float((reloaded - ours).abs().max()),
               "merged_max_abs_diff": float((merged - reloaded).abs().max()),
               "tied": plain.base_model.model.lm_head.weight is plain.base_model.model.model.embed_tokens.weight,
               "adapter": adapter}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
