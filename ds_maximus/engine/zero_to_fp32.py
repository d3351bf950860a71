"""DeepSpeed's ``zero_to_fp32`` made whole for maximus checkpoints.

DeepSpeed copies its ``zero_to_fp32.py`` (and ``zero_to_torch.py``) into every ZeRO checkpoint folder; users run it
to get a plain state dict (``python zero_to_fp32.py . out/``), and libraries call its
``get_fp32_state_dict_from_zero_checkpoint``. On a maximus checkpoint DeepSpeed's files do not hold the swapped
tables (they are in ``<tag>/maximus_states.pt``), so DeepSpeed alone writes a state dict **without** the embedding
(and the sharded LM head) and with the engine's norm carrier: ``from_pretrained`` would then initialise a random
embedding and only warn.

So a maximus engine's ``save_checkpoint`` replaces that copy with :data:`SCRIPT`: the same command line, and
DeepSpeed's own conversion with :func:`install` applied, which wraps
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (every conversion entry point of that
module goes through it) to add the tables (fp32, as DeepSpeed's) and drop the carrier. ``zero_to_torch.py`` (the
``--dtype`` variant) imports the script beside it, so it is made whole too. ``ds_maximus.initialize`` and
``ds_maximus.enable()`` install the wrapper in-process. A checkpoint without ``maximus_states.pt`` passes through
unchanged.

Before DeepSpeed reads a maximus checkpoint's files (with ``weights_only=False``), each is checked as
:mod:`ds_maximus.safe_load` checks them (``--trust_checkpoint`` on the command line skips that, for checkpoints you
wrote).
"""
from __future__ import annotations

import argparse
import functools
import os
import stat
from typing import Dict, Optional

import torch

from ds_maximus.engine.norm_carrier import CARRIER_NAME

#: what a maximus engine's save_checkpoint writes as ``<save_dir>/zero_to_fp32.py`` (over DeepSpeed's copy)
SCRIPT = '''#!/usr/bin/env python
# This checkpoint was written by ds_maximus. Its vocabulary tables (the swapped embedding, a sharded LM head) are in
# <tag>/maximus_states.pt, outside DeepSpeed's files, so DeepSpeed's own zero_to_fp32.py would leave them out. This
# script is DeepSpeed's zero_to_fp32 (the same command line and functions) with them put back:
#
#   python zero_to_fp32.py . output_dir/ [--safe_serialization] [-t TAG] [--max_shard_size 5GB]
#
# It needs deepspeed and ds_maximus installed; `maximus-export` writes a whole Hugging Face folder instead.
import sys

try:
    from ds_maximus.engine.zero_to_fp32 import deepspeed_module, main
except ImportError as e:
    sys.exit(f"this checkpoint was written by ds_maximus and needs it to convert ({e}): pip install ds_maximus, "
             "or run maximus-export")

_ds = deepspeed_module()
# DeepSpeed's names (zero_to_torch.py beside this file imports it as `zero_to_fp32`)
globals().update({k: v for k, v in vars(_ds).items() if not k.startswith("__")})

if __name__ == "__main__":
    main()
'''


def latest_tag(checkpoint_dir: str) -> Optional[str]:
    """The tag DeepSpeed's ``latest`` file in ``checkpoint_dir`` names, or None where there is none."""
    latest = os.path.join(checkpoint_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def _tag_folder(checkpoint_dir: str, tag: Optional[str]) -> Optional[str]:
    """``checkpoint_dir/tag`` (the tag from ``latest`` when not given), as DeepSpeed resolves it; None when it cannot
    (DeepSpeed then raises its own error)."""
    tag = latest_tag(checkpoint_dir) if tag is None else tag
    return None if tag is None else os.path.join(checkpoint_dir, str(tag))


def _is_maximus(folder: Optional[str]) -> bool:
    return folder is not None and os.path.isdir(folder) and any(
        n == "maximus_states.pt" or n.startswith("maximus_states_rank") for n in os.listdir(folder))


_TRUST = {"value": False}  # --trust_checkpoint of the command line


def _complete(orig):
    @functools.wraps(orig)
    def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                                 lazy_mode=False):
        folder = _tag_folder(checkpoint_dir, tag)
        if not _is_maximus(folder):
            return orig(checkpoint_dir, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters,
                        lazy_mode=lazy_mode)
        from ds_maximus.safe_load import check_deepspeed_folder
        check_deepspeed_folder(folder, trust=_TRUST["value"])
        sd = orig(checkpoint_dir, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters, lazy_mode=lazy_mode)
        sd = drop_carrier(sd)
        add_tables(sd, folder, trust_checkpoint=_TRUST["value"])
        return sd

    get_fp32_state_dict_from_zero_checkpoint.maximus_complete = True
    return get_fp32_state_dict_from_zero_checkpoint


def install() -> None:
    """Wrap DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` (once) so that maximus checkpoints convert
    whole; idempotent."""
    import deepspeed.utils.zero_to_fp32 as z
    if not getattr(z.get_fp32_state_dict_from_zero_checkpoint, "maximus_complete", False):
        z.get_fp32_state_dict_from_zero_checkpoint = _complete(z.get_fp32_state_dict_from_zero_checkpoint)


def deepspeed_module():
    """``deepspeed.utils.zero_to_fp32`` with :func:`install` applied."""
    install()
    import deepspeed.utils.zero_to_fp32 as z
    return z


def write_recovery_script(save_dir: str) -> None:
    """Put :data:`SCRIPT` where DeepSpeed copied its ``zero_to_fp32.py`` (rank 0, after ``save_checkpoint``)."""
    path = os.path.join(save_dir, "zero_to_fp32.py")
    if not os.path.isfile(path):  # DeepSpeed wrote none (ZeRO stage 0): nothing to replace
        return
    tmp = path + ".maximus.tmp"
    with open(tmp, "w") as f:
        f.write(SCRIPT)
    os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IEXEC)
    os.replace(tmp, path)


def main(argv=None) -> None:
    """DeepSpeed's ``zero_to_fp32.py`` command line (0.19.8), plus ``--trust_checkpoint``."""
    p = argparse.ArgumentParser(description="Consolidate a (maximus) DeepSpeed ZeRO checkpoint into fp32 weights.")
    p.add_argument("checkpoint_dir", type=str, help="path to the desired checkpoint folder, e.g., path/checkpoint-12")
    p.add_argument("output_dir", type=str, help="directory to the pytorch fp32 state_dict output files")
    p.add_argument("--max_shard_size", type=str, default="5GB",
                   help="the maximum size of a shard file, digits then a unit (5GB, 500MB)")
    p.add_argument("--safe_serialization", default=False, action="store_true",
                   help="save with safetensors instead of PyTorch pickle serialization")
    p.add_argument("-t", "--tag", type=str, default=None,
                   help="checkpoint tag used as a unique identifier for checkpoint, e.g., global_step1")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    p.add_argument("-d", "--debug", action="store_true", help="enable debug")
    p.add_argument("--trust_checkpoint", action="store_true",
                   help="load files that need types outside DeepSpeed's allow-list (only checkpoints you wrote)")
    args = p.parse_args(argv)
    z = deepspeed_module()
    z.debug = args.debug
    _TRUST["value"] = args.trust_checkpoint
    z.convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                                 max_shard_size=args.max_shard_size,
                                                 safe_serialization=args.safe_serialization, tag=args.tag,
                                                 exclude_frozen_parameters=args.exclude_frozen_parameters)


# ---- the tables of a checkpoint folder (maximus-export reads them too) ------------------------------------
def drop_carrier(sd: dict) -> dict:
    """``sd`` without the engine's norm carrier (engine plumbing, not the model's)."""
    return {k: v for k, v in sd.items() if k.split(".")[-1] != CARRIER_NAME}


def _table(d: dict, module_name: str, path: str) -> Dict[str, torch.Tensor]:
    tensors = d.get("tensors", d) if isinstance(d, dict) else None  # embedding: d["tensors"]; LM head: d
    if not isinstance(tensors, dict) or not isinstance(tensors.get("weight"), torch.Tensor):
        from ds_maximus.errors import ConfigError
        raise ConfigError(f"{path}: the state of {module_name!r} has no tensors['weight'] (keys "
                          f"{sorted(d) if isinstance(d, dict) else type(d).__name__}); it was written by another "
                          "ds_maximus version: export it from the live engine with ds_maximus.export_hf")
    out = {"weight": tensors["weight"]}
    if isinstance(tensors.get("bias"), torch.Tensor):
        out["bias"] = tensors["bias"]
    return out


def add_tables(sd: dict, folder: str, trust_checkpoint: bool = False) -> dict:
    """Put the sharded tables of the tag folder ``folder`` (its ``maximus_states.pt``) into ``sd`` in fp32, under
    the model's own keys (``model.embed_tokens.weight``); returns ``sd``. The dense part's reader (``maximus-export``
    and DeepSpeed's ``zero_to_fp32`` through this module) share it."""
    from ds_maximus.errors import ShardStoreError
    from ds_maximus.safe_load import safe_torch_load
    path = os.path.join(folder, "maximus_states.pt")
    if not os.path.isfile(path):
        ranks = [f for f in os.listdir(folder) if f.startswith("maximus_states_rank")]
        if ranks:
            raise ShardStoreError(f"{folder} was saved in partitioned shard mode ({len(ranks)} rank files); "
                                  "maximus-export and zero_to_fp32 read replicated checkpoints only: export from "
                                  "the live engine with ds_maximus.export_hf instead", folder)
        raise ShardStoreError(f"{folder} has no maximus_states.pt: it was not saved by a maximus engine (a plain "
                              "DeepSpeed checkpoint needs DeepSpeed's zero_to_fp32.py, not maximus-export)", path)
    state = safe_torch_load(path, trust=trust_checkpoint)
    for name, d in state["modules"].items():
        for k, t in _table(d, name, path).items():
            sd[f"{name}.{k}"] = t.detach().float()
    return sd
