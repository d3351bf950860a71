"""ShardedEmbedding against nn.Embedding + torch optimizers (CPU; the same code path as the GPU cache)."""
import pytest
import torch
from torch import nn

from ds_maximus.errors import CapacityError
from ds_maximus.vocab import ShardedEmbedding
from emb_helpers import make_config, train_pair, zipf_batch


@pytest.mark.parametrize("dim", [1, 3, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_equals_nn_embedding(dim, dtype):
    torch.manual_seed(0)
    ref = nn.Embedding(50, dim)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=20))
    ref = ref.to(dtype)
    emb = emb.to(dtype)
    ids = torch.randint(0, 50, (3, 5))
    with torch.no_grad():
        assert torch.equal(emb(ids), ref(ids))
        assert emb(ids).dtype == dtype


@pytest.mark.parametrize("dim", [1, 129])
def test_backward_equals_dense_gradient_on_touched_rows(dim):
    torch.manual_seed(1)
    ref = nn.Embedding(40, dim)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=40))
    ids = torch.randint(0, 40, (4, 9))
    w = torch.randn(4, 9, dim)
    (ref(ids) * w).sum().backward()
    (emb(ids) * w).sum().backward()
    touched = torch.unique(ids)
    assert torch.equal(emb.grad.ids, touched)
    assert torch.equal(emb.grad.rows, ref.weight.grad[touched])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[touched] = False
    assert ref.weight.grad[untouched].abs().sum() == 0
    assert torch.allclose(emb.sparse_grad_norm_sq(), ref.weight.grad.pow(2).sum())


@pytest.mark.parametrize("cache_rows", [12, 64], ids=["heavy-eviction", "roomy"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("dim", [3, 129])
def test_exact_adamw_equals_dense_adamw(cache_rows, policy, dim):
    g = torch.Generator().manual_seed(7)
    vocab, steps = 64, 50
    ref = nn.Embedding(vocab, dim)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=cache_rows, policy=policy))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    batches = [zipf_batch(g, vocab, 10).view(2, 5) for _ in range(steps)]
    lrs = [1e-2 * (0.5 + 0.5 * torch.rand((), generator=g).item()) for _ in range(steps)]
    train_pair(emb, ref, opt, batches, lrs, wd=0.1)
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    if cache_rows == 12:
        assert emb.stats()["rows_evicted"] > 50
    st = emb.maximus_state_dict()["tensors"]
    torch.testing.assert_close(st["exp_avg"], opt.state[ref.weight]["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(st["exp_avg_sq"], opt.state[ref.weight]["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_gradient_accumulation_over_micro_batches():
    g = torch.Generator().manual_seed(3)
    ref = nn.Embedding(32, 5)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=32))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    batches = [torch.randint(0, 32, (4, 3), generator=g) for _ in range(6)]
    train_pair(emb, ref, opt, batches, [1e-2] * 6, wd=0.01, micro=2)
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_lazy_equals_sparse_adam():
    g = torch.Generator().manual_seed(5)
    ref = nn.Embedding(48, 7, sparse=True)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=10, mode="lazy"))
    opt = torch.optim.SparseAdam(ref.parameters(), lr=3e-2)
    batches = [zipf_batch(g, 48, 8).view(2, 4) for _ in range(30)]
    train_pair(emb, ref, opt, batches, [3e-2] * 30, wd=0.0)
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_adagrad_equals_torch_adagrad():
    g = torch.Generator().manual_seed(6)
    ref = nn.Embedding(30, 4)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=8, opt="adagrad"))
    opt = torch.optim.Adagrad(ref.parameters(), lr=5e-2, weight_decay=0.05, eps=1e-8, foreach=False)
    batches = [torch.randint(0, 30, (6,), generator=g) for _ in range(20)]
    train_pair(emb, ref, opt, batches, [5e-2] * 20, wd=0.05)
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_padding_row_never_changes():
    g = torch.Generator().manual_seed(8)
    ref = nn.Embedding(20, 6, padding_idx=3)
    with torch.no_grad():
        ref.weight[3] = 0.25  # a non-zero padding row must stay exactly as it is
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=8))
    before = emb.full_weight()[3].clone()
    for _ in range(10):
        ids = torch.randint(0, 20, (5,), generator=g)
        ids[0] = 3
        emb(ids).pow(2).sum().backward()
        emb.sparse_step(lr=0.1, weight_decay=0.5)
    w = emb.full_weight()
    assert torch.equal(w[3], before)
    assert not torch.equal(w[4:], ref.weight.detach()[4:])


@pytest.mark.parametrize("bad", [20, 1000, -1])
def test_out_of_range_id_raises_index_error(bad):
    emb = ShardedEmbedding(20, 4, config=make_config(cache_rows=8))
    with pytest.raises(IndexError, match=rf"{bad}.*20|20.*{bad}"):
        emb(torch.tensor([1, bad, 2]))
    with pytest.raises(IndexError):
        emb.prefetch(torch.tensor([bad]))


def test_batch_larger_than_cache_raises_capacity_error():
    """With ``on_overflow: error`` (the default serves it: tests/vocab/test_overflow.py)."""
    emb = ShardedEmbedding(50, 4, config=make_config(cache_rows=4, on_overflow="error"))
    with pytest.raises(CapacityError, match="gpu_cache_rows"):
        emb(torch.arange(10))


def test_prefetch_then_forward_hits():
    emb = ShardedEmbedding(100, 4, config=make_config(cache_rows=32))
    ids = torch.tensor([5, 7, 9, 7])
    emb.prefetch(ids)
    fetched = emb.cache.traffic.rows_fetched
    with torch.no_grad():
        out = emb(ids)
    assert emb.cache.traffic.rows_fetched == fetched == 3
    assert emb.cache.counters.hits == 3
    torch.testing.assert_close(out, emb.full_weight()[ids])
    assert int(emb.cache.map.pin_count.sum()) == 0


def test_prefetch_is_adopted_by_the_lookup_and_counted_once():
    emb = ShardedEmbedding(100, 4, config=make_config(cache_rows=32))
    ref = emb.full_weight()
    emb.prefetch(torch.tensor([5, 7, 9, 7]))
    out = emb(torch.tensor([[9, 5], [7, 7]]))
    torch.testing.assert_close(out, ref[torch.tensor([[9, 5], [7, 7]])])
    out.sum().backward()
    c = emb.cache.counters
    assert (c.lookups, c.misses, c.hits) == (3, 3, 0)  # the prefetch counted them; the lookup did not again
    assert not emb._prefetched and int(emb.cache.map.pin_count.sum()) == 3  # pinned until the step
    emb.sparse_step(lr=0.1)
    assert int(emb.cache.map.pin_count.sum()) == 0
    emb.prefetch(torch.tensor([5, 9]))
    emb(torch.tensor([5, 9])).sum().backward()
    emb.sparse_step(lr=0.1)
    assert (c.lookups, c.hits) == (5, 2) and int(emb.cache.map.pin_count.sum()) == 0
    # a lookup of other ids than the prefetched ones still releases the prefetch's pins
    emb.prefetch(torch.tensor([1, 2]))
    emb(torch.tensor([1, 2, 3])).sum().backward()
    emb.sparse_step(lr=0.1)
    assert not emb._prefetched and int(emb.cache.map.pin_count.sum()) == 0


@pytest.mark.parametrize("mode", ["exact", "lazy"])
def test_rows_outside_the_cache_are_stepped_like_dense(device, mode):
    """Data parallel: after the gradient all-reduce a rank steps rows it never looked up, most of them not in
    its cache. They are stepped without taking slots (on the GPU when there is one), equal to dense AdamW
    (exact) or SparseAdam (lazy), skipped steps replayed."""
    from ds_maximus.distributed.sparse_grads import merge_rows
    g = torch.Generator().manual_seed(5)
    vocab, dim = 200, 33
    ref = nn.Embedding(vocab, dim)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=24, mode=mode)).to(device)
    ref = ref.to(device)
    dense = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False) if mode == "exact" \
        else torch.optim.SparseAdam(ref.parameters(), lr=1e-2)
    for step in range(30):
        own = zipf_batch(g, vocab, 12).to(device)
        (emb(own) * torch.randn(12, dim, generator=g).to(device)).sum().backward()
        ids, rows = emb.sparse_grads()
        other = torch.randint(0, vocab, (16,), generator=g)  # "another rank's" rows, mostly not cached here
        dev = rows.device
        ids, rows = merge_rows(torch.cat([ids.to(dev), other.to(dev)]),
                               torch.cat([rows, torch.randn(16, dim, generator=g).to(dev)]))
        emb.set_sparse_grads_(ids, rows)
        emb.sparse_step(lr=1e-2, weight_decay=0.1 if mode == "exact" else 0.0)
        grad = torch.zeros(vocab, dim, device=device).index_add_(0, ids.to(device), rows.to(device))
        ref.weight.grad = grad if mode == "exact" else grad.to_sparse()
        dense.step()
    assert emb.stats()["rows_fetched"] > 0
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_exact_adamw_with_the_next_batch_prefetched_equals_dense(device, policy):
    """The loader's pattern: ``prefetch(batch t+1)`` before step t. The optimizer step leaves the prefetched
    rows alone (it would wait on the GPU for their fills, which are still crossing the link); the next lookup
    replays their skipped steps, after the host sync it makes anyway."""
    g = torch.Generator().manual_seed(11)
    vocab, dim, steps = 120, 33, 40
    ref = nn.Embedding(vocab, dim)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=40, policy=policy)).to(device)
    ref = ref.to(device)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    batches = [zipf_batch(g, vocab, 16) for _ in range(steps + 1)]
    replays, replayed_by_lookups = [], 0
    real = emb.optimizer.catch_up

    def counted(w, states, slots, ids, **kw):
        lag = real(w, states, slots, ids, **kw)
        replays.append(int(lag.sum()))
        return lag
    emb.optimizer.catch_up = counted
    for step in range(steps):
        lr = 1e-2 * (0.5 + 0.5 * torch.rand((), generator=g).item())
        opt.param_groups[0]["lr"] = lr
        emb.prefetch(batches[step + 1])
        if emb.cache.cuda:  # on a GPU the prefetch replays the rows it brings in, on the fill stream
            assert not emb.optimizer.lagging(emb.cache.last_misses[0]).any()
        w = torch.randn(16, dim, generator=g).to(device)
        opt.zero_grad()
        (ref(batches[step].to(device)) * w).sum().backward()
        opt.step()
        replays.clear()
        (emb(batches[step].to(device)) * w).sum().backward()
        replayed_by_lookups += sum(replays)
        replays.clear()
        emb.sparse_step(lr=lr, weight_decay=0.1)
        assert replays == [], "the optimizer step replayed rows: it must not wait for the next batch's fills"
    assert replayed_by_lookups > 0
    assert emb.stats()["rows_evicted"] > 50
    emb.prefetch(batches[0])  # rows in flight when the whole table is read: it waits for them
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach().cpu(), rtol=1e-5, atol=1e-6)


def test_weight_is_the_whole_table_and_trains_like_nn_embedding(device):
    """``emb.weight`` (code written for nn.Embedding reads it: Llama-4 its device, Gemma-4 its pad row) behaves as
    nn.Embedding's weight: its metadata, the rows it indexes, and any other use; under grad mode a loss through it
    sends nn.Embedding's gradient to the rows, beside the lookup's (the padding row's too: indexing is no lookup).
    Metadata and row reads build no table; ``plain_weight``, for our own scans, builds nothing."""
    from ds_maximus.vocab import plain_weight
    torch.manual_seed(3)
    ref = nn.Embedding(30, 5, padding_idx=0)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=8)).to(device)
    ref = ref.to(device)
    w = emb.weight
    assert (w.shape, w.dtype, w.device, w.requires_grad, w.dim(), len(w)) == ((30, 5), torch.float32,
                                                                            emb.compute_device, True, 2, 30)
    assert plain_weight(emb) is None
    with torch.no_grad():
        assert torch.equal(emb.weight[4], ref.weight[4]) and torch.equal(emb.weight[-1, :], ref.weight[-1])
        assert torch.equal(emb.weight[torch.tensor([2, 9, 2])], ref.weight[[2, 9, 2]])
        assert torch.equal(emb.weight.t(), ref.weight.t()) and torch.equal(emb.weight[3:7], ref.weight[3:7])
    with pytest.raises(IndexError):
        emb.weight[30]
    with torch.no_grad():   # writes would go to a copy: refused, never lost
        for write in (lambda w: w.__setitem__(2, 0.0), lambda w: w.data.__setitem__(slice(0, 2), 1.0),
                      lambda w: w.normal_(), lambda w: nn.init.zeros_(w), lambda w: w.copy_(ref.weight)):
            with pytest.raises(TypeError, match="read-only view"):
                write(emb.weight)
        assert torch.equal(emb.weight[2], ref.weight[2]) and torch.equal(emb.weight.data[5], ref.weight[5])
    built = []
    emb.compute_weight = lambda f=emb.compute_weight: built.append(1) or f()
    ids = torch.tensor([[1, 2, 2, 7]], device=device)
    x = torch.randn(1, 4, 5).to(device)

    def loss(m):  # a lookup, rows read through .weight (Gemma-4's pad row), and a use of the whole table
        w = m.weight
        return ((m(ids) * x).sum() + (w[0, :] * x[0, 0]).sum() + (w[torch.tensor([3, 3, 8])] * x[0, 1:]).sum()
                + w.sum() * 0.5)
    loss(ref).backward()
    loss(emb).backward()
    assert len(built) == 1   # only w.sum() built the table
    rows = torch.zeros(30, 5, device=emb.grad.rows.device)
    rows[emb.grad.ids.to(rows.device)] = emb.grad.rows
    torch.testing.assert_close(rows, ref.weight.grad.to(rows.device))
