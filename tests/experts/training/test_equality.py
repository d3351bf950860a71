"""20 steps of a tiny Mixtral / DeepSpeed-MoE model with an expert cache smaller than one layer's experts
equal plain DeepSpeed training (fp32, exact mode) under ZeRO stages 0-3 (tests/engine's tolerance policy)."""
import pytest
import torch

from tests.experts.training.moe_utils import (
    assert_experts_close,
    batches,
    build,
    dense_params,
    ds_moe_experts,
    mixtral_experts,
    moe_section,
    tiny_ds_moe,
    tiny_mixtral,
)
from tests.helpers.models import assert_weights_close, train


def _compare(ref, got, l_ref, l_got, experts_fn):
    assert l_got == pytest.approx(l_ref, rel=1e-5)
    assert_experts_close(got, ref, experts_fn)
    dr, dg = dense_params(ref), dense_params(got)
    assert set(dr) == set(dg)
    for n in dr:
        assert_weights_close(dg[n], dr[n])


@pytest.mark.parametrize("stage,gas", [(0, 1), (1, 1), (2, 2), (3, 1)])
def test_mixtral_equals_deepspeed(stage, gas):
    data = batches(20 * gas, batch=2, seqlen=4)
    ref = build(tiny_mixtral(num_experts=8), stage, gas=gas, clip=0.5)
    l_ref = train(ref, data)
    got = build(tiny_mixtral(num_experts=8), stage, maximus=moe_section(slots=3), gas=gas, clip=0.5)
    l_got = train(got, data)
    _compare(ref, got, l_ref, l_got, mixtral_experts)
    t = got.maximus.modules["moe"]
    assert got.maximus.steps == 20
    assert t.counters.caught_up > 0, "no expert skipped a step: the test does not exercise exact catch-up"
    assert t.stats()["evictions"] > 0


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_moe_equals_deepspeed(stage):
    """DeepSpeed refuses native MoE under ZeRO-3, so the reference is plain ZeRO-2 (the same fp32 math)."""
    data = batches(20, batch=2, seqlen=4)
    ref = build(tiny_ds_moe(num_experts=8, k=1), 2, clip=0.5)
    l_ref = train(ref, data)
    got = build(tiny_ds_moe(num_experts=8, k=1), stage, maximus=moe_section(slots=2), clip=0.5)
    l_got = train(got, data)
    _compare(ref, got, l_ref, l_got, ds_moe_experts)
    assert got.maximus.modules["moe"].counters.caught_up > 0


def test_resume_is_exact(tmp_path):
    data = batches(20, batch=2, seqlen=4)
    sec = moe_section(slots=3)
    full = build(tiny_mixtral(num_experts=8), 2, maximus=sec, clip=0.5)
    ref = train(full, data)
    first = build(tiny_mixtral(num_experts=8), 2, maximus=sec, clip=0.5)
    train(first, data[:10])
    first.save_checkpoint(str(tmp_path), tag="step10")
    resumed = build(tiny_mixtral(num_experts=8, seed=7), 2, maximus=sec, clip=0.5)  # other init: all comes back
    path, _ = resumed.load_checkpoint(str(tmp_path), tag="step10")
    assert path is not None and resumed.maximus.steps == 10
    assert train(resumed, data[10:]) == ref[10:]
    er, eg = mixtral_experts(full), mixtral_experts(resumed)
    for g in er:
        for n in er[g]:
            assert torch.equal(eg[g][n], er[g][n])


def test_bf16_follows_deepspeed():
    """bf16: compute copies in bf16 in the cache, fp32 masters + moments in the tier (a short smoke check)."""
    data = batches(4, batch=2, seqlen=4)
    ref = build(tiny_mixtral(num_experts=8), 2, dtype="bf16")
    got = build(tiny_mixtral(num_experts=8), 2, dtype="bf16", maximus=moe_section(slots=3))
    t = got.maximus.modules["moe"]
    assert t.cache.slot_buffer(0).dtype == torch.bfloat16 and t.store.master_row(0).dtype == torch.float32
    assert train(got, data) == pytest.approx(train(ref, data), rel=2e-2)


@pytest.mark.parametrize("device", ["cpu", "split"])
def test_bf16_cpu_step_writes_the_shadow_in_its_pass(device):
    """bf16, clipped, experts stepped on the CPU tier (all, or a share beside the staged step): the op scales
    the gradient by the clip factor and writes the bf16 compute copy in its one pass; the shadow and every
    resident cache slot then hold exactly the fp32 master cast to bf16 (no stale copy)."""
    data = batches(6, batch=2, seqlen=8)
    got = build(tiny_mixtral(num_experts=8), 2, dtype="bf16", clip=0.05,
                maximus=moe_section(slots=2, optimizer_device=device, cpu_step_share=0.5, step_chunk_bytes=1 << 16))
    train(got, data)
    t = got.maximus.modules["moe"]
    t.finish_step()  # a split step runs on into the next forward: let it end before reading the tier
    w = t.store.tables["weight"]
    assert t.row_optimizer.step == 6 and torch.equal(t.store.shadow, w.to(torch.bfloat16))
    for g in range(t.num_layers):
        for e, s in enumerate(t.cache.groups[g].map.id_to_slot.tolist()):
            if s >= 0:
                assert torch.equal(t.cache.slot_buffer(g)[s], t.store.shadow[g * t.num_experts + e])


@pytest.mark.parametrize("share", [0.5, None])
def test_split_step_equals_deepspeed(share):
    """optimizer_device split: a worker thread steps a share of the experts in place on the CPU tier while
    the rest are staged through the compute device in pieces; together they equal plain DeepSpeed."""
    data = batches(12, batch=2, seqlen=4)
    ref = build(tiny_mixtral(num_experts=8), 2, clip=0.5)
    l_ref = train(ref, data)
    sec = moe_section(slots=3, optimizer_device="split", cpu_step_share=share, step_chunk_bytes=1 << 16)
    got = build(tiny_mixtral(num_experts=8), 2, maximus=sec, clip=0.5)
    l_got = train(got, data)
    _compare(ref, got, l_ref, l_got, mixtral_experts)
    t = got.maximus.modules["moe"]
    assert t.counters.cpu_step_share is not None and t.counters.caught_up > 0
    if share is None:
        assert 0.05 <= t.cpu_step_share <= 0.95
    assert "CPU share" in t.counters.line() and "last split step: CPU" in t.counters.line()
    sides = t.stats()["last_step"]["split_sides"]  # the last finished step: every expert on one side or the other
    assert sides["cpu_experts"] + sides["device_experts"] == t.counters.last.experts_stepped > 0
    assert sides["cpu_ms"] >= 0 and sides["device_ms"] >= 0
    parts = t.stats()["last_step"]["step_parts_ms"]  # the step's host time in its three parts
    assert list(parts) == ["finish", "sync", "issue"] and min(parts.values()) >= 0
    assert sum(parts.values()) <= t.counters.last.step_ms + 1e-6
