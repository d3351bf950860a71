"""``moe.overlap_step``: a split step runs on into the next forward, each layer waited for when it is reached.

The CPU side is slowed down here (a sleep before each expert), so the next forward always arrives at a
layer whose experts are still being updated: if it did not wait for them, it would compute with stale
copies and the losses and weights would differ from the synchronous step's, bit for bit.
"""
import time

import pytest
import torch

from tests.experts.training.moe_utils import batches, build, mixtral_experts, moe_section, tiny_mixtral
from tests.helpers.models import train


def _slow_cpu_side(monkeypatch, delay_s=0.02, fail_at=None):
    from ds_maximus.experts.training.step import InPlaceStep
    real = InPlaceStep.update
    calls = []

    def slow(step, uid, grad, grad_scale=1.0):
        calls.append(uid)
        time.sleep(delay_s)
        if fail_at is not None and len(calls) == fail_at:
            raise OSError("simulated failure in the CPU side")
        real(step, uid, grad, grad_scale)
    monkeypatch.setattr(InPlaceStep, "update", slow)
    return calls


def _run(overlap, data, dtype="fp32"):
    sec = moe_section(slots=2, optimizer_device="split", cpu_step_share=0.5, step_chunk_bytes=1 << 16,
                      overlap_step=overlap)
    e = build(tiny_mixtral(num_experts=8), 2, dtype=dtype, clip=0.5, maximus=sec)
    return e, train(e, data)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_overlapped_step_equals_the_synchronous_one(monkeypatch, dtype):
    calls = _slow_cpu_side(monkeypatch)
    data = batches(8, batch=2, seqlen=8)
    sync, l_sync = _run(False, data, dtype)
    assert sync.maximus.modules["moe"].step_running is False  # it waited for every expert before returning
    n_sync = len(calls)
    over, l_over = _run(True, data, dtype)
    t = over.maximus.modules["moe"]
    assert t.step_running  # the last step still runs after engine.step() returned
    assert l_over == l_sync
    es, eo = mixtral_experts(sync), mixtral_experts(over)  # exports wait for the step to end
    assert not t.step_running and len(calls) - n_sync == n_sync > 0
    for g in es:
        for n in es[g]:
            assert torch.equal(eo[g][n], es[g][n]), (g, n)
    # every forward after the first waited for the last step in a layer still being updated (a layer whose updates
    # were all done by then is taken without counting, by the prefetch of the layer before)
    assert t.counters.overlapped_layers >= len(data) - 1
    assert t.counters.step_wait_ms > 0 and sync.maximus.modules["moe"].counters.overlapped_layers == 0
    ts = sync.maximus.modules["moe"]
    for n, v in ts.store.tables.items():
        assert torch.equal(t.store.tables[n], v), n
    for g in range(t.num_layers):  # every resident slot holds its expert's current copy
        for e, s in enumerate(t.cache.groups[g].map.id_to_slot.tolist()):
            if s >= 0:
                want = t.store.shadow[g * t.num_experts + e] if t.store.shadow is not None else \
                    t.store.tables["weight"][g * t.num_experts + e]
                assert torch.equal(t.cache.slot_buffer(g)[s], want)


def test_checkpoint_while_the_step_runs_holds_its_updates(monkeypatch, tmp_path):
    _slow_cpu_side(monkeypatch)
    data = batches(4, batch=2, seqlen=8)
    over, _ = _run(True, data)
    assert over.maximus.modules["moe"].step_running
    over.save_checkpoint(str(tmp_path), tag="t")
    sync, _ = _run(False, data)
    resumed, _ = _run(True, [])
    resumed.load_checkpoint(str(tmp_path), tag="t")
    er, eg = mixtral_experts(sync), mixtral_experts(resumed)
    for g in er:
        for n in er[g]:
            assert torch.equal(eg[g][n], er[g][n]), (g, n)


def test_a_failed_cpu_side_stops_the_next_forward(monkeypatch):
    _slow_cpu_side(monkeypatch, fail_at=3)
    data = batches(3, batch=2, seqlen=8)
    with pytest.raises(RuntimeError, match="expert optimizer step failed on the CPU side.*simulated failure"):
        _run(True, data)


@pytest.mark.parametrize("overlap,user,want", [(True, None, False), (False, None, True), (True, True, True)])
def test_deepspeed_throughput_timer_does_not_wait_for_the_step(overlap, user, want):
    """DeepSpeed's throughput timer syncs the device at every forward unless told not to: with an overlapped
    split step it is told not to, unless the config sets it."""
    import ds_maximus
    from tests.helpers.models import ds_config
    sec = moe_section(slots=2, optimizer_device="split", overlap_step=overlap)
    cfg = ds_config(2, maximus=sec)
    if user is not None:
        cfg["timers"] = {"throughput": {"synchronized": user}}
    model = tiny_mixtral(num_experts=4)
    e, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert e.tput_timer.config.synchronized is want
