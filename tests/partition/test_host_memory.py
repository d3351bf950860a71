"""The host-memory planner: bytes per tier checked against what the host has, refused before anything is
allocated with the numbers and the fix; exact-size tables mapped in pieces of whole rows."""
import pytest
import torch

from ds_maximus.errors import CapacityError
from ds_maximus.partition import host_memory as hm
from ds_maximus.partition.host_memory import (
    GiB,
    HostMemoryPlan,
    HostResources,
    HostTier,
    PiecedHostTable,
    TierDemand,
    host_tensor,
    pinned_empty,
)


def cpu(nbytes, reclaim=0, what="a table", fix="use NVMe"):
    return TierDemand(HostTier.CPU, nbytes, what, fix=fix, reclaimable_bytes=reclaim)


def test_demands_add_up_per_tier():
    plan = HostMemoryPlan([cpu(3 * GiB), cpu(2 * GiB), TierDemand(HostTier.NVME, 7, "file", path="/x"),
                           TierDemand(HostTier.SHM, 5, "shm")])
    assert plan.bytes_per_tier() == {"cpu": 5 * GiB, "nvme": 7, "shm": 5}


def test_cpu_tier_fits_exactly_and_one_byte_more_is_refused():
    free = 10 * GiB
    res = HostResources(mem_available_bytes=free)
    HostMemoryPlan([cpu(6 * GiB), cpu(free - 6 * GiB - hm.HOST_RESERVE_BYTES)]).check(res)
    with pytest.raises(CapacityError) as e:
        HostMemoryPlan([cpu(6 * GiB), cpu(free - 6 * GiB - hm.HOST_RESERVE_BYTES + 1)]).check(res)
    msg = str(e.value)
    # the numbers (need, free, kept free) and both tables and the fix are named
    assert "needs 9.00 GiB" in msg and "10.00 GiB" in msg and "MemAvailable" in msg and "1.00 GiB kept free" in msg
    assert msg.count("a table") == 2 and "Fix: use NVMe" in msg and "Nothing was allocated" in msg


def test_reclaimable_bytes_count_as_free():
    """A 90 GB expert table on a host with 40 GiB free fits when filling it frees the model's 90 GB of CPU
    experts; the same table from GPU weights (nothing reclaimed) does not."""
    res = HostResources(mem_available_bytes=40 * GiB)
    table = 256 * 3 * 4096 * 14336 * 2  # Mixtral-8x7B's experts in bf16: 90.2 GB
    HostMemoryPlan([cpu(table, reclaim=table)]).check(res)
    with pytest.raises(CapacityError, match=r"short by 45\.\d\d GiB"):
        HostMemoryPlan([cpu(table)]).check(res)


def test_nvme_and_shm_tiers_are_checked_against_their_own_free_space(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    res = HostResources(mem_available_bytes=None, shm_free_bytes=100, disk_free_bytes={a: 1000, b: 10})
    HostMemoryPlan([TierDemand(HostTier.NVME, 600, "x", path=a), TierDemand(HostTier.NVME, 400, "y", path=a),
                    TierDemand(HostTier.NVME, 10, "z", path=b), TierDemand(HostTier.SHM, 100, "s"),
                    cpu(1 << 60)]).check(res)  # memory unknown: never refused for it
    with pytest.raises(CapacityError, match=f"nvme tier needs .*free space of {a}.*Fix: free it"):
        HostMemoryPlan([TierDemand(HostTier.NVME, 1001, "x", path=a, fix="free it")]).check(res)
    # an old file the tier overwrites is space it gets back
    HostMemoryPlan([TierDemand(HostTier.NVME, 1001, "x", path=a, reclaimable_bytes=1)]).check(res)
    with pytest.raises(CapacityError, match="/dev/shm"):
        HostMemoryPlan([TierDemand(HostTier.SHM, 101, "s")]).check(res)


def test_probe_reads_meminfo_and_disk(tmp_path, monkeypatch):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24684084 kB\nMemFree:  1 kB\nMemAvailable:   18502468 kB\n")
    monkeypatch.setattr(hm, "_cgroup_available_bytes", lambda *a: None)
    assert hm.mem_available_bytes(str(info)) == 18502468 * 1024
    monkeypatch.setattr(hm, "_cgroup_available_bytes", lambda *a: 5 * GiB)  # a container's limit is lower
    assert hm.mem_available_bytes(str(info)) == 5 * GiB
    # a folder not made yet: the free space of the disk it will be made on
    assert hm.free_disk_bytes(str(tmp_path / "not" / "yet")) == hm.free_disk_bytes(str(tmp_path)) > 0
    res = HostResources.probe([str(tmp_path / "nvme")])
    assert res.mem_available_bytes == 5 * GiB and res.disk_free_bytes[str(tmp_path / "nvme")] > 0


def test_check_probes_the_host_by_default(monkeypatch):
    monkeypatch.setattr(hm, "mem_available_bytes", lambda *a: 4 * GiB)
    HostMemoryPlan([cpu(3 * GiB)]).check()
    with pytest.raises(CapacityError):
        HostMemoryPlan([cpu(3 * GiB + 1)]).check()


@pytest.mark.parametrize("rows,row_numel,piece_bytes", [(7, 5, 40), (1, 3, 1), (6, 4, 48), (5, 3, 1 << 20)])
def test_pieced_table_rows_are_whole_contiguous_and_independent(rows, row_numel, piece_bytes):
    t = PiecedHostTable(rows, row_numel, torch.float32, piece_bytes=piece_bytes)
    per = max(1, min(rows, piece_bytes // (row_numel * 4)))
    assert t.rows_per_piece == per and t.num_pieces == -(-rows // per)
    assert t.allocated_bytes == 0 and t.nbytes == rows * row_numel * 4  # nothing mapped until used
    ref = torch.arange(rows * row_numel, dtype=torch.float32).view(rows, row_numel)
    for i in reversed(range(rows)):
        r = t.row(i)
        assert r.is_contiguous() and r.shape == (row_numel,) and float(r.abs().sum()) == 0.0
        r.copy_(ref[i])
    assert torch.equal(torch.stack([t.row(i) for i in range(rows)]), ref)
    assert t.allocated_bytes == t.nbytes  # exact size: the last piece holds only the rows left
    with pytest.raises(IndexError, match=f"row {rows} is out of range"):
        t.row(rows)


def test_pieces_are_allocated_on_first_use():
    t = PiecedHostTable(6, 4, torch.bfloat16, piece_bytes=16)  # 2 rows of 8 bytes a piece
    t.row(3)
    assert t.allocated_bytes == 16 and t._pieces[1] is not None and t._pieces[0] is None


def test_released_pieces_are_dropped_and_come_back_zeroed():
    t = PiecedHostTable(6, 4, torch.float32, piece_bytes=32)  # 2 rows a piece
    t.row(1).fill_(3.0)
    t.row(4).fill_(5.0)
    kept = t.row(4)
    t.release()
    assert t.allocated_bytes == 0 and t.num_pieces == 3
    assert float(kept.sum()) == 20.0, "a view taken before the release keeps its memory"
    assert float(t.row(1).abs().sum()) == 0.0 and t.allocated_bytes == 32


def test_pinned_empty_has_the_shape_and_dtype_and_pins_only_with_cuda():
    t = pinned_empty((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert t.is_pinned() == torch.cuda.is_available()
    assert not pinned_empty((2,), pin=False).is_pinned()


def test_host_tensor_refuses_more_than_the_host_has_before_mapping(monkeypatch):
    monkeypatch.setattr(hm, "mem_available_bytes", lambda *a: 1000)

    def no_map(*a, **k):
        raise AssertionError("mapped before the check")
    monkeypatch.setattr(hm, "_Mapping", no_map)
    with pytest.raises(CapacityError, match="cpu tier needs"):
        host_tensor((1001,), torch.uint8)


@pytest.mark.gpu
def test_pinned_pieces_are_registered_and_copy_asynchronously():
    """Each piece is page-locked on its own (cudaHostRegister): every row is pinned and a non-blocking copy of
    one row to the GPU and back gives its bytes."""
    t = PiecedHostTable(7, 1000, torch.bfloat16, pin=True, piece_bytes=3 * 2000)  # 3 rows a piece
    src = torch.randn(7, 1000).to(torch.bfloat16)
    for i in range(7):
        t.row(i).copy_(src[i])
    assert t.num_pieces == 3 and all(t.row(i).is_pinned() for i in range(7))
    dev = torch.empty(1000, dtype=torch.bfloat16, device="cuda")
    dev.copy_(t.row(5), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), src[5])
