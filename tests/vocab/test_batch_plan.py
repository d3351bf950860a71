"""The lookup's host plan of a batch (unique ids, inverse, stable order, segment offsets) against torch."""
import numpy as np
import pytest
import torch

from ds_maximus.vocab.function import BatchPlanner


def _want(flat: torch.Tensor):
    uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(inverse, minlength=uniq.numel())
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    return uniq, inverse, order, offsets


@pytest.mark.parametrize("vocab,n,hot", [(50, 0, False), (50, 1, False), (1000, 7, False),  # np.unique path
                                         (300, 4099, True),                                   # the mask path
                                         (200_000, 150_000, False)])                          # > 65536 unique ids
def test_plan_equals_torch_unique_and_stable_sort(vocab, n, hot):
    g = torch.Generator().manual_seed(n)
    flat = torch.randint(0, vocab, (n,), generator=g)
    if hot:
        flat[: n // 2] = 3
    from ds_maximus.ops.row_ops import host_op
    assert hasattr(host_op(), "batch_plan"), "the op was not built: both sides would be the reference"
    for use_op in (True, False):  # the batch_plan op, and the numpy reference
        planner = BatchPlanner(vocab, use_op=use_op)
        for _ in range(2):  # the kept buffers are clean again after a call
            plan = planner.plan(flat.numpy(), "cpu")
            for got, want in zip(plan, _want(flat)):
                assert got.dtype == torch.long and torch.equal(got, want)
    if vocab == 200_000:
        assert plan.uniq.numel() > 1 << 16  # the 64-bit stable sort, not the 16-bit radix one


@pytest.mark.parametrize("bad", [-1, 300, 2**40])
def test_plan_names_an_id_outside_the_vocabulary(bad):
    flat = np.arange(600, dtype=np.int64) % 300
    flat[17] = bad
    for use_op in (True, False):
        planner = BatchPlanner(300, use_op=use_op)
        with pytest.raises(IndexError, match=f"{bad}.*300|300.*{bad}"):
            planner.plan(flat)
        flat[17] = 5  # nothing was left behind: the next plan is right
        assert torch.equal(planner.plan(flat).uniq, torch.arange(300))
        flat[17] = bad
