"""Greedy generate() with offloaded experts equals the model without: same tokens, same logits."""
import json

import pytest
import torch

from ds_maximus.config import MaximusConfig
from ds_maximus.errors import ConfigError
from ds_maximus.experts import OffloadedExperts, compute, offload_experts

from .tiny_moe import clone, tiny_model

NEW_TOKENS = 32


def greedy(model, ids, new_tokens=NEW_TOKENS):
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def check_equal(model, config, impl_exact=True, prompt_len=6, batch=1, new_tokens=NEW_TOKENS):
    ref = clone(model)
    ids = torch.randint(1, 128, (batch, prompt_len), generator=torch.Generator().manual_seed(7))
    seq_ref, logits_ref = greedy(ref, ids, new_tokens)
    handle = offload_experts(model, config)
    try:
        assert all(isinstance(b.block.experts, OffloadedExperts) for b in handle.blocks)
        assert not any("gate_up_proj" in n for n, _ in model.named_parameters())
        seq, logits = greedy(model, ids, new_tokens)
        assert torch.equal(seq, seq_ref)
        if impl_exact:
            assert torch.equal(logits, logits_ref)
        else:
            torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
        return handle.stats()
    finally:
        handle.close()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("slots", [1, 8])
def test_generate_identical(kind, slots):
    top_k = 2 if kind == "mixtral" else 4
    st = check_equal(tiny_model(kind, top_k=top_k), {"gpu_experts_per_layer": slots})
    if slots == 8:
        assert st["hit_rate"] > 0.5
    assert st["demand_misses"] > 0 and st["bytes_moved"] > 0 and st["tokens"] > 0


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_other_expert_implementations(impl):
    """top-4 of 8 with 3 slots: every layer computes in rounds; eager is bit-exact, batched_mm close."""
    model = tiny_model("mixtral", impl, num_experts=8, top_k=4)
    check_equal(model, {"gpu_experts_per_layer": 3}, impl_exact=impl == "eager", batch=2, prompt_len=4, new_tokens=6)


def test_prefetch_off_and_on_same_tokens_and_stats():
    on = check_equal(tiny_model("qwen3_moe", layers=3, top_k=2), {"gpu_experts_per_layer": 2})
    off = check_equal(tiny_model("qwen3_moe", layers=3, top_k=2),
                      {"gpu_experts_per_layer": 2, "speculative_prefetch": False})
    assert on["prefetch_issued"] > 0 and on["prefetch_useful"] > 0
    assert off["prefetch_issued"] == 0 and off["prefetch_recall"] == 0.0
    assert 0.0 < on["prefetch_precision"] <= 1.0 and 0.0 < on["prefetch_recall"] <= 1.0


@pytest.mark.parametrize("impl,quant", [("eager", None), ("grouped_mm", None), ("batched_mm", None),
                                        ("eager", {"bits": 4, "group_size": 16})])
def test_prefetch_queued_after_the_first_round(monkeypatch, impl, quant):
    """Each layer queues the next layer's guesses once, after its first round's expert work and release (the GPU
    starts on the round before the host stages a guess or reads one from NVMe), in every expert loop."""
    model = tiny_model("mixtral", impl, num_experts=8, top_k=2, layers=3)
    handle = offload_experts(model, {"gpu_experts_per_layer": 2, **({"quant": quant} if quant else {})})
    log = []
    release, issue = handle.cache.release, handle._issue_prefetch
    monkeypatch.setattr(handle.cache, "release", lambda g, slots: (log.append(("release", g)), release(g, slots)))
    monkeypatch.setattr(handle, "_issue_prefetch", lambda g, votes: (log.append(("prefetch", g)), issue(g, votes)))
    greedy(model, torch.tensor([[5, 9, 17]]), new_tokens=3)
    handle.close()
    prefetches = [i for i, (what, _) in enumerate(log) if what == "prefetch"]
    assert prefetches  # layers 0 and 1 guess for 1 and 2, every forward
    for i in prefetches:
        assert log[i - 1] == ("release", log[i][1] - 1)  # right after its layer's first round released
    assert len(prefetches) == 2 * 3  # once a call of layers 0 and 1 (not once a round), in the 3 forwards


def test_two_guesses_a_layer_staged_same_tokens():
    """moe.prefetch_top_k=2 on the CPU tier: each layer's two best guesses stage in a buffer each (the whole tiny
    expert), the tokens stay the plain model's."""
    one = check_equal(tiny_model("qwen3_moe", layers=3, top_k=2), {"gpu_experts_per_layer": 2})
    two = check_equal(tiny_model("qwen3_moe", layers=3, top_k=2), {"gpu_experts_per_layer": 2, "prefetch_top_k": 2})
    assert one["staging_bytes"] == one["expert_bytes"] and two["staging_bytes"] == 2 * two["expert_bytes"]
    assert two["prefetch_issued"] > one["prefetch_issued"] and two["prefetch_useful"] > 0


def test_skip_resident_guesses_same_tokens_more_staged():
    """moe.prefetch_skip_resident: a layer whose best guess is resident stages its next predicted expert (still one
    buffer), so more guesses are issued and right; the tokens stay the plain model's."""
    cfg = {"gpu_experts_per_layer": 4}
    off = check_equal(tiny_model("qwen3_moe", layers=3, top_k=2), cfg)
    on = check_equal(tiny_model("qwen3_moe", layers=3, top_k=2), {**cfg, "prefetch_skip_resident": True})
    assert on["staging_bytes"] == off["staging_bytes"] == on["expert_bytes"]
    assert on["prefetch_issued"] > off["prefetch_issued"] and on["prefetch_useful"] > off["prefetch_useful"]


def test_skip_resident_stages_the_best_absent_guess():
    """The guess order: the prediction's first pick, then the rest by rank; resident ones skipped with the option
    on, and a layer whose first pick is resident stages nothing with it off."""
    handle = offload_experts(tiny_model("mixtral", num_experts=8, top_k=2), {"gpu_experts_per_layer": 2})
    try:
        cache, E = handle.cache, 8
        cache.acquire(1, [3])  # expert 3 of layer 1 resident
        guess, predicted = [0] * E, [0] * E
        guess[3], predicted[3], predicted[5] = 1, 2, 1  # one token: first pick 3, second pick 5
        handle._issue_prefetch(1, guess + predicted)
        assert cache.staged_ids(1) == []
        handle.cfg.prefetch_skip_resident = True
        handle._issue_prefetch(1, guess + predicted)
        assert cache.staged_ids(1) == [5]
        # a round of more experts than slots takes the resident and the staged guess first
        mod = handle.modules[1]
        ctx = compute.ExpertComputeContext(cache, 1, mod._original._apply_gate, E, mod.form)
        assert ctx.rounds([0, 1, 3, 5]) == [[3, 5], [0, 1]]
    finally:
        handle.close()


def test_nvme_tier_equals_ram(tmp_path):
    """The file tier (plain reads, or the NVMe loader when its op builds) gives the RAM tier's tokens."""
    cfg = {"gpu_experts_per_layer": 1, "offload": {"device": "nvme", "nvme_path": str(tmp_path / "experts")}}
    st = check_equal(tiny_model("mixtral"), cfg)
    assert st["tier"] == "nvme"
    assert st["prefetch_issued"] > 0 and st["staging_bytes"] == 0  # guesses are read whole into slots there
    from ds_maximus.store import ShardStore
    store = ShardStore.open(str(tmp_path / "experts" / "experts"))  # the shard store format, one expert a shard
    assert store.num_shards == 2 * 8 and store.rows_per_shard == 1
    assert store.verify()["bytes"] >= 2 * 8 * st["expert_bytes"]


def test_config_forms(tmp_path):
    model = tiny_model("mixtral")
    moe = {"gpu_experts_per_layer": 3}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 1, "maximus": {"moe": moe}}))
    for cfg in (moe, {"maximus": {"moe": moe}}, str(path), MaximusConfig.from_dict({"moe": moe}),
                MaximusConfig.from_dict({"moe": moe}).moe):
        h = offload_experts(clone(model), cfg)
        assert h.cache.slots_per_group == 3
        h.close()
    nbytes = 2 * 64 * 96 * 4 + 64 * 96 * 4   # one fp32 expert (before alignment padding)
    h = offload_experts(clone(model), {"gpu_expert_bytes": 2 * nbytes + 8192})
    assert h.cache.slots_per_group == 2
    h.close()
    with pytest.raises(ConfigError, match="gpu_experts_per_layr"):
        offload_experts(clone(model), {"maximus": {"moe": {"gpu_experts_per_layr": 1}}})
    with pytest.raises(ConfigError, match="no MoE block"):
        offload_experts(torch.nn.Sequential(torch.nn.Linear(4, 4)), moe)


def test_round_index_cached_by_value():
    """A round's short index tensor is made once and reused by value (never written by its users); long ones are
    made each time."""
    a = compute.round_index([0, 1, 0, 1, 2, 7, 9], torch.device("cpu"))
    assert a.dtype == torch.long and a.tolist() == [0, 1, 0, 1, 2, 7, 9]
    assert compute.round_index([0, 1, 0, 1, 2, 7, 9], torch.device("cpu")) is a
    long = list(range(compute.ROUND_INDEX_CACHED + 1))
    b = compute.round_index(long, torch.device("cpu"))
    assert b.tolist() == long and compute.round_index(long, torch.device("cpu")) is not b


def test_a_decode_step_reads_one_host_list_a_layer(monkeypatch):
    """The offload path turns tensors into Python values once a layer call (the routing's ``tolist``, its one sync
    on a GPU): no ``int()``/``item()``/``bool()`` of a tensor in ``ds_maximus`` on the way (on a GPU each would be a
    sync; on the host, an ATen call the decode pays 32 times a token at the Mixtral shape). int4 and bf16 slots."""
    import traceback
    for quant in (None, {"bits": 4, "group_size": 16}):
        model = tiny_model("mixtral", "eager", num_experts=8, top_k=2, layers=3)
        handle = offload_experts(model, {"gpu_experts_per_layer": 2, **({"quant": quant} if quant else {})})
        greedy(model, torch.tensor([[5, 9, 17]]), new_tokens=2)
        calls = []
        for name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__"):
            orig = getattr(torch.Tensor, name)

            def counted(self, *a, _orig=orig, _name=name, **k):
                where = traceback.extract_stack(limit=2)[0]
                if "ds_maximus" in where.filename:
                    calls.append((_name, where.filename.rsplit("ds_maximus", 1)[1], where.lineno))
                return _orig(self, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)
        greedy(model, torch.tensor([[5, 9, 17]]), new_tokens=4)  # a prefill and 3 decode steps
        monkeypatch.undo()
        assert {c[0] for c in calls} == {"tolist"} and len(calls) == 3 * 4, calls
        handle.close()
