"""The maximus_row_ops ops (CPU op here, CUDA op under marker gpu) against the PyTorch reference."""
import pytest
import torch

from ds_maximus.ops import row_ops as ops
from ds_maximus.vocab import reference as ref


def _op(kind):
    op = ops.load_op(kind)
    if op is None:
        pytest.fail(f"maximus_row_ops {kind} op did not build (see the warning above)")
    return op


def _devices():
    return ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dim", [1, 3, 129, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_bit_exact(device, dim, dtype):
    op = _op(device)
    g = torch.Generator().manual_seed(dim)
    table = torch.randn(40, dim, generator=g).to(device)
    slots = torch.randperm(40, generator=g)[:11].to(device)
    inverse = torch.randint(0, 11, (57,), generator=g).to(device)
    out = torch.empty(57, dim, dtype=dtype, device=device)
    op.gather(table, slots, inverse, out)
    assert torch.equal(out, ref.gather_ref(table, slots, inverse, dtype))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dim", [1, 3, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_segment_reduce_matches_reference(device, dim, dtype):
    _op(device)
    g = torch.Generator().manual_seed(dim + 1)
    grad = torch.randn(300, dim, generator=g).to(dtype).to(device)
    inverse = torch.randint(0, 17, (300,), generator=g)
    inverse[:17] = torch.arange(17)  # every segment non-empty
    inverse = inverse.to(device)
    got = ops.segment_reduce(grad, inverse, 17)
    want = ref.segment_reduce_ref(grad.cpu(), inverse.cpu(), 17)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)  # same summation order: bit exact



@pytest.mark.gpu
@pytest.mark.parametrize("n", [0, 1, 7, 4099])
def test_planned_segment_reduce_equals_the_reference(n):
    """The CUDA backward with the lookup's host plan (order and offsets uploaded) against the reference
    segment sum, bit for bit; a hot id with thousands of tokens spans the unrolled loop."""
    from ds_maximus.vocab.function import BatchPlanner
    _op("cuda")
    g = torch.Generator().manual_seed(n)
    flat = torch.randint(0, 50, (n,), generator=g)
    if n > 100:
        flat[: n // 2] = 3  # one hot id
    plan = BatchPlanner(50).plan(flat.numpy(), "cuda")
    want_u, want_inv = torch.unique(flat, sorted=True, return_inverse=True)
    assert torch.equal(plan.uniq, want_u) and torch.equal(plan.inverse.cpu(), want_inv)
    grad = torch.randn(n, 4100, generator=g)  # not a multiple of the column tile
    got = ops.segment_reduce(grad.cuda(), plan.inverse, plan.uniq.numel(), order=plan.order, offsets=plan.offsets)
    torch.testing.assert_close(got.cpu(), ref.segment_reduce_ref(grad, want_inv, plan.uniq.numel()), rtol=0, atol=0)


def _tables(opt, g, rows=24, dim=5, device="cpu"):
    w = torch.randn(rows, dim, generator=g)
    s0 = torch.rand(rows, dim, generator=g) * 0.1 - 0.05
    s1 = torch.rand(rows, dim, generator=g) * 0.01
    if opt == ref.ADAGRAD:
        s0 = s1.clone()
    return [t.to(device) for t in (w, s0, s1)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("opt,lazy", [(ref.ADAMW, False), (ref.ADAMW, True), (ref.ADAGRAD, False)])
@pytest.mark.parametrize("has_grad", [True, False])
@pytest.mark.parametrize("dim", [1, 3, 129])
def test_row_update_matches_reference(device, opt, lazy, has_grad, dim):
    op = _op(device)
    if lazy and not has_grad:
        pytest.skip("lazy mode has no replay-only call")
    g = torch.Generator().manual_seed(11 * dim + opt)
    step = 9
    lr_hist = torch.cat([torch.zeros(1), torch.rand(step, generator=g) * 1e-2 + 1e-3]).double()
    wd_hist = torch.cat([torch.zeros(1), torch.rand(step, generator=g) * 0.2]).double()
    slots = torch.tensor([3, 0, 17, 9, 21])
    last = torch.tensor([0, 8, 3, 7, 1]) if has_grad else torch.tensor([0, 9, 3, 8, 1])
    grads = torch.randn(5, dim, generator=g) if has_grad else None
    kw = dict(step=step, lr=float(lr_hist[step]), weight_decay=float(wd_hist[step]), beta1=0.9, beta2=0.99, eps=1e-8,
              optimizer=opt, lazy=lazy)
    want = _tables(opt, torch.Generator().manual_seed(5), dim=dim)
    ref.row_update_ref(want[0], want[1:3] if opt == ref.ADAMW else want[1:2], slots, grads, last,
                       lr_hist=lr_hist, wd_hist=wd_hist, **kw)
    got = _tables(opt, torch.Generator().manual_seed(5), dim=dim, device=device)
    dev = lambda t: t.to(device) if t is not None else None  # noqa: E731
    empty = torch.empty(0, device=device)
    op.row_update(got[0], got[1], got[2] if opt == ref.ADAMW else empty, dev(slots),
                  dev(grads) if has_grad else empty, dev(last), dev(lr_hist), dev(wd_hist), step, kw["lr"],
                  kw["weight_decay"], 0.9, 0.99, 1e-8, opt, lazy, has_grad)
    rtol, atol = (2e-6, 1e-7) if device == "cpu" else (1e-5, 1e-6)  # nvcc contracts to FMA
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=atol)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    fresh = _tables(opt, torch.Generator().manual_seed(5), dim=dim)
    assert torch.equal(got[0].cpu()[untouched], fresh[0][untouched])


@pytest.mark.parametrize("dim", [5, 37, 4099])
def test_bf16_shadow_rounds_every_bit_pattern_like_torch(dim):
    """The op's bf16 copy (streaming stores where the CPU has AVX2: an unaligned head, 16-element blocks, a
    tail) equals ``tensor.to(bfloat16)`` bit for bit for every kind of value (ties, infinities, subnormals;
    a NaN is a NaN). With
    lr and weight decay 0 the update leaves the rows as they are, so the copy is the cast of the input."""
    if ops.op_for(torch.zeros(1)) is None:
        pytest.skip("the CPU op is not built")
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(-2**31, 2**31 - 1, (24, dim), generator=g, dtype=torch.int64).to(torch.int32)
    # ties, +-inf, NaNs...: rows 0-1
    bits.view(-1)[:8] = torch.tensor([0x3F808000, 0x3F818000, 0x7F800000, -0x800000, 0x7FC00001, -0x400000,
                                      0x00008000, 0x7F7FFFFF], dtype=torch.int64).to(torch.int32)
    w = bits.view(torch.float32).clone()
    s0, s1 = torch.zeros(24, dim), torch.zeros(24, dim)
    slots = torch.tensor([0, 3, 17, 9, 1])
    shadow = torch.full((24, dim), 7.0, dtype=torch.bfloat16)
    lr_hist, wd_hist = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    before = w.clone()
    ops.row_update(w, [s0, s1], slots, torch.zeros(5, dim), torch.full((5,), 1), step=2, lr_hist=lr_hist,
                   wd_hist=wd_hist, lr=0.0, weight_decay=0.0, beta1=0.9, beta2=0.99, eps=1e-8, shadow=shadow)
    keep = ~before.isnan()  # lr 0: the rows as they were (a signalling NaN comes out quiet)
    assert torch.equal(w.view(torch.int32)[keep], before.view(torch.int32)[keep])
    want, got = w[slots].to(torch.bfloat16), shadow[slots]
    nan = want.isnan()  # a NaN's payload is not kept (c10's scalar cast gives 0x7FC0, its vector cast 0xFFFF)
    assert bool(nan.any()) and torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    rest = torch.ones(24, dtype=torch.bool)
    rest[slots] = False
    assert bool((shadow[rest] == 7.0).all())


@pytest.mark.parametrize("shadow_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lazy", [False, True])
def test_row_update_scaled_with_shadow_equals_scaling_then_casting(shadow_dtype, lazy):
    """CPU: ``grad_scale`` and ``shadow`` in the op's one pass give what ``grads * scale``, the plain update and
    then a cast copy of the rows give (the CPU side of a split expert step), bit for bit: the op is built with
    -ffp-contract=off, so each product is rounded before the update uses it, as torch's ``mul_`` rounds it; the
    shadow is exactly the cast of the updated rows and its other rows stay; the reference fallback (no op)
    agrees within 2e-6 relative."""
    g = torch.Generator().manual_seed(3)
    step, dim = 6, 37
    lr_hist = torch.cat([torch.zeros(1), torch.rand(step, generator=g) * 1e-2 + 1e-3]).double()
    wd_hist = torch.cat([torch.zeros(1), torch.rand(step, generator=g) * 0.2]).double()
    slots, last = torch.tensor([3, 0, 17, 9]), torch.tensor([0, 5, 2, 4])
    grads = torch.randn(4, dim, generator=g)
    kw = dict(step=step, lr_hist=lr_hist, wd_hist=wd_hist, lr=float(lr_hist[step]), weight_decay=float(wd_hist[step]),
              beta1=0.9, beta2=0.99, eps=1e-8, lazy=lazy)
    want = _tables(ref.ADAMW, torch.Generator().manual_seed(5), dim=dim)
    ops.row_update(want[0], want[1:3], slots, grads * 0.37, last, **kw)
    for use_op in (True, False):
        got = _tables(ref.ADAMW, torch.Generator().manual_seed(5), dim=dim)
        shadow = None if shadow_dtype is None else torch.full((24, dim), 7.0, dtype=shadow_dtype)
        if use_op:
            ops.row_update(got[0], got[1:3], slots, grads, last, grad_scale=0.37, shadow=shadow, **kw)
        else:
            saved = ops.op_for
            try:
                ops.op_for = lambda t: None  # noqa: E731 - the PyTorch reference path
                ops.row_update(got[0], got[1:3], slots, grads, last, grad_scale=0.37, shadow=shadow, **kw)
            finally:
                ops.op_for = saved
        for a, b in zip(got, want):
            if use_op:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        if shadow is not None:
            assert torch.equal(shadow[slots], got[0][slots].to(shadow_dtype))
            rest = torch.ones(24, dtype=torch.bool)
            rest[slots] = False
            assert bool((shadow[rest] == 7.0).all())


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_row_update_reads_bf16_gradients_as_their_fp32_values(lazy, scale):
    """CPU: a bf16 gradient (an expert's single bf16 contribution) gives bit for bit what the same values in
    fp32 give: the op widens each element exactly, with the gradient scale and the shadow in the same pass."""
    g = torch.Generator().manual_seed(4)
    step, dim = 5, 4099  # not a multiple of the vector width
    lr_hist = torch.cat([torch.zeros(1), torch.rand(step, generator=g) * 1e-2 + 1e-3]).double()
    wd_hist = torch.cat([torch.zeros(1), torch.rand(step, generator=g) * 0.2]).double()
    slots, last = torch.tensor([3, 0, 17, 9]), torch.tensor([0, 4, 2, 3])
    low = torch.randn(4, dim, generator=g).to(torch.bfloat16)
    kw = dict(step=step, lr_hist=lr_hist, wd_hist=wd_hist, lr=float(lr_hist[step]), weight_decay=float(wd_hist[step]),
              beta1=0.9, beta2=0.99, eps=1e-8, lazy=lazy, grad_scale=scale)
    out = []
    for grads in (low, low.float()):
        t = _tables(ref.ADAMW, torch.Generator().manual_seed(5), dim=dim)
        shadow = torch.zeros(24, dim, dtype=torch.bfloat16)
        ops.row_update(t[0], t[1:3], slots, grads, last, shadow=shadow, **kw)
        out.append((*t, shadow))
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("opt,lazy", [(ref.ADAMW, False), (ref.ADAMW, True), (ref.ADAGRAD, False)])
@pytest.mark.parametrize("grad_dtype,scale", [(torch.float32, 1.0), (torch.bfloat16, 0.0371), (torch.float32, 0.37)])
def test_cpu_op_equals_cuda_op_bit_for_bit(opt, lazy, grad_dtype, scale):
    """The split expert step's two sides: the CPU op (given a gradient and its clip factor) and the CUDA op (given
    the gradient scaled by torch on the device, as the pipelined step does) give the same rows bit for bit,
    subnormal moments too. Rows that also replay skipped steps (exact mode) agree within 1e-5: the CUDA op
    replays with the GPU's approximate division and square root, for speed (row_math.h)."""
    g = torch.Generator().manual_seed(8)
    step, dim = 6, 70001  # not a multiple of any vector width
    lr_hist = torch.cat([torch.zeros(1), torch.rand(step, generator=g) * 1e-2 + 1e-3]).double()
    wd_hist = torch.cat([torch.zeros(1), torch.rand(step, generator=g) * 0.2]).double()
    slots, last = torch.tensor([3, 0, 17, 9]), torch.tensor([5, 2, 0, 5])
    grads = torch.randn(4, dim, generator=g) * torch.logspace(-30, 0, dim).float()  # tiny ones: subnormal g*g
    grads = grads.to(grad_dtype)
    kw = dict(step=step, lr=float(lr_hist[step]), weight_decay=float(wd_hist[step]), beta1=0.9, beta2=0.999,
              eps=1e-8, optimizer=opt, lazy=lazy)
    n_states = 2 if opt == ref.ADAMW else 1
    cpu = _tables(opt, torch.Generator().manual_seed(5), dim=dim)
    ops.row_update(cpu[0], cpu[1:1 + n_states], slots, grads, last, lr_hist=lr_hist, wd_hist=wd_hist,
                   grad_scale=scale, **kw)
    dev = _tables(opt, torch.Generator().manual_seed(5), dim=dim, device="cuda")
    ops.row_update(dev[0], dev[1:1 + n_states], slots.cuda(), grads.cuda().float().mul_(scale), last.cuda(),
                   lr_hist=lr_hist.cuda(), wd_hist=wd_hist.cuda(), **kw)
    replayed = torch.zeros(24, dtype=torch.bool)
    if not lazy:
        replayed[slots[last < step - 1]] = True
    for a, b in zip(cpu[:1 + n_states], dev):
        b = b.cpu()
        same = a[~replayed] == b[~replayed]
        assert bool(same.all()), f"{int((~same).sum())} elements differ, max {float((a - b).abs().max()):.3g}"
        torch.testing.assert_close(a[replayed], b[replayed], rtol=1e-5, atol=1e-6)
    assert bool(replayed.any()) or lazy


def test_row_update_shadow_rounds_like_torch():
    """The op's bf16 shadow cast (branch-free on the bits) equals ``tensor.to(torch.bfloat16)`` bit for bit on ties,
    infinities, subnormals, signed zeros and the largest finite values, and NaN stays NaN (torch's own vectorised
    and scalar casts differ in the NaN bits) (rows left unchanged: lr 0, zero state and gradient)."""
    special = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), float("nan"), float("inf"),
                            -float("inf"), 1e-40, -1e-40, 3.3895e38, -3.4e38, 0.0, -0.0, 65504.0, 1 / 3])
    w = torch.cat([special, torch.randn(50, generator=torch.Generator().manual_seed(1))]).reshape(4, 16)
    m, v, grads = torch.zeros_like(w), torch.zeros_like(w), torch.zeros_like(w)
    shadow = torch.empty(4, 16, dtype=torch.bfloat16)
    hist = torch.zeros(2, dtype=torch.float64)
    want = w.to(torch.bfloat16)
    ops.row_update(w, [m, v], torch.arange(4), grads, torch.zeros(4, dtype=torch.long), step=1, lr_hist=hist,
                   wd_hist=hist, lr=0.0, weight_decay=0.0, beta1=0.9, beta2=0.99, eps=1e-8, shadow=shadow)
    nan = torch.isnan(want)
    assert bool(nan.any()) and torch.equal(torch.isnan(shadow), nan)
    assert torch.equal(shadow.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [3, 4096])
def test_copy_rows_between_pinned_host_and_gpu(dim):
    op = _op("cuda")
    host = torch.randn(50, dim).pin_memory()
    dev = torch.zeros(10, dim, device="cuda")
    src_idx = torch.tensor([49, 0, 7], device="cuda")
    dst_idx = torch.tensor([2, 9, 0], device="cuda")
    op.copy_rows(host, src_idx, dev, dst_idx)
    assert torch.equal(dev[dst_idx.cpu()].cpu(), host[src_idx.cpu()])
    back = torch.zeros(50, dim).pin_memory()
    op.copy_rows(dev, dst_idx, back, src_idx)
    torch.cuda.synchronize()
    assert torch.equal(back[src_idx.cpu()], host[src_idx.cpu()])
    with pytest.raises(RuntimeError, match="pinned"):
        op.copy_rows(torch.randn(50, dim), src_idx, dev, dst_idx)


def test_ops_fall_back_to_reference_when_disabled(monkeypatch):
    monkeypatch.setenv("MAXIMUS_ROW_OPS_REFERENCE", "1")
    assert ops.load_op("cpu") is None
    out = ops.gather(torch.eye(4), torch.tensor([1]), torch.tensor([0, 0]), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out[0, 1] == 1
