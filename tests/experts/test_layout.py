import pytest
import torch

from ds_maximus.errors import ConfigError
from ds_maximus.experts.layout import ALIGN_ELEMS, ExpertLayout


def test_pack_view_roundtrip_and_alignment():
    gu, dn = torch.randn(3, 10, 6), torch.randn(3, 6, 5)
    lay = ExpertLayout.from_stacked({"gate_up_proj": gu, "down_proj": dn}, num_experts=3)
    assert lay.offsets["gate_up_proj"] == 0 and lay.offsets["down_proj"] % ALIGN_ELEMS == 0
    assert lay.numel % ALIGN_ELEMS == 0
    buf = torch.full((3, lay.numel), float("nan"))
    for e in range(3):
        lay.pack_(buf[e], {"gate_up_proj": gu[e], "down_proj": dn[e]})
    for e in range(3):
        assert torch.equal(lay.view(buf[e], "gate_up_proj"), gu[e])
        assert torch.equal(lay.view(buf[e], "down_proj"), dn[e])
    assert torch.equal(lay.stacked_view(buf, "down_proj"), dn)
    assert torch.equal(lay.stacked_view(buf, "gate_up_proj").transpose(-2, -1), gu.transpose(-2, -1))


def test_bad_layouts_are_config_errors():
    with pytest.raises(ConfigError, match="num_experts"):
        ExpertLayout.from_stacked({"w": torch.zeros(2, 3, 3)}, num_experts=4)
    with pytest.raises(ConfigError, match="dtype"):
        ExpertLayout.from_stacked({"a": torch.zeros(2, 3, 3), "b": torch.zeros(2, 3, 3, dtype=torch.float16)}, 2)
