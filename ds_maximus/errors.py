"""Typed errors of ds_maximus.

Every error says what was wrong, what is allowed and how to fix it. Each carries a
``category`` (an :class:`ErrorCategory`) so callers can branch without parsing text,
as TorchRec's ``PlannerError`` does.
"""
from __future__ import annotations

import enum
from typing import Optional


class ErrorCategory(str, enum.Enum):
    CONFIG = "config"
    SHARD_STORE = "shard_store"
    CAPACITY = "capacity"
    OP_BUILD = "op_build"
    IO = "io"
    DISTRIBUTED = "distributed"
    TOKEN_MAP = "token_map"


class MaximusError(Exception):
    """Base class of every ds_maximus error."""

    category: ErrorCategory = ErrorCategory.CONFIG


class ConfigError(MaximusError, ValueError):
    """A wrong key, type or value in the ``"maximus"`` section of a ds_config.

    ``key_path`` is the dotted path of the offending key (``"maximus.embedding.cache_policy"``).
    """

    category = ErrorCategory.CONFIG

    def __init__(self, message: str, key_path: Optional[str] = None):
        super().__init__(message)
        self.key_path = key_path


class ShardStoreError(MaximusError, OSError):
    """A shard file or ``shard_index.json`` is missing, torn, corrupt or inconsistent."""

    category = ErrorCategory.SHARD_STORE

    def __init__(self, message: str, path: Optional[str] = None):
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:  # OSError's __str__ would drop our message when errno is unset
        return self.args[0] if self.args else ""


class UntrustedCheckpointError(ShardStoreError):
    """A checkpoint file would run code or build objects outside the allow-list when loaded.

    ``globals`` names the refused types; a checkpoint the user wrote loads with ``trust_checkpoint=True``
    (``maximus-export --trust-checkpoint``).
    """

    def __init__(self, message: str, path: Optional[str] = None, globals_: tuple = ()):
        super().__init__(message, path)
        self.globals = tuple(globals_)


class TokenMapError(MaximusError, ValueError):
    """A token map, its corpus, its tokenizer or a checkpoint it is applied to is wrong or inconsistent."""

    category = ErrorCategory.TOKEN_MAP


class CapacityError(MaximusError, RuntimeError):
    """A tier cannot hold what is asked of it (cache slots all pinned, disk full, ...)."""

    category = ErrorCategory.CAPACITY


class OpBuildError(MaximusError, RuntimeError):
    """A maximus op failed to compile or load. ``log`` holds the compiler output, ``fix`` the remedy."""

    category = ErrorCategory.OP_BUILD

    def __init__(self, op_name: str, reason: str, log: str = "", fix: str = ""):
        msg = f"could not build/load op '{op_name}': {reason}"
        if fix:
            msg += f"\n  fix: {fix}"
        if log:
            tail = log[-4000:]
            msg += f"\n  compiler log (last {len(tail)} chars):\n{tail}"
        super().__init__(msg)
        self.op_name = op_name
        self.reason = reason
        self.log = log
        self.fix = fix


class NVMeIOError(MaximusError, OSError):
    """An asynchronous read or write failed; names the path, offset and errno."""

    category = ErrorCategory.IO

    def __init__(self, message: str, path: str = "", offset: int = 0, err: int = 0):
        super().__init__(err, message)
        self.path = path
        self.offset = offset
        self.err = err

    def __str__(self) -> str:
        return self.args[1] if len(self.args) > 1 else super().__str__()


class DistributedError(MaximusError, RuntimeError):
    """A collective timed out or ranks disagree (names the collective and the ranks involved)."""

    category = ErrorCategory.DISTRIBUTED
