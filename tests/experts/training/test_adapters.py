"""The HF adapters (Qwen2-MoE with its shared expert, Qwen3-MoE) train like dense torch AdamW, without an engine."""
import copy

import pytest
import torch

from ds_maximus.config import MaximusConfig
from ds_maximus.experts.training import attach_expert_training
from tests.experts.tiny_moe import tiny_model
from tests.experts.training.moe_utils import moe_section
from tests.helpers.models import assert_weights_close


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_trains_like_dense_adamw(kind):
    dense = tiny_model(kind, experts_impl="grouped_mm", num_experts=8).train()
    ours = copy.deepcopy(dense)
    t = attach_expert_training(ours, MaximusConfig.from_dict(moe_section(slots=2)))
    opt_d = torch.optim.AdamW(dense.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 128, (1, 4), generator=g)
        ld, lo = dense(input_ids=ids, labels=ids).loss, ours(input_ids=ids, labels=ids).loss
        assert float(lo.detach()) == pytest.approx(float(ld.detach()), rel=1e-5)
        ld.backward()
        lo.backward()
        opt_d.step(), opt_o.step(), t.sparse_step(lr=1e-2, weight_decay=0.1)
        opt_d.zero_grad(), opt_o.zero_grad()
    assert t.counters.caught_up > 0
    for gi, layer in enumerate(dense.model.layers):
        got = t.expert_tensors(gi)
        for n in ("gate_up_proj", "down_proj"):
            assert_weights_close(got[n], getattr(layer.mlp.experts, n).detach())
