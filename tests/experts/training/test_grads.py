"""ExpertGrads keeps an expert's single bf16 gradient in bf16 (half the bytes to move and to read), with the
values of its fp32 copy everywhere they are used."""
import pytest
import torch

from ds_maximus.experts.training.grads import ExpertGrads
from tests.experts.training.moe_utils import batches, build, mixtral_experts, moe_section, tiny_mixtral
from tests.helpers.models import train


def _bf16(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_single_bf16_gradient_stays_bf16_and_reads_as_fp32():
    g = ExpertGrads(torch.device("cpu"), max_on_device=4)
    a, b = _bf16(1000, 1), _bf16(1000, 2)
    g.add(0, a)
    g.add(1, a.float())
    assert g.raw(0).dtype == torch.bfloat16 and g.raw(1).dtype == torch.float32
    assert torch.equal(g.get(0), a.float()) and g.get(0).dtype == torch.float32
    assert float(g.norm_sq()) == pytest.approx(2 * float(torch.dot(a.float(), a.float())), rel=1e-6)
    t, f, _ = g.take_to_host(0)
    assert t.dtype == torch.bfloat16 and f == 1.0 and torch.equal(t, a)  # the CPU step reads it as it is
    g.add(0, a)
    g.add(0, b)  # a second contribution: accumulated in fp32
    assert g.raw(0).dtype == torch.float32 and torch.equal(g.raw(0), a.float() + b.float())
    g.add(2, b)
    g.scale_(0.5)  # scaled: the factor is recorded and applied in fp32 where it is read, never rounded to bf16
    assert g.raw(2).dtype == torch.bfloat16 and g.factor(2) == 0.5 and g.factor(0) == 1.0
    assert torch.equal(g.get(2), b.float() * 0.5) and torch.equal(g.raw(0), (a.float() + b.float()) * 0.5)
    assert float(g.norm_sq()) == pytest.approx(sum(float(torch.dot(g.get(u), g.get(u))) for u in g.uids()), rel=1e-6)
    t, f, _ = g.take_to_host(2)
    assert t.dtype == torch.bfloat16 and f == 0.5  # the CPU step applies it in its pass
    g.add(3, b)
    g.scale_(0.25)
    g.add(3, a)  # a contribution after scaling: the scale is applied first, then fp32 accumulates
    assert g.raw(3).dtype == torch.float32 and g.factor(3) == 1.0
    assert torch.equal(g.raw(3), b.float() * 0.25 + a.float())


class _Fp32Grads(ExpertGrads):
    """Every gradient fp32 from its first contribution (the behaviour before bf16 ones were kept)."""

    def add(self, uid, grad):
        super().add(uid, grad.float() if uid not in self.g else grad)


class _Recording(ExpertGrads):
    """Records the dtypes gradients are stored in, and those the split step's CPU side is handed."""
    stored, handed = [], []

    def add(self, uid, grad):
        super().add(uid, grad)
        _Recording.stored.append(self.g[uid].dtype)

    def take_to_host(self, uid):
        out = super().take_to_host(uid)
        _Recording.handed.append(out[0].dtype)
        return out


@pytest.mark.parametrize("device", ["cpu", "split"])
def test_bf16_training_is_bit_identical_to_fp32_gradients(monkeypatch, device):
    """bf16, clipped, gradients spilled to the host: keeping single bf16 gradients in bf16 changes no bit of
    the experts' masters, moments or compute copies against storing every gradient in fp32."""
    data = batches(5, batch=2, seqlen=8)
    sec = moe_section(slots=2, gpu_grad_experts=1, optimizer_device=device, cpu_step_share=0.5,
                      step_chunk_bytes=1 << 16)
    import ds_maximus.experts.training.trainer as trainer_mod
    _Recording.stored, _Recording.handed = [], []
    monkeypatch.setattr(trainer_mod, "ExpertGrads", _Recording)
    torch.manual_seed(0)
    got = build(tiny_mixtral(num_experts=8), 2, dtype="bf16", clip=0.05, maximus=sec)
    l_got = train(got, data)
    assert torch.bfloat16 in _Recording.stored
    if device == "split" and got.maximus.modules["moe"].compute_device.type == "cuda":
        # spilled to the host in bf16, with the clip factor pending: the CPU side read them as they were
        assert torch.bfloat16 in _Recording.handed
    monkeypatch.setattr(trainer_mod, "ExpertGrads", _Fp32Grads)
    torch.manual_seed(0)
    ref = build(tiny_mixtral(num_experts=8), 2, dtype="bf16", clip=0.05, maximus=sec)
    l_ref = train(ref, data)
    t_got, t_ref = got.maximus.modules["moe"], ref.maximus.modules["moe"]
    assert isinstance(t_ref.grads, _Fp32Grads) and isinstance(t_got.grads, _Recording)
    assert l_got == l_ref
    t_got.finish_step(), t_ref.finish_step()  # a split step runs on into the next forward: let it end
    for n, v in t_ref.store.tables.items():
        assert torch.equal(t_got.store.tables[n], v), n
    assert torch.equal(t_got.store.shadow, t_ref.store.shadow)
    er, eg = mixtral_experts(ref), mixtral_experts(got)
    assert all(torch.equal(eg[g][n], er[g][n]) for g in er for n in er[g])


@pytest.mark.parametrize("key", ["host_grad_accumulate", "host_grad_parts"])
def test_removed_host_gradient_options_are_refused_with_the_reason(key):
    """The two host-gradient options measured slower than the default and were removed: a config that still sets
    one is a ConfigError saying so (not a silent default, not a bare unknown-key error)."""
    from ds_maximus.config import MaximusConfig
    from ds_maximus.errors import ConfigError
    with pytest.raises(ConfigError, match=f"moe.{key} was removed: .*measured slower.*drop the key"):
        MaximusConfig.from_ds_config({"maximus": {"moe": {"enabled": True, "train": True, key: False}}})
