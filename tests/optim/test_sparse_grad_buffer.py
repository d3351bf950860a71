"""``SparseRowGrad(keep_buffer=True)``: the joined rows' memory is kept from one gradient to the next and later adds
are copied straight into it; the results are those of a plain ``SparseRowGrad`` in every case (pieces past the last
id, ids already held, new ids among held ones, a gradient larger than the kept memory)."""
import torch

from ds_maximus.optim import SparseRowGrad


def _chunks(g, d, vocab, chunk):
    """A tied head's gradient: every row, chunk after chunk."""
    return [(torch.arange(lo, min(vocab, lo + chunk)), torch.randn(min(vocab, lo + chunk) - lo, d, generator=g))
            for lo in range(0, vocab, chunk)]


def _same(a, b):
    assert torch.equal(a.ids, b.ids) and torch.equal(a.rows, b.rows)


def test_kept_memory_is_reused_and_gives_the_plain_result():
    g = torch.Generator().manual_seed(0)
    kept, plain = SparseRowGrad(keep_buffer=True), SparseRowGrad()
    addresses = []
    for step in range(4):
        adds = _chunks(g, 3, 40, 8)
        held = torch.unique(torch.randint(0, 40, (9,), generator=g))   # the lookup's rows: all held
        adds.append((held, torch.randn(held.numel(), 3, generator=g)))
        if step == 2:  # ids already held twice in one micro-batch window (gradient accumulation)
            adds.append((held, torch.randn(held.numel(), 3, generator=g)))
        for ids, rows in adds:
            kept.add(ids, rows)
            plain.add(ids, rows)
        _same(kept, plain)
        addresses.append(kept.rows.data_ptr())
        kept.rows.mul_(0.5)  # a step's clipping scales in place
        plain.rows.mul_(0.5)
        _same(kept, plain)
        kept.clear()
        plain.clear()
    assert len(set(addresses[1:])) == 1 and addresses[1] == kept._buf.data_ptr()  # no new memory after the first


def test_gradients_the_kept_memory_cannot_take_fall_back_to_new_memory():
    g = torch.Generator().manual_seed(1)
    kept, plain = SparseRowGrad(keep_buffer=True), SparseRowGrad()
    for vocab, extra in ((24, False), (40, False), (24, True), (40, True)):  # 40 rows: more than the kept 24
        adds = _chunks(g, 2, vocab, 8)
        if extra:  # ids not held among held ones: the sorted union is rebuilt
            adds.insert(1, (torch.tensor([30 + vocab, 31 + vocab]), torch.randn(2, 2, generator=g)))
        for ids, rows in adds:
            kept.add(ids, rows)
            plain.add(ids, rows)
        _same(kept, plain)
        kept.clear()
        plain.clear()
    assert kept._buf.shape[0] >= 40
