"""Bytes moved per step scale with the routed experts, not with all experts (fine-grained 16-expert top-2
model), and the NVMe tier trains exactly like the CPU tier. The trainer is driven directly (no engine)."""
import pytest
import torch

from ds_maximus.config import MaximusConfig
from ds_maximus.errors import ConfigError
from ds_maximus.experts.training import attach_expert_training
from tests.experts.training.moe_utils import VOCAB, moe_section, tiny_mixtral

E, K, SLOTS = 16, 2, 4


def _trainer(model, **moe):
    return attach_expert_training(model, MaximusConfig.from_dict(moe_section(**moe)))


def _count_routed(trainer):
    """Independent count of distinct experts per layer, from the routing the experts modules receive."""
    seen = {}
    for g, layer in enumerate(m for m in trainer._model_layers):
        def hook(mod, args, g=g):
            seen.setdefault(g, set()).update(int(e) for e in args[1].flatten().tolist())
        layer.register_forward_pre_hook(hook)
    return seen


def _step(model, trainer, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    trainer.sparse_step(lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("tokens", [2, 3, 12])
def test_bytes_scale_with_routed_experts(tokens):
    model = tiny_mixtral(num_experts=E, top_k=K, layers=2, hidden=32, ffn=32)
    t = _trainer(model, slots=SLOTS, speculative_prefetch=False, backward_prefetch=False)
    t._model_layers = [layer.mlp.experts for layer in model.model.layers]
    g = torch.Generator().manual_seed(3)
    expert_bytes = t.cache.layout.nbytes
    all_bytes = t.num_uids * expert_bytes
    for _ in range(3):
        seen = _count_routed(t)
        _step(model, t, torch.randint(0, VOCAB, (1, tokens), generator=g))
        last = t.stats()["last_step"]
        distinct = sum(len(s) for s in seen.values())
        assert last["experts_stepped"] == distinct
        assert last["bytes_step"] == distinct * 4 * t.numel          # gradients to the CPU optimizer
        lower = sum(max(0, len(s) - SLOTS) for s in seen.values())
        assert lower <= last["experts_loaded"] <= 2 * distinct        # forward misses + backward re-fetches
        assert last["bytes_loaded"] == last["experts_loaded"] * expert_bytes
        assert last["bytes_refresh"] <= distinct * expert_bytes
        assert last["bytes_moved"] <= 4 * distinct * expert_bytes
        if tokens * K < E:  # a dense step moves every expert in and every expert's gradient out
            assert last["bytes_moved"] < 2 * all_bytes
        for g_, s in seen.items():
            t._model_layers[g_]._forward_pre_hooks.clear()
    assert sum(sum(1 for c in row if c) for row in last["routing"]) == distinct


def test_nvme_tier_equals_cpu_tier(tmp_path):
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    runs = []
    nvme = {"offload": {"device": "nvme", "nvme_path": str(tmp_path / "experts")}, "step_chunk_bytes": 1 << 16}
    for off in ({}, nvme):  # the NVMe tier is stepped staged, in pieces smaller than one expert
        model = tiny_mixtral(num_experts=8)
        t = _trainer(model, slots=2, **off)
        for i in range(3):
            _step(model, t, ids[:, i:i + 4])
        runs.append({g: t.expert_tensors(g) for g in range(t.num_layers)})
    assert t.store.tier == "nvme" and any((tmp_path / "experts").iterdir())
    assert t.numel > (1 << 16) // 16  # more than one piece per expert
    for g in runs[0]:
        for n in runs[0][g]:
            assert torch.equal(runs[0][g][n], runs[1][g][n])


def test_no_moe_layer_is_a_config_error():
    from tests.helpers.models import tiny_llama
    with pytest.raises(ConfigError, match="no MoE layer"):
        _trainer(tiny_llama())


def test_state_dict_shape_mismatch_is_clear():
    a = _trainer(tiny_mixtral(num_experts=8))
    b = _trainer(tiny_mixtral(num_experts=4))
    with pytest.raises(ConfigError, match="8 experts"):
        b.load_maximus_state_dict(a.maximus_state_dict())


def test_deepspeed_moe_expert_parallel_is_clear():
    from deepspeed.moe.layer import MoE
    net = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2, k=1))
    with pytest.raises(ConfigError, match="ep_size=2"):
        _trainer(net)


def test_state_dict_holds_current_experts_under_hf_names():
    """model.state_dict() / save_pretrained give a complete HF checkpoint; loading it sets the masters."""
    model = tiny_mixtral(num_experts=4)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    t = _trainer(model, slots=2)
    sd = model.state_dict()
    assert set(sd) == set(ref)
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    _step(model, t, ids)
    after = model.state_dict()
    key = "model.layers.1.mlp.experts.down_proj"
    assert not torch.equal(after[key], ref[key])
    assert torch.equal(after[key], t.expert_tensors(1)["down_proj"])
    fresh = tiny_mixtral(num_experts=4, seed=5)
    t2 = _trainer(fresh, slots=2)
    fresh.load_state_dict(after)
    assert torch.equal(t2.expert_tensors(1)["down_proj"], after[key])
    assert t2.store.host_view(4).equal(t2.store.master_row(4))


def test_train_without_enabled_is_a_config_error():
    with pytest.raises(ConfigError, match="moe.enabled is false"):
        MaximusConfig.from_dict({"moe": {"train": True}})
