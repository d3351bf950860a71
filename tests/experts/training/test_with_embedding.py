"""Both kinds of partitions in one model: a sharded embedding (vocab rows) and experts trained as partitions,
under one engine (one norm carrier for both, one clipping coefficient) equal plain DeepSpeed (fp32, exact)."""
import pytest

from tests.experts.training.moe_utils import (
    assert_experts_close,
    batches,
    build,
    dense_params,
    moe_section,
    tiny_mixtral,
)
from tests.helpers.models import assert_weights_close, train


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_embedding_and_experts_equal_deepspeed(stage):
    data = batches(12, batch=2, seqlen=8)
    ref = build(tiny_mixtral(num_experts=8), stage, clip=0.5)
    l_ref = train(ref, data)
    sec = moe_section(slots=3)
    sec["embedding"] = {"modules": ["model.embed_tokens"], "gpu_cache_rows": 24, "optimizer": {"mode": "exact"}}
    got = build(tiny_mixtral(num_experts=8), stage, maximus=sec, clip=0.5)
    l_got = train(got, data)
    assert set(got.maximus.modules) >= {"model.embed_tokens", "moe"}
    assert l_got == pytest.approx(l_ref, rel=1e-5)
    assert_experts_close(got, ref)
    dr, dg = dense_params(ref), dense_params(got)  # (gathered under ZeRO-3)
    assert_weights_close(got.module.model.embed_tokens.full_weight(), dr["model.embed_tokens.weight"])
    for n in dr:
        if "embed_tokens" not in n:
            assert_weights_close(dg[n], dr[n])
