"""The same checks on CUDA: side-stream loads, device-side AdamW with staged masters/moments, bf16 slots."""
import pytest
import torch

from tests.experts.training.moe_utils import (
    assert_experts_close,
    batches,
    build,
    mixtral_experts,
    moe_section,
    tiny_mixtral,
)
from tests.helpers.models import train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("optimizer_device", ["compute", "cpu", "split"])
def test_mixtral_equals_deepspeed_on_cuda(optimizer_device):
    data = batches(12, batch=2, seqlen=4)
    ref = build(tiny_mixtral(num_experts=8).cuda(), 2, clip=0.5)
    l_ref = train(ref, data)
    got = build(tiny_mixtral(num_experts=8).cuda(), 2, clip=0.5,
                maximus=moe_section(slots=3, optimizer_device=optimizer_device, step_chunk_bytes=1 << 16))
    t = got.maximus.modules["moe"]
    assert t.cache.device.type == "cuda"
    l_got = train(got, data)
    assert l_got == pytest.approx(l_ref, rel=1e-4)
    assert_experts_close(got, ref, lr=2e-2)
    assert t.store.tables["weight"].is_pinned()


def test_bf16_on_cuda_built_on_cpu():
    """The benchmark's path: model built on the CPU, DeepSpeed moves it, the trainer follows to the GPU."""
    data = batches(6, batch=2, seqlen=8)
    ref = build(tiny_mixtral(num_experts=8), 2, dtype="bf16")
    got = build(tiny_mixtral(num_experts=8), 2, dtype="bf16", maximus=moe_section(slots=2))
    t = got.maximus.modules["moe"]
    assert t.cache.device.type == "cuda" and t.cache.slot_buffer(0).dtype == torch.bfloat16
    assert train(got, data) == pytest.approx(train(ref, data), rel=3e-2)
    assert t.stats()["gpu_stall_ms"] >= 0.0


def test_device_gradient_budget():
    """At most gpu_grad_experts accumulated gradients stay on the GPU; the rest wait in pinned memory."""
    from ds_maximus.config import MaximusConfig
    from ds_maximus.experts.training import attach_expert_training
    model = tiny_mixtral(num_experts=8).cuda()
    t = attach_expert_training(model, MaximusConfig.from_dict(moe_section(slots=2, gpu_grad_experts=2)))
    ids = batches(1, batch=4, seqlen=8)[0].cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    on_gpu = [u for u, g in t.grads.g.items() if g.is_cuda]
    assert len(t.grads.g) > 2 and len(on_gpu) <= 2
    assert all(g.is_pinned() for g in t.grads.g.values() if not g.is_cuda)
    t.sparse_step(lr=1e-3, weight_decay=0.0)
    assert not t.grads


def test_fp16_overflow_skips_the_expert_step():
    """fp16: expert grads are unscaled with the dense ones, and an overflow skips both sides."""
    data = [ids.cuda() for ids in batches(4, batch=2, seqlen=8)]
    e = build(tiny_mixtral(num_experts=8), 2, dtype="fp16", clip=1.0, maximus=moe_section(slots=2), lr=1e-3)
    t = e.maximus.modules["moe"]
    for ids in data[:2]:
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()
    assert e.skipped_steps == 0 and t.row_optimizer.step == 2
    before = mixtral_experts(e)
    e.backward(e(input_ids=data[2], labels=data[2]).loss * 1e30)
    e.step()
    assert e.skipped_steps == 1 and t.row_optimizer.step == 2 and not t.grads
    after = mixtral_experts(e)
    assert all(torch.equal(after[g][n], before[g][n]) for g in before for n in before[g])
    e.backward(e(input_ids=data[3], labels=data[3]).loss)
    e.step()
    assert t.row_optimizer.step == 3


def test_bf16_pipelined_step_refreshes_every_copy():
    """bf16, clipped, gradients spilled to the host and experts stepped in pieces on the GPU (the pipelined
    step): the fp32 masters equal those of the CPU-tier step, and the shadow and every resident slot hold
    exactly the master cast to bf16 (no stale or half-written copy)."""
    data = batches(6, batch=2, seqlen=8)
    engines = {}
    for dev in ("cpu", "compute", "split"):
        engines[dev] = build(tiny_mixtral(num_experts=8).cuda(), 2, dtype="bf16", clip=0.05,
                             maximus=moe_section(slots=2, gpu_grad_experts=1, optimizer_device=dev,
                                                 step_chunk_bytes=1 << 16))
        train(engines[dev], data)
    assert_experts_close(engines["split"], engines["cpu"])
    assert engines["split"].maximus.modules["moe"].counters.cpu_step_share is not None
    got, ref = (engines[d].maximus.modules["moe"] for d in ("compute", "cpu"))
    assert got.grads.moved_to_host > 0 and got.sub < got.numel
    assert_experts_close(engines["compute"], engines["cpu"])  # the CPU and CUDA ops round differently
    w_got = got.store.tables["weight"]
    assert torch.equal(got.store.shadow, w_got.to(torch.bfloat16))
    for g in range(got.num_layers):
        slots = got.cache.groups[g].map.id_to_slot.tolist()
        for e, s in enumerate(slots):
            if s >= 0:
                assert torch.equal(got.cache.slot_buffer(g)[s].cpu(), got.store.shadow[g * got.num_experts + e])


def test_overlapped_split_step_on_cuda_equals_the_synchronous_one(monkeypatch):
    """bf16, clipped, gradients spilled: the split step's device side queued on its own stream and its CPU
    side (slowed down) running on into the next forward give the synchronous step's losses and state, bit
    for bit (the forward waits for each layer's events and CPU experts)."""
    from tests.experts.training.test_overlap import _slow_cpu_side
    _slow_cpu_side(monkeypatch)
    data = batches(6, batch=2, seqlen=8)
    _engines, trainers, losses = _split_runs(data, "overlap_step", (False, True), {"clip": 0.05},
                                             gpu_grad_experts=1)
    t, ts = trainers[True], trainers[False]
    assert t.step_running and t.cache.device.type == "cuda"
    assert losses[True] == losses[False]
    t.finish_step()
    # every forward after the first waited for the last step in a layer still being updated (a layer whose updates
    # were all done by then is taken without counting, by the prefetch of the layer before)
    assert t.counters.overlapped_layers >= len(data) - 1
    _assert_same_tier(t, ts)
    for g in range(t.num_layers):
        for e, s in enumerate(t.cache.groups[g].map.id_to_slot.tolist()):
            if s >= 0:
                assert torch.equal(t.cache.slot_buffer(g)[s].cpu(), t.store.shadow[g * t.num_experts + e])


@pytest.mark.parametrize("overlap", [False, True])
def test_device_state_experts_on_cuda_equal_the_tier_only_run(overlap):
    """``moe.gpu_state_experts`` on the H200: bf16, clipped, 5 of 16 experts' masters and moments on the GPU
    (layer 0's first five), stepped there on the pipeline's streams, overlapped or not: the same losses, tier
    (once read), shadows and resident slots as the split step without them, bit for bit."""
    data = batches(8, batch=2, seqlen=8)
    _engines, trainers, losses = _split_runs(data, "gpu_state_experts", (0, 5), {"clip": 0.05},
                                             gpu_grad_experts=3, overlap_step=overlap)
    t, ts = trainers[5], trainers[0]
    assert losses[5] == losses[0]
    t.finish_step()
    ts.finish_step()
    assert t.store.device_tables["weight"].is_cuda
    for n, v in ts.store.state().items():
        assert torch.equal(t.store.state()[n], v), n
    assert torch.equal(t.store.shadow, ts.store.shadow)
    for g in range(t.num_layers):
        for e, s in enumerate(t.cache.groups[g].map.id_to_slot.tolist()):
            if s >= 0:
                assert torch.equal(t.cache.slot_buffer(g)[s].cpu(), t.store.shadow[g * t.num_experts + e])


def test_gradient_accumulation_on_cuda_sums_the_same_bits():
    """Three micro-batches of bf16 gradients for 6 experts, 2 kept on the device: sums waiting on the host are
    brought back and added on the device; every sum is the fp32 sum of the micro-batches bit for bit, and the
    device never holds more than 2 gradients' worth (an fp32 sum counts two)."""
    from ds_maximus.experts.training.grads import ExpertGrads
    g = ExpertGrads(torch.device("cuda"), max_on_device=2)
    gen = torch.Generator().manual_seed(0)
    parts = [[torch.randn(4099, generator=gen).to(torch.bfloat16) for _ in range(6)] for _ in range(3)]
    for mb in parts:
        for u, p in enumerate(mb):
            g.add(u, p.cuda())
            bytes_on = sum(t.numel() * t.element_size() for t in g.g.values() if t.is_cuda)
            assert bytes_on <= 2 * 4099 * 2
    assert g.moved_to_host > 0
    want = {u: parts[0][u].float() + parts[1][u].float() + parts[2][u].float() for u in range(6)}
    norm = sum(float(torch.dot(w, w)) for w in want.values())
    assert float(g.norm_sq()) == pytest.approx(norm, rel=1e-5)
    assert g.finite()
    g.scale_(0.5)
    for u in range(6):
        assert torch.equal(g.get(u, torch.device("cuda")).cpu(), want[u] * 0.5), u
    t, f, ev = g.take_to_host(0)
    if ev is not None:
        ev.synchronize()
    assert torch.equal(t.float() * f, want[0] * 0.5)


def _split_runs(data, name, values, build_kw, **section):
    """A bf16 tiny Mixtral trained on ``data`` with the split step for each value of ``moe.<name>`` (the rest of
    the section: ``section``; DeepSpeed's config: ``build_kw``): engines (hold them while their trainers are
    used), trainers and losses, by value."""
    engines, trainers, losses = {}, {}, {}
    for v in values:
        engines[v] = engine = build(tiny_mixtral(num_experts=8).cuda(), 2, dtype="bf16", **build_kw,
                       maximus=moe_section(slots=2, optimizer_device="split", cpu_step_share=0.5,
                                           step_chunk_bytes=1 << 16, **section, **{name: v}))
        losses[v] = train(engine, data)
        trainers[v] = engine.maximus.modules["moe"]
    return engines, trainers, losses


def _assert_same_tier(t, ts) -> None:
    """Every tier tensor and the compute copy of trainer ``t`` equal ``ts``'s, bit for bit."""
    for n, v in ts.store.tables.items():
        assert torch.equal(t.store.tables[n], v), n
    assert torch.equal(t.store.shadow, ts.store.shadow)
