"""The trained-expert tier's set-up: exact-size host tables, experts written a layer at a time."""
import gc

import pytest
import torch

from ds_maximus.errors import ConfigError
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.training.store import ExpertTrainStore
from ds_maximus.partition.host_memory import host_tensor


def test_host_tensor_zeros_init_and_lifetime():
    t = host_tensor((3, 1000), torch.float32)
    assert t.shape == (3, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    assert float(t.abs().sum()) == 0.0
    src = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = host_tensor((2, 3), torch.bfloat16, init=lambda x: x.copy_(src))
    assert torch.equal(b, src.bfloat16())
    assert host_tensor((0, 5)).shape == (0, 5)
    with pytest.raises(ValueError, match="negative"):
        host_tensor((2, -1))
    # a view keeps the memory alive after the tensor itself is gone
    view = host_tensor((4, 4), init=lambda x: x.fill_(7.0))[2]
    gc.collect()
    view.add_(1.0)
    assert float(view.sum()) == 32.0


def _stacked(e=3, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(e, 6, 5, generator=g).to(dtype),
            "down_proj": torch.randn(e, 5, 3, generator=g).to(dtype)}


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_write_layer_equals_write_master_per_expert(compute_dtype):
    """One strided copy per tensor lays experts out exactly as packing them one by one does (padding zero)."""
    src = _stacked(seed=1)
    lay = ExpertLayout.from_stacked(src, num_experts=3)
    bulk = ExpertTrainStore(lay, num_uids=6, state_names=("exp_avg", "exp_avg_sq"), compute_dtype=compute_dtype)
    one = ExpertTrainStore(lay, num_uids=6, state_names=("exp_avg", "exp_avg_sq"), compute_dtype=compute_dtype)
    bulk.write_layer(3, src)
    for e in range(3):
        one.write_master(3 + e, {n: v[e] for n, v in src.items()})
    for uid in range(6):
        assert torch.equal(bulk.master_row(uid), one.master_row(uid))
        assert torch.equal(bulk.host_view(uid), one.host_view(uid))
        assert bulk.host_view(uid).dtype == compute_dtype
    assert torch.equal(lay.view(bulk.master_row(4), "down_proj"), src["down_proj"][1].float())
    assert float(bulk.master_row(0).abs().sum()) == 0.0
    assert all(float(bulk.read_rows(torch.arange(6))[n].abs().sum()) == 0.0 for n in ("exp_avg", "exp_avg_sq"))


def test_write_layer_on_nvme_tier(tmp_path):
    src = _stacked(e=2, seed=2, dtype=torch.float32)
    lay = ExpertLayout.from_stacked(src, num_experts=2)
    st = ExpertTrainStore(lay, num_uids=2, state_names=("exp_avg",), nvme_path=str(tmp_path / "x"))
    st.write_layer(0, src)
    assert torch.equal(lay.view(st.master_row(1), "gate_up_proj"), src["gate_up_proj"][1])


def test_write_layer_rejects_bad_input():
    src = _stacked()
    lay = ExpertLayout.from_stacked(src, num_experts=3)
    st = ExpertTrainStore(lay, num_uids=3, state_names=())
    with pytest.raises(ConfigError, match="missing"):
        st.write_layer(0, {"gate_up_proj": src["gate_up_proj"]})
    with pytest.raises(ConfigError, match="shape"):
        st.write_layer(0, {**src, "down_proj": src["down_proj"][:, :, :2]})
    with pytest.raises(IndexError, match="outside"):
        st.write_layer(1, src)


def test_trainer_drops_the_models_expert_copy():
    """After attach the trainer holds no reference to the model's expert tensors (they can be freed)."""
    from ds_maximus.config import MaximusConfig
    from ds_maximus.experts.training.build import attach_expert_training
    from tests.experts.training.moe_utils import tiny_mixtral
    model = tiny_mixtral()
    want = model.model.layers[1].mlp.experts.down_proj.detach().float().clone()
    trainer = attach_expert_training(model, MaximusConfig.from_dict({"moe": {"enabled": True, "train": True}}))
    assert all(spec.tensors is None for spec in trainer.layers)
    assert all(p.numel() == 0 for p in trainer.removed_params)
    assert torch.equal(trainer.expert_tensors(1)["down_proj"], want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tensor_pinned_on_cuda():
    src = torch.randn(4, 1 << 16)
    t = host_tensor(src.shape, torch.float32, pin=True, init=lambda x: x.copy_(src))
    z = host_tensor((8, 1 << 16), torch.bfloat16, pin=True)
    assert t.is_pinned() and z.is_pinned() and float(z.float().abs().sum()) == 0.0
    d = t.to("cuda", non_blocking=True)
    back = host_tensor(src.shape, torch.float32, pin=True)
    back.copy_(d * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src * 2)
    view = t[1]
    del t
    gc.collect()  # a view keeps the memory mapped and registered
    assert view.is_pinned() and torch.equal(view, src[1])


@pytest.mark.parametrize("numel,sub,chunk_elems", [(22 * 64, 64, 16 * 64), (100 * 8, 8, 30 * 8), (10 * 4, 4, 4 * 4),
                                                   (12 * 4, 4, 12 * 4)])
def test_step_pieces_are_even_and_cover_each_expert(numel, sub, chunk_elems):
    """The staged step cuts an expert larger than the budget into pieces of one size (multiples of the sub-row),
    which together cover it once: a short last piece had made the CUDA pipeline's next piece wait."""
    from types import SimpleNamespace

    from ds_maximus.experts.training.step import STATE_BYTES
    from ds_maximus.experts.training.step import pieces as step_pieces
    names = ("weight", "exp_avg", "exp_avg_sq")
    parts = SimpleNamespace(numel=numel, sub=sub, store=SimpleNamespace(names=names),
                            step_chunk_bytes=chunk_elems * STATE_BYTES * (len(names) + 1))
    pieces = list(step_pieces(parts, [3, 7]))
    for u in (3, 7):
        spans = [(lo, hi) for part, lo, hi in pieces if part == [u]]
        assert spans[0][0] == 0 and spans[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        widths = [hi - lo for lo, hi in spans]
        assert all(w % sub == 0 and 0 < w <= chunk_elems for w in widths)
        assert max(widths) - min(widths) <= sub  # one size, give or take a sub-row
