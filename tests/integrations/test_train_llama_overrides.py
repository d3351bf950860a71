"""examples/train_llama.py's command-line variations of a config: the ones bench_headline passes."""
import pytest

from tests.helpers.scripts import ROOT, load_script


def _train_llama():
    return load_script("examples/train_llama.py", "train_llama_example")


def test_maximus_overrides_set_nested_keys_as_json_or_string():
    tl = _train_llama()
    args = tl.parse_args(["--maximus", "lm_head.grad_on_device=bf16", "--maximus", "lm_head.chunk_rows=4096",
                          "--maximus", "moe.speculative_prefetch=false", "--micro-batch", "4"])
    cfg = tl.apply_overrides({"maximus": {"lm_head": {"enabled": True}}, "train_batch_size": 8}, args)
    assert cfg["maximus"]["lm_head"] == {"enabled": True, "grad_on_device": "bf16", "chunk_rows": 4096}
    assert cfg["maximus"]["moe"] == {"speculative_prefetch": False}
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and "train_batch_size" not in cfg
    from ds_maximus.config import MaximusConfig
    assert MaximusConfig.from_dict({"lm_head": cfg["maximus"]["lm_head"]}).lm_head.grad_on_device.value == "bf16"


def test_maximus_override_without_value_is_refused():
    tl = _train_llama()
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        tl.apply_overrides({}, tl.parse_args(["--maximus", "lm_head.grad_on_device"]))


def test_offload_peer_drops_the_torch_adam_options():
    """``--offload-optimizer`` hands the optimizer to DeepSpeedCPUAdam: the headline config's torch-only keys
    (``torch_adam``, ``fused``) must not reach it (``fused`` is no argument of DeepSpeedCPUAdam)."""
    import inspect
    import json

    from deepspeed.ops.adam import DeepSpeedCPUAdam
    tl = _train_llama()
    cfg = json.loads((ROOT / "ds_configs" / "llama_262k_16gib.json").read_text())
    assert cfg["optimizer"]["params"]["fused"] is True
    out = tl.apply_overrides(cfg, tl.parse_args(["--plain", "--offload-optimizer", "--zero-stage", "3"]))
    params = out["optimizer"]["params"]
    assert "torch_adam" not in params and "fused" not in params
    accepted = inspect.signature(DeepSpeedCPUAdam.__init__).parameters
    assert all(k in accepted for k in params), params
    assert out["zero_optimization"]["offload_param"]["device"] == "cpu"
