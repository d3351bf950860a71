"""The CPU tier of a ``placement: cpu`` LM head is the partition core's: its tables are a TensorTier (mapped
when first used, pinned where CUDA is), its compute-dtype copy is made the same way, and on a GPU its chunk
loads and gradient stores go through the core's transfer engine, with the bits of a plain copy and add."""
import pytest
import torch

from ds_maximus.vocab.lm_head_tier import HeadTier

V, D, CHUNK = 23, 6, 5


def _w0(seed=0):
    return torch.randn(V, D, generator=torch.Generator().manual_seed(seed))


def _table_ptr(tier, name):
    return tier.host_tier.host_table(name).whole.data_ptr()


def test_tables_are_the_tier_tables_and_mapped_when_first_used():
    w0 = _w0().to(torch.bfloat16)
    tier = HeadTier(w0, CHUNK, update_device="host")
    assert torch.equal(tier.weight, w0.float()) and tier.weight.dtype == torch.float32
    assert tier.weight.data_ptr() == _table_ptr(tier, "weight")
    assert tier.weight.is_pinned() == torch.cuda.is_available()
    tables = {n: tier.host_tier.host_table(n) for n in ("exp_avg", "exp_avg_sq", "grad")}
    assert all(t.allocated_bytes == 0 for t in tables.values()), "moments and gradient wait for their first use"
    assert tier.host_tier.plan.bytes_per_tier() == {"cpu": V * D * 16}
    tier.add_grad_(0, CHUNK, torch.ones(CHUNK, D))
    assert tier.grad.data_ptr() == _table_ptr(tier, "grad") and tables["exp_avg"].allocated_bytes == 0
    assert tier.step_(lr=0.1, weight_decay=0.0)
    assert tier.exp_avg.data_ptr() == _table_ptr(tier, "exp_avg")
    assert tier.exp_avg_sq.data_ptr() == _table_ptr(tier, "exp_avg_sq")


def test_the_weight_is_a_copy():
    w0 = _w0()
    tier = HeadTier(w0, CHUNK, update_device="host")
    w0.add_(1.0)
    assert torch.equal(tier.weight, _w0()) and tier.weight.data_ptr() != w0.data_ptr()


def test_compute_dtype_copy_is_the_cast_and_follows_the_step():
    tier = HeadTier(_w0(), CHUNK, update_device="host")
    rows = tier.host_rows(3, 11, torch.bfloat16)
    assert torch.equal(rows, tier.weight[3:11].to(torch.bfloat16))
    assert rows.is_pinned() == torch.cuda.is_available()
    tier.add_grad_(0, V, torch.randn(V, D))
    tier.step_(lr=0.1, weight_decay=0.01)
    assert torch.equal(tier._mirrors[torch.bfloat16], tier.weight.to(torch.bfloat16))


def test_state_without_moments_releases_them_and_the_next_step_starts_from_zeros():
    grad = torch.randn(V, D, generator=torch.Generator().manual_seed(1))
    used = HeadTier(_w0(), CHUNK, update_device="host")
    used.add_grad_(0, V, torch.ones(V, D))
    used.step_(lr=0.1, weight_decay=0.0)
    used.load_state_dict({"weight": _w0(), "exp_avg": None, "exp_avg_sq": None, "step": 0})
    assert used.exp_avg is None and used.host_tier.host_table("exp_avg").allocated_bytes == 0
    fresh = HeadTier(_w0(), CHUNK, update_device="host")
    for tier in (used, fresh):
        tier.add_grad_(0, V, grad)
        tier.step_(lr=0.1, weight_decay=0.01)
    for name in ("weight", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(used, name), getattr(fresh, name)), name


@pytest.mark.gpu
def test_gpu_chunks_in_and_gradients_out_through_the_transfer_engine():
    """Prefetched and fetched chunks are the host rows bit for bit; gradient chunks copied out (a fresh one,
    then one added on the GPU to what the tier holds) are the fp32 sums a CPU add gives; after sync nothing is
    in flight. One engine per device, with a write-back stream for the gradients."""
    tier = HeadTier(_w0(), CHUNK, update_device="host")
    chunks = [(lo, min(V, lo + CHUNK)) for lo in range(0, V, CHUNK)]
    for lo, hi in chunks:
        tier.prefetch(lo, hi, torch.device("cuda"), torch.bfloat16)
    for lo, hi in chunks:
        t = tier.fetch(lo, hi, torch.device("cuda"), torch.bfloat16)
        assert t.is_cuda and torch.equal(t.cpu(), tier.weight[lo:hi].to(torch.bfloat16))
    g = torch.Generator().manual_seed(2)
    parts = [[torch.randn(hi - lo, D, generator=g) for lo, hi in chunks] for _ in range(2)]
    for micro in parts:
        for (lo, hi), p in zip(chunks, micro):
            tier.add_grad_(lo, hi, p.cuda())
    tier.sync()
    want = torch.cat([a + b for a, b in zip(*parts)])
    assert torch.equal(tier.grad, want)
    assert not tier._pending and list(tier._transfers) == [torch.cuda.current_device()]
    assert tier._transfers[torch.cuda.current_device()].wb_stream is not None
    assert tier.counters["bytes_d2h"] == 2 * V * D * 4 and tier.counters["rows_fetched"] == V


@pytest.mark.gpu
def test_gpu_master_on_device_releases_the_host_weight_table():
    tier = HeadTier(_w0(), CHUNK, update_device="cuda", master_on_device=True)
    t = tier.fetch(0, CHUNK, torch.device("cuda"), torch.float32)
    assert tier.weight.is_cuda and torch.equal(t.cpu(), _w0()[:CHUNK])
    assert tier.host_tier.host_table("weight").allocated_bytes == 0
    assert torch.equal(tier.master_cpu(), _w0())
