"""A PEFT LoRA model whose embedding and head are in ``modules_to_save``, under ``ds_maximus.initialize``.

PEFT wraps ``embed_tokens`` and ``lm_head`` in a ``ModulesToSaveWrapper`` holding the frozen
``original_module`` and the trained copy ``modules_to_save["default"]`` that its forward calls. maximus
swaps the trained embedding copy's rows into a ShardedEmbedding and leaves the frozen original alone;
with an ``lm_head`` section the loss is streamed through the trained head copy (``placement: gpu``) or
that copy becomes a CPU-tier ShardedLMHead (``placement: cpu``). LoRA weights train as ordinary
parameters. The run equals plain ``deepspeed.initialize`` (losses rtol 1e-4, weights under tests/engine's
fp32 policy) with a row cache smaller than the rows a run touches, ZeRO-0 and ZeRO-3.

What maximus cannot do with PEFT is refused: naming the frozen original, and swapping a frozen table or
head (PEFT without ``modules_to_save``: maximus would train rows PEFT froze).

A tied model kept tied (``ensure_weight_tying``), the saved adapter folder reloaded with plain peft, HF Trainer and
vocabulary growth: tests/integrations/test_peft_vocab.py.
"""
import pytest
import torch

from ds_maximus.errors import ConfigError
from ds_maximus.vocab import ShardedEmbedding, ShardedLMHead
from ds_maximus.vocab.host_table import HostTable
from tests.conformance.helpers import ds_config, zipf_ids
from tests.helpers.models import assert_weights_close, initialize, train

VOCAB = 384
EMB = "base_model.model.model.embed_tokens"
HEAD = "base_model.model.lm_head"


def lora_llama(modules_to_save=("embed_tokens", "lm_head"), seed: int = 0, vocab: int = VOCAB):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      modules_to_save=list(modules_to_save) or None, init_lora_weights=False)  # B != 0: LoRA counts
    return get_peft_model(model, lora)


def section(head=None, **emb):
    sec = {"embedding": {"min_rows": VOCAB, "gpu_cache_rows": 48, "optimizer": {"mode": "exact"}, **emb},
           "logging": {"interval_steps": 1000}}
    if head is not None:
        sec["lm_head"] = {"enabled": True, "placement": head, "chunk_rows": 128}
    return sec


def _batches(n=10):
    return [{"input_ids": ids, "labels": ids} for ids in zipf_ids(n, batch=2, seqlen=8, vocab=VOCAB)]


def _weights(engine) -> dict:
    """Every trained weight (fp32 CPU) by name, the sharded table's rows included, plus the frozen original."""
    import deepspeed
    out = {}
    for name, mod in engine.module.named_modules():
        if isinstance(mod, (ShardedEmbedding, ShardedLMHead)):
            out[name + ".weight"] = mod.full_weight().float().cpu()
        if isinstance(mod, HostTable):  # a frozen original kept in host memory: no parameter, its state dict
            out.update({f"{name}.{k}": v.float().cpu().clone() for k, v in mod.state_dict().items()})
    for n, p in engine.module.named_parameters():
        if "maximus_norm_carrier" in n or not (p.requires_grad or "original_module" in n):
            continue
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out[n] = p.detach().float().cpu().clone()
    return out


@pytest.mark.parametrize("stage,head", [(0, None), (3, None), (0, "gpu"), (0, "cpu"), (3, "cpu")])
def test_lora_with_modules_to_save_equals_deepspeed(stage, head):
    data = _batches()
    init = lora_llama().state_dict()
    ref = initialize(lora_llama(), ds_config(stage, clip=0.5))
    l_ref = train(ref, data)
    got = initialize(lora_llama(), ds_config(stage, clip=0.5, maximus=section(head)))
    wrapper = got.module.get_submodule(EMB)
    assert type(wrapper).__name__ == "ModulesToSaveWrapper"
    assert isinstance(wrapper.modules_to_save["default"], ShardedEmbedding)  # the trained copy is the partition
    assert isinstance(wrapper.original_module, HostTable)          # the frozen original waits in host memory
    assert type(wrapper.original_module.host) is torch.nn.Embedding
    head_copy = got.module.get_submodule(HEAD).modules_to_save["default"]
    assert isinstance(head_copy, ShardedLMHead) == (head == "cpu")
    head_original = got.module.get_submodule(HEAD).original_module
    assert type(getattr(head_original, "host", head_original)) is torch.nn.Linear
    no_logits = []

    def loss_of(engine, batch):
        out = engine(**batch)
        no_logits.append(out.logits is None)
        return out.loss
    l_got = train(got, data, loss_of)
    assert all(no_logits) == (head is not None)  # with an lm_head section the loss is streamed: no logits
    assert l_got == pytest.approx(l_ref, rel=1e-4)
    wr, wg = _weights(ref), _weights(got)
    copy_key = EMB + ".modules_to_save.default.weight"
    assert set(wr) == set(wg) and copy_key in wr
    assert any("lora_B" in n for n in wr) and any("lm_head.modules_to_save" in n for n in wr)
    for n in wr:
        assert_weights_close(wg[n], wr[n])
    assert not torch.equal(wr[copy_key], init[copy_key]), "the embedding copy did not train"
    assert torch.equal(wg[EMB + ".original_module.weight"], init[EMB + ".original_module.weight"])
    st = wrapper.modules_to_save["default"].stats()
    assert st["rows_evicted"] > 0, st


def test_naming_the_frozen_original_is_refused():
    cfg = ds_config(0, maximus=section(modules=[EMB + ".original_module"]))
    with pytest.raises(ConfigError, match=r"ModulesToSaveWrapper.*modules_to_save\.default"):
        initialize(lora_llama(), cfg)


def test_frozen_table_named_is_refused_and_chosen_by_min_rows_is_left_alone(capfd):
    """LoRA without modules_to_save: PEFT froze the embedding, and maximus trains every row of a table it swaps. Named
    in embedding.modules it is refused; chosen by min_rows (a section for the streamed head, say) it stays the
    model's, a wiring line says why, and the run is plain DeepSpeed's (head streamed)."""
    named = section(modules=["base_model.model.model.embed_tokens"])
    with pytest.raises(ConfigError, match=r"embed_tokens is frozen.*modules_to_save"):
        initialize(lora_llama(modules_to_save=()), ds_config(0, maximus=named))
    data = _batches(4)
    l_ref = train(initialize(lora_llama(modules_to_save=()), ds_config(0)), data)
    got = initialize(lora_llama(modules_to_save=()), ds_config(0, maximus=section("gpu")))
    assert type(got.module.get_submodule("base_model.model.model.embed_tokens")) is torch.nn.Embedding
    assert "embed_tokens" in capfd.readouterr().out.split("left alone:")[1].split("frozen")[0]
    assert train(got, data) == pytest.approx(l_ref, rel=1e-6)


def test_frozen_head_on_the_cpu_tier_is_refused():
    """The head outside modules_to_save is frozen: a CPU-tier head would train its rows (placement gpu only
    streams the loss, see above)."""
    cfg = ds_config(0, maximus=section("cpu"))
    with pytest.raises(ConfigError, match=r"LM head \(Linear\) is frozen.*placement 'gpu'"):
        initialize(lora_llama(modules_to_save=("embed_tokens",)), cfg)


def test_wiring_report_names_the_frozen_original():
    """The one-line-per-table report says why PEFT's frozen original stays an nn.Embedding (not min_rows)."""
    from ds_maximus.config import MaximusConfig
    from ds_maximus.engine.swap import select_embeddings, swap_embeddings
    from ds_maximus.engine.wiring_report import left_alone_lines
    model = lora_llama(vocab=8192)  # a table the report lists (LARGE_ROWS)
    cfg = MaximusConfig.from_dict(section(min_rows=8192))
    assert select_embeddings(model, cfg) == [EMB + ".modules_to_save.default"]
    swap_embeddings(model, cfg)
    lines = left_alone_lines(model, cfg)
    assert len(lines) == 1 and f"{EMB}.original_module (8192 rows x 32)" in lines[0], lines
    assert "frozen original beside the trained copy" in lines[0], lines
