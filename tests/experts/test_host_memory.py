"""The expert tiers plan their host memory: the CPU tier in pieces of whole experts (generate() still equals the
plain model), a table the host cannot hold refused before anything is allocated or the model is touched."""
import os

import pytest
import torch

from ds_maximus.errors import CapacityError
from ds_maximus.experts import CpuExpertStore, offload_experts
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.partition import host_memory as hm
from ds_maximus.partition.host_memory import GiB

from .test_offload_generate import check_equal
from .tiny_moe import tiny_model

MIXTRAL_EXPERT = {"gate_up_proj": torch.empty(8, 2 * 14336, 4096, dtype=torch.bfloat16, device="meta"),
                  "down_proj": torch.empty(8, 4096, 14336, dtype=torch.bfloat16, device="meta")}


def mixtral_layout():
    return ExpertLayout.from_stacked(MIXTRAL_EXPERT, num_experts=8)


def test_mixtral_8x7b_table_is_planned_in_pieces_without_allocating(monkeypatch):
    """32 layers x 8 experts of 336 MiB (90.2 GB): on a host with 125 GiB free the store is planned and mapped
    in ~1 GiB pieces of 3 experts, none allocated before an expert is written."""
    lay = mixtral_layout()
    assert lay.nbytes == 3 * 4096 * 14336 * 2
    monkeypatch.setattr(hm, "mem_available_bytes", lambda *a: 125 * GiB)
    store = CpuExpertStore(lay, 256, pin_memory=False)
    assert store.plan.bytes_per_tier() == {"cpu": 256 * lay.nbytes}
    assert store.table.rows_per_piece == 3 and store.table.num_pieces == 86 and store.table.allocated_bytes == 0


def test_a_table_that_cannot_fit_is_refused_with_the_numbers_and_the_fix(monkeypatch):
    lay = mixtral_layout()
    monkeypatch.setattr(hm, "mem_available_bytes", lambda *a: 40 * GiB)
    with pytest.raises(CapacityError) as e:
        CpuExpertStore(lay, 256, pin_memory=False)
    msg = str(e.value)
    assert "256 experts of 336.0 MiB" in msg and "84.00 GiB" in msg and "40.00 GiB" in msg
    assert "moe.offload.device = 'nvme'" in msg and "Nothing was allocated" in msg
    # the model's own CPU experts, freed as they are copied in, make room for it
    CpuExpertStore(lay, 256, pin_memory=False, reclaimable_bytes=256 * lay.nbytes)


@pytest.mark.parametrize("piece_experts", [1, 3])
def test_generate_equals_plain_with_the_pieced_store(monkeypatch, piece_experts):
    model = tiny_model("mixtral", layers=3, num_experts=8, top_k=2)
    lay = ExpertLayout.from_stacked({n: getattr(model.model.layers[0].mlp.experts, n)
                                     for n in ("gate_up_proj", "down_proj")}, num_experts=8)
    monkeypatch.setattr(hm, "PIECE_BYTES", piece_experts * lay.nbytes + 7)  # 1 or 3 experts a piece
    created = []
    orig = CpuExpertStore.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        created.append(self)
    monkeypatch.setattr(CpuExpertStore, "__init__", spy)
    check_equal(model, {"gpu_experts_per_layer": 2}, new_tokens=8)
    table = created[0].table
    assert table.rows_per_piece == piece_experts and table.num_pieces == -(-24 // piece_experts)
    assert table.allocated_bytes == table.nbytes


def test_offload_frees_each_layer_and_counts_cpu_weights_as_reclaimable(monkeypatch):
    """The model's CPU experts (3 layers x 8) are what the CPU tier gets back: with less free memory than the
    table the plan passes, and every layer's fused weights are gone once offloaded."""
    model = tiny_model("mixtral", layers=3, num_experts=8, top_k=2)
    experts = [layer.mlp.experts for layer in model.model.layers]
    table = sum(getattr(x, n).numel() * 4 for x in experts for n in ("gate_up_proj", "down_proj"))
    monkeypatch.setattr(hm, "mem_available_bytes", lambda *a: hm.HOST_RESERVE_BYTES + table // 2)
    handle = offload_experts(model, {"gpu_experts_per_layer": 2})
    try:
        assert handle.cache.store.plan.demands[0].reclaimable_bytes == table
        assert all(not hasattr(x, "gate_up_proj") and not hasattr(x, "down_proj") for x in experts)
    finally:
        handle.close()


def test_refused_offload_leaves_the_model_untouched(monkeypatch):
    model = tiny_model("mixtral", layers=2, num_experts=4, top_k=2)
    monkeypatch.setattr(hm, "mem_available_bytes", lambda *a: 1024)
    ref = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(CapacityError, match="cpu tier needs"):
        offload_experts(model, {"gpu_experts_per_layer": 2})
    assert {n: p for n, p in model.named_parameters()}.keys() == ref.keys()
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())


def test_nvme_tier_is_refused_when_its_disk_is_too_small(monkeypatch, tmp_path):
    model = tiny_model("mixtral", layers=2, num_experts=4, top_k=2)
    folder = tmp_path / "experts"
    monkeypatch.setattr(hm, "free_disk_bytes", lambda path: 4096)
    with pytest.raises(CapacityError) as e:
        offload_experts(model, {"gpu_experts_per_layer": 2, "offload": {"device": "nvme", "nvme_path": str(folder)}})
    assert "nvme tier needs" in str(e.value) and str(folder) in str(e.value) and "nvme_path" in str(e.value)
    assert not os.path.exists(folder / "experts")
    assert hasattr(model.model.layers[0].mlp.experts, "gate_up_proj")
