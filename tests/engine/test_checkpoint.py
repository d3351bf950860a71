"""save_checkpoint at step 10 + load_checkpoint equals the uninterrupted run at step 20 (fp32, bitwise)."""
import pytest
import torch

from ds_maximus.errors import ShardStoreError
from tests.engine.llama_utils import build, embedding_weight, maximus_section
from tests.helpers.models import train, zipf_batches


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_exact(tmp_path, stage):
    batches = zipf_batches(20, batch=2, seqlen=16)
    sec = maximus_section(cache_rows=64)
    full = build(stage, "fp32", clip=0.5, maximus=sec)
    ref = train(full, batches)
    ref_w = embedding_weight(full)

    first = build(stage, "fp32", clip=0.5, maximus=sec)
    train(first, batches[:10])
    first.save_checkpoint(str(tmp_path), tag="step10")
    assert (tmp_path / "step10" / "maximus_states.pt").exists()

    resumed = build(stage, "fp32", clip=0.5, maximus=sec, seed=123)  # different init: all state must come back
    path, _ = resumed.load_checkpoint(str(tmp_path), tag="step10")
    assert path is not None
    assert resumed.maximus.steps == 10
    got = train(resumed, batches[10:])
    assert got == ref[10:]
    assert torch.equal(embedding_weight(resumed), ref_w)


def test_missing_maximus_state_is_clear(tmp_path):
    e = build(2, "fp32", maximus=maximus_section(cache_rows=64))
    train(e, zipf_batches(1, batch=2, seqlen=16))
    e.save_checkpoint(str(tmp_path), tag="t")
    (tmp_path / "t" / "maximus_states.pt").unlink()
    with pytest.raises(ShardStoreError, match="maximus_states.pt"):
        e.load_checkpoint(str(tmp_path), tag="t")
