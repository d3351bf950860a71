"""SparseRowGrad: every way rows are added (in-order pieces past the last id, ids already held, new ids among old)
gives the dense accumulation bit for bit, and the in-order and in-place adds keep what is held where it is."""
import torch

from ds_maximus.optim import SparseRowGrad


def _dense(adds, vocab, dim):
    out = torch.zeros(vocab, dim)
    seen = torch.zeros(vocab, dtype=torch.bool)
    for ids, rows in adds:
        out[ids] += rows
        seen[ids] = True
    return seen.nonzero().flatten(), out[seen]


def test_tied_head_chunks_then_lookup_rows_accumulate_exactly_and_in_place():
    vocab, dim, chunk = 103, 5, 16
    g = torch.Generator().manual_seed(0)
    adds = [(torch.arange(lo, min(lo + chunk, vocab)), torch.randn(min(chunk, vocab - lo), dim, generator=g))
            for lo in range(0, vocab, chunk)]                         # a tied head, chunk after chunk
    lookup = torch.tensor([90, 3, 57, 11])                            # the lookup's unique ids, unsorted
    adds.append((lookup, torch.randn(4, dim, generator=g)))
    sg = SparseRowGrad()
    for ids, rows in adds[:-1]:
        sg.add(ids, rows)
    assert len(sg._tail) == len(adds) - 2                              # pieces wait: nothing reallocated yet
    assert bool(sg)
    joined = sg.rows
    sg.add(*adds[-1])
    assert sg.rows.data_ptr() == joined.data_ptr()                     # added in place
    want_ids, want_rows = _dense(adds, vocab, dim)
    assert torch.equal(sg.ids, want_ids) and torch.equal(sg.rows, want_rows)


def test_mixed_adds_match_the_dense_accumulation():
    vocab, dim = 50, 3
    g = torch.Generator().manual_seed(1)
    adds = []
    for _ in range(12):
        ids = torch.randperm(vocab, generator=g)[:int(torch.randint(1, 9, (1,), generator=g))]
        adds.append((ids, torch.randn(ids.numel(), dim, generator=g)))
    adds.append((torch.arange(45, 50), torch.randn(5, dim, generator=g)))
    sg = SparseRowGrad()
    for ids, rows in adds:
        sg.add(ids, rows)
    want_ids, want_rows = _dense(adds, vocab, dim)
    assert torch.equal(sg.ids, want_ids)
    torch.testing.assert_close(sg.rows, want_rows, rtol=1e-6, atol=1e-6)
    sg.scale_(0.5)
    torch.testing.assert_close(sg.rows, want_rows * 0.5, rtol=1e-6, atol=1e-6)
    sg.clear()
    assert not sg and sg.ids is None
