"""ShardStore reading through the async NVMe loader gives the same bytes as plain reads."""
import pytest
import torch

from ds_maximus.errors import ShardStoreError
from ds_maximus.store import ShardStore


def _loader_or_skip():
    mod = pytest.importorskip("ds_maximus.ops.nvme_loader", reason="the NVMe loader op is not in the tree yet")
    if not mod.nvme_loader_available():
        pytest.skip("the NVMe loader op does not build/load here")
    return mod


@pytest.mark.parametrize("o_direct", [True, False])
def test_loader_reads_match_plain_reads(tmp_path, o_direct):
    mod = _loader_or_skip()
    dim = 100  # 400-byte rows: shard data sizes not a multiple of 4096
    gen = torch.Generator().manual_seed(0)
    plain = ShardStore.create(str(tmp_path / "s"), 1000, dim, rows_per_shard=300, state_names=("exp_avg",),
                              init=lambda lo, hi: {"weight": torch.randn(hi - lo, dim, generator=gen)}, loader=False)
    loader = mod.NVMeLoader(threads=2, o_direct=o_direct)
    try:
        fast = ShardStore.open(plain.path, loader=loader)
        assert fast.uses_loader and not plain.uses_loader
        for i in range(plain.num_shards):
            a, b = plain.read_shard(i), fast.read_shard(i)
            assert all(torch.equal(a[k], b[k]) for k in a)
        fast.verify()
        # damage is still reported by name through the loader path
        path = fast.shard_path(1)
        with open(path, "r+b") as f:
            f.seek(fast.shard_info(1).data_offset + 8)
            f.write(b"\x00\x01\x02\x03")
        with pytest.raises(ShardStoreError, match="checksum"):
            fast.read_shard(1)
    finally:
        loader.close()


def test_default_loader_is_chosen_when_available(tmp_path):
    mod = _loader_or_skip()
    s = ShardStore.create(str(tmp_path / "s"), 10, 4, rows_per_shard=4)
    assert s.uses_loader
    assert isinstance(s._loader, mod.NVMeLoader)
    assert not ShardStore.open(s.path, loader=False).uses_loader
