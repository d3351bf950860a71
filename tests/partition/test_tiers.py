"""The Tier protocol, one set of tests run against both tiers (pinned CPU in one piece or in pieces, NVMe with and
without a CPU shard cache) for a vocabulary row table (rows + optimizer state, fp32) and an expert table (one flat
bf16 buffer per expert, one expert per shard on NVMe); and every expert store keeps its experts in these tiers."""
import pytest
import torch

from ds_maximus.partition.store_tier import ShardStoreTier
from ds_maximus.partition.tier import TensorTier, Tier
from ds_maximus.store import ShardStore

TABLES = {  # kind: (num_ids, {name: (entry numel, dtype)}, rows per shard)
    "rows": (10, {"weight": (6, torch.float32), "exp_avg": (6, torch.float32)}, 4),
    "experts": (7, {"weight": (40, torch.bfloat16)}, 1),
}
TIERS = ["cpu", "cpu_pieces", "nvme", "nvme_uncached"]


def _reference(kind):
    n, entries, _ = TABLES[kind]
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, numel, generator=g).to(dtype) for name, (numel, dtype) in entries.items()}


def _make(tier_kind, kind, tmp_path):
    n, entries, rows_per_shard = TABLES[kind]
    ref = _reference(kind)
    if tier_kind == "cpu":
        return TensorTier({k: v.clone() for k, v in ref.items()}), ref
    if tier_kind == "cpu_pieces":  # three entries a piece
        numel, dtype = entries["weight"]
        tier = TensorTier.allocate(n, {k: ((m,), d) for k, (m, d) in entries.items()}, pin=False,
                                   piece_bytes=3 * numel * torch.empty((), dtype=dtype).element_size())
        tier.write(torch.arange(n), ref)
        return tier, ref
    dtype = entries["weight"][1]
    store = ShardStore.create(str(tmp_path / "store"), n, entries["weight"][0], dtype, rows_per_shard=rows_per_shard,
                              state_names=tuple(k for k in entries if k != "weight"),
                              init=lambda lo, hi: {k: v[lo:hi] for k, v in ref.items()}, loader=False)
    return ShardStoreTier(store, cpu_cache_shards=2 if tier_kind == "nvme" else 0), ref


def _empty_like(ref, n):
    return {k: torch.zeros(n, v.shape[1], dtype=v.dtype) for k, v in ref.items()}


@pytest.fixture(params=[(t, k) for t in TIERS for k in TABLES], ids=lambda p: f"{p[0]}-{p[1]}")
def tier_and_ref(request, tmp_path):
    return _make(*request.param, tmp_path)


def test_layout(tier_and_ref):
    tier, ref = tier_and_ref
    assert isinstance(tier, Tier) and set(tier.names) == set(ref) and tier.num_ids == next(iter(ref.values())).shape[0]
    for name, v in ref.items():
        assert tier.entry_shape(name) == tuple(v.shape[1:]) and tier.dtype(name) == v.dtype
    assert tier.entry_bytes == sum(v[0].numel() * v.element_size() for v in ref.values())


def test_read_write_round_trip(tier_and_ref):
    tier, ref = tier_and_ref
    ids = torch.tensor([tier.num_ids - 1, 0, 3])
    out = _empty_like(ref, 5)  # a destination longer than the ids: only the first rows are written
    tier.read(ids, out)
    for name in ref:
        assert torch.equal(out[name][:3], ref[name][ids]) and not out[name][3:].any()
    new = {k: torch.full((2, v.shape[1]), 7.0 + i, dtype=v.dtype) for i, (k, v) in enumerate(ref.items())}
    tier.write(torch.tensor([5, 2]), new)
    tier.flush()
    want = {k: v.clone() for k, v in ref.items()}
    for k in want:
        want[k][[5, 2]] = new[k]
    every = _empty_like(ref, tier.num_ids)
    tier.read(torch.arange(tier.num_ids), every)
    for name in ref:
        assert torch.equal(every[name], want[name]), name
        assert torch.equal(tier.materialize(name), want[name]), name


def test_host_view_is_the_entry_in_the_tier(tier_and_ref):
    tier, ref = tier_and_ref
    view = tier.host_view(4)
    if isinstance(tier, ShardStoreTier):  # on NVMe an entry is read into a destination the caller owns
        assert view is None
        return
    assert torch.equal(view, ref["weight"][4]) and view.device.type == "cpu" and view.is_contiguous()
    view.fill_(3.0)  # writes through it persist
    out = _empty_like(ref, 1)
    tier.read(torch.tensor([4]), out)
    assert torch.equal(out["weight"][0], torch.full_like(ref["weight"][4], 3.0))
    assert torch.equal(tier.host_view(3, "weight"), ref["weight"][3])


def test_pieces_cover_the_table_in_whole_entries(tier_and_ref):
    tier, ref = tier_and_ref
    for name in ref:
        pieces = tier.pieces(name)
        if isinstance(tier, ShardStoreTier):
            assert pieces == []
            continue
        assert pieces[0][0] == 0 and pieces[-1][1] == tier.num_ids
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        for lo, hi, t in pieces:
            assert t.shape == (hi - lo, *tier.entry_shape(name)) and t.is_contiguous()
            assert torch.equal(t, ref[name][lo:hi])
        per = 3 if isinstance(tier, TensorTier) and tier.num_pieces > 1 else tier.num_ids
        assert [(lo, hi) for lo, hi, _ in pieces] == [(lo, min(lo + per, tier.num_ids))
                                                      for lo in range(0, tier.num_ids, per)]
        # an entry at a piece boundary is one contiguous buffer inside one piece
        lo, hi, t = pieces[-1]
        assert tier.host_view(lo, name).data_ptr() == t.data_ptr()


def test_blocks_and_load(tier_and_ref):
    tier, ref = tier_and_ref
    seen = []
    for lo, hi, t in tier.blocks(block_rows=2):
        seen.append((lo, hi))
        for name in ref:
            assert torch.equal(t[name], ref[name][lo:hi])
    assert seen[0][0] == 0 and seen[-1][1] == tier.num_ids and all(a[1] == b[0] for a, b in zip(seen, seen[1:]))
    doubled = {k: (v.float() * 2).to(v.dtype) for k, v in ref.items()}
    tier.load(doubled)
    for name in ref:
        assert torch.equal(tier.materialize(name), doubled[name])


def test_whole_tables_nbytes_and_edits_through_blocks(tier_and_ref, tmp_path):
    """``whole_tables`` is the tier's own memory for a CPU tier of one piece and ``None`` otherwise; ``nbytes`` is
    the whole table; edits through a block's views, marked with ``mark_dirty_range``, are durable after flush."""
    tier, ref = tier_and_ref
    assert tier.nbytes() == sum(v.numel() * v.element_size() for v in ref.values())
    whole = tier.whole_tables()
    if isinstance(tier, TensorTier) and tier.num_pieces == 1:
        assert set(whole) == set(ref) and all(torch.equal(whole[k], v) for k, v in ref.items())
        assert whole["weight"][1].data_ptr() == tier.host_view(1).data_ptr() and whole is tier.tensors
    else:
        assert whole is None
    for lo, hi, t in tier.blocks(block_rows=2):
        t["weight"].add_(1)
        tier.mark_dirty_range(lo, hi)
    tier.flush()
    if isinstance(tier, ShardStoreTier):
        tier = ShardStoreTier(ShardStore.open(str(tmp_path / "store")), cpu_cache_shards=0)
    assert torch.equal(tier.materialize("weight"), ref["weight"] + 1)


@pytest.mark.parametrize("bad", [-1, "num_ids", "num_ids_plus"])
def test_bad_ids_are_index_errors_naming_the_id(tier_and_ref, bad):
    tier, ref = tier_and_ref
    i = {"num_ids": tier.num_ids, "num_ids_plus": tier.num_ids + 5}.get(bad, bad)
    ids = torch.tensor([0, i])
    with pytest.raises(IndexError, match=rf"id {i} is out of range.*{tier.num_ids}"):
        tier.read(ids, _empty_like(ref, 2))
    with pytest.raises(IndexError, match="out of range"):
        tier.write(ids, _empty_like(ref, 2))
    if not isinstance(tier, ShardStoreTier):
        with pytest.raises(IndexError, match="out of range"):
            tier.host_view(i)
    assert torch.equal(tier.materialize("weight"), ref["weight"])  # nothing was written


def test_nvme_tier_writes_persist_in_the_shard_store(tmp_path):
    tier, ref = _make("nvme", "experts", tmp_path)
    tier.write(torch.tensor([6]), {"weight": torch.ones(1, 40, dtype=torch.bfloat16)})
    tier.flush()
    again = ShardStore.open(str(tmp_path / "store"))
    assert again.rows_per_shard == 1 and again.dtype == torch.bfloat16
    assert torch.equal(again.read_all(), torch.cat([ref["weight"][:6], torch.ones(1, 40, dtype=torch.bfloat16)]))


def test_uncached_nvme_tier_reads_one_entry_shards_straight_into_the_destination(tmp_path):
    tier, ref = _make("nvme_uncached", "experts", tmp_path)
    dst = torch.empty(1, 40, dtype=torch.bfloat16)
    ptr = dst.data_ptr()
    tier.read(torch.tensor([2]), {"weight": dst})
    assert torch.equal(dst[0], ref["weight"][2]) and dst.data_ptr() == ptr and tier.cached_shards == 0


def test_pieced_cpu_tier_allocates_a_piece_when_first_used_and_plans_first(monkeypatch):
    from ds_maximus.errors import CapacityError
    from ds_maximus.partition import host_memory as hm
    tier = TensorTier.allocate(9, {"weight": ((4,), torch.float32)}, pin=False, piece_bytes=48)
    assert tier.host_table("weight").allocated_bytes == 0 and tier.plan.bytes_per_tier() == {"cpu": 9 * 16}
    tier.write(torch.tensor([4]), {"weight": torch.ones(1, 4)})
    assert tier.host_table("weight").allocated_bytes == 3 * 16  # the piece of entries 3..5 only
    with pytest.raises(AttributeError, match="3 pieces"):
        tier.tensors
    assert tier.whole_tables() is None  # what whole-table users (UVA row copies) ask
    monkeypatch.setattr(hm, "mem_available_bytes", lambda *a: 100)
    with pytest.raises(CapacityError, match="the cpu tier needs.*a small table.*Fix: smaller"):
        TensorTier.allocate(9, {"weight": ((4,), torch.float32)}, pin=False, what="a small table", fix="smaller",
                            reserve_bytes=0)


def test_released_table_reads_zeros_and_is_mapped_again():
    tier = TensorTier.allocate(4, {"weight": ((3,), torch.float32), "exp_avg": ((3,), torch.float32)}, pin=False,
                               piece_bytes=1 << 20)
    tier.write(torch.arange(4), {"weight": torch.ones(4, 3), "exp_avg": torch.full((4, 3), 2.0)})
    whole = tier.tensors["weight"]
    tier.release("weight")
    assert tier.host_table("weight").allocated_bytes == 0
    assert float(whole.sum()) == 12.0, "a view taken before the release keeps its memory"
    assert float(tier.tensors["weight"].abs().sum()) == 0.0 and tier.tensors["weight"].data_ptr() != whole.data_ptr()
    assert torch.equal(tier.tensors["exp_avg"], torch.full((4, 3), 2.0)), "the other tables are kept"


def test_every_expert_store_keeps_its_experts_in_the_partition_tiers(tmp_path):
    """Inference (CPU, NVMe) and training (CPU, NVMe) expert stores: one of the two tiers each, no other."""
    from ds_maximus.experts.expert_store import CpuExpertStore, FileExpertStore
    from ds_maximus.experts.layout import ExpertLayout
    from ds_maximus.experts.training.store import ExpertTrainStore
    lay = ExpertLayout.from_stacked({"w": torch.zeros(3, 2, 4, dtype=torch.bfloat16)}, num_experts=3)
    stores = [CpuExpertStore(lay, 3, pin_memory=False), FileExpertStore(lay, 3, str(tmp_path / "experts")),
              ExpertTrainStore(lay, 3, ("exp_avg",)),
              ExpertTrainStore(lay, 3, ("exp_avg",), nvme_path=str(tmp_path / "t"))]
    assert [type(s.backing) for s in stores] == [TensorTier, ShardStoreTier, TensorTier, ShardStoreTier]
    for s in stores[:2]:
        s.write(2, {"w": torch.full((2, 4), 5.0)})
        assert float(s.read(2).float().sum()) == 40.0 and float(s.read(1).float().abs().sum()) == 0.0
        with pytest.raises(IndexError, match="uid 3 is out of range"):
            s.read(3)
    assert stores[1].num_written == 3 and ShardStore.open(str(tmp_path / "experts")).num_shards == 3
    (tmp_path / "experts" / "notes.txt").write_text("not the store's")
    assert FileExpertStore.existing_bytes(str(tmp_path / "experts")) == 3 * stores[1].record_bytes
    FileExpertStore(lay, 3, str(tmp_path / "experts"))  # a new store there replaces the old shards, keeps the rest
    assert sorted(p.name for p in (tmp_path / "experts").iterdir()) == ["notes.txt", "shard_index.json"]


@pytest.mark.gpu
def test_pinned_tier_pieces_are_page_locked_and_copy_to_the_gpu():
    """The pinned-CPU tier in pieces (cudaHostRegister each): every piece is pinned, and entries read with
    non-blocking copies from their host views, and written back through them, keep their bytes."""
    src = torch.randn(7, 1000).to(torch.bfloat16)
    tier = TensorTier.allocate(7, {"weight": ((1000,), torch.bfloat16)}, pin=True, piece_bytes=3 * 2000)
    tier.write(torch.arange(7), {"weight": src})
    assert tier.pinned and [(lo, hi) for lo, hi, _ in tier.pieces()] == [(0, 3), (3, 6), (6, 7)]
    assert all(t.is_pinned() for _, _, t in tier.pieces())
    dev = torch.empty(7, 1000, dtype=torch.bfloat16, device="cuda")
    for i in range(7):
        dev[i].copy_(tier.host_view(i), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), src)
    tier.host_view(6).copy_(dev[0], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(tier.materialize("weight")[6], src[0])
