"""The vocabulary tiers plan their host memory like the expert tier: a CPU-tier embedding or head that this host's
free memory cannot hold is a CapacityError with the numbers and the fix, raised before anything is allocated."""
import pytest
import torch

from ds_maximus.config import EmbeddingConfig
from ds_maximus.errors import CapacityError
from ds_maximus.partition import host_memory
from ds_maximus.vocab import ShardedEmbedding


@pytest.fixture
def tiny_host(monkeypatch):
    """A host reporting 2 GiB of MemAvailable (the plan keeps 1 GiB of it for the process)."""
    monkeypatch.setattr(host_memory, "mem_available_bytes", lambda *a, **k: 2 << 30)


def test_embedding_cpu_tier_refused_before_allocating(tiny_host, monkeypatch):
    allocated = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocated.append(a) or real_zeros(*a, **k))
    with pytest.raises(CapacityError, match=r"cpu tier needs .*GiB.*short by.*NVMe tier"):
        # 1M x 256 fp32 rows with two AdamW moments: 3 GiB
        ShardedEmbedding(1 << 20, 256, config=EmbeddingConfig(gpu_cache_rows=64))
    assert (1 << 20, 256) not in allocated, "nothing the size of the table was allocated"


def test_embedding_that_fits_is_built(tiny_host):
    emb = ShardedEmbedding(1024, 16, config=EmbeddingConfig(gpu_cache_rows=64))
    assert emb(torch.tensor([[1, 2, 3]])).shape == (1, 3, 16)


def test_cpu_head_tier_refused_with_the_fix(tiny_host):
    from ds_maximus.vocab.lm_head_tier import HeadTier
    with pytest.raises(CapacityError, match=r"head's fp32 master.*lm_head.placement"):
        HeadTier(torch.empty(1 << 19, 256, device="meta"), chunk_rows=4096)  # 4 x 0.5 GiB
