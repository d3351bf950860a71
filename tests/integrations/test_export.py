"""export_hf / maximus-export / maximize(inference=True).

A tiny Llama trains a few steps through ``ds_maximus.initialize`` (CPU DeepSpeed, ZeRO-2 and ZeRO-3)
on ids from a frequency-ordered token map. Its export (from the live engine and, through the CLI,
from the DeepSpeed checkpoint folder) is loaded by a python process in which ds_maximus cannot be
imported, and must give the maximus model's logits and greedy tokens; ``--original-order`` output
must give the same in the base tokenizer's ids.
"""
import os

import pytest
import torch

from tests.helpers.fresh_process import load_in_fresh_process
from tests.helpers.models import LLAMA_VOCAB as VOCAB
from tests.helpers.models import ds_config, tiny_llama

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be "
         "maximus shard vocabulary row cache tier pinned memory expert token embedding head stream").split()
TEXT = "the maximus cache streams vocabulary rows from the pinned memory tier"
NEW_TOKENS = 8

# ---- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_map(tmp_path_factory):
    """A byte-level BPE tokenizer (~300 ids) and its frequency-ordered token map (a real permutation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ds_maximus.tokenmap.token_map import TokenMap
    root = tmp_path_factory.mktemp("tok")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (12,), generator=g)) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    base = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    base.save_pretrained(root / "base")
    tm = TokenMap.build(str(root / "base"), texts=texts, progress=False).save(str(root / "tokenmap"))
    assert not torch.equal(tm.new_to_old, torch.arange(tm.vocab_size))
    return tm, str(root / "base"), texts


def _train(stage: int, tm, texts, tmp_path, steps: int = 3, head: bool = False):
    """``head``: the LM head in the CPU tier too (its rows then live in maximus_states.pt)."""
    import ds_maximus
    model = tiny_llama(0)
    maximus = {"embedding": {"modules": ["model.embed_tokens"], "gpu_cache_rows": 64,
                             "token_map_dir": tm.path},
               "lm_head": {"enabled": head, "placement": "cpu", "chunk_rows": 128}}
    cfg = ds_config(stage, micro=2, maximus=maximus, scheduler=False)
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.tensor(tm.encode_ids(texts)[: steps * 2 * 16]).view(steps, 2, 16)
    for b in ids:
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
    assert engine.maximus.steps == steps
    assert ("lm_head" in engine.maximus.modules) == head
    return engine


def _reference(engine, tm):
    """Logits and greedy tokens of the maximus model itself (new ids)."""
    prompt = torch.tensor([tm.encode(TEXT)[:10]])
    ids = torch.tensor([tm.encode(TEXT)])
    m = engine.module.eval()
    with torch.no_grad():
        logits = m(input_ids=ids).logits.float()
        tokens = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                            do_sample=False)
    m.train()
    return {"ids": ids, "prompt": prompt, "logits": logits, "tokens": tokens}


def _job(out_dir, ref, tm, original_order=False):
    ids, prompt = ref["ids"], ref["prompt"]
    if original_order:
        ids, prompt = tm.to_old(ids), tm.to_old(prompt)
    return {"dir": str(out_dir), "kwargs": {"input_ids": ids}, "prompt": prompt, "new": NEW_TOKENS, "text": TEXT}


def _check_new_order(got, ref, tm):
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["tokens"], ref["tokens"])
    assert got["encoded"] == tm.encode(TEXT)
    assert not any("maximus" in k for k in got["keys"])


def _check_original_order(got, ref, tm, base_dir):
    from transformers import AutoTokenizer
    V = tm.vocab_size
    o2n = tm.old_to_new
    # the base model sees base ids; its row o is the maximus model's row old_to_new[o]
    torch.testing.assert_close(got["logits"][..., :V], ref["logits"][..., o2n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["logits"][..., V:], ref["logits"][..., V:], rtol=1e-5, atol=1e-5)
    n2o = torch.cat([tm.new_to_old, torch.arange(V, VOCAB)])
    assert torch.equal(got["tokens"], n2o[ref["tokens"]])
    base = AutoTokenizer.from_pretrained(base_dir)
    assert got["encoded"] == base(TEXT, add_special_tokens=False)["input_ids"]


# ---- tests --------------------------------------------------------------------------------------------
def test_export_zero2_engine_and_checkpoint(token_map, tmp_path):
    """Live export (new and original order) and the CLI from the ZeRO-2 checkpoint folder; the LM head
    is in the CPU tier as well (no Parameter: its rows come from the tier / maximus_states.pt)."""
    from ds_maximus import export_hf
    from ds_maximus.integrations.export_cli import main
    tm, base_dir, texts = token_map
    engine = _train(2, tm, texts, tmp_path, head=True)
    ref = _reference(engine, tm)
    live = export_hf(engine, str(tmp_path / "live"))  # the token map comes from the maximus config
    live_orig = export_hf(engine, str(tmp_path / "live_orig"), original_order=True, token_map=tm.path)
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt), tag="step3")
    engine.module.config.save_pretrained(str(ckpt))  # config.json beside the checkpoint
    assert main([str(ckpt), str(tmp_path / "cli"), "--token-map", tm.path]) == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "cli", "live", "live_orig"]  # no temp folders left
    got = load_in_fresh_process(tmp_path, {"live": _job(live, ref, tm), "cli": _job(tmp_path / "cli", ref, tm),
                                             "live_orig": _job(live_orig, ref, tm, original_order=True)})
    _check_new_order(got["live"], ref, tm)
    _check_new_order(got["cli"], ref, tm)
    _check_original_order(got["live_orig"], ref, tm, base_dir)
    assert got["cli"]["dtype"] == "torch.float32"


def test_export_zero3_checkpoint_original_order(token_map, tmp_path):
    """ZeRO-3: partitioned dense params gathered (live) and read by zero_to_fp32 (CLI, --original-order)."""
    from ds_maximus import export_hf
    from ds_maximus.integrations.export_cli import main
    tm, base_dir, texts = token_map
    engine = _train(3, tm, texts, tmp_path)
    ref = _reference(engine, tm)
    live = export_hf(engine, str(tmp_path / "live"))
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt))  # tag from the engine, found through 'latest'
    engine.module.config.save_pretrained(str(tmp_path / "model_config"))
    assert main([str(ckpt), str(tmp_path / "cli_orig"), "--model-config", str(tmp_path / "model_config"),
                 "--token-map", tm.path, "--original-order"]) == 0
    got = load_in_fresh_process(tmp_path, {"live": _job(live, ref, tm),
                                             "cli_orig": _job(tmp_path / "cli_orig", ref, tm, original_order=True)})
    _check_new_order(got["live"], ref, tm)
    _check_original_order(got["cli_orig"], ref, tm, base_dir)


@pytest.mark.parametrize("tie", [False, True])
def test_maximized_inference_generates_like_plain(tie, tmp_path):
    """Row cache smaller than the vocabulary, head in the CPU tier (or tied): same tokens, last position only.
    Exported again, the model is the plain one (a tied head is tied again in the HF config)."""
    import copy

    from ds_maximus.integrations.hf import maximize
    from ds_maximus.vocab import ShardedEmbedding, ShardedLMHead
    plain = tiny_llama(0, tie=tie).eval()
    ours = maximize(copy.deepcopy(plain), {"maximus": {
        "embedding": {"modules": ["model.embed_tokens"], "gpu_cache_rows": 48},
        "lm_head": {"enabled": True, "placement": "cpu", "chunk_rows": 100}}}, inference=True)
    assert isinstance(ours.model.embed_tokens, ShardedEmbedding) and ours.model.embed_tokens.cache.num_slots == 48
    assert isinstance(ours.lm_head, ShardedLMHead) and ours.lm_head.placement == ("tied" if tie else "cpu")
    seen = []
    ours.lm_head.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 20), generator=g)
    assert torch.unique(ids).numel() > 48  # the prompt has more distinct ids than the cache has rows
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a = plain.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        b = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(ours(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(a, b)
    assert seen[:12] == [1] * 12  # generate() asked the head for the last position only
    from transformers import AutoModelForCausalLM

    from ds_maximus import export_hf
    back = AutoModelForCausalLM.from_pretrained(export_hf(ours, str(tmp_path / "hf"))).eval()
    assert back.config.tie_word_embeddings == tie
    sd, ref = back.state_dict(), plain.state_dict()
    assert sorted(sd) == sorted(ref)
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k


def test_export_is_atomic_and_replaces(tmp_path):
    from ds_maximus import export_hf
    from ds_maximus.errors import TokenMapError
    model = tiny_llama(1)
    with pytest.raises(TokenMapError, match="token map"):
        export_hf(model, str(tmp_path / "out"), original_order=True)
    assert os.listdir(tmp_path) == []
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.bin").write_bytes(b"x")
    export_hf(model, str(tmp_path / "out"))
    assert "stale.bin" not in os.listdir(tmp_path / "out") and os.listdir(tmp_path) == ["out"]
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    torch.testing.assert_close(sd["model.embed_tokens.weight"], model.model.embed_tokens.weight.detach())


def test_cli_errors_name_the_fix(tmp_path, capsys):
    from ds_maximus.integrations.export_cli import main
    (tmp_path / "ckpt" / "t").mkdir(parents=True)
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "--tag" in capsys.readouterr().err
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--tag", "t"]) == 2
    assert "--model-config" in capsys.readouterr().err
    tiny_llama(0).config.save_pretrained(str(tmp_path / "ckpt"))
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--tag", "t"]) == 2
    assert "model_states" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("tie", [False, True])
def test_maximized_inference_on_gpu(tie):
    """The same on CUDA: rows cached on the GPU, head rows streamed from pinned CPU memory."""
    import copy

    from ds_maximus.integrations.hf import maximize
    plain = tiny_llama(0, tie=tie).eval()
    ours = maximize(copy.deepcopy(plain), {"maximus": {
        "embedding": {"modules": ["model.embed_tokens"], "gpu_cache_rows": 48},
        "lm_head": {"enabled": True, "placement": "cpu", "chunk_rows": 100}}}, inference=True).cuda()
    plain = plain.cuda()
    assert ours.model.embed_tokens.compute_device.type == "cuda"
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a = plain.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        b = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(ours(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(a, b)
