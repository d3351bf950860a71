"""The ops' ``grad_sum`` (an expert gradient's micro-batch sum on the host) against its PyTorch reference."""
import pytest
import torch

from ds_maximus.ops import row_ops as ops
from ds_maximus.vocab import reference as ref


@pytest.fixture(scope="module")
def op():
    op = ops.load_op("cpu")
    if op is None:
        pytest.fail("the CPU op did not build")
    return op


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("add_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [1.0, 0.37])
def test_grad_sum_equals_the_reference_bit_for_bit(op, base_dtype, add_dtype, factor):
    g = torch.Generator().manual_seed(0)
    n = 200_003  # several chunks and a ragged end
    base = (torch.randn(n, generator=g) * 3).to(base_dtype)
    add = torch.randn(n, generator=g).to(add_dtype)
    want = torch.empty(n)
    w_sq, w_fin = ref.grad_sum_ref(want, base, factor, add)
    out = torch.empty(n)
    sq, fin = op.grad_sum(out, base, factor, add)
    assert torch.equal(out, want)
    assert sq == pytest.approx(w_sq, rel=1e-12) and fin and w_fin
    if base_dtype == torch.float32:  # in place, as ExpertGrads adds to an fp32 sum
        sq2, _ = op.grad_sum(base, base, factor, add)
        assert torch.equal(base, want) and sq2 == sq


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_grad_sum_reports_a_non_finite_element(op, bad):
    base, add = torch.ones(100_000), torch.ones(100_000, dtype=torch.bfloat16)
    add[77_777] = bad
    _, fin = op.grad_sum(torch.empty(100_000), base, 1.0, add)
    assert not fin
    _, fin = ref.grad_sum_ref(torch.empty(100_000), base, 1.0, add)
    assert not fin


def test_grad_sum_rejects_bad_arguments_before_the_op():
    """The wrapper's checks, not the op's TORCH_CHECK: a throw from the op (it runs without the GIL) crashed
    pytest with a segmentation fault on the H200 host, so no caller relies on it."""
    with pytest.raises(ValueError, match="differ in size"):
        ops.grad_sum(torch.empty(10), torch.ones(10), 1.0, torch.ones(9))
    with pytest.raises(ValueError, match="contiguous float32"):
        ops.grad_sum(torch.empty(10, dtype=torch.bfloat16), torch.ones(10), 1.0, torch.ones(10))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ops.grad_sum(torch.empty(10), torch.ones(10, dtype=torch.int32), 1.0, torch.ones(10))
    with pytest.raises(ValueError, match="contiguous float32"):
        ops.grad_sum(torch.empty(20)[::2], torch.ones(10), 1.0, torch.ones(10))


def test_the_wrapper_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setenv("MAXIMUS_ROW_OPS_REFERENCE", "1")
    out = torch.empty(5)
    sq, fin = ops.grad_sum(out, torch.full((5,), 2.0, dtype=torch.bfloat16), 0.5, torch.ones(5))
    assert torch.equal(out, torch.full((5,), 2.0)) and sq == 20.0 and fin


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 2, 4])
@pytest.mark.parametrize("factor", [1.0, 0.37])
def test_grad_sum_parts_equals_the_reference_and_one_addition_at_a_time(op, base_dtype, add_dtype, k, factor):
    """A sum of k micro-batch parts in one pass has the bits of adding them one after another (the fp32 running
    sum a device accumulates)."""
    g = torch.Generator().manual_seed(k)
    n = 70_001  # several chunks and a ragged end
    base = (torch.randn(n, generator=g) * 3).to(base_dtype)
    adds = [torch.randn(n, generator=g).to(add_dtype) for _ in range(k)]
    want = torch.empty(n)
    w_sq, w_fin = ref.grad_sum_parts_ref(want, base, factor, adds)
    out = torch.empty(n)
    sq, fin = op.grad_sum_parts(out, base, factor, adds)
    assert torch.equal(out, want) and fin and w_fin
    assert sq == pytest.approx(w_sq, rel=1e-12)
    step = base.float() * factor if factor != 1.0 else base.float()  # the device's running sum
    for a in adds:
        step = step + a.float()
    assert torch.equal(out, step)
    if base_dtype == torch.float32:  # in place
        op.grad_sum_parts(base, base, factor, adds)
        assert torch.equal(base, want)


def test_grad_sum_parts_wrapper_checks_and_falls_back(monkeypatch):
    with pytest.raises(ValueError, match="share one dtype"):
        ops.grad_sum_parts(torch.empty(4), torch.ones(4), 1.0, [torch.ones(4), torch.ones(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="differ in size"):
        ops.grad_sum_parts(torch.empty(4), torch.ones(4), 1.0, [torch.ones(4), torch.ones(3)])
    monkeypatch.setenv("MAXIMUS_ROW_OPS_REFERENCE", "1")
    out = torch.empty(3)
    sq, fin = ops.grad_sum_parts(out, torch.ones(3), 2.0, [torch.ones(3)] * 3)
    assert torch.equal(out, torch.full((3,), 5.0)) and sq == 75.0 and fin
