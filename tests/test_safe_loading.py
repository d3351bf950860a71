"""Safe loading of checkpoints: no pickled code runs when ds_maximus reads a checkpoint.

Real checkpoints of a tiny Llama (ZeRO 0 and 2, CPU DeepSpeed) are saved, then one of their files is
replaced by a pickle whose ``__reduce__`` creates a marker file. ``maximus-export``,
``checkpoint_state_dict`` and ``engine.load_checkpoint`` must refuse it with an error naming the type and
the opt-in, and the marker must not exist. Unmodified checkpoints load without the opt-in; one that needs
a type outside the allow-list (an ``argparse.Namespace`` in ``client_state``) loads with it.
"""
import argparse
import os

import pytest
import torch

from ds_maximus.errors import ShardStoreError, UntrustedCheckpointError
from ds_maximus.integrations.export import checkpoint_state_dict
from ds_maximus.integrations.export_cli import main as export_main
from ds_maximus.safe_load import DEEPSPEED_GLOBALS, check_torch_file, safe_torch_load
from tests.engine.llama_utils import build, maximus_section
from tests.helpers.models import tiny_llama, train, zipf_batches


class MakesMarker:
    """Unpickling this calls ``open(path, "w")``: the file appearing means code ran on load."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{stage: ckpt_dir}`` for ZeRO 0 and 2, tag ``t``, each with a config.json for maximus-export."""
    out = {}
    for stage in (0, 2):
        d = tmp_path_factory.mktemp(f"ckpt{stage}")
        e = build(stage, "fp32", maximus=maximus_section(cache_rows=64))
        train(e, zipf_batches(2, batch=2, seqlen=16))
        e.save_checkpoint(str(d), tag="t")
        tiny_llama().config.save_pretrained(str(d))
        out[stage] = d
    return out


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _poison(path, marker, key=None):
    """Rewrite ``path`` with a marker-making object inside (under ``key`` of its dict, or as the whole file)."""
    if key is None:
        torch.save({"modules": MakesMarker(marker)}, path)
        return
    d = torch.load(path, weights_only=False)
    d[key] = MakesMarker(marker)
    torch.save(d, path)


def test_real_checkpoints_load_without_opt_in(checkpoints):
    for stage, d in checkpoints.items():
        st = safe_torch_load(str(d / "t" / "maximus_states.pt"))
        assert isinstance(st["modules"]["model.embed_tokens"]["tensors"]["weight"], torch.Tensor)
        sd = checkpoint_state_dict(str(d), "t")
        assert "model.embed_tokens.weight" in sd and "lm_head.weight" in sd
        for name in os.listdir(d / "t"):
            check_torch_file(str(d / "t" / name))


def test_deepspeed_allow_list_is_needed_and_importable(checkpoints):
    optim = [f for f in os.listdir(checkpoints[2] / "t") if f.endswith("optim_states.pt")][0]
    path = str(checkpoints[2] / "t" / optim)
    found = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    # some Pythons (Debian's 3.11.2) pickle ZeroStageEnum's member as getattr(ZeroStageEnum, NAME): the loader
    # maps that getattr to allow-listed enum members only (test_safe_loading_enum.py), so it is not on the list
    assert found and found - {"builtins.getattr"} <= set(DEEPSPEED_GLOBALS)
    with pytest.raises(UntrustedCheckpointError, match="ZeroStageEnum|LossScaler|fragment_address"):
        safe_torch_load(path)  # without DeepSpeed's allow-list
    assert "optimizer_state_dict" in safe_torch_load(path, allow_deepspeed=True)


@pytest.mark.parametrize("stage,victim", [(0, "maximus_states.pt"), (0, "mp_rank_00_model_states.pt"),
                                          (2, "zero_pp_rank_0_mp_rank_00_optim_states.pt")])
def test_export_refuses_pickled_code(checkpoints, tmp_path, capsys, stage, victim):
    d = _copy(checkpoints[stage], tmp_path / "ckpt")
    marker = tmp_path / "marker"
    _poison(d / "t" / victim, marker, key=None if victim == "maximus_states.pt" else "client_note")
    with pytest.raises(UntrustedCheckpointError, match=r"io\.open.*--trust-checkpoint") as err:
        checkpoint_state_dict(str(d), "t")
    assert err.value.globals == ("io.open",)
    assert not marker.exists()
    rc = export_main([str(d), str(tmp_path / "out"), "--tag", "t"])
    assert rc == 2 and "--trust-checkpoint" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_resume_refuses_pickled_code_before_deepspeed_reads(checkpoints, tmp_path):
    marker = tmp_path / "marker"
    e = build(2, "fp32", maximus=maximus_section(cache_rows=64))
    for victim in ("mp_rank_00_model_states.pt", "maximus_states.pt"):
        d = _copy(checkpoints[2], tmp_path / victim)
        _poison(d / "t" / victim, marker, key=None if victim == "maximus_states.pt" else "client_note")
        with pytest.raises(UntrustedCheckpointError, match="trust_checkpoint=True"):
            e.load_checkpoint(str(d), tag="t")
        assert not marker.exists()


def test_trust_checkpoint_loads_a_checkpoint_the_user_wrote(tmp_path, caplog):
    """A client_state with an argparse.Namespace (a common habit) needs the opt-in; with it, it resumes."""
    e = build(2, "fp32", maximus=maximus_section(cache_rows=64))
    train(e, zipf_batches(1, batch=2, seqlen=16))
    e.save_checkpoint(str(tmp_path), tag="t", client_state={"args": argparse.Namespace(lr=0.1)})
    with pytest.raises(UntrustedCheckpointError, match="argparse.Namespace"):
        e.load_checkpoint(str(tmp_path), tag="t")
    with caplog.at_level("WARNING", logger="ds_maximus"):
        path, client = e.load_checkpoint(str(tmp_path), tag="t", trust_checkpoint=True)
        e.load_checkpoint(str(tmp_path), tag="t", trust_checkpoint=True)
    assert path is not None and client["args"].lr == 0.1
    assert sum("trust_checkpoint=True" in r.getMessage() for r in caplog.records) == 1  # warned once
    sd = checkpoint_state_dict(str(tmp_path), "t", trust_checkpoint=True)
    assert "model.embed_tokens.weight" in sd
    # the ds_config key, for callers that cannot pass the kwarg (HF Trainer's resume)
    trusting = build(2, "fp32", maximus={**maximus_section(cache_rows=64), "trust_checkpoint": True})
    path, client = trusting.load_checkpoint(str(tmp_path), tag="t")
    assert path is not None and client["args"].lr == 0.1


def test_corrupt_checkpoint_file_is_a_store_error(tmp_path):
    p = tmp_path / "maximus_states.pt"
    torch.save({"w": torch.ones(3)}, p)
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ShardStoreError, match="not a readable torch checkpoint"):
        safe_torch_load(str(p))
    p.write_bytes(b"\x80\x02garbage")
    with pytest.raises(ShardStoreError):
        safe_torch_load(str(p))
