"""Regression tests for the fidelity failures of issue 35 (dense models), each against the unswapped model.

* Gemma-3's scaled embedding lost its scale (max |logit diff| 0.21): scaled embedding subclasses are
  reproduced bit for bit in fp32 and bf16, and any other overridden forward is refused by class name;
* a tied head crashed the ordinary ``engine(input_ids, labels).loss`` call (logits under no_grad): covered
  per family by ``test_dense_families``; here the other path, a script's own loss from the logits, and a
  DeepSpeedExamples (HelloDeepSpeed) style RoBERTa MLM whose tied decoder has a bias;
* ``lm_head.enabled`` with a tied head saved ``tie_word_embeddings: false`` without ``lm_head.weight``, plus
  a ``maximus_norm_carrier`` key: the saved folder now has the plain model's keys and reloads to the logits;
* ``lm_head.enabled`` on a model whose loss the patch cannot stream is a ConfigError, not a crash;
* ``lm_head.enabled`` on Cohere (``logit_scale``) and Granite (``logits_scaling``) returned the loss times the
  model's logit scale: the model's code after the head scaled the streamed loss. The scale now goes into the
  streamed loss, and a change to the logits it does not know is refused.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_maximus.config import MaximusConfig
from ds_maximus.engine.swap import swap_embeddings
from ds_maximus.errors import ConfigError
from tests.conformance.families import FAMILIES, VOCAB
from tests.conformance.helpers import ds_config, load_in_fresh_process, maximus_section, zipf_ids
from tests.helpers.models import initialize, train

STEPS = 3


def _swap(model: nn.Module, modules):
    return swap_embeddings(model, MaximusConfig.from_dict({"embedding": {"modules": modules, "gpu_cache_rows": 8}}))


def _holder(emb: nn.Module) -> nn.Module:
    m = nn.Module()
    m.emb = emb
    return m


@pytest.mark.parametrize("cls_path", ["transformers.models.gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding",
                                      "transformers.models.gemma2.modeling_gemma2.Gemma2TextScaledWordEmbedding",
                                      "transformers.models.m2m_100.modeling_m2m_100.M2M100ScaledWordEmbedding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_embeddings_reproduced_exactly(cls_path, dtype):
    import importlib
    mod, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(mod), name)
    torch.manual_seed(0)
    ref = cls(40, 8, 0, embed_scale=8 ** 0.5 + 0.01)   # not exact in bf16: the cast order matters
    ids = torch.randint(0, 40, (3, 7))
    ours = _holder(copy.deepcopy(ref))
    _swap(ours, ["emb"])
    ref, ours = ref.to(dtype), ours.to(dtype)
    want = ref(ids)
    got = ours.emb(ids)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)
    assert "embed_scale" not in ours.state_dict() and set(ours.state_dict()) == {"emb.weight"}


class _Offset(nn.Embedding):
    def forward(self, input_ids):
        return super().forward(input_ids + 2)


def test_other_embedding_forwards_are_refused_by_name():
    with pytest.raises(ConfigError, match="_Offset"):
        _swap(_holder(_Offset(40, 8)), ["emb"])
    with pytest.raises(ConfigError, match="max_norm"):
        _swap(_holder(nn.Embedding(40, 8, max_norm=1.0)), ["emb"])


def test_gemma3_forward_equal_with_lm_head_disabled():
    """The reported case: Gemma-3, lm_head off, no soft-capping; 0.21 max |logit diff| before the fix."""
    torch.manual_seed(0)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=8, final_logit_softcapping=None))
    ids = zipf_ids(1, 2, 12, VOCAB)[0]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        _swap(model, ["model.embed_tokens"])
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _plain_and_ours(family, lm_head=None):
    """``STEPS`` batches of ``family`` and the same model (seed 0) in a plain engine and a maximus one (ZeRO-0, a
    32-row cache, the ``lm_head`` section when given)."""
    batches = [family.batch(ids) for ids in zipf_ids(STEPS, 2, 16, VOCAB)]
    torch.manual_seed(0)
    model = family.build()
    plain = initialize(copy.deepcopy(model), ds_config(0))
    ours = initialize(model, ds_config(0, maximus_section(family.modules, 32, lm_head=lm_head)))
    return batches, plain, ours


def _own_loss(engine, batch):
    """A script's own loss from the logits the model returns (no labels passed to the model)."""
    logits = engine(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1))


@pytest.mark.parametrize("name", ["llama_tied", "gemma3"])
def test_tied_head_logits_feed_a_scripts_own_loss(name):
    batches, plain, ours = _plain_and_ours(FAMILIES[name])
    ref = train(plain, batches, _own_loss)
    got = train(ours, batches, _own_loss)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-6)


class RobertaMLMModel(nn.Module):
    """DeepSpeedExamples' HelloDeepSpeed ``train_bert.py`` model: a RoBERTa encoder, an LM head whose decoder
    (with its own bias) is tied to the word embeddings by assignment, and its own masked-LM loss over the
    non-pad target positions."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.roberta.modeling_roberta import RobertaLMHead, RobertaModel
        self.config = config
        self.encoder = RobertaModel(config, add_pooling_layer=False)
        self.lm_head = RobertaLMHead(config)
        self.lm_head.decoder.weight = self.encoder.embeddings.word_embeddings.weight
        nn.init.normal_(self.lm_head.decoder.bias, std=0.02)     # a bias that matters to the loss

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        hidden, *_ = self.encoder(input_ids=src_tokens, attention_mask=attention_mask, return_dict=False)
        keep = torch.nonzero((tgt_tokens != self.config.pad_token_id).view(-1)).view(-1)
        hidden = torch.index_select(hidden.reshape(-1, hidden.shape[-1]), 0, keep)
        scores = self.lm_head(hidden)
        target = torch.index_select(tgt_tokens.view(-1), 0, keep)
        return nn.CrossEntropyLoss(ignore_index=-1)(scores.view(-1, self.config.vocab_size), target)


@pytest.mark.parametrize("stage", [0, 3])
def test_hello_deepspeed_bert_with_tied_biased_decoder(stage):
    from transformers import RobertaConfig
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=80, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=1)
    torch.manual_seed(0)
    model = RobertaMLMModel(cfg)
    twin = copy.deepcopy(model)
    batches = []
    for ids in zipf_ids(4, 2, 16, VOCAB, low=3):
        tgt = torch.full_like(ids, 1)
        tgt[:, 1::3] = ids[:, 1::3]                   # 1 (pad) except at the masked positions
        src = ids.clone()
        src[:, 1::3] = 2                              # a [MASK] id
        batches.append({"src_tokens": src, "attention_mask": torch.ones_like(ids), "tgt_tokens": tgt})
    plain = initialize(model, ds_config(stage))
    ours = initialize(twin, ds_config(stage, maximus_section(["encoder.embeddings.word_embeddings"], 24)))
    bias = ours.module.lm_head.decoder.bias
    assert isinstance(bias, nn.Parameter) and any(bias is p for p in ours.module.parameters())

    def step(engine, batch):
        return engine(**batch)

    ref = train(plain, batches, step)
    got = train(ours, batches, step)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["llama_tied", "gemma3", "gemma3_multimodal", "cohere", "granite", "bloom"])
def test_lm_head_enabled_tied_model_saves_tied(name, tmp_path):
    """``lm_head.enabled`` (the streamed loss; Gemma-3's soft-capping, Cohere's ``logit_scale`` and Granite's
    ``logits_scaling`` applied inside it: the model's own code once scaled the returned loss instead) trains like
    plain DeepSpeed, and save_pretrained writes the plain model's keys, tied, reloading to the same logits."""
    batches, plain, ours = _plain_and_ours(FAMILIES[name], {"enabled": True, "chunk_rows": 96})
    ref = train(plain, batches)
    got = train(ours, batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-6)
    assert ours.module.config.tie_word_embeddings is True
    ours.module.save_pretrained(tmp_path / "saved")
    plain.module.save_pretrained(tmp_path / "plain")
    from safetensors import safe_open
    keys = {}
    for d in ("saved", "plain"):
        with safe_open(str(tmp_path / d / "model.safetensors"), "pt") as f:
            keys[d] = set(f.keys())
    assert keys["saved"] == keys["plain"] and "lm_head.weight" not in keys["saved"]
    ids = batches[0]["input_ids"]
    with torch.no_grad():
        want = ours(input_ids=ids).logits.float().cpu()   # the fresh process loads on the CPU
    out = load_in_fresh_process(tmp_path, {"m": {"dir": str(tmp_path / "saved"), "kwargs": {"input_ids": ids}}})
    assert out["m"]["tie"] is True and not out["m"]["info"]["missing_keys"] and not out["m"]["info"]["unexpected_keys"]
    torch.testing.assert_close(out["m"]["logits"].float(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["cohere", "granite", "gemma3"])
def test_lm_head_on_the_cpu_tier_applies_the_models_logit_transforms(name):
    """``placement: cpu`` (a CPU-tier ShardedLMHead tied to the swapped table) applies the same transforms."""
    batches, plain, ours = _plain_and_ours(FAMILIES[name], {"enabled": True, "placement": "cpu", "chunk_rows": 96})
    torch.testing.assert_close(torch.tensor(train(ours, batches)), torch.tensor(train(plain, batches)),
                               rtol=1e-4, atol=1e-6)
    # the numbers the model's own statements read are back after the calls
    cfg = ours.module.config
    assert (getattr(ours.module, "logit_scale", None), getattr(cfg, "logits_scaling", None),
            getattr(cfg, "final_logit_softcapping", None)) == (getattr(plain.module, "logit_scale", None),
                                                               getattr(plain.module.config, "logits_scaling", None),
                                                               getattr(plain.module.config, "final_logit_softcapping",
                                                                       None))


class _MaskedLogitsLM(nn.Module):
    """A causal LM whose forward changes its logits in a way the streamed loss does not know."""

    def __init__(self, learned_scale: bool = False):
        super().__init__()
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(())) if learned_scale else 2.0

    def loss_function(self, logits, labels, vocab_size, **kw):
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten())

    def forward(self, hidden, labels=None):
        logits = self.lm_head(hidden)
        if isinstance(self.logit_scale, nn.Parameter):
            logits = logits * self.logit_scale
        else:
            logits = logits + self.logit_scale
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=16)
        return loss, logits


@pytest.mark.parametrize("learned", [False, True], ids=["added", "learned_scale"])
def test_lm_head_enabled_refuses_a_logit_change_it_cannot_reproduce(learned):
    from ds_maximus.integrations.hf_lm_head import check_streamable
    with pytest.raises(ConfigError, match="cannot reproduce") as err:
        check_streamable(_MaskedLogitsLM(learned))
    assert ("logits * self.logit_scale" if learned else "logits + self.logit_scale") in str(err.value)


@pytest.mark.parametrize("name", ["bert_mlm", "t5_tied", "mbart", "m2m100"])
def test_lm_head_enabled_refused_where_the_loss_is_not_streamable(name):
    torch.manual_seed(0)
    model = FAMILIES[name].build()
    with pytest.raises(ConfigError, match="lm_head"):
        initialize(model, ds_config(0, maximus_section(FAMILIES[name].modules, 32, lm_head={"enabled": True})))


@pytest.mark.parametrize("name", ["llama_tied", "t5_tied", "bert_mlm", "gemma3"])
def test_hf_tie_weights_after_the_swap_changes_nothing(name):
    """``model.tie_weights()`` (``resize_token_embeddings`` calls it) raised on a swapped table: HF looked for
    the weight Parameter the swap removed."""
    torch.manual_seed(0)
    family = FAMILIES[name]
    model = family.build().eval()
    _swap(model, family.modules)
    batch = family.batch(zipf_ids(1, 2, 12, VOCAB)[0])
    with torch.no_grad():
        want = model(**batch).logits
        model.tie_weights()
        assert torch.equal(model(**batch).logits, want)


def test_logits_to_keep_with_a_tied_swapped_head():
    torch.manual_seed(0)
    model = FAMILIES["llama_tied"].build().eval()
    ref = copy.deepcopy(model)
    _swap(model, ["model.embed_tokens"])
    ids = zipf_ids(1, 2, 12, VOCAB)[0]
    with torch.no_grad():
        for keep in (1, 3):
            want = ref(input_ids=ids, logits_to_keep=keep).logits
            got = model(input_ids=ids, logits_to_keep=keep).logits
            assert got.shape == want.shape == (2, keep, VOCAB)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _loss_from_head_weight(engine, inputs):
    """A loss computed from ``get_output_embeddings().weight`` by the caller's own code, as TRL's SFTTrainer (its
    fused LM head), Liger and Cut CE do: the backbone's hidden states times the head's weight."""
    model = engine.module
    ids = inputs["input_ids"]
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    weight = model.get_output_embeddings().weight
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    return F.cross_entropy(logits.float(), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("tie,head", [(True, None), (True, "cpu"), (False, "cpu")],
                         ids=["tied", "tied_cpu_head", "untied_cpu_head"])
def test_a_loss_from_the_heads_weight_trains_like_plain_deepspeed(tie, head):
    """TRL's SFTTrainer read ``lm_head.weight`` of a swapped head and got an AttributeError (a tied head, and a
    CPU-placed one, own no Parameter). ``weight`` is now the whole table, differentiable into the rows."""
    lm = None if head is None else {"enabled": True, "placement": head, "chunk_rows": 96}
    batches, plain, ours = _plain_and_ours(FAMILIES["llama_tied" if tie else "llama"], lm)
    ref = train(plain, batches, _loss_from_head_weight)
    got = train(ours, batches, _loss_from_head_weight)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    from ds_maximus.vocab import ShardedLMHead
    assert isinstance(ours.module.get_output_embeddings(), ShardedLMHead)
    with torch.no_grad():   # outside grad mode: the same table, no graph
        w = ours.module.get_output_embeddings().weight
        assert not w.requires_grad and w.shape == (VOCAB, 32)
    # it says it is gathered: TRL's ZeRO-3 gather helper reads ds_status before it reads the weight
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    assert w.ds_status == ZeroParamStatus.AVAILABLE


def test_transformers_resize_after_initialize_is_a_clear_error():
    """``model.resize_token_embeddings`` once maximus holds the table failed inside transformers ('ShardedEmbedding'
    object has no attribute 'weight'); it is a ConfigError saying to grow the vocabulary before initialize."""
    torch.manual_seed(0)
    family = FAMILIES["llama_tied"]
    engine = initialize(family.build(), ds_config(0, maximus_section(family.modules, 32)))
    with pytest.raises(ConfigError, match="before initialize.*ds_maximus.resize_token_embeddings"):
        engine.module.resize_token_embeddings(VOCAB + 8)
    assert engine.module.get_input_embeddings().num_embeddings == VOCAB


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_hooks_registered_on_the_embedding_before_initialize_still_run(name):
    """A forward hook on the input embedding registered before ``initialize`` (HF Trainer's NEFTune noise is one: it
    is registered in ``train()`` before DeepSpeed is set up, and was silently dropped by the swap) runs on the swapped
    table, after the embedding scale; the attribute it reads comes along; its handle removes it."""
    family = FAMILIES[name]
    batches = [family.batch(ids) for ids in zipf_ids(STEPS, 2, 16, VOCAB)]

    def noise(module, args, output):   # NEFTune's shape: reads an attribute of its module, changes the output
        return output + module.noise_alpha * torch.sin(output * 7.0)

    def engine(section):
        torch.manual_seed(0)
        model = family.build()
        emb = model.get_input_embeddings()
        emb.noise_alpha = 0.3
        handle = emb.register_forward_hook(noise)
        cfg = ds_config(0, maximus_section(family.modules, 32)) if section else ds_config(0)
        return initialize(model, cfg), handle

    (plain, _), (ours, handle) = engine(False), engine(True)
    assert type(ours.module.get_input_embeddings()).__name__ == "ShardedEmbedding"
    torch.testing.assert_close(torch.tensor(train(ours, batches)), torch.tensor(train(plain, batches)),
                               rtol=1e-4, atol=1e-6)
    handle.remove()
    emb = ours.module.get_input_embeddings()
    assert noise not in emb._forward_hooks.values() and len(emb._forward_hooks) == (name == "gemma3")  # scale stays
