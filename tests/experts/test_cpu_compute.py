"""Missed experts computed on the host (moe.cpu_compute): the policy, the host forward against the plain-PyTorch
expert, and offload_experts with cpu_compute on tiny MoE models: the same greedy tokens and logits (within
fp32-accumulation tolerance) as the model without offload."""
import pytest
import torch

from ds_maximus.config import ExpertCPUCompute
from ds_maximus.errors import ConfigError
from ds_maximus.experts import offload_experts
from ds_maximus.experts.cpu_compute import HostExpertCompute
from ds_maximus.experts.expert_store import CpuExpertStore
from ds_maximus.experts.layout import ExpertLayout

from .test_offload_generate import greedy
from .tiny_moe import clone, tiny_model


def _store(E=4, H=16, F=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {"gate_up_proj": torch.randn(E, 2 * F, H, generator=g).to(dtype),
               "down_proj": torch.randn(E, H, F, generator=g).to(dtype)}
    store = CpuExpertStore(ExpertLayout.from_stacked(tensors, E), E, pin_memory=False)
    for e in range(E):
        store.write(e, {n: t[e] for n, t in tensors.items()})
    return store, tensors


@pytest.mark.parametrize("mode,max_tokens,want", [("off", 8, []), ("misses", 1, [2, 3]), ("auto", 2, [3]),
                                                  ("auto", 5, [2, 3])])
def test_choose(mode, max_tokens, want):
    store, _ = _store()
    h = HostExpertCompute(store, 4, ExpertCPUCompute(mode), max_tokens)
    assert h.choose(used=[0, 2, 3], counts=[1, 0, 5, 2], resident=[0, 1]) == want


def test_auto_splits_light_misses_between_host_and_link():
    """With a link (its seconds an expert known, as on CUDA), auto gives the link the share of the light misses
    that finishes with the host's, never more than the layer's free slots, the staged guess first; misses
    stays all-host, and crowded experts take slots and link time first."""
    store, _ = _store()
    h = HostExpertCompute(store, 4, ExpertCPUCompute.AUTO, max_tokens=2)
    assert h.link_s is None  # no link on a CPU device: the token rule alone
    assert h.choose(used=[0, 1, 2, 3], counts=[1, 1, 1, 1], resident=[], slots=4) == [0, 1, 2, 3]
    h.host_s, h.link_s = 1.0, 1.0
    assert h.choose(used=[0, 1, 2, 3], counts=[1, 1, 1, 1], resident=[], slots=4) == [1, 3]
    assert h.choose(used=[0, 1, 2, 3], counts=[1, 1, 1, 1], resident=[0], slots=2) == [2, 3]  # 1 free slot
    assert h.choose(used=[0, 1, 2, 3], counts=[1, 1, 1, 1], resident=[0, 1], slots=2) == [2, 3]  # none free
    # 3 is crowded: it goes over the link first, so the link is busy 1 s when the light ones are split
    assert h.choose(used=[1, 2, 3], counts=[0, 1, 1, 5], resident=[], slots=3) == [1]
    h.link_s = 3.0   # a slow link: the host takes all but the staged guess, whose rest is cheap
    assert h.choose(used=[0, 1, 2], counts=[1, 1, 1], resident=[], slots=3, staged=2, staged_frac=0.1) == [0, 1]
    m = HostExpertCompute(store, 4, ExpertCPUCompute.MISSES)
    m.link_s = 1e-9
    assert m.choose(used=[0, 1], counts=[1, 1], resident=[], slots=2) == [0, 1]


def test_auto_samples_an_idle_host_again():
    """A host estimate that keeps every light miss on the link is measured again: after EXPLORE such layers one
    light miss goes to the host, the lightest and not the staged guess; a layer that uses the host, or has no light
    miss, restarts the count (the layers must be in a row)."""
    from ds_maximus.experts.cpu_compute import EXPLORE
    store, _ = _store()
    h = HostExpertCompute(store, 4, ExpertCPUCompute.AUTO, max_tokens=4)
    h.host_s, h.link_s = 100.0, 1.0  # the host looks far slower than the link
    ask = dict(used=[0, 1, 2], counts=[2, 1, 3, 0], resident=[], slots=3, staged=1, staged_frac=0.5)
    got = [h.choose(**ask) for _ in range(EXPLORE)]
    assert got[:-1] == [[]] * (EXPLORE - 1) and got[-1] == [0]
    assert h.choose(used=[3], counts=[0, 0, 0, 9], resident=[], slots=3) == []  # crowded only: the row restarts
    got = [h.choose(**ask) for _ in range(EXPLORE - 1)]
    h.host_s = 1.5  # now the host takes the second miss: the count restarts
    assert h.choose(used=[0, 1, 2], counts=[1, 1, 1, 0], resident=[], slots=3) == [1]
    h.host_s = 100.0
    assert [h.choose(**ask) for _ in range(EXPLORE)][-1] == [0] and got == [[]] * (EXPLORE - 1)


def test_host_seconds_an_expert_follow_the_measured_forward():
    store, t = _store()
    h = HostExpertCompute(store, 4, ExpertCPUCompute.AUTO)
    h.host_s = 10.0  # far above any real expert's time: the running mean must come down
    x, rw = torch.randn(3, t["down_proj"].shape[1]), torch.rand(3, 2)
    h.forward(0, x, rw, [1, 2], {1: ([0], [0]), 2: ([1, 0], [1, 2])})
    assert h.host_s < 10.0 * (1 - 0.2) ** 2 + 1.0 and h.stats()["cpu_ms_per_expert"] == h.host_s * 1e3


def test_a_slow_host_call_moves_the_running_mean_at_most_by_its_cap():
    """One call far slower than the mean (a preempted thread) counts as twice the mean, not as itself; the first
    estimate is the median of a few timed experts."""
    store, t = _store()
    h = HostExpertCompute(store, 4, ExpertCPUCompute.AUTO)
    first = h._time_host()
    assert 0.0 < first < 1.0
    h.host_s = 1e-9  # every real call is far slower than this
    x, rw = torch.randn(3, t["down_proj"].shape[1]), torch.rand(3, 2)
    h.forward(0, x, rw, [1, 2], {1: ([0], [0]), 2: ([1, 0], [1, 2])})
    assert h.host_s == pytest.approx(1e-9 * (1 + 0.2) ** 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_forward_equals_the_eager_expert_loop(dtype):
    store, t = _store(dtype=dtype)
    h = HostExpertCompute(store, 4, ExpertCPUCompute.MISSES)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 16, generator=g).to(dtype)
    rw = torch.rand(3, 2, generator=g)
    where = {1: ([0, 1], [0, 2]), 3: ([1], [1])}
    got = h.forward(0, hidden, rw, [1, 3], where)
    want = torch.zeros(3, 16)
    for e, (pos, tok) in where.items():
        x = hidden[tok].float()
        gate, up = (x @ t["gate_up_proj"][e].float().t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ t["down_proj"][e].float().t()
        want.index_add_(0, torch.tensor(tok), y * rw[tok, pos, None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert {k: h.stats()[k] for k in ("cpu_experts", "cpu_expert_tokens")} == {"cpu_experts": 2, "cpu_expert_tokens": 3}


def _run(model, cfg, batch=1, prompt_len=6, new_tokens=12):
    ref = clone(model)
    ids = torch.randint(1, 128, (batch, prompt_len), generator=torch.Generator().manual_seed(7))
    seq_ref, logits_ref = greedy(ref, ids, new_tokens)
    handle = offload_experts(model, cfg)
    try:
        seq, logits = greedy(model, ids, new_tokens)
        return seq, logits, seq_ref, logits_ref, handle.stats()
    finally:
        handle.close()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_offload_with_cpu_misses_generates_the_same(kind, impl):
    model = tiny_model(kind, impl, top_k=2)
    seq, logits, seq_ref, logits_ref, st = _run(model, {"gpu_experts_per_layer": 1, "cpu_compute": "misses"})
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-4)
    assert st["cpu_experts"] > 0 and st["cpu_expert_tokens"] >= st["cpu_experts"]
    assert st["prefetch_useful"] > 0  # the next layer's guesses land in slots and the GPU computes them there


def test_auto_sends_crowded_experts_to_the_device():
    """auto with max 1 token: a prefill's experts (many tokens) go to the slots, decode misses to the host."""
    model = tiny_model("mixtral", top_k=2)
    cfg = {"gpu_experts_per_layer": 2, "cpu_compute": "auto", "cpu_compute_max_tokens": 1}
    seq, logits, seq_ref, logits_ref, st = _run(model, cfg, prompt_len=16)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-4)
    assert st["cpu_experts"] > 0 and st["cpu_expert_tokens"] == st["cpu_experts"]  # one token each
    assert st["demand_misses"] > 0  # the prefill's loads


def test_batched_decode_with_cpu_misses():
    model = tiny_model("mixtral", "eager", top_k=2)
    seq, logits, seq_ref, logits_ref, st = _run(model, {"gpu_experts_per_layer": 1, "cpu_compute": "misses"},
                                                batch=3, prompt_len=4, new_tokens=6)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-4)


def test_cpu_compute_refuses_an_nvme_tier(tmp_path):
    cfg = {"cpu_compute": "misses", "offload": {"device": "nvme", "nvme_path": str(tmp_path / "x")}}
    with pytest.raises(ConfigError, match="CPU memory"):
        offload_experts(tiny_model("mixtral"), cfg)


def test_host_forward_from_packed_weights_equals_the_reference():
    """With moe.quant the CPU tier holds the packed form: the host computes from it (the op decodes the codes) and
    equals the plain-PyTorch SwiGLU of the dequantized weights (offload with quant + cpu_compute:
    tests/experts/test_quant_offload.py)."""
    from ds_maximus.experts.quant import swiglu_reference
    from ds_maximus.experts.quant_layout import QuantizedExpertLayout
    exact, t = _store()
    store = CpuExpertStore(QuantizedExpertLayout.from_layout(exact.layout, 4, 8), 4, pin_memory=False)
    for e in range(4):
        store.write(e, {n: v[e] for n, v in t.items()})
    h = HostExpertCompute(store, 4, ExpertCPUCompute.MISSES)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(2))
    got = h.forward(0, x, torch.ones(2, 1), [3], {3: ([0, 0], [0, 1])})
    want = swiglu_reference(x, *h.weights(3))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.allclose(got, swiglu_reference(x, t["gate_up_proj"][3][:24], t["gate_up_proj"][3][24:],
                                                    t["down_proj"][3]), rtol=1e-3, atol=0)  # 4-bit, not exact

@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["misses", "auto"])
def test_offload_with_cpu_misses_on_the_gpu(mode):
    """On CUDA: the resident experts on the device, the missed ones on the host, the same greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_model("mixtral", top_k=2).cuda()
    ref = clone(model)
    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(7)).cuda()
    seq_ref, logits_ref = greedy(ref, ids, 12)
    handle = offload_experts(model, {"gpu_experts_per_layer": 1, "cpu_compute": mode, "cpu_compute_max_tokens": 2})
    try:
        seq, logits = greedy(model, ids, 12)
        st = handle.stats()
    finally:
        handle.close()
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-4)
    assert st["cpu_experts"] > 0
