"""Export builds its skeleton model on the meta device even while a ZeRO-3 HfDeepSpeedConfig is alive in the
process (an earlier Trainer's): HF's ZeRO-3 initialisation would fail on meta tensors."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

from ds_maximus.integrations.export import _meta_model


def test_meta_model_with_a_live_zero3_config():
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    live = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    try:
        assert is_deepspeed_zero3_enabled()
        model = _meta_model(LlamaForCausalLM, cfg)
        assert all(p.device.type == "meta" for p in model.parameters())
        assert is_deepspeed_zero3_enabled(), "the live config is restored"
    finally:
        del live
        unset_hf_deepspeed_config()
    assert isinstance(model, LlamaForCausalLM) and torch.device("meta") == model.lm_head.weight.device
