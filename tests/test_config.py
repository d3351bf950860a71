import json
from pathlib import Path

import pytest

from ds_maximus.config import CachePolicy, MaximusConfig, OffloadDevice
from ds_maximus.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_missing_section_is_off():
    assert MaximusConfig.from_ds_config({"train_batch_size": 8}).enabled is False
    assert MaximusConfig.from_ds_config(None).enabled is False


def test_disabled_section():
    assert MaximusConfig.from_ds_config({"maximus": {"enabled": False}}).enabled is False


def test_defaults_and_values():
    cfg = MaximusConfig.from_ds_config({"maximus": {"embedding": {"gpu_cache_rows": 1024, "cache_policy": "lru"}}})
    assert cfg.enabled and cfg.embedding.gpu_cache_rows == 1024
    assert cfg.embedding.cache_policy is CachePolicy.LRU
    assert cfg.embedding.offload.device is OffloadDevice.CPU
    assert cfg.io.block_bytes == 1 << 20


def test_unknown_key_suggests():
    with pytest.raises(ConfigError, match=r'maximus\.embeding.*did you mean "embedding"') as e:
        MaximusConfig.from_ds_config({"maximus": {"embeding": {}}})
    assert e.value.key_path == "maximus.embeding"
    with pytest.raises(ConfigError, match=r'maximus\.embedding\.gpu_cache_row.*did you mean "gpu_cache_rows"'):
        MaximusConfig.from_ds_config({"maximus": {"embedding": {"gpu_cache_row": 4}}})


def test_wrong_type():
    with pytest.raises(ConfigError, match=r"maximus\.io\.threads"):
        MaximusConfig.from_ds_config({"maximus": {"io": {"threads": "many"}}})


def test_bad_enum_lists_allowed():
    with pytest.raises(ConfigError, match=r"'lru' or 'lfu'"):
        MaximusConfig.from_ds_config({"maximus": {"embedding": {"cache_policy": "fifo"}}})


def test_out_of_range():
    with pytest.raises(ConfigError, match=r"maximus\.embedding\.gpu_cache_rows"):
        MaximusConfig.from_ds_config({"maximus": {"embedding": {"gpu_cache_rows": 0}}})
    with pytest.raises(ConfigError, match="multiple of 4096"):
        MaximusConfig.from_ds_config({"maximus": {"io": {"block_bytes": 5000}}})


def test_conflicting_nvme_without_path():
    with pytest.raises(ConfigError, match="nvme_path"):
        MaximusConfig.from_ds_config({"maximus": {"embedding": {"offload": {"device": "nvme"}}}})


@pytest.mark.parametrize("key, value", [("device_fetch", True), ("device_fetch", False),
                                        ("device_fetch_refresh_tokens", 32)])
def test_removed_device_fetch_keys_are_refused_with_the_reason(key, value):
    """moe.device_fetch measured slower than the default decode path on the GPU and was removed with its refresh key:
    a config that still sets either (even to the old default) is a ConfigError saying why and to drop the key."""
    with pytest.raises(ConfigError, match=rf"moe\.{key} was removed: .*measured slower than the default path on "
                                          r"the GPU.*copy engine moves missed experts faster.*drop the key") as e:
        MaximusConfig.from_ds_config({"maximus": {"moe": {"enabled": True, "quant": {"bits": 4}, key: value}}})
    assert e.value.key_path == "maximus.moe"


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        MaximusConfig.from_ds_config(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MaximusConfig.from_ds_config(str(bad))


@pytest.mark.parametrize("path", sorted((ROOT / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_every_example_config_loads(path):
    raw = json.loads(path.read_text())
    cfg = MaximusConfig.from_ds_config(raw)
    assert cfg.enabled
    # DeepSpeed itself accepts the file with our section in it
    from deepspeed.runtime.config import DeepSpeedConfig
    DeepSpeedConfig(raw)


def test_config_reference_lists_every_key():
    text = (ROOT / "ds_configs" / "README.md").read_text()
    missing = []

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")
            elif f"`{prefix}{name}`" not in text:
                missing.append(prefix + name)

    walk(MaximusConfig, "")
    assert not missing, f"ds_configs/README.md lacks: {missing}"
