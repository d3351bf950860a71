"""QLoRA-style PEFT models under ds_maximus: quantized (non-float, frozen) block weights, PEFT's
``prepare_model_for_kbit_training`` (tables and norms upcast to fp32), LoRA, and the vocabulary as maximus rows.

On the CPU: a Llama whose blocks carry frozen uint8 parameters (the storage dtype of bitsandbytes' packed 4-bit
weights) beside their own, prepared by ``prepare_model_for_kbit_training``, trains under maximus like plain PEFT
and its frozen originals go to host memory. On a GPU with bitsandbytes: real ``Linear4bit`` NF4 blocks, the same
comparison (skipped cleanly without CUDA or bitsandbytes).
"""
import importlib.util
import warnings

import pytest
import torch
from torch import nn

from ds_maximus.vocab import ShardedEmbedding, ShardedLMHead
from ds_maximus.vocab.host_table import HostTable
from tests.conformance.helpers import ds_config, zipf_ids
from tests.helpers.models import initialize, train
from tests.integrations.test_peft_vocab import EMB, HEAD, VOCAB, llama, section


def _lora(model):
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     modules_to_save=["embed_tokens", "lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, cfg)


def _packed_blocks(model):
    """Each MLP gets a frozen uint8 parameter, as bitsandbytes' Params4bit stores packed weights."""
    for layer in model.model.layers:
        layer.mlp.register_parameter("packed", nn.Parameter(torch.randint(0, 255, (64, 1), dtype=torch.uint8),
                                                            requires_grad=False))
    return model


def _prepared(seed=0):
    from peft import prepare_model_for_kbit_training
    model = _packed_blocks(llama(seed=seed).to(torch.bfloat16))
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert model.model.embed_tokens.weight.dtype == torch.float32        # upcast by PEFT
    return _lora(model)


def test_kbit_prepared_model_with_uint8_block_params_trains_like_plain_peft():
    data = [{"input_ids": ids, "labels": ids} for ids in zipf_ids(4, batch=2, seqlen=8, vocab=VOCAB)]
    ref = initialize(_prepared(), ds_config(0, clip=0.5))
    l_ref = train(ref, data)
    sec = section()
    sec["lm_head"]["placement"] = "cpu"
    got = initialize(_prepared(), ds_config(0, clip=0.5, maximus=sec))
    model = got.module
    assert isinstance(model.get_submodule(EMB).modules_to_save["default"], ShardedEmbedding)
    assert isinstance(model.get_submodule(HEAD).modules_to_save["default"], ShardedLMHead)
    assert all(isinstance(model.get_submodule(n).original_module, HostTable) for n in (EMB, HEAD))
    packed = [p for n, p in model.named_parameters() if n.endswith("mlp.packed")]
    assert len(packed) == 2 and all(p.dtype == torch.uint8 and not p.requires_grad for p in packed)
    assert train(got, data) == pytest.approx(l_ref, rel=1e-5)


def _bnb_llama(vocab, seed):
    import bitsandbytes as bnb
    model = llama(vocab=vocab, seed=seed).to(torch.bfloat16)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and ".layers." in name:
            q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4", device="cpu")
            q.weight = bnb.nn.Params4bit(mod.weight.data, requires_grad=False, quant_type="nf4")
            parent, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), attr, q)
    model.model.layers.cuda()
    model.is_loaded_in_4bit = True
    from peft import prepare_model_for_kbit_training
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    return _lora(model)


@pytest.mark.gpu
def test_bnb_4bit_blocks_train_under_maximus_like_plain_peft():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("needs bitsandbytes (pip install bitsandbytes)")
    vocab = 4096
    data = [{"input_ids": ids, "labels": ids} for ids in zipf_ids(4, batch=2, seqlen=32, vocab=vocab)]
    bf16 = {"bf16": {"enabled": True}}
    ref = initialize(_bnb_llama(vocab, 0), {**ds_config(0, clip=0.5), **bf16})
    l_ref = train(ref, data)
    sec = section(vocab=vocab, cache_rows=512)
    sec["lm_head"].update(placement="cpu", chunk_rows=1024)
    got = initialize(_bnb_llama(vocab, 0), {**ds_config(0, clip=0.5, maximus=sec), **bf16})
    assert all(isinstance(got.module.get_submodule(n).original_module, HostTable) for n in (EMB, HEAD))
    big = [t for t in got.module.parameters() if t.is_cuda and t.dim() == 2 and vocab in t.shape]
    assert big == []
    assert train(got, data) == pytest.approx(l_ref, rel=2e-2)
