"""A batch with more distinct rows than the row cache holds is served (``on_overflow: serve``), bit-equal to a
cache that holds it all; ``on_overflow: error`` raises ``CapacityError``."""
import logging

import pytest
import torch
import torch.nn.functional as F

from ds_maximus.config import EmbeddingConfig
from ds_maximus.errors import CapacityError
from ds_maximus.vocab import ShardedEmbedding, ShardedLMHead

VOCAB, DIM = 600, 12


def make(cache_rows, mode="exact", policy="lfu", weight=None, device="cpu", **kw):
    cfg = EmbeddingConfig(gpu_cache_rows=cache_rows, cache_policy=policy,
                          optimizer={"mode": mode, "lr": 1e-2, "weight_decay": 0.1 if mode == "exact" else 0.0}, **kw)
    w = weight if weight is not None else torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0))
    return ShardedEmbedding(VOCAB, DIM, config=cfg, _weight=w).to(device)


def swinging_batches(cache_rows, steps, seed=1):
    """Batches whose distinct-row count swings from 10% to 300% of ``cache_rows`` (ids drawn without repeats
    then repeated, so each batch has exactly the count it names)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        frac = (0.1, 3.0, 0.5, 1.5, 2.2, 0.3, 1.0, 2.9)[i % 8]
        n = max(1, min(VOCAB, int(frac * cache_rows)))
        uniq = torch.randperm(VOCAB, generator=g)[:n]
        out.append(uniq[torch.randint(0, n, (n + n // 2,), generator=g)].clone().index_copy_(
            0, torch.arange(n), uniq))  # every id at least once
    return out


def run(emb, batches, micro=1, prefetch=False, head=None):
    """Train over ``batches`` (each split into ``micro`` micro-batches); returns every forward output.
    ``head``: a factory of a tied LM head for ``emb`` (the loss is then its cross-entropy)."""
    outs = []
    head = head(emb) if head is not None else None
    dev = emb.compute_device
    for i, ids in enumerate(batches):
        for j, mb in enumerate(ids.chunk(micro)):
            mb = mb.to(dev)
            g = torch.randn(mb.numel(), DIM, generator=torch.Generator().manual_seed(i * 7 + j)).to(dev)
            x = emb(mb)
            outs.append(x.detach().cpu().clone())
            if head is not None:
                loss = head(torch.tanh(x * g).view(1, -1, DIM), mb.view(1, -1).roll(1, 1))
            else:
                loss = (x * g).sum()
            loss.backward()
        if prefetch and i + 1 < len(batches):
            emb.prefetch(batches[i + 1].to(dev))
        emb.sparse_step()
    return outs


def assert_same_run(small, big, batches, **kw):
    a, b = run(small, batches, **kw), run(big, batches, **kw)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"lookup {i} differs"
    sa, sb = small.maximus_state_dict(), big.maximus_state_dict()
    for name in sa["tensors"]:
        assert torch.equal(sa["tensors"][name], sb["tensors"][name]), name
    assert torch.equal(sa["optimizer"]["last_step"], sb["optimizer"]["last_step"])


def test_regression_64_rows_195_distinct_ids():
    """The reported failure: 64 cache rows, one batch of 195 distinct ids raised CapacityError at once."""
    w = torch.randn(VOCAB, DIM)
    emb = make(64, weight=w)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:195]
    out = emb(ids)
    assert torch.equal(out, F.embedding(ids, w))
    out.sum().backward()
    emb.sparse_step()
    s = emb.stats()
    assert s["overflow_rows"] == 195 - 64 and s["overflow_batches"] == 1
    assert s["last_step"]["overflow_rows"] == 195 - 64
    assert int(emb.cache.map.pin_count.sum()) == 0


@pytest.mark.parametrize("mode", ["exact", "lazy"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("micro,prefetch", [(1, False), (2, False), (1, True)])
def test_overflow_equals_a_cache_that_holds_the_batch(mode, policy, micro, prefetch):
    """Forward outputs, table and optimizer state equal, bit for bit, a cache as large as the vocabulary,
    over batches of 10%-300% of the small cache, with micro-batches (rows pinned by the first) and with the
    next batch prefetched."""
    batches = swinging_batches(40, 16)
    small, big = make(40, mode, policy), make(VOCAB, mode, policy)
    assert_same_run(small, big, batches, micro=micro, prefetch=prefetch)
    assert small.stats()["overflow_batches"] >= 6 and big.stats()["overflow_rows"] == 0


@pytest.mark.parametrize("mode", ["exact", "lazy"])
def test_overflow_with_a_tied_lm_head(mode):
    """A tied ShardedLMHead reads and updates the same table (every row, most of them not cached)."""
    batches = swinging_batches(30, 8, seed=4)
    small, big = make(30, mode), make(VOCAB, mode)
    assert_same_run(small, big, batches, head=lambda emb: ShardedLMHead(tied_to=emb, config={"chunk_rows": 128}))
    assert small.stats()["overflow_rows"] > 0


def test_overflow_on_the_nvme_tier(tmp_path):
    batches = swinging_batches(32, 10, seed=6)
    off = {"device": "nvme", "nvme_path": str(tmp_path / "small"), "cpu_cache_shards": 2}
    small = make(32, rows_per_shard=64, offload=off)
    big = make(VOCAB, rows_per_shard=64, offload=dict(off, nvme_path=str(tmp_path / "big")))
    assert_same_run(small, big, batches, micro=2)
    assert small.stats()["overflow_rows"] > 0


def test_no_grad_lookup_overflows_too():
    w = torch.randn(VOCAB, DIM)
    emb = make(16, weight=w)
    ids = torch.arange(100)
    with torch.no_grad():
        assert torch.equal(emb(ids), F.embedding(ids, w))
    assert emb.stats()["overflow_rows"] == 84


def test_warns_once_naming_the_batch_and_a_cache_size_that_holds_it(caplog):
    emb = make(64)
    with caplog.at_level(logging.WARNING, logger="ds_maximus"):
        emb(torch.arange(195)).sum().backward()
        emb.sparse_step()
        emb(torch.arange(300)).sum().backward()
        emb.sparse_step()
    msgs = [r.getMessage() for r in caplog.records if "distinct embedding rows" in r.getMessage()]
    assert len(msgs) == 1
    assert "195 distinct" in msgs[0] and "gpu_cache_rows of at least 195" in msgs[0]
    assert emb.stats()["overflow_batches"] == 2


def test_warning_counts_rows_pinned_by_earlier_micro_batches(caplog):
    emb = make(64)
    with caplog.at_level(logging.WARNING, logger="ds_maximus"):
        emb(torch.arange(50)).sum().backward()              # 50 rows pinned until the step
        emb(torch.arange(100, 130)).sum().backward()         # 30 more: 80 > 64
    msg = next(r.getMessage() for r in caplog.records if "distinct embedding rows" in r.getMessage())
    assert "50 rows are pinned" in msg and "at least 80" in msg
    emb.sparse_step()
    assert int(emb.cache.map.pin_count.sum()) == 0


def test_error_mode_raises_capacity_error():
    emb = make(64, on_overflow="error")
    with pytest.raises(CapacityError, match=r"195 distinct.*gpu_cache_rows of at least 195.*on_overflow"):
        emb(torch.arange(195))
    assert int(emb.cache.map.pin_count.sum()) == 0
    emb(torch.arange(64)).sum().backward()  # a batch that fits still runs
    emb.sparse_step()


def test_on_overflow_is_a_validated_enum():
    from ds_maximus.config import MaximusConfig, OverflowPolicy
    from ds_maximus.errors import ConfigError
    cfg = MaximusConfig.from_ds_config({"maximus": {"embedding": {"on_overflow": "error"}}})
    assert cfg.embedding.on_overflow == OverflowPolicy.ERROR
    assert MaximusConfig.from_ds_config({"maximus": {}}).embedding.on_overflow == OverflowPolicy.SERVE
    with pytest.raises(ConfigError, match="on_overflow"):
        MaximusConfig.from_ds_config({"maximus": {"embedding": {"on_overflow": "drop"}}})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "lazy"])
@pytest.mark.parametrize("micro,prefetch", [(1, False), (2, False), (1, True)])
def test_gpu_overflow_equals_a_cache_that_holds_the_batch(mode, micro, prefetch):
    """On CUDA (pinned CPU tier, the copy kernels): every forward output bit-equal to a vocabulary-sized cache,
    and a final lookup of every row (each row brought current on the GPU in both) too."""
    batches = swinging_batches(40, 16)
    small, big = make(40, mode, device="cuda"), make(VOCAB, mode, device="cuda")
    a = run(small, batches, micro=micro, prefetch=prefetch)
    b = run(big, batches, micro=micro, prefetch=prefetch)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"lookup {i} differs"
    with torch.no_grad():
        every = torch.arange(VOCAB, device="cuda")
        assert torch.equal(small(every), big(every))
    assert small.stats()["overflow_batches"] >= 6


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("mode", ["exact", "lazy"])
def test_deepspeed_engine_with_overflowing_batches_equals_a_large_cache(mode, tie):
    """Through ``ds_maximus.initialize`` (ZeRO 2, gradient accumulation 2, clipping, a scheduler): a 16-row cache
    under batches of ~40 distinct ids gives the losses and table of a vocabulary-sized cache, bit for bit; with
    ``tie`` a tied ShardedLMHead shares the table."""
    from tests.engine.llama_utils import build, embedding_weight, maximus_section
    from tests.helpers.models import LLAMA_VOCAB as V
    from tests.helpers.models import train, zipf_batches
    batches = zipf_batches(12, batch=2, seqlen=32)
    runs = []
    for rows in (16, V):
        sec = maximus_section(cache_rows=rows, mode=mode)
        if tie:
            sec["lm_head"] = {"enabled": True, "chunk_rows": 128}
        engine = build(2, "fp32", gas=2, clip=0.5, maximus=sec, tie=tie)
        losses = train(engine, batches)
        emb = engine.module.model.embed_tokens
        assert not tie or getattr(engine.module.lm_head, "placement", None) == "tied"
        runs.append((losses, embedding_weight(engine), emb.stats()))
    (la, wa, sa), (lb, wb, sb) = runs
    assert la == lb
    assert torch.equal(wa, wb)
    assert sa["overflow_batches"] >= 6 and sb["overflow_rows"] == 0
