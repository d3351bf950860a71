"""linear_cross_entropy / ShardedLMHead against F.cross_entropy(hidden @ weight.T) (the reference)."""
import pytest
import torch
import torch.nn.functional as F

from ds_maximus.vocab import ShardedLMHead, linear_cross_entropy
from ds_maximus.vocab.linear_cross_entropy import linear_cross_entropy_reference
from tests.helpers.threads import torch_threads

IGN = -100


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one thread avoids OpenMP barrier stalls on a busy 2-core CI machine."""
    with torch_threads(1):
        yield


def _data(n, d, v, dtype=torch.float32, ignore_every=0, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, n, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.5).to(dtype).requires_grad_()
    y = torch.randint(0, v, (*lead, n), generator=g)
    if ignore_every:
        y.view(-1)[::ignore_every] = IGN
    return h, w, y


def _ref(h, w, y, **kw):
    """Plain F.cross_entropy on materialised logits, with grads (fp32)."""
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = linear_cross_entropy_reference(h2, w2, y, **kw)
    return loss, h2, w2


def _check(kw, n=37, d=16, v=101, chunk_rows=17, token_block=8, ignore_every=5, lead=(), rtol=1e-5, atol=1e-6):
    h, w, y = _data(n, d, v, ignore_every=ignore_every, lead=lead)
    loss = linear_cross_entropy(h, w, y, chunk_rows=chunk_rows, token_block=token_block, **kw)
    ref, h2, w2 = _ref(h, w, y, **kw)
    torch.testing.assert_close(loss, ref, rtol=rtol, atol=atol)
    go = torch.randn_like(loss) if loss.dim() else torch.tensor(1.3)
    loss.backward(go)
    ref.backward(go)
    torch.testing.assert_close(h.grad, h2.grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(w.grad, w2.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing,softcap", [(0.0, None), (0.1, None), (0.0, 4.0), (0.25, 2.5)])
def test_matches_cross_entropy_fp32(reduction, smoothing, softcap):
    _check(dict(reduction=reduction, label_smoothing=smoothing, logit_softcap=softcap))


@pytest.mark.parametrize("n,v,chunk_rows,token_block", [
    (1, 101, 17, None),      # N = 1
    (37, 101, 101, None),    # one chunk, one block
    (37, 101, 200, 5),       # chunk wider than V
    (64, 97, 10, 64),        # V not a multiple of the chunk
    (9, 3, 1, 2),            # tiny vocabulary, one row per chunk
])
def test_odd_shapes(n, v, chunk_rows, token_block):
    _check({}, n=n, v=v, chunk_rows=chunk_rows, token_block=token_block, ignore_every=0)


def test_leading_dims_and_ignore_index_value():
    _check(dict(ignore_index=IGN), n=11, lead=(3,), ignore_every=4)
    h, w, y = _data(8, 16, 50)
    y[2] = 7
    loss = linear_cross_entropy(h, w, y, ignore_index=7)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, y, ignore_index=7), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_grads(reduction):
    h, w, y = _data(6, 16, 50)
    y[:] = IGN
    loss = linear_cross_entropy(h, w, y, reduction=reduction)
    assert torch.all(loss == 0) and loss.shape == (() if reduction != "none" else y.shape)
    loss.sum().backward()
    assert h.grad is not None and torch.all(h.grad == 0)
    assert w.grad is None or torch.all(w.grad == 0)


def test_partial_requires_grad_and_no_grad():
    h, w, y = _data(12, 16, 60, ignore_every=3)
    w.requires_grad_(False)
    linear_cross_entropy(h, w, y, chunk_rows=7).backward()
    ref, h2, _ = _ref(h, w, y)
    ref.backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y), ref.detach(), rtol=1e-5, atol=1e-6)


def test_bad_label_raises_index_error():
    h, w, y = _data(5, 16, 50)
    y[1] = 50
    with pytest.raises(IndexError, match="50.*vocabulary of 50"):
        linear_cross_entropy(h, w, y)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y.clamp(max=49), reduction="avg")


def test_fp32_weight_grad_accumulator_and_bf16():
    """bf16: loss within 1e-2 relative and grads within 3e-2 of max |grad| of the fp32 reference."""
    h, w, y = _data(40, 32, 300, ignore_every=7)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    for fp32_acc in (False, True):
        hb.grad = wb.grad = None
        loss = linear_cross_entropy(hb, wb, y, chunk_rows=64, token_block=16, fp32_weight_grad=fp32_acc)
        loss.backward()
        assert wb.grad.dtype == torch.bfloat16 and hb.grad.dtype == torch.bfloat16
        ref, h2, w2 = _ref(hb.float(), wb.float(), y)
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-2, atol=0)
        for got, want in ((hb.grad, h2.grad), (wb.grad, w2.grad)):
            assert (got.float() - want).abs().max() <= 3e-2 * want.abs().max()


def test_fp16_recomputes_with_loss_scale():
    """fp16 folds grad_output (the loss scale) in before rounding: no underflow of softmax / n."""
    h, w, y = _data(40, 16, 300, ignore_every=3)
    hh, wh = h.detach().half().requires_grad_(), w.detach().half().requires_grad_()
    loss = linear_cross_entropy(hh, wh, y, chunk_rows=64, token_block=16)
    loss.backward(torch.tensor(1024.0))
    ref, h2, w2 = _ref(hh.float(), wh.float(), y)
    (ref * 1024).backward()
    torch.testing.assert_close(loss, ref, rtol=2e-3, atol=0)
    for got, want in ((hh.grad, h2.grad), (wh.grad, w2.grad)):
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()


# -- the module: resident, CPU tier (streamed), tied ---------------------------------------------------

def _heads(w, chunk_rows=96):
    gpu = ShardedLMHead(config={"chunk_rows": chunk_rows}, weight=w)
    cpu = ShardedLMHead(config={"chunk_rows": chunk_rows, "placement": "cpu"}, weight=w)
    return gpu, cpu


@pytest.mark.parametrize("kw", [{}, dict(reduction="sum", label_smoothing=0.1, logit_softcap=5.0),
                                dict(reduction="none")])
def test_streamed_from_cpu_tier_equals_resident(kw):
    h, w, y = _data(23, 16, 1000, ignore_every=4)
    gpu, cpu = _heads(w.detach())
    a = gpu(h, y, **kw)
    go = torch.randn_like(a) if a.dim() else torch.tensor(0.7)
    a.backward(go)
    gh_a = h.grad.clone()
    h.grad = None
    b = cpu(h, y, **kw)
    b.backward(go)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, gh_a, rtol=1e-5, atol=1e-6)
    ids, rows = cpu.sparse_grads()
    assert ids.tolist() == list(range(1000))
    torch.testing.assert_close(rows, gpu.weight.grad, rtol=1e-5, atol=1e-6)
    # logits for generation: the streamed head equals the plain matmul
    last = h[-3:].detach().unsqueeze(0)
    torch.testing.assert_close(cpu(last), last @ w.detach().T, rtol=1e-5, atol=1e-5)


def test_cpu_tier_step_equals_torch_adamw_and_state_round_trip():
    h, w, y = _data(20, 16, 300, ignore_every=3)
    cpu = ShardedLMHead(config={"chunk_rows": 64, "placement": "cpu"}, weight=w.detach())
    ref = torch.nn.Parameter(w.detach().clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(3):
        for micro in range(2):   # gradient accumulation over micro-batches
            hh = h[micro::2].detach()
            cpu(hh, y[micro::2]).backward()
            F.cross_entropy(hh @ ref.T, y[micro::2]).backward()
        n2 = float(cpu.sparse_grad_norm_sq())
        assert n2 == pytest.approx(float(ref.grad.pow(2).sum()), rel=1e-5)
        ids, rows = cpu.sparse_grads()            # the data-parallel round trip of the engine
        cpu.set_sparse_grads_(ids, rows * 2)
        cpu.scale_sparse_grads_(0.5)
        assert float(cpu.sparse_grad_norm_sq()) == pytest.approx(n2, rel=1e-6)
        assert cpu.sparse_grads_finite()
        cpu.sparse_step(lr=1e-2, weight_decay=0.1)
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(cpu.full_weight(), ref.detach(), rtol=1e-5, atol=1e-6)
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in cpu.maximus_state_dict().items()}
    other = ShardedLMHead(300, 16, config={"chunk_rows": 64, "placement": "cpu"})
    other.load_maximus_state_dict(state)
    torch.testing.assert_close(other.full_weight(), cpu.full_weight(), rtol=0, atol=0)
    assert other.tier.step == 3 and other.tier.lr_history == [1e-2] * 3
    assert set(ShardedLMHead(300, 16, config={"placement": "cpu"}).state_dict()) == {"weight"}
    assert cpu.stats()["steps"] == 3 and cpu.stats()["rows_fetched"] > 0


def test_tied_to_sharded_embedding_receives_both_gradients():
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.vocab import ShardedEmbedding
    v, d = 200, 16
    w0 = torch.randn(v, d) * 0.5
    emb = ShardedEmbedding(v, d, config=EmbeddingConfig(gpu_cache_rows=64), _weight=w0)
    head = ShardedLMHead(tied_to=emb, config={"chunk_rows": 48})
    ids = torch.randint(0, v, (3, 7))
    y = torch.randint(0, v, (3, 7))
    y[0, :2] = IGN
    x = emb(ids)
    loss = head(torch.tanh(x), y)
    loss.backward()
    ref_w = w0.clone().requires_grad_()
    ref = F.cross_entropy(torch.tanh(F.embedding(ids, ref_w)).reshape(-1, d) @ ref_w.T, y.reshape(-1))
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    gids, rows = emb.sparse_grads()
    dense = torch.zeros(v, d).index_add_(0, gids.cpu(), rows.cpu())
    torch.testing.assert_close(dense, ref_w.grad, rtol=1e-5, atol=1e-6)
    assert not head.owns_weights and head.placement == "tied"


def _counting_fetches(head):
    """Count ``head.source.fetch`` calls (patched on the instance)."""
    calls = []
    real = head.source.fetch

    def fetch(lo, hi, device, dtype):
        calls.append((lo, hi))
        return real(lo, hi, device, dtype)
    head.source.fetch = fetch
    return calls


def _tied_pair(reuse, v=200, d=16, chunk_rows=48):
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.vocab import ShardedEmbedding
    w0 = torch.randn(v, d, generator=torch.Generator().manual_seed(3)) * 0.5
    emb = ShardedEmbedding(v, d, config=EmbeddingConfig(gpu_cache_rows=64), _weight=w0)
    return emb, ShardedLMHead(tied_to=emb, config={"chunk_rows": chunk_rows, "reuse_rows": reuse})


@pytest.mark.parametrize("placement", ["tied", "cpu"])
def test_reused_rows_give_the_same_loss_and_gradients_with_one_fetch_per_chunk(placement):
    """``reuse_rows: on``: the backward takes the forward's chunks (no second fetch) and everything it computes is
    bit-identical to ``off``, for a tied head and a CPU-tier head."""
    v, d, n_chunks = 200, 16, 5                      # 48-row chunks: 4 full and one of 8 rows
    ids = torch.randint(0, v, (3, 7), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, v, (3, 7), generator=torch.Generator().manual_seed(2))
    y[0, :2] = IGN
    out = {}
    for reuse in ("off", "on"):
        if placement == "tied":
            emb, head = _tied_pair(reuse)
            x = torch.tanh(emb(ids))
        else:
            w = torch.randn(v, d, generator=torch.Generator().manual_seed(3))
            head = ShardedLMHead(config={"chunk_rows": 48, "placement": "cpu", "reuse_rows": reuse}, weight=w)
            x = torch.randn(3, 7, d, generator=torch.Generator().manual_seed(4)).requires_grad_()
        calls = _counting_fetches(head)
        loss = head(x, y)
        assert len(calls) == n_chunks
        loss.backward()
        assert len(calls) == (n_chunks if reuse == "on" else 2 * n_chunks)
        g = emb.sparse_grads() if placement == "tied" else head.sparse_grads()
        out[reuse] = (loss.detach(), g[0], g[1].detach(), None if placement == "tied" else x.grad)
    for a, b in zip(out["off"], out["on"]):
        if a is not None:
            assert torch.equal(a, b)


def test_tied_head_reads_the_rows_its_table_step_left_and_trains_the_same():
    """``reuse_rows: on`` with a tied table: each step leaves the new weights of the rows it stepped outside the
    cache in a table the head's next forward and backward read (no copy of a chunk from the tier), freed after
    the backward; losses and weights are bit-identical to ``off`` over several steps."""
    v = 200
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, v, (3, 7), generator=g), torch.randint(0, v, (3, 7), generator=g)) for _ in range(4)]
    out = {}
    for reuse in ("off", "on"):
        emb, head = _tied_pair(reuse)
        copies = []
        real = emb._copy_tier_rows
        emb._copy_tier_rows = lambda *a, **k: (copies.append(k.get("span", True)), real(*a, **k))
        losses = []
        for i, (ids, y) in enumerate(data):
            copies.clear()
            loss = head(torch.tanh(emb(ids)), y)
            loss.backward()
            losses.append(loss.detach())
            if reuse == "on":
                # the forward of step 0 copies every chunk; later ones read the table, patching the rows the step
                # did not write (cached during it, evicted by the next lookups) row by row
                assert copies.count(True) == (5 if i == 0 else 0)
                assert emb._step_rows is None                 # freed once the backward has read it
            emb.sparse_step(lr=1e-2)
            if reuse == "on":
                assert emb._step_rows is not None and bool(emb._step_rows[1].any())
        out[reuse] = (torch.stack(losses), emb.full_weight())
    assert torch.equal(out["on"][0], out["off"][0]) and torch.equal(out["on"][1], out["off"][1])


def test_step_table_is_brought_up_to_date_once_a_step_and_every_chunk_is_a_view_of_it():
    """With the step's table, the head's first chunk after a step writes the cached rows over the whole table once;
    the other chunks, forward and backward, are views of it (no bookkeeping per chunk), and each equals the rows as
    they are (``full_weight``), cached rows included."""
    emb, head = _tied_pair("on")
    g = torch.Generator().manual_seed(7)
    calls = []
    real = emb._current_rows_into
    emb._current_rows_into = lambda *a, **k: (calls.append(a[1:3]), real(*a, **k))
    for step in range(3):
        ids, y = torch.randint(0, 200, (3, 7), generator=g), torch.randint(0, 200, (3, 7), generator=g)
        calls.clear()
        x = torch.tanh(emb(ids))
        if step:
            table = emb._step_rows[0]
            got = [emb.rows_for_compute(lo, min(lo + 48, 200), torch.device("cpu"), torch.float32)
                   for lo in range(0, 200, 48)]
            assert calls == [(0, 200)]                     # one pass over every row, then views
            assert all(c.data_ptr() == table[lo:].data_ptr() for c, lo in zip(got, range(0, 200, 48)))
            assert torch.equal(torch.cat(got), emb.full_weight())
        head(x, y).backward()
        assert calls == ([(0, 200)] if step else [(lo, min(lo + 48, 200)) for lo in range(0, 200, 48)])
        emb.sparse_step(lr=1e-2)


def test_step_rows_are_not_read_where_a_row_left_the_cache_after_the_step():
    """A row cached during the step (so not stepped into the step's table) and evicted after it is read from the
    tier, where its eviction wrote it, into the table."""
    emb, head = _tied_pair("on")
    ids = torch.arange(0, 21).view(3, 7)
    head(torch.tanh(emb(ids)), ids).backward()
    emb.sparse_step(lr=1e-2)
    table, stepped, _ = emb._step_rows
    res = emb.cache.slots_of(torch.arange(200)) >= 0
    assert bool(res[:21].all()) and not bool(stepped[:21].any()) and bool(stepped[~res].all())
    emb.cache.clear()   # every cached row leaves the cache (written back to the tier)
    want = emb.full_weight()[:48]
    got = emb.rows_for_compute(0, 48, torch.device("cpu"), torch.float32)
    assert torch.equal(got, want)
    assert bool(emb._step_rows[1][:48].all())   # the 21 rows patched from the tier are in the table now
    assert torch.equal(emb._step_rows[0][:48], want)


def test_reused_rows_are_dropped_when_the_rows_changed_before_the_backward():
    """A backward after a step (the source's version moved) fetches the rows again, as ``off`` would."""
    emb, head = _tied_pair("on")
    calls = _counting_fetches(head)
    loss = head(torch.tanh(emb(torch.arange(10).view(2, 5))), torch.arange(10, 20).view(2, 5))
    head.source.version = lambda: -1
    loss.backward()
    assert len(calls) == 10


def test_reuse_rows_auto_keeps_nothing_on_the_cpu_and_a_bad_value_is_refused():
    from ds_maximus.errors import ConfigError
    emb, head = _tied_pair("auto")
    calls = _counting_fetches(head)
    head(torch.tanh(emb(torch.arange(10).view(2, 5))), torch.arange(10, 20).view(2, 5)).backward()
    assert len(calls) == 10
    with pytest.raises((ConfigError, ValueError), match="reuse_rows"):
        ShardedLMHead(tied_to=emb, config={"reuse_rows": "always"})


# -- GPU variants ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(label_smoothing=0.1, logit_softcap=30.0), dict(reduction="none")])
def test_gpu_fp32_matches_reference(kw):
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, y = _data(300, 64, 5000, ignore_every=9)
    h, w = h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_()
    y = y.cuda()
    loss = linear_cross_entropy(h, w, y, chunk_rows=1024, token_block=128, **kw)
    ref, h2, w2 = _ref(h, w, y, **kw)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("fp32_acc,factor", [(False, 4.0), (True, 1.5)])
def test_gpu_bf16_error_close_to_torch_bf16(fp32_acc, factor):
    """bf16 tolerance: each gradient's relative (Frobenius) error vs the fp32 reference is within ``factor``
    times that of torch's bf16 linear + F.cross_entropy (+1e-3): 4x when grad_W is accumulated over the
    8 token blocks in bf16 (one rounding per block), 1.5x with the fp32 accumulator; the loss within 2x."""
    h, w, y = _data(2048, 256, 32768, ignore_every=11)
    h, w, y = h.detach().cuda(), w.detach().cuda(), y.cuda()
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    ref, h32, w32 = _ref(hb.float(), wb.float(), y)
    ref.backward()
    hb2, wb2 = hb.detach().clone().requires_grad_(), wb.detach().clone().requires_grad_()
    tl = F.cross_entropy((hb2 @ wb2.T).float(), y)
    tl.backward()
    loss = linear_cross_entropy(hb, wb, y, chunk_rows=4096, token_block=256, fp32_weight_grad=fp32_acc)
    loss.backward()
    assert abs(loss.item() - ref.item()) <= 2 * abs(tl.item() - ref.item()) + 1e-4 * abs(ref.item())
    for ours, theirs, want in ((hb.grad, hb2.grad, h32.grad), (wb.grad, wb2.grad, w32.grad)):
        e_ours = (ours.float() - want).norm() / want.norm()
        e_torch = (theirs.float() - want).norm() / want.norm()
        assert e_ours <= factor * e_torch + 1e-3, (e_ours.item(), e_torch.item())
    from ds_maximus.vocab.lm_head_tiles import KERNELS
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    assert not KERNELS._broken and KERNELS._compiled, "the tile math should run compiled where Triton is"


@pytest.mark.gpu
def test_gpu_streamed_from_cpu_tier_equals_resident_bf16():
    h, w, y = _data(512, 128, 20000, ignore_every=5)
    h, y = h.detach().cuda().bfloat16().requires_grad_(), y.cuda()
    gpu = ShardedLMHead(config={"chunk_rows": 4096}, weight=w.detach().bfloat16(), device="cuda")
    cpu = ShardedLMHead(config={"chunk_rows": 4096, "placement": "cpu"}, weight=w.detach().bfloat16().float())
    a = gpu(h, y)
    a.backward()
    gh = h.grad.clone()
    h.grad = None
    b = cpu(h, y)
    b.backward()
    torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-3)
    assert (h.grad.float() - gh.float()).abs().max() <= 2e-2 * gh.float().abs().max()
    _, rows = cpu.sparse_grads()
    g = gpu.weight.grad.float().cpu()
    assert (rows - g).abs().max() <= 2e-2 * g.abs().max()
    cpu.sparse_step(lr=1e-3)
    assert torch.isfinite(cpu.full_weight()).all()


@pytest.mark.gpu
def test_gpu_reuse_rows_auto_keeps_the_chunks_when_they_fit_and_not_under_a_tight_cap():
    from ds_maximus.vocab.linear_cross_entropy import LCEOptions
    from ds_maximus.vocab.lm_head_stream import keeps_rows
    emb, head = _tied_pair("auto", v=20000, d=128, chunk_rows=4096)
    dev = torch.device("cuda", torch.cuda.current_device())
    opts = LCEOptions(chunk_rows=4096)
    assert keeps_rows("auto", head.source, 512, 128, dev, torch.bfloat16, opts)
    assert not keeps_rows("auto", head.source, 512, 128, torch.device("cpu"), torch.bfloat16, opts)
    free, total = torch.cuda.mem_get_info(dev)
    frac = torch.cuda.get_per_process_memory_fraction(dev)
    try:   # a cap just above what is allocated now: no room for the weight's 5 MB beside a 256 MiB margin
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated(dev) + 2 ** 20) / total, dev)
        assert not keeps_rows("auto", head.source, 512, 128, dev, torch.bfloat16, opts)
    finally:
        torch.cuda.set_per_process_memory_fraction(frac, dev)


@pytest.mark.gpu
def test_gpu_tied_head_reading_its_step_rows_trains_bit_identically():
    """A tied bf16 head over a CUDA table with ``reuse_rows`` on (the step's rows on the device, the forward's chunks
    kept for the backward) and off: the same losses and final weights, bit for bit, over steps whose lookups evict
    rows the step left out of its table."""
    from ds_maximus.config import EmbeddingConfig
    from ds_maximus.vocab import ShardedEmbedding
    v, d, steps = 40000, 128, 4
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(v, d, generator=g) * 0.05
    data = [(torch.randint(0, v, (4, 256), generator=g).cuda(), torch.randint(0, v, (4, 256), generator=g).cuda())
            for _ in range(steps)]
    out = {}
    # "off" first and again last, the last compared: a process's first step runs the tile math compiled for the first
    # tile's shape, which rounds other low bits than the dynamic-shape kernel of every later step (_Kernels._call)
    for reuse in ("off", "on", "off"):
        emb = ShardedEmbedding(v, d, config=EmbeddingConfig(gpu_cache_rows=2048), _weight=w0, device="cuda",
                               dtype=torch.bfloat16)
        head = ShardedLMHead(tied_to=emb, config={"chunk_rows": 8192, "reuse_rows": reuse})
        losses = []
        for ids, y in data:
            loss = head(torch.tanh(emb(ids)), y)
            loss.backward()
            losses.append(loss.detach())
            emb.sparse_step(lr=1e-2)
            assert (emb._step_rows is not None) == (reuse == "on")
        out[reuse] = (torch.stack(losses).cpu(), emb.full_weight())
    assert torch.equal(out["on"][0], out["off"][0]) and torch.equal(out["on"][1], out["off"][1])
