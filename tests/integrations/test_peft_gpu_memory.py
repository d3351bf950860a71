"""GPU memory of a PEFT step with a tied table in maximus (``-m gpu``; skipped without CUDA).

A tied head's gradient reaches every row, so one fp32 ``[V, d]`` gradient exists from the loss's backward to
``engine.step()``. Nothing else of that size may: the frozen original is in host memory, the gradient chunks are
joined once (not re-concatenated chunk by chunk), and the rows outside the GPU cache are stepped a cache's worth
at a time (not the whole vocabulary's weights and moments at once). The step's peak above the memory held before
it stays under 3 fp32 tables (the gradient, its one joined copy, the rest small).
"""
import pytest
import torch

from tests.conformance.helpers import ds_config, zipf_ids
from tests.helpers.models import initialize
from tests.integrations.test_peft_vocab import EMB, lora, section


def _gemma3(vocab, hidden, seed=0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
        sliding_window=64, final_logit_softcapping=30.0, tie_word_embeddings=True, attn_implementation="eager"))


@pytest.mark.gpu
def test_tied_peft_step_holds_one_vocab_sized_gradient():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab, hidden = 65536, 256
    table = vocab * hidden * 4
    sec = section(vocab=vocab, cache_rows=1024)
    sec["lm_head"]["chunk_rows"] = 8192
    engine = initialize(lora(_gemma3(vocab, hidden)), ds_config(0, maximus=sec))
    model = engine.module
    assert model.get_submodule(EMB).original_module.weight.device.type == "cpu"
    for i, ids in enumerate(zipf_ids(3, batch=2, seqlen=64, vocab=vocab)):
        ids = ids.cuda()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert torch.isfinite(loss)
        if i:   # the first step also builds DeepSpeed's and the cache's lazily made buffers
            assert extra < 3 * table, f"step {i}: {extra / 2**20:.0f} MiB above the resting memory, " \
                                      f"one fp32 table is {table / 2**20:.0f} MiB"
