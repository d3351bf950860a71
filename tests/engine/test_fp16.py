"""fp16 loss scaling: sparse grads are unscaled with the dense ones, and an overflow skips both sides."""
import pytest
import torch

from tests.engine.llama_utils import build, embedding_weight, maximus_section
from tests.helpers.models import zipf_batches


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_skips_step_on_both_sides(stage):
    batches = zipf_batches(4, batch=2, seqlen=16)
    e = build(stage, "fp16", clip=1.0, maximus=maximus_section(cache_rows=128), lr=1e-3)
    for ids in batches[:2]:
        ids = ids.to(e.device)
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()
    assert e.skipped_steps == 0 and e.maximus.steps == 2
    before = embedding_weight(e)
    ids = batches[2].to(e.device)
    loss = e(input_ids=ids, labels=ids).loss
    e.backward(loss * 1e30)  # inf in fp16: every gradient overflows
    e.step()
    assert e.skipped_steps == 1, "DeepSpeed did not skip the overflowing step"
    assert e.maximus.skipped_steps == 1 and e.maximus.steps == 2, "the sparse side did not skip"
    assert torch.equal(embedding_weight(e), before)
    ids = batches[3].to(e.device)
    e.backward(e(input_ids=ids, labels=ids).loss)
    e.step()
    assert e.maximus.steps == 3 and not torch.equal(embedding_weight(e), before)
