"""moe.device_fetch: batch-1 decode steps that look experts up and fetch the missed ones without the host. On this
machine the same steps run with plain copies (the CUDA kernel's twin); the tokens and logits must equal the
default path's bit for bit, and the counters must say which experts crossed."""
import pytest
import torch

from ds_maximus.config import MaximusConfig
from ds_maximus.errors import ConfigError
from ds_maximus.experts import offload_experts

from .test_offload_generate import greedy
from .test_quant_offload import GROUP, prompt
from .tiny_moe import clone, tiny_model


def quant_cfg(kind, slots, bits=4, **extra):
    return {"gpu_experts_per_layer": slots, "quant": {"bits": bits, "group_size": GROUP[kind]}, **extra}


def decode(model, cfg, prompts, new_tokens=10):
    """Greedy decodes of each prompt in turn on one offloaded model: (sequences, logits) each, and the stats."""
    handle = offload_experts(model, cfg)
    try:
        outs = [greedy(model, ids, new_tokens) for ids in prompts]
        return outs, handle.stats()
    finally:
        handle.close()


@pytest.mark.parametrize("kind,top_k,bits", [("mixtral", 2, 4), ("qwen3_moe", 4, 4), ("qwen3_moe", 4, 8),
                                             ("mixtral", 2, 2)])
def test_same_tokens_and_logits_as_the_default_path(kind, top_k, bits):
    """Two prompts, one after the other on one handle (the second prefill changes the slots, so the tables are
    rebuilt): every token and logit equals the default path's; top-4 sorts the experts on the device first."""
    model = tiny_model(kind, layers=3, top_k=top_k)
    prompts = [prompt(), prompt(length=9)[:, 3:]]
    ref, st_ref = decode(clone(model), quant_cfg(kind, 2, bits), prompts)
    got, st = decode(model, quant_cfg(kind, 2, bits, device_fetch=True), prompts)
    for (seq_r, log_r), (seq, log) in zip(ref, got):
        assert torch.equal(seq, seq_r)
        assert torch.equal(log, log_r)
    assert st["device_fetch"] and st["device_fetches"] > 0
    assert st_ref["lookups"] == st["lookups"]  # every routed expert of every step counted once either way
    assert st["hits"] + st["misses"] == st["lookups"]


def test_counts_each_step_and_the_bytes_it_fetched():
    """Decode steps fetch exactly the routed experts the prefill did not leave in a slot; with every expert in a
    slot none crosses, and the bytes are the fetched experts' packed bytes."""
    kind, new = "mixtral", 8
    model = tiny_model(kind, layers=2, top_k=2, num_experts=4)
    handle = offload_experts(model, quant_cfg(kind, 4, device_fetch=True))
    try:
        greedy(model, prompt(), new)
        st = handle.stats()
        # the prefill (6 tokens) routed to some experts; its loads count as default-path misses
        assert st["device_fetches"] <= st["misses"]
        handle.reset_stats()
        greedy(model, prompt(), new)  # the prefill's loads, then the decode steps
        before = handle.stats()
        steps = new - 1  # the first new token comes from the prefill
        assert before["lookups"] >= steps * 2 * 2
        fetched = before["device_fetches"]
        assert before["bytes_h2d"] >= fetched * handle.cache.layout.nbytes
    finally:
        handle.close()


def test_everything_resident_fetches_nothing():
    kind = "qwen3_moe"
    model = tiny_model(kind, layers=2, top_k=4, num_experts=4)
    ids = prompt(length=24)  # a prefill long enough to route to all 4 experts of each layer
    ref, _ = decode(clone(model), quant_cfg(kind, 4), [ids])
    got, st = decode(model, quant_cfg(kind, 4, device_fetch=True), [ids])
    assert torch.equal(got[0][1], ref[0][1])
    assert st["device_fetches"] == 0 and st["resident_hit_rate"] > 0


def test_switched_on_and_off_between_generations():
    """The config switch is read at each step: off, on, off on one handle gives the default path's tokens each
    time (leaving device-fetched steps orders the next loads after them and rebuilds the tables)."""
    kind = "mixtral"
    model = tiny_model(kind, layers=3, top_k=2)
    prompts = [prompt(), prompt(length=8)[:, 2:], prompt(length=7)[:, 1:]]
    ref, _ = decode(clone(model), quant_cfg(kind, 1), prompts)
    handle = offload_experts(model, quant_cfg(kind, 1))
    try:
        for i, ids in enumerate(prompts):
            handle.cfg.device_fetch = i == 1
            seq, logits = greedy(model, ids, 10)
            assert torch.equal(seq, ref[i][0]) and torch.equal(logits, ref[i][1])
        assert handle.stats()["device_fetches"] > 0
    finally:
        handle.close()


def test_batch_decode_takes_the_default_path():
    """Several sequences a step: the default path (rounds, loads), the same tokens as without device_fetch."""
    kind = "mixtral"
    model = tiny_model(kind, layers=2, top_k=2)
    ids = prompt(batch=3)
    ref, _ = decode(clone(model), quant_cfg(kind, 2), [ids])
    got, st = decode(model, quant_cfg(kind, 2, device_fetch=True), [ids])
    assert torch.equal(got[0][0], ref[0][0]) and torch.equal(got[0][1], ref[0][1])
    assert st["device_fetches"] == 0


@pytest.mark.parametrize("moe,match", [
    ({"device_fetch": True}, "quant.bits"),
    ({"device_fetch": True, "quant": {"bits": 3, "group_size": 32}}, "quant.bits"),
    ({"device_fetch": True, "quant": {"bits": 4}, "cpu_compute": "misses"}, "cpu_compute"),
    ({"device_fetch": True, "quant": {"bits": 4}, "offload": {"device": "nvme", "nvme_path": "/tmp"}}, "NVMe"),
])
def test_config_refuses_what_it_cannot_run(moe, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        MaximusConfig.from_dict({"moe": moe})


@pytest.mark.gpu
@pytest.mark.parametrize("kind,top_k,slots,extra", [
    ("mixtral", 2, 1, {}), ("mixtral", 2, 3, {}), ("qwen3_moe", 4, 2, {}),
    ("mixtral", 2, 2, {"prefetch_skip_resident": True}), ("qwen3_moe", 4, 2, {"prefetch_top_k": 2}),
    ("mixtral", 2, 2, {"speculative_prefetch": False}), ("mixtral", 2, 2, {"device_fetch_refresh_tokens": 2})])
def test_same_tokens_and_logits_cuda(kind, top_k, slots, extra, monkeypatch):
    """On CUDA: the fetch kernel reads missed experts from the pinned CPU tier through their mapped address, the
    gemv reads them from the staging buffers or the slots, a right guess from the buffers the side stream fetched
    it into; bf16, bit for bit the default path's. With refreshes every 2 tokens, any count difference swaps:
    slot loads on the transfer stream under the device-fetched steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ds_maximus.experts import device_fetch
    monkeypatch.setattr(device_fetch, "SWAP_Z", 0.0)
    monkeypatch.setattr(device_fetch, "SWAP_MIN", 0.5)
    model = tiny_model(kind, "eager", layers=3, top_k=top_k, dtype=torch.bfloat16).cuda()
    prompts = [prompt(device="cuda"), prompt(length=9, device="cuda")[:, 3:]]
    ref, _ = decode(clone(model), quant_cfg(kind, slots), prompts, new_tokens=16)
    got, st = decode(model, quant_cfg(kind, slots, device_fetch=True, **extra), prompts, new_tokens=16)
    for (seq_r, log_r), (seq, log) in zip(ref, got):
        assert torch.equal(seq, seq_r)
        assert torch.equal(log, log_r)
    assert st["hits"] + st["misses"] == st["lookups"] and st["misses"] + st["prefetch_useful"] > 0
    if extra.get("speculative_prefetch", True):
        assert st["prefetch_issued"] > 0 and st["prefetch_useful"] > 0
    else:
        assert st["prefetch_issued"] == 0
    if "device_fetch_refresh_tokens" in extra:
        assert st["device_fetch_swaps"] > 0


def test_refresh_swaps_keep_the_default_paths_tokens(monkeypatch):
    """Refreshes every 2 tokens with any count difference taken as a reason to swap: slots change under the
    device-fetched steps (loads ordered after their readers, tables rebuilt), and every token and logit still
    equals the default path's."""
    from ds_maximus.experts import device_fetch
    monkeypatch.setattr(device_fetch, "SWAP_Z", 0.0)
    monkeypatch.setattr(device_fetch, "SWAP_MIN", 0.5)
    kind = "mixtral"
    model = tiny_model(kind, layers=3, top_k=2)
    prompts = [prompt(), prompt(length=9)[:, 3:]]
    ref, _ = decode(clone(model), quant_cfg(kind, 2), prompts, new_tokens=16)
    got, st = decode(model, quant_cfg(kind, 2, device_fetch=True, device_fetch_refresh_tokens=2), prompts,
                     new_tokens=16)
    for (seq_r, log_r), (seq, log) in zip(ref, got):
        assert torch.equal(seq, seq_r)
        assert torch.equal(log, log_r)
    assert st["device_fetch_swaps"] > 0
    assert st["hits"] + st["misses"] == st["lookups"]


def test_rebalance_loads_the_most_routed_and_ignores_noise():
    """A layer whose counts say one absent expert is routed to far more than a resident one swaps the two (the
    resident expert routed to least leaves); counts that differ by noise swap nothing; the counts then decay."""
    kind = "mixtral"
    model = tiny_model(kind, layers=2, top_k=2, num_experts=8)
    ref_model = clone(model)
    handle = offload_experts(model, quant_cfg(kind, 2, device_fetch=True))
    try:
        greedy(model, prompt(), 3)
        fetch, cache = handle.device_fetch, handle.cache
        fetch.flush()  # the decode steps' routing counted now, so the counts below are the whole story
        before = [cache.resident(g) for g in range(2)]
        absent = [e for e in range(8) if e not in before[0]]
        fetch.routed[0] = [8.0] * 8
        fetch.routed[0][absent[0]] = 40.0  # far above noise
        fetch.routed[0][before[0][1]] = 1.0
        fetch.routed[1] = [8.0 + (e % 3) for e in range(8)]  # noise
        assert fetch.rebalance()
        cache.synchronize()
        after = [cache.resident(g) for g in range(2)]
        assert after[0] == sorted([before[0][0], absent[0]])
        assert after[1] == before[1]
        assert fetch.swaps == 1 and fetch.routed[0][absent[0]] == 20.0
        # the swapped-in expert is read from its slot: the next steps give the default path's tokens
        seq, logits = greedy(model, prompt(length=8), 6)
    finally:
        handle.close()
    ref, _ = decode(ref_model, quant_cfg(kind, 2), [prompt(length=8)], new_tokens=6)
    assert torch.equal(seq, ref[0][0]) and torch.equal(logits, ref[0][1])
