"""Checkpoints, the NVMe tier, the tied-head protocol and stats of ShardedEmbedding."""
import logging

import pytest
import torch
from torch import nn

from ds_maximus.config import MaximusConfig
from ds_maximus.vocab import ShardedEmbedding
from emb_helpers import make_config, zipf_batch


def _train(emb, seed, steps, vocab):
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        ids = zipf_batch(g, vocab, 8)
        w = torch.randn(8, emb.embedding_dim, generator=g)
        (emb(ids) * w).sum().backward()
        emb.sparse_step(lr=1e-2 * (1 + s % 3), weight_decay=0.05)


@pytest.mark.parametrize("mode", ["exact", "lazy"])
def test_state_round_trip_is_exact(mode):
    torch.manual_seed(0)
    a = ShardedEmbedding(40, 6, config=make_config(cache_rows=10, mode=mode))
    _train(a, 1, 12, 40)
    state = a.maximus_state_dict()
    b = ShardedEmbedding(40, 6, config=make_config(cache_rows=13, mode=mode, policy="lfu"))
    b.load_maximus_state_dict(state)
    _train(a, 2, 9, 40)
    _train(b, 2, 9, 40)
    sa, sb = a.maximus_state_dict(), b.maximus_state_dict()
    for k in sa["tensors"]:
        assert torch.equal(sa["tensors"][k], sb["tensors"][k]), k
    assert torch.equal(sa["optimizer"]["last_step"], sb["optimizer"]["last_step"])
    assert sa["optimizer"]["step"] == sb["optimizer"]["step"] == 21


def test_module_state_dict_holds_fp32_weight_and_loads():
    ref = nn.Embedding(30, 4)
    a = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=8)).to(torch.bfloat16)
    _train(a, 3, 5, 30)
    sd = a.state_dict()
    assert list(sd) == ["weight"] and sd["weight"].dtype == torch.float32
    assert torch.equal(sd["weight"], a.full_weight())
    assert list(a.parameters()) == [] and list(a.buffers()) == []
    b = ShardedEmbedding(30, 4, config=make_config(cache_rows=8))
    b.load_state_dict(sd)
    assert torch.equal(b.full_weight(), sd["weight"])
    nn.Embedding(30, 4).load_state_dict(sd)  # HF-style save is an ordinary embedding checkpoint


def test_nvme_tier_equals_cpu_tier(tmp_path):
    ref = nn.Embedding(70, 5)
    cpu = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=12))
    nvme_cfg = make_config(cache_rows=12, rows_per_shard=16,
                           offload={"device": "nvme", "nvme_path": str(tmp_path / "emb"), "cpu_cache_shards": 2})
    nvme = ShardedEmbedding.from_embedding(ref, nvme_cfg)
    _train(cpu, 4, 15, 70)
    _train(nvme, 4, 15, 70)
    assert nvme.tier.shard_writes > 0 and nvme.tier.shard_reads > 5  # shards really cycled through the disk
    assert torch.equal(cpu.full_weight(), nvme.full_weight())
    s_cpu, s_nvme = cpu.maximus_state_dict(), nvme.maximus_state_dict()
    for k in s_cpu["tensors"]:
        assert torch.equal(s_cpu["tensors"][k], s_nvme["tensors"][k])
    nvme.flush()
    from ds_maximus.store import ShardStore
    assert torch.equal(ShardStore.open(str(tmp_path / "emb")).read_all("weight"), s_cpu["tensors"]["weight"])


@pytest.mark.parametrize("staged", [False, True, "windows-capped"])
def test_tied_head_protocol_equals_dense(staged, monkeypatch):
    """rows_for_compute + add_dense_row_grad_ (a tied LM head) and the embedding's own grads, vs dense AdamW.
    ``staged``: the rows outside the cache (the head's gradient reaches every row) step through the staged-update
    pipeline, as on a GPU (its CPU twin: the same windows, copied into staging sets and back); ``windows-capped``:
    windows of at most ``TIER_WINDOW_ROWS`` rows, fewer than the cache holds."""
    if staged == "windows-capped":
        monkeypatch.setattr(ShardedEmbedding, "TIER_WINDOW_ROWS", 4)
        staged = True
    g = torch.Generator().manual_seed(9)
    ref = nn.Embedding(24, 4)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=6))
    emb.staged_tier_update = staged
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(6):
        ids = torch.randint(0, 24, (5,), generator=g)
        h = torch.randn(3, 4, generator=g)
        opt.zero_grad()
        (ref(ids).sum() + (h @ ref.weight.t()).pow(2).sum()).backward()
        opt.step()
        emb(ids).sum().backward()
        for lo in range(0, 24, 10):  # the head streams vocab chunks
            hi = min(24, lo + 10)
            w = emb.rows_for_compute(lo, hi, "cpu", torch.float32).requires_grad_(True)
            (h @ w.t()).pow(2).sum().backward()
            emb.add_dense_row_grad_(lo, hi, w.grad)
        emb.sparse_step(lr=1e-2, weight_decay=0.1)
    torch.testing.assert_close(emb.rows_for_compute(0, 24), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    assert (emb._tier_pipeline is not None) == staged  # the staged run went through the pipeline


def test_grad_scaling_and_finiteness_protocol():
    emb = ShardedEmbedding(10, 3, config=make_config(cache_rows=10))
    emb(torch.tensor([1, 2, 2])).sum().backward()
    n = emb.sparse_grad_norm_sq().item()
    assert n == pytest.approx(3 * 1 + 3 * 4)
    emb.scale_sparse_grads_(0.5)
    assert emb.sparse_grad_norm_sq().item() == pytest.approx(n / 4)
    assert emb.sparse_grads_finite()
    emb.scale_sparse_grads_(float("inf"))
    assert not emb.sparse_grads_finite()
    emb.zero_sparse_grads()
    assert emb.sparse_grad_norm_sq().item() == 0 and int(emb.cache.map.pin_count.sum()) == 0


def test_stats_and_log_line(caplog):
    cfg = MaximusConfig.from_dict({"embedding": {"gpu_cache_rows": 16, "optimizer": {"lr": 0.01}},
                                   "logging": {"interval_steps": 2}})
    emb = ShardedEmbedding(64, 4, config=cfg)
    with caplog.at_level(logging.INFO, logger="ds_maximus"):
        _train(emb, 5, 4, 64)
    lines = [r.message for r in caplog.records if "ShardedEmbedding" in r.message]
    assert len(lines) == 2 and "hit" in lines[0]
    s = emb.stats()
    for k in ("hit_rate", "rows_fetched", "rows_evicted", "bytes_h2d", "bytes_d2h", "stall_ms", "row_sparsity"):
        assert k in s and k in s["last_step"]
    assert 0 < s["hit_rate"] < 1 and 0 < s["row_sparsity"] < 1 and s["steps"] == 4
    assert s["bytes_h2d"] == s["rows_fetched"] * 4 * 4 * 3
