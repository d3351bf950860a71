"""GPU versions of the key ShardedEmbedding tests (marker gpu; skipped where no CUDA is)."""
import pytest
import torch
from torch import nn

from ds_maximus.vocab import ShardedEmbedding
from emb_helpers import make_config, zipf_batch
from tests.helpers.models import assert_weights_close

pytestmark = pytest.mark.gpu


def _cuda_op_built():
    from ds_maximus.ops import row_ops as ops
    assert ops.load_op("cuda") is not None, "the CUDA op did not build (see the warning)"


@pytest.mark.parametrize("dim", [1, 3, 129, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_forward_equals_nn_embedding(dim, dtype):
    _cuda_op_built()
    ref = nn.Embedding(300, dim)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=128)).to("cuda", dtype)
    ref = ref.to("cuda", dtype)
    ids = torch.randint(0, 300, (4, 25), device="cuda")
    with torch.no_grad():
        assert torch.equal(emb(ids), ref(ids))


@pytest.mark.parametrize("cache_rows", [24, 200], ids=["heavy-eviction", "roomy"])
@pytest.mark.parametrize("dim", [3, 129, 256])
def test_gpu_exact_adamw_equals_dense(cache_rows, dim):
    g = torch.Generator().manual_seed(0)
    ref = nn.Embedding(200, dim)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=cache_rows, policy="lfu")).to("cuda")
    ref = ref.cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(50):
        ids = zipf_batch(g, 200, 20)
        lr = 1e-2 * (0.5 + 0.5 * torch.rand((), generator=g).item())
        for pg in opt.param_groups:
            pg["lr"] = lr
        if step % 2 == 0:
            emb.prefetch(ids)
        w = torch.randn(20, dim, generator=g).cuda()
        opt.zero_grad()
        (ref(ids.cuda()) * w).sum().backward()
        opt.step()
        (emb(ids.cuda()) * w).sum().backward()
        emb.sparse_step(lr=lr, weight_decay=0.1)
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach().cpu(), rtol=1e-5, atol=1e-6)
    s = emb.stats()
    assert s["rows_fetched"] > 0 and 0 <= s["hit_rate"] <= 1
    if cache_rows == 24:
        assert s["rows_evicted"] > 100


def test_gpu_lazy_equals_sparse_adam():
    g = torch.Generator().manual_seed(1)
    ref = nn.Embedding(100, 33, sparse=True)
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=20, mode="lazy")).to("cuda")
    ref = ref.cuda()
    opt = torch.optim.SparseAdam(ref.parameters(), lr=1e-2)
    for _ in range(20):
        ids = zipf_batch(g, 100, 12).cuda()
        w = torch.randn(12, 33, generator=g).cuda()
        opt.zero_grad()
        (ref(ids) * w).sum().backward()
        opt.step()
        (emb(ids) * w).sum().backward()
        emb.sparse_step(lr=1e-2, weight_decay=0.0)
    torch.testing.assert_close(emb.full_weight(), ref.weight.detach().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [1000, -3])
def test_gpu_bad_id_raises_index_error_and_gpu_survives(bad):
    emb = ShardedEmbedding(1000, 8, config=make_config(cache_rows=16)).to("cuda")
    with pytest.raises(IndexError, match="1000"):
        emb(torch.tensor([1, bad], device="cuda"))
    torch.cuda.synchronize()
    assert emb(torch.tensor([1, 2], device="cuda")).shape == (2, 8)  # no illegal address, still usable


def test_gpu_backward_segment_reduce_equals_dense_grad():
    ref = nn.Embedding(500, 64).cuda()
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=500))
    ids = torch.randint(0, 50, (8, 64), device="cuda")  # many duplicates
    w = torch.randn(8, 64, 64, device="cuda")
    (ref(ids) * w).sum().backward()
    (emb(ids) * w).sum().backward()
    torch.testing.assert_close(emb.grad.rows, ref.weight.grad[emb.grad.ids.cuda()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep", [True, False], ids=["grad-memory-kept", "grad-memory-anew"])
def test_gpu_staged_tier_update_equals_the_one_stream_path(keep, monkeypatch):
    """A tied head's gradient reaches every row: the rows outside the cache step through the staged-update pipeline
    (three streams, two staging sets) and give the same bits as the windows one after another on one stream
    (``keep``: the gradient's memory kept from step to step, written while the last step's updates may still read
    it on their stream)."""
    monkeypatch.setattr(ShardedEmbedding, "KEEP_GRAD_BUFFER", keep)

    def run(staged):
        g = torch.Generator().manual_seed(3)
        emb = ShardedEmbedding.from_embedding(nn.Embedding(1000, 48), make_config(cache_rows=64)).to("cuda")
        emb.staged_tier_update = staged
        for _ in range(4):
            ids = zipf_batch(g, 1000, 16).cuda()
            h = torch.randn(8, 48, generator=g).cuda()
            emb(ids).sum().backward()
            for lo in range(0, 1000, 300):
                hi = min(1000, lo + 300)
                w = emb.rows_for_compute(lo, hi, "cuda", torch.float32).requires_grad_(True)
                (h @ w.t()).pow(2).sum().backward()
                emb.add_dense_row_grad_(lo, hi, w.grad)
            emb.sparse_step(lr=1e-2, weight_decay=0.1)
        return emb
    torch.manual_seed(0)
    a = run(True)
    torch.manual_seed(0)
    b = run(False)
    assert a._tier_pipeline is not None and b._tier_pipeline is None
    assert torch.equal(a.full_weight(), b.full_weight())
    sa, sb = a.maximus_state_dict()["tensors"], b.maximus_state_dict()["tensors"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "anew"])
def test_gpu_tied_head_gradient_written_while_the_last_step_reads_it(keep, monkeypatch):
    """A tied head's step in its real order: the streamed head adds its gradient chunk by chunk in the forward
    (``add_head_grad_``), the lookup's lands on top in the backward, and the step of the rows outside the cache reads
    the gradient window by window on its own stream, into the next forward. With the gradient's memory kept
    (``KEEP_GRAD_BUFFER``), the next step's chunks are written into it while that stream may still read the last
    step's rows: each chunk waits only for the window that read its rows (``SparseRowGrad.read_on`` with ``upto``).
    A chunk written too early would step the rows after it with the next step's gradient: against ``nn.Embedding``
    + ``torch.optim.AdamW``, within the bounds above; kept, the ``[V, d]`` gradient is allocated once for every step."""
    _cuda_op_built()
    monkeypatch.setattr(ShardedEmbedding, "KEEP_GRAD_BUFFER", keep)
    g = torch.Generator().manual_seed(7)
    vocab, dim, steps, chunk = 65536, 256, 5, 8192
    ref = nn.Embedding(vocab, dim).cuda()
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=4096)).to("cuda")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    grads = set()
    for _ in range(steps):
        ids = zipf_batch(g, vocab, 2048).cuda()
        h = torch.randn(16, dim, generator=g).cuda()
        for lo in range(0, vocab, chunk):   # the head's forward, queued while the last step's copies run
            w = emb.rows_for_compute(lo, lo + chunk, "cuda", torch.float32).requires_grad_(True)
            (h @ w.t()).tanh().sum().backward()
            emb.add_head_grad_(torch.arange(lo, lo + chunk), w.grad)
        (h @ ref.weight.t()).tanh().sum().backward()
        (emb(ids).float().pow(2).sum() * 1e-3).backward()
        (ref(ids).pow(2).sum() * 1e-3).backward()
        grads.add(emb.grad.rows.data_ptr())
        opt.step()
        opt.zero_grad()
        emb.sparse_step(lr=1e-2, weight_decay=0.1)
        assert emb.cache._tier_event is not None  # the step's copies were left in flight
    assert_weights_close(emb.full_weight(), ref.weight.detach().cpu(), lr=1e-3)
    if keep:
        assert len(grads) == 1 and emb.grad._buf is not None


@pytest.mark.parametrize("keep", ["off", "on"], ids=["copied", "step-rows"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["lookup-fills", "prefetched"])
def test_gpu_tier_step_overlapping_the_next_forward_equals_dense_adamw(prefetch, keep):
    """The step of the rows outside the cache runs on side streams into the next forward (no host wait in
    ``sparse_step``): the next lookup's fills, a prefetch's fills and evictions, and the tied head's reads of the
    tier are ordered after it. A table large enough that its copies are still in flight when the next forward is
    queued, every row stepped each step (a tied head's gradient), its chunks' tier spans copied ahead on a side
    stream (``stage_rows_for_compute``), against ``nn.Embedding`` + ``torch.optim.AdamW``: summation-order noise
    (99.5% of elements within 1e-5), but no element a tenth of an lr step off, as a row read before or after the
    wrong step would be. ``keep: on`` (a tied head's ``lm_head.reuse_rows``): the step also leaves its rows' new
    weights in a table on the GPU, which the head's reads take instead of copies of the tier's spans."""
    _cuda_op_built()
    g = torch.Generator().manual_seed(5)
    vocab, dim, steps = 65536, 256, 5
    ref = nn.Embedding(vocab, dim).cuda()
    emb = ShardedEmbedding.from_embedding(ref, make_config(cache_rows=4096)).to("cuda")
    emb.keep_step_rows(keep)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    batches = [zipf_batch(g, vocab, 2048).cuda() for _ in range(steps + 1)]
    heads = [torch.randn(16, dim, generator=g).cuda() for _ in range(steps)]
    chunk = 16384
    if prefetch:
        emb.prefetch(batches[0])
    for k in range(steps):
        ids, h = batches[k], heads[k]
        (emb(ids).float().pow(2).sum() * 1e-3).backward()
        (ref(ids).pow(2).sum() * 1e-3).backward()
        if prefetch:
            emb.prefetch(batches[k + 1])
        logits_ref = h @ ref.weight.t()
        for lo in range(0, vocab, chunk):   # the tied head: every row read and given a gradient
            if lo + chunk < vocab:   # the next chunk's span copied ahead, as the streamed head asks for it
                emb.stage_rows_for_compute(lo + chunk, lo + 2 * chunk, "cuda")
                staged = any(key[:2] == (lo + chunk, lo + 2 * chunk) for key in emb._staged_spans)
                assert staged == (emb._step_rows is None)   # nothing to copy where the step left the rows
            w = emb.rows_for_compute(lo, lo + chunk, "cuda", torch.float32).requires_grad_(True)
            assert_weights_close(w.detach(), ref.weight[lo:lo + chunk].detach(), lr=1e-3)
            (h @ w.t()).tanh().sum().backward()
            emb.add_dense_row_grad_(lo, lo + chunk, w.grad)
        logits_ref.tanh().sum().backward()
        opt.step()
        opt.zero_grad()
        emb.sparse_step(lr=1e-2, weight_decay=0.1)
        assert emb.cache._tier_event is not None  # the step's copies were left in flight
        assert (emb._step_rows is not None) == (keep == "on")
        with torch.no_grad():  # the next forward, queued at once
            assert_weights_close(emb(batches[k + 1]).float(), ref(batches[k + 1]), lr=1e-3)
    assert_weights_close(emb.full_weight(), ref.weight.detach().cpu(), lr=1e-3)
