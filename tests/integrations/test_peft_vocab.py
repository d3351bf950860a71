"""PEFT LoRA + a full trained vocabulary (ds_maximus.integrations.peft) and vocabulary growth (ds_maximus.vocab.resize).

A tied Gemma-3 (scaled embeddings, soft-capped logits) under ``LoraConfig(ensure_weight_tying=True)`` keeps its tie as
one maximus row store and trains like plain PEFT with fp32 masters (losses rel 1e-5 on CPU fp32); ``save_peft`` (and
PEFT's own ``save_pretrained``, which ``trainer.save_model()`` calls) writes an ordinary PEFT folder that plain
``peft`` + ``transformers`` (ds_maximus blocked) reload, tied, to the same logits, and whose ``merge_and_unload()``
gives them again. An untied Llama and PEFT's
default untie are reproduced the same way. ``resize_token_embeddings`` keeps old rows bit-equal, keeps ties,
fills new rows as ``embedding.new_row_init`` documents, and a grown PEFT model trains and reloads.
"""
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from ds_maximus.errors import ConfigError
from ds_maximus.integrations.peft import save_peft
from ds_maximus.vocab import ShardedEmbedding, ShardedLMHead
from ds_maximus.vocab.resize import pieces_of, resize_token_embeddings
from tests.conformance.helpers import ds_config, zipf_ids
from tests.helpers.fresh_process import BLOCK_DS_MAXIMUS
from tests.helpers.models import initialize, train

VOCAB = 384
EMB = "base_model.model.model.embed_tokens"
HEAD = "base_model.model.lm_head"

RELOAD = BLOCK_DS_MAXIMUS + r'''import torch, transformers
from peft import PeftModel
job = torch.load(sys.argv[1])
base = transformers.AutoModelForCausalLM.from_pretrained(job["base"])
if job.get("vocab"):
    base.resize_token_embeddings(job["vocab"])
model = PeftModel.from_pretrained(base, job["adapter"]).eval()
emb = model.base_model.model.model.embed_tokens.modules_to_save["default"].weight
head = model.base_model.model.lm_head
head = head.modules_to_save["default"].weight if hasattr(head, "modules_to_save") else head.weight
with torch.no_grad():
    out = {"logits": model(input_ids=job["ids"]).logits, "tied": head is emb}
    merged = model.merge_and_unload()
    out["merged"] = merged(input_ids=job["ids"]).logits
    out["merged_type"] = type(merged).__name__
out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "ds_maximus")
torch.save(out, sys.argv[2])
'''


def _reload(tmp_path, base_dir, adapter_dir, ids, vocab=None) -> dict:
    req, res = tmp_path / "job.pt", tmp_path / "res.pt"
    torch.save({"base": str(base_dir), "adapter": str(adapter_dir), "ids": ids, "vocab": vocab}, req)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", RELOAD, str(req), str(res)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out = torch.load(res)
    assert out["loaded"] == [], "the reloading process imported ds_maximus"
    return out


def gemma3(vocab=VOCAB, seed=0, tie=True):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                           sliding_window=16, final_logit_softcapping=30.0, tie_word_embeddings=tie,
                           attn_implementation="eager")
    return Gemma3ForCausalLM(cfg)


def llama(vocab=VOCAB, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False, attn_implementation="eager"))


def lora(model, modules_to_save=("embed_tokens",), tie=True):
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                     modules_to_save=list(modules_to_save), ensure_weight_tying=tie,
                     init_lora_weights=False)  # B != 0: LoRA counts from the first step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # PEFT's warning about untying a tied model (tested below)
        return get_peft_model(model, cfg)


def section(vocab=VOCAB, cache_rows=48, head=True):
    sec = {"embedding": {"min_rows": vocab, "gpu_cache_rows": cache_rows, "optimizer": {"mode": "exact"}},
           "logging": {"interval_steps": 1000}}
    if head:
        sec["lm_head"] = {"enabled": True, "chunk_rows": 128}
    return sec


def _batches(n=6, vocab=VOCAB):
    return [{"input_ids": ids, "labels": ids} for ids in zipf_ids(n, batch=2, seqlen=8, vocab=vocab)]


def _logits(engine, ids):
    engine.module.eval()
    with torch.no_grad():
        return engine.module(input_ids=ids).logits.float()


@pytest.mark.parametrize("stage", [0, 3])
def test_tied_gemma3_trains_like_plain_peft_and_reloads_with_plain_peft(tmp_path, stage):
    base = tmp_path / "base"
    gemma3().save_pretrained(base)
    data = _batches()
    ref = initialize(lora(gemma3()), ds_config(stage, clip=0.5))
    l_ref = train(ref, data)
    got = initialize(lora(gemma3()), ds_config(stage, clip=0.5, maximus=section()))
    emb = got.module.get_submodule(EMB).modules_to_save["default"]
    head = got.module.get_submodule(HEAD).modules_to_save["default"]
    assert isinstance(emb, ShardedEmbedding)
    assert isinstance(head, ShardedLMHead) and head.tied_to[0] is emb       # the tie is one row store
    l_got = train(got, data)
    assert l_got == pytest.approx(l_ref, rel=1e-5)

    ids = zipf_ids(1, batch=2, seqlen=8, vocab=VOCAB, seed=7)[0]
    adapter = save_peft(got, str(tmp_path / "adapter"))
    ref_dir = tmp_path / "ref_adapter"
    if stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters([p for p in ref.module.parameters() if p.requires_grad]):
            ref.module.save_pretrained(ref_dir)
    else:
        ref.module.save_pretrained(ref_dir)
    plain_call = tmp_path / "plain_call"
    got.module.save_pretrained(plain_call)   # PEFT's own call, as trainer.save_model() makes it (it lost the head key)
    ours, theirs = _reload(tmp_path, base, adapter, ids), _reload(tmp_path, base, ref_dir, ids)
    again = _reload(tmp_path, base, plain_call, ids)
    assert ours["tied"] and theirs["tied"] and again["tied"]
    torch.testing.assert_close(again["logits"], ours["logits"], rtol=0, atol=0)
    torch.testing.assert_close(ours["logits"], theirs["logits"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours["merged"], ours["logits"], rtol=1e-4, atol=1e-4)
    assert ours["merged_type"] == "Gemma3ForCausalLM"
    if stage == 0:
        torch.testing.assert_close(ours["logits"], _logits(got, ids), rtol=1e-4, atol=1e-4)


def test_untied_llama_and_peft_default_untie(tmp_path):
    """Llama with both tables in modules_to_save; Gemma-3 under PEFT's default untie (two copies): maximus keeps
    each model as PEFT made it, trains it like plain PEFT, and the folder reloads to the same logits."""
    ids = zipf_ids(1, batch=2, seqlen=8, vocab=VOCAB, seed=7)[0]
    for name, make in (("llama", llama), ("gemma3_untied", gemma3)):
        base = tmp_path / f"base_{name}"
        make().save_pretrained(base)
        data = _batches(4)
        ref = initialize(lora(make(), ("embed_tokens", "lm_head"), tie=False), ds_config(0))
        l_ref = train(ref, data)
        got = initialize(lora(make(), ("embed_tokens", "lm_head"), tie=False), ds_config(0, maximus=section()))
        head = got.module.get_submodule(HEAD).modules_to_save["default"]
        assert type(head) is torch.nn.Linear                                 # untied: the head copy is its own
        assert isinstance(got.module.get_submodule(EMB).modules_to_save["default"], ShardedEmbedding)
        assert train(got, data) == pytest.approx(l_ref, rel=1e-5)
        out = _reload(tmp_path, base, save_peft(got, str(tmp_path / f"adapter_{name}")), ids)
        assert not out["tied"]
        torch.testing.assert_close(out["logits"], _logits(got, ids), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out["merged"], out["logits"], rtol=1e-4, atol=1e-4)


def test_trainable_token_indices_table_is_left_alone_or_refused():
    """PEFT's trainable_token_indices trains chosen rows of a frozen table: maximus (which trains every row of a
    table it swaps) leaves it to PEFT where min_rows chose it, and refuses it by name in embedding.modules rather
    than train rows PEFT froze."""
    from peft import LoraConfig, get_peft_model

    def model():
        return get_peft_model(gemma3(), LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5]))
    engine = initialize(model(), ds_config(0, maximus=section(head=False)))
    assert not any(isinstance(m, ShardedEmbedding) for m in engine.module.modules())
    emb = [n for n, m in model().named_modules() if isinstance(m, torch.nn.Embedding) and m.num_embeddings == VOCAB][0]
    named = section(head=False)
    named["embedding"]["modules"] = [emb]
    with pytest.raises(ConfigError, match="frozen"):
        initialize(model(), ds_config(0, maximus=named))


def test_save_peft_refuses_a_model_without_adapters(tmp_path):
    with pytest.raises(ConfigError, match="peft.PeftModel"):
        save_peft(llama(), str(tmp_path / "x"))


# ---- resize_token_embeddings -------------------------------------------------------------------------------------
NEW = 6


def _pieces():
    return [[1, 2], [7], [], [3, 3, 10], [100, 200, 300], [5, 6]]


@pytest.mark.parametrize("init", ["mean_of_pieces", "mean", "normal"])
def test_resize_keeps_old_rows_and_fills_new_rows_as_documented(init):
    model = llama()
    old_e = model.model.embed_tokens.weight.detach().clone()
    old_h = model.lm_head.weight.detach().clone()
    resize_token_embeddings(model, VOCAB + NEW, pieces=_pieces() if init == "mean_of_pieces" else None, init=init)
    e, h = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    assert e.shape == h.shape == (VOCAB + NEW, 32) and model.config.vocab_size == VOCAB + NEW
    assert model.model.embed_tokens.num_embeddings == VOCAB + NEW and model.lm_head.out_features == VOCAB + NEW
    assert torch.equal(e[:VOCAB], old_e) and torch.equal(h[:VOCAB], old_h)          # bit-equal
    for old, new in ((old_e, e), (old_h, h)):
        if init == "mean_of_pieces":
            for k, p in enumerate(_pieces()):
                want = old[p].mean(0) if p else old.mean(0)
                torch.testing.assert_close(new[VOCAB + k], want, rtol=0, atol=1e-6)
        elif init == "mean":
            assert torch.allclose(new[VOCAB:], old.mean(0).expand(NEW, -1), atol=1e-6)
        else:
            g = torch.Generator().manual_seed(0)
            want = old.mean(0) + torch.randn((NEW, 32), generator=g) * old.std(0)
            torch.testing.assert_close(new[VOCAB:], want, rtol=0, atol=1e-6)
    assert model.model.embed_tokens.weight.requires_grad
    out = model(input_ids=torch.tensor([[VOCAB + NEW - 1, 3]]), labels=torch.tensor([[VOCAB + NEW - 1, 3]]))
    assert torch.isfinite(out.loss)


def test_resize_default_init_comes_from_the_config_and_needs_pieces():
    model = llama()
    with pytest.raises(ConfigError, match="needs pieces"):
        resize_token_embeddings(model, VOCAB + NEW)
    resize_token_embeddings(model, VOCAB + NEW, config={"maximus": {"embedding": {"new_row_init": "mean"}}})
    assert model.model.embed_tokens.weight.shape[0] == VOCAB + NEW
    with pytest.raises(ConfigError, match="new_row_init"):
        from ds_maximus.config import MaximusConfig
        MaximusConfig.from_dict({"embedding": {"new_row_init": "zeros"}})
    with pytest.raises(ConfigError, match="outside the old vocabulary"):
        resize_token_embeddings(llama(), VOCAB + 1, pieces=[[VOCAB]])
    with pytest.raises(ConfigError, match="grows by 6"):
        resize_token_embeddings(llama(), VOCAB + NEW, pieces=[[1]])


def test_resize_keeps_the_tie_and_peft_copies():
    model = gemma3()
    resize_token_embeddings(model, VOCAB + NEW, pieces=_pieces())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    pm = lora(gemma3(), tie=True)
    w0 = pm.get_submodule(EMB).original_module.weight.detach().clone()
    resize_token_embeddings(pm, VOCAB + NEW, pieces=_pieces())
    wrapper = pm.get_submodule(EMB)
    orig, copy = wrapper.original_module.weight, wrapper.modules_to_save["default"].weight
    assert orig.shape[0] == copy.shape[0] == VOCAB + NEW and torch.equal(orig, copy)
    assert torch.equal(orig[:VOCAB], w0) and not orig.requires_grad and copy.requires_grad
    assert pm.get_submodule(HEAD).modules_to_save["default"].weight is copy        # the tie kept
    assert pm.base_model.model.config.vocab_size == VOCAB + NEW


def test_grown_vocabulary_trains_under_maximus_and_reloads(tmp_path):
    """Tokenizer extension -> resize (mean of pieces) -> maximus PEFT training -> plain-peft reload onto the base
    resized with plain transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    text = ["the patient received acetylsalicylic acid and ibuprofen"] * 20 + ["a b c d e f g h i j k"] * 20
    tk = Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(text, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    old = PreTrainedTokenizerFast(tokenizer_object=tk)
    terms = ["acetylsalicylic", "ibuprofen"]
    pieces = pieces_of(terms, old)
    assert all(len(p) >= 1 for p in pieces)
    assert pieces_of(terms, tk) == pieces                 # a tokenizers.Tokenizer splits the same way
    new = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tk.to_str()))
    new.add_tokens(terms)
    base_v = len(old)
    base = tmp_path / "base"
    gemma3(vocab=base_v).save_pretrained(base)
    model = lora(gemma3(vocab=base_v))
    resize_token_embeddings(model, len(new), pieces=pieces)
    ids = torch.tensor([new.encode("the patient received acetylsalicylic acid and ibuprofen")] * 2)
    assert int(ids.max()) == len(new) - 1
    eng = initialize(model, ds_config(0, maximus=section(vocab=len(new), cache_rows=16)))
    losses = train(eng, [{"input_ids": ids, "labels": ids}] * 3)
    assert losses[-1] < losses[0]
    out = _reload(tmp_path, base, save_peft(eng, str(tmp_path / "adapter")), ids, vocab=len(new))
    torch.testing.assert_close(out["logits"], _logits(eng, ids), rtol=1e-4, atol=1e-4)
    assert out["tied"]


def test_domain_vocab_peft_example(tmp_path):
    """examples/domain_vocab/peft_lora.py, small: tokenizer on real text, terms added, Gemma-3 shape, LoRA, maximus
    rows, a few CPU steps, plain-peft reload to the same logits (tied) and merge_and_unload."""
    import json
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{root}:{os.environ.get('PYTHONPATH', '')}"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(sock.getsockname()[1])
    cmd = [sys.executable, os.path.join(root, "examples", "domain_vocab", "peft_lora.py"), "--out", str(tmp_path),
           "--vocab", "600", "--terms", "16", "--steps", "3", "--seqlen", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["vocab"] == s["base_vocab"] + s["terms"] and s["terms"] == 16
    assert len(s["losses"]) == 3 and all(l == l for l in s["losses"])
    assert s["tied"] and s["reload_max_abs_diff"] < 1e-4 and s["merged_max_abs_diff"] < 1e-4


def test_hf_trainer_after_enable_trains_a_peft_model(tmp_path):
    """HF Trainer with ``deepspeed=<config>`` after ``ds_maximus.enable()`` on a tied Gemma-3 PeftModel: maximus holds
    the rows, the run equals the same Trainer without maximus, and save_peft's folder reloads with plain peft."""
    from transformers import Trainer, TrainingArguments

    import ds_maximus
    from ds_maximus.engine.initialize import disable
    base = tmp_path / "base"
    gemma3().save_pretrained(base)
    data = [{"input_ids": ids[0], "labels": ids[0].clone()} for ids in zipf_ids(6, 1, 16, VOCAB)]
    runs = {}
    for name, maximus in (("plain", None), ("ours", section(cache_rows=32))):
        ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}
        if maximus:
            ds["maximus"] = maximus
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2,
                                 learning_rate=1e-2, weight_decay=0.0, save_strategy="no", report_to=[],
                                 deepspeed=ds, use_cpu=True, dataloader_num_workers=0, logging_steps=1)
        ds_maximus.enable()
        try:
            trainer = Trainer(model=lora(gemma3()), args=args, train_dataset=data)
            runs[name] = [h["loss"] for h in trainer.train() and trainer.state.log_history if "loss" in h]
            if maximus:
                assert trainer.model_wrapped.maximus.steps == 3
                emb = trainer.model.get_submodule(EMB).modules_to_save["default"]
                assert isinstance(emb, ShardedEmbedding)
                save_peft(trainer.model_wrapped, str(tmp_path / "adapter"))
                ids = zipf_ids(1, 2, 16, VOCAB, seed=5)[0]
                want = _logits(trainer.model_wrapped, ids)
        finally:
            disable()
    assert len(runs["ours"]) == 3 and runs["ours"] == pytest.approx(runs["plain"], rel=1e-4)
    out = _reload(tmp_path, base, tmp_path / "adapter", ids)
    assert out["tied"]
    torch.testing.assert_close(out["logits"], want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_save_model_of_a_tied_peft_model_on_two_ranks(tmp_path, stage):
    """``trainer.save_model()`` on two ranks: the Trainer saves on rank 0 only, so the completed ``save_pretrained``
    must not start a collective (ZeRO-3's gather) there; the folder reloads with plain ``peft``, tied, to the
    trained logits."""
    from tests.distributed.ranks import ROOT, launch
    launch(2, ROOT / "tests" / "integrations" / "peft_trainer_worker.py", tmp_path, stage, timeout=900)
    want = torch.load(tmp_path / "want.pt")
    got = _reload(tmp_path, tmp_path / "base", tmp_path / "adapter", want["ids"])
    assert got["tied"]
    torch.testing.assert_close(got["logits"].float(), want["logits"], rtol=0, atol=0)


def test_gemma3_multimodal_class_trains_like_plain_peft_and_saves(tmp_path):
    """The class the real Gemma-3-4B checkpoint loads as (``Gemma3ForConditionalGeneration``, the table at
    ``model.language_model.embed_tokens``), LoRA + the tied table trained: the losses of plain PEFT, and PEFT's own
    ``save_pretrained`` reloads (peft + transformers) to the trained logits."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from tests.conformance.families import FAMILIES
    from tests.conformance.families import VOCAB as FVOCAB
    torch.manual_seed(0)
    base = FAMILIES["gemma3_multimodal"].build()
    base.save_pretrained(tmp_path / "base")

    def peft_model():
        torch.manual_seed(5)   # the same random LoRA weights for both engines
        return lora(copy.deepcopy(base), modules_to_save=("embed_tokens", "lm_head"))
    data = _batches(4, vocab=FVOCAB - 4)   # below the image and boundary tokens
    ref = initialize(peft_model(), ds_config(0))
    got = initialize(peft_model(), ds_config(0, maximus=section(vocab=100, cache_rows=32)))
    head = got.module.get_submodule(HEAD).modules_to_save["default"]
    assert isinstance(head, ShardedLMHead) and head.tied_to
    assert train(got, data) == pytest.approx(train(ref, data), rel=1e-5)
    got.module.save_pretrained(tmp_path / "adapter")
    ids = data[0]["input_ids"]
    want = _logits(got, ids)
    reloaded = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tmp_path / "base"),
                                         tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits.float(), want, rtol=1e-5, atol=1e-5)
