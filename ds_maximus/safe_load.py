"""``safe_torch_load``: reading a ``.pt`` file never runs code from it.

Every ``torch.load`` in ds_maximus goes through this module. Files are read with
``weights_only=True``: only tensors, primitive containers and the types on an explicit allow-list
can be built, so a pickle whose ``__reduce__`` calls a function is refused before it runs.

* ds_maximus's own state (``maximus_states*.pt``) holds tensors, dicts, lists and numbers only and
  needs no allow-list.
* DeepSpeed's checkpoint files (``*model_states.pt``, ``*optim_states.pt``) also pickle a few of
  DeepSpeed's own types; :data:`DEEPSPEED_GLOBALS` lists them (found by saving real ZeRO 0-3
  checkpoints, with bf16, fp16, a scheduler and CPU offload, and scanning them with
  ``torch.serialization.get_unsafe_globals_in_checkpoint``).
* Where DeepSpeed loads a file itself with ``weights_only=False`` (``zero_to_fp32``, the engine's
  ``load_checkpoint``), :func:`check_torch_file` first reads that file the safe way (memory-mapped, so
  no tensor data is copied) and refuses it if it needs anything else.

A file that needs another type raises :class:`~ds_maximus.errors.UntrustedCheckpointError` naming
the type. ``trust=True`` (``maximus-export --trust-checkpoint``, ``checkpoint_state_dict(...,
trust_checkpoint=True)``, ``engine.load_checkpoint(..., trust_checkpoint=True)``) loads a file the
user wrote with plain ``torch.load`` after a one-time warning.

Example::

    >>> import tempfile, torch
    >>> p = tempfile.mkdtemp() + "/s.pt"
    >>> torch.save({"w": torch.ones(2), "steps": 3}, p)
    >>> safe_torch_load(p)["steps"]
    3
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import zipfile
from typing import List, Sequence

import torch

from ds_maximus.errors import ShardStoreError, UntrustedCheckpointError

logger = logging.getLogger("ds_maximus")

# The types DeepSpeed 0.19 pickles into its checkpoint files besides tensors and primitives.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

_warned_trusted = set()


def _resolve(names: Sequence[str]) -> list:
    """The classes named (``module.Name``) that import here; a missing one is left out."""
    out = []
    for full in names:
        mod, _, name = full.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            continue
    return out


def _enum_member(cls, name):
    """``builtins.getattr`` as the safe loader sees it: a member of an allow-listed ``Enum`` by name, nothing else.

    Some Python versions pickle an enum member as ``getattr(EnumClass, "NAME")`` (DeepSpeed's ``ZeroStageEnum``
    in ZeRO-2's optimizer states, written by Debian's Python 3.11.2). A general ``getattr`` would let a pickle walk
    from an allowed class to anything (``__init__.__globals__``), so only ``EnumClass.__members__`` is reachable.
    """
    import enum
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not an "
                                 "enum member of an allowed type")


def deepspeed_safe_globals() -> list:
    """The classes of :data:`DEEPSPEED_GLOBALS` (empty where DeepSpeed is not installed)."""
    return _resolve(DEEPSPEED_GLOBALS)


def _unsafe_globals(path: str, allowed: Sequence[str]) -> List[str]:
    """The globals in ``path``'s pickle outside torch's and our allow-list (a static scan, nothing is built)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint, or corrupt: the caller reports the load error instead
        return []
    return sorted(set(found) - set(allowed) - ({"builtins.getattr"} if allowed else set()))


def _warn_trusted(path: str) -> None:
    key = os.path.dirname(os.path.abspath(path))
    if key not in _warned_trusted:
        _warned_trusted.add(key)
        logger.warning("ds_maximus: loading %s with trust_checkpoint=True: pickled code in these files can run; "
                       "use it only for checkpoints you wrote yourself", key)


def _load(path: str, map_location, allow_deepspeed: bool, mmap: bool):
    allowed = DEEPSPEED_GLOBALS if allow_deepspeed else ()
    try:
        with torch.serialization.safe_globals(_resolve(allowed) + ([(_enum_member, "builtins.getattr")]
                                                               if allow_deepspeed else [])):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        bad = _unsafe_globals(path, allowed)
        if bad:
            raise UntrustedCheckpointError(
                f"{path} needs {', '.join(bad)} to load, which ds_maximus does not allow (loading it could run "
                "code from the file); if you wrote this checkpoint yourself, pass --trust-checkpoint "
                "(maximus-export) or trust_checkpoint=True (checkpoint_state_dict, engine.load_checkpoint)",
                path, bad) from None
        raise UntrustedCheckpointError(
            f"{path} was refused by the safe loader ({str(e).splitlines()[0]}); if you wrote this checkpoint "
            "yourself, pass --trust-checkpoint (maximus-export) or trust_checkpoint=True "
            "(checkpoint_state_dict, engine.load_checkpoint)", path) from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile, KeyError, IndexError, TypeError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ShardStoreError(f"{path} is not a readable torch checkpoint ({type(e).__name__}: {first}); restore it "
                              "or save it again", path) from None


def safe_torch_load(path: str, map_location="cpu", trust: bool = False, allow_deepspeed: bool = False):
    """``torch.load(path)`` with ``weights_only=True`` (plus DeepSpeed's types when ``allow_deepspeed``).

    ``trust=True`` loads with ``weights_only=False`` after a one-time warning per folder.
    Raises UntrustedCheckpointError naming the refused types, ShardStoreError for a corrupt file.
    """
    if trust:
        _warn_trusted(path)
        return torch.load(path, map_location=map_location, weights_only=False)
    return _load(path, map_location, allow_deepspeed, mmap=False)


def check_torch_file(path: str, trust: bool = False) -> None:
    """Refuse a DeepSpeed file that DeepSpeed is about to load itself with ``weights_only=False``.

    The file is read the safe way and dropped; with the zip format (what ``torch.save`` writes) its
    tensors are memory-mapped, not copied.
    """
    if trust:
        _warn_trusted(path)
        return
    try:
        _load(path, "cpu", allow_deepspeed=True, mmap=True)
    except ShardStoreError as e:
        if isinstance(e, UntrustedCheckpointError):
            raise
        _load(path, "cpu", allow_deepspeed=True, mmap=False)  # a legacy (non-zip) file cannot be mapped


def check_deepspeed_folder(folder: str, trust: bool = False) -> None:
    """:func:`check_torch_file` on every ``*.pt`` file DeepSpeed wrote in a checkpoint tag folder."""
    if not os.path.isdir(folder):
        return
    for name in sorted(os.listdir(folder)):
        if name.endswith(("model_states.pt", "optim_states.pt")):
            check_torch_file(os.path.join(folder, name), trust=trust)
