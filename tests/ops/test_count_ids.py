"""``ds_maximus.ops.count_ids``: the routing counts an MoE layer takes without a host wait on a GPU."""
import pytest
import torch

from ds_maximus.ops import _count_by_compare, count_ids


@pytest.mark.parametrize("shape,n", [((1, 2), 8), ((16, 8), 128), ((0,), 4), ((5, 3), 3)])
def test_counts_equal_bincount(shape, n):
    """The host path (bincount) and the device path (compare and sum, run here on the CPU) give bincount's counts."""
    ids = torch.randint(0, n, shape, generator=torch.Generator().manual_seed(n))
    want = torch.bincount(ids.flatten(), minlength=n)
    for got in (count_ids(ids, n), _count_by_compare(ids, n), _count_by_compare(ids, n, max_elems=3 * n)):
        assert got.dtype == torch.long and got.tolist() == want.tolist()  # the last one a few ids at a time


@pytest.mark.gpu
def test_counts_on_the_gpu_make_no_host_wait():
    """On CUDA the counts are queued behind a long kernel without the host waiting for it (bincount would)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ids = torch.randint(0, 8, (4, 2), device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):
        a = a @ a / 64  # ~tens of ms queued
    got = count_ids(ids, 8)
    assert not torch.cuda.current_stream().query(), "count_ids waited for the queued work"
    assert got.tolist() == torch.bincount(ids.flatten().cpu(), minlength=8).tolist()
