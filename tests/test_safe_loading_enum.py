"""An enum member pickled as ``getattr(EnumClass, "NAME")`` (how Debian's Python 3.11.2 writes DeepSpeed's
``ZeroStageEnum`` into ZeRO-2 optimizer states) loads without the opt-in; any other ``getattr`` stays refused,
since a general one would let a pickle walk from an allowed class to any function."""
import os

import pytest
import torch
from deepspeed.runtime.zero.config import ZeroStageEnum

from ds_maximus.errors import UntrustedCheckpointError
from ds_maximus.safe_load import check_torch_file, safe_torch_load


class _ByGetattr:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def _save(tmp_path, obj, name="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
    path = str(tmp_path / name)
    torch.save({"optimizer_state_dict": {"zero_stage": obj, "w": torch.ones(3)}}, path)
    return path


def test_enum_member_by_getattr_loads(tmp_path):
    path = _save(tmp_path, _ByGetattr(ZeroStageEnum, "gradients"))
    check_torch_file(path)
    got = safe_torch_load(path, allow_deepspeed=True)["optimizer_state_dict"]
    assert got["zero_stage"] is ZeroStageEnum.gradients and torch.equal(got["w"], torch.ones(3))


@pytest.mark.parametrize("name", ["__init__", "__class__", "mro", "_member_map_"])
def test_other_getattr_is_refused(tmp_path, name):
    path = _save(tmp_path, _ByGetattr(ZeroStageEnum, name))
    with pytest.raises(UntrustedCheckpointError):
        check_torch_file(path)
    with pytest.raises(UntrustedCheckpointError):
        safe_torch_load(path, allow_deepspeed=True)


def test_getattr_chain_to_a_function_runs_nothing(tmp_path):
    marker = tmp_path / "marker"

    class _Chain:  # getattr(getattr(ZeroStageEnum, "__init__"), "__globals__") would reach the module's names
        def __reduce__(self):
            return getattr, (_ByGetattr(ZeroStageEnum, "__init__"), "__globals__")

    path = _save(tmp_path, _Chain())
    with pytest.raises(UntrustedCheckpointError):
        check_torch_file(path)
    assert not os.path.exists(marker)
