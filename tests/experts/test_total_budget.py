"""moe.gpu_expert_total_bytes: one GPU budget for all layers' expert slots, its remainder spread over the layers;
greedy decode stays the plain model's, layer by layer in rounds of that layer's own slots, inference and training."""
import pytest
import torch

from ds_maximus.config import MaximusConfig, MoEConfig
from ds_maximus.errors import ConfigError
from ds_maximus.experts import offload_experts
from ds_maximus.experts.expert_cache import layer_slots
from tests.helpers.scripts import load_script

from .test_offload_generate import check_equal, greedy
from .tiny_moe import clone, tiny_model


@pytest.mark.parametrize("total,layers", [(7, 4), (130, 32), (147, 32), (32, 32), (9, 3), (64, 32)])
def test_layer_slots_spread_the_whole_budget(total, layers):
    got = layer_slots(MoEConfig(gpu_expert_total_bytes=total * 1000 + 999), 1000, layers, 8)
    assert sum(got) == total and len(got) == layers
    assert max(got) - min(got) <= 1
    plus = [i for i, n in enumerate(got) if n == max(got)] if max(got) > min(got) else []
    if plus:  # evenly spaced: gaps between the layers with one more differ by at most one
        gaps = [b - a for a, b in zip(plus, plus[1:])]
        assert not gaps or max(gaps) - min(gaps) <= 1


def test_layer_slots_caps_refuses_and_keeps_the_older_keys():
    assert layer_slots(MoEConfig(gpu_expert_total_bytes=10 ** 9), 1000, 4, 8) == [8] * 4   # never more than E
    with pytest.raises(ConfigError, match="gpu_expert_total_bytes.*fewer than the model's 4 MoE layers"):
        layer_slots(MoEConfig(gpu_expert_total_bytes=3999), 1000, 4, 8)
    assert layer_slots(MoEConfig(gpu_expert_bytes=2500), 1000, 3, 8) == [2] * 3
    assert layer_slots(MoEConfig(gpu_experts_per_layer=3, gpu_expert_bytes=2500,
                                 gpu_expert_total_bytes=7000), 1000, 3, 8) == [2, 2, 3]
    with pytest.raises(ConfigError, match="gpu_expert_total_byte"):
        MaximusConfig.from_dict({"moe": {"gpu_expert_total_byte": 1}})


@pytest.mark.parametrize("kind,top_k", [("mixtral", 2), ("qwen3_moe", 4)])
def test_generate_identical_with_uneven_slots(kind, top_k):
    """3 layers, 4 slots in all (1, 1, 2 a layer, or so): the layers with one slot compute top-2/top-4 in rounds of
    one, the other in rounds of two; tokens and logits equal the plain model's (eager loop, bit-exact)."""
    model = tiny_model(kind, "eager", layers=3, top_k=top_k)
    probe = offload_experts(clone(model), {"gpu_experts_per_layer": 1})
    nbytes = probe.cache.layout.nbytes
    probe.close()
    st = check_equal(model, {"gpu_expert_total_bytes": 4 * nbytes + nbytes // 2}, batch=2, prompt_len=4,
                     new_tokens=8)
    assert st["slots_per_layer"] == pytest.approx(4 / 3)
    assert st["overflow_rows"] > 0 and st["demand_misses"] > 0


def _expert_bytes(model, cfg):
    probe = offload_experts(clone(model), {**cfg, "gpu_experts_per_layer": 1})
    try:
        return probe.cache.layout.nbytes
    finally:
        probe.close()


def test_uneven_slots_with_host_compute():
    """cpu_compute misses over uneven slots: each layer's misses by its own slots, the plain model's tokens."""
    model = tiny_model("mixtral", "eager", layers=3)
    nbytes = _expert_bytes(model, {})
    ref = clone(model)
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    seq_ref, logits_ref = greedy(ref, ids, 8)
    h = offload_experts(model, {"gpu_expert_total_bytes": 5 * nbytes, "cpu_compute": "misses"})
    try:
        assert h.cache.group_slots == [1, 2, 2]
        assert [m.extra_repr().split("slots=")[1].split(",")[0] for m in h.modules] == ["1", "2", "2"]
        seq, logits = greedy(model, ids, 8)
        assert torch.equal(seq, seq_ref)
        torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-4)
        assert h.stats()["cpu_experts"] > 0
    finally:
        h.close()


def test_uneven_quantized_slots_equal_every_expert_resident():
    """8-bit experts: the remainder's uneven rounds give the logits of the same quantized model with every expert
    resident (the packed loop computes each expert alone and adds them in ascending id)."""
    model = tiny_model("mixtral", "eager", layers=3, top_k=2)
    q = {"quant": {"bits": 8, "group_size": 32}}
    nbytes = _expert_bytes(model, q)
    ids = torch.randint(1, 128, (2, 4), generator=torch.Generator().manual_seed(5))
    out = []
    for cfg in ({**q, "gpu_experts_per_layer": 8}, {**q, "gpu_expert_total_bytes": 4 * nbytes}):
        m = clone(model)
        h = offload_experts(m, cfg)
        try:
            out.append(greedy(m, ids, 6))
        finally:
            h.close()
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])


def test_training_with_uneven_slots_equals_deepspeed():
    """MoE training (ZeRO-2, fp32) over 5 slots for 2 layers of 8 experts, 2 and 3 a layer: 12 steps equal plain
    DeepSpeed's, as with even slots (tests/experts/training/test_equality.py)."""
    from tests.experts.training.moe_utils import (
        assert_experts_close,
        batches,
        build,
        dense_params,
        mixtral_experts,
        moe_section,
        tiny_mixtral,
    )
    from tests.helpers.models import assert_weights_close, train
    nbytes = (2 * 48 * 32 + 32 * 48) * 4   # one fp32 expert of tiny_mixtral (hidden 32, ffn 48)
    data = batches(12, batch=2, seqlen=4)
    ref = build(tiny_mixtral(num_experts=8), 2, clip=0.5)
    l_ref = train(ref, data)
    got = build(tiny_mixtral(num_experts=8), 2, maximus=moe_section(gpu_expert_total_bytes=5 * nbytes), clip=0.5)
    l_got = train(got, data)
    t = got.maximus.modules["moe"]
    assert t.slots == [2, 3] and "slots_per_layer=2-3" in t.extra_repr()
    from ds_maximus.engine.wiring_report import swapped_lines
    assert "GPU cache 2-3 experts per layer" in swapped_lines({"moe": t}, {}, got.maximus.cfg)[0]
    assert l_got == pytest.approx(l_ref, rel=1e-5)
    assert_experts_close(got, ref, mixtral_experts)
    dr, dg = dense_params(ref), dense_params(got)
    for n in dr:
        assert_weights_close(dg[n], dr[n])
    assert t.stats()["evictions"] > 0


def test_example_takes_a_total_budget(capsys):
    """examples/generate_moe_offload.py --expert-gib: 23 slots over 4 layers, the un-offloaded model's tokens."""
    mod = load_script("examples/generate_moe_offload.py")
    mod.main(["--expert-gib", "0.035", "--tokens", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "identical to the un-offloaded model: True" in out
    assert '"slots_per_layer": 5.75' in out
