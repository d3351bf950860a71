"""HF gradient checkpointing with experts trained as partitions: the recomputed forward routes through the
expert cache again (a second forward per layer in backward) and still equals plain DeepSpeed with
checkpointing (fp32, exact mode, ZeRO-2, a cache smaller than one layer's experts)."""
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


def _checkpointed(**kw):
    model = tiny_mixtral(num_experts=8, **kw)
    model.gradient_checkpointing_enable()
    model.train()
    return model


def test_gradient_checkpointing_equals_deepspeed():
    data = batches(8, batch=2, seqlen=4)
    ref = build(_checkpointed(), 2, clip=0.5)
    l_ref = train(ref, data)
    got = build(_checkpointed(), 2, maximus=moe_section(slots=3), clip=0.5)
    l_got = train(got, data)
    assert l_got == pytest.approx(l_ref, rel=1e-5)
    assert_experts_close(got, ref)
    dr, dg = dense_params(ref), dense_params(got)
    for n in dr:
        assert_weights_close(dg[n], dr[n])
    assert got.maximus.modules["moe"].stats()["evictions"] > 0
