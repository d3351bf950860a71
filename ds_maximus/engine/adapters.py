"""Model adapters: the model-family glue the engine calls at fixed points, registered by the integrations.

The engine imports no integration. An integration registers a :class:`ModelAdapter` when it is imported
(``ds_maximus.integrations.hf`` registers the Hugging Face one); ``ds_maximus.ADAPTERS`` names the modules
that register the packaged adapters, and :func:`adapters` imports them by name the first time the engine
asks, the way entry points are loaded, so ``ds_maximus.initialize`` on a Hugging Face model attaches the
streamed head whether or not the caller imported the integration.

Example::

    >>> from ds_maximus.engine.adapters import ModelAdapter, adapters, register_adapter, unregister_adapter
    >>> register_adapter(ModelAdapter("mine", attach_lm_head=lambda model, cfg: None))
    >>> "mine" in [a.name for a in adapters()]
    True
    >>> unregister_adapter("mine")
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Dict, List, Optional

from torch import nn

from ds_maximus.config import MaximusConfig


@dataclasses.dataclass(frozen=True)
class ModelAdapter:
    """What one integration does for the engine; a hook left ``None`` is one it has nothing to do for."""

    name: str
    """Registry key: registering another adapter of the same name replaces it (a re-import is harmless)."""
    attach_lm_head: Optional[Callable[[nn.Module, MaximusConfig], Optional[nn.Module]]] = None
    """``(model, cfg) -> head``: route the model's loss through a streamed LM head (``lm_head.enabled``);
    returns the head when it holds rows the engine must step, else ``None``."""
    prepare_model: Optional[Callable[[nn.Module, MaximusConfig], None]] = None
    """``(model, cfg)``: rework the model once its tables are swapped and its head attached, before DeepSpeed
    places it on the device (PEFT: the frozen originals of the swapped tables go to host memory)."""
    on_enable: Optional[Callable[[], None]] = None
    """Called by ``ds_maximus.enable()`` (install the integration's own hooks, e.g. a Trainer callback)."""
    on_disable: Optional[Callable[[], None]] = None
    """Called by ``ds_maximus.engine.disable()``: undo ``on_enable``."""


_REGISTRY: Dict[str, ModelAdapter] = {}
_PACKAGED_LOADED = False


def register_adapter(adapter: ModelAdapter) -> None:
    """Add ``adapter`` (an integration calls this when it is imported)."""
    _REGISTRY[adapter.name] = adapter


def unregister_adapter(name: str) -> None:
    _REGISTRY.pop(name, None)


def adapters() -> List[ModelAdapter]:
    """Every registered adapter, in registration order; the packaged ones (``ds_maximus.ADAPTERS``) first
    imported, once."""
    global _PACKAGED_LOADED
    if not _PACKAGED_LOADED:
        import ds_maximus
        for name in ds_maximus.ADAPTERS:
            importlib.import_module(name)
        _PACKAGED_LOADED = True
    return list(_REGISTRY.values())


def attach_lm_head(model: nn.Module, cfg: MaximusConfig) -> Optional[nn.Module]:
    """The streamed LM head of ``model`` from the first adapter that returns one (``None`` when the head
    stays the model's parameter, which DeepSpeed trains)."""
    for a in adapters():
        if a.attach_lm_head is not None:
            head = a.attach_lm_head(model, cfg)
            if head is not None:
                return head
    return None


def prepare_model(model: nn.Module, cfg: MaximusConfig) -> None:
    """Every adapter's ``prepare_model`` hook, in registration order."""
    for a in adapters():
        if a.prepare_model is not None:
            a.prepare_model(model, cfg)


def run_enable_hooks() -> None:
    for a in adapters():
        if a.on_enable is not None:
            a.on_enable()


def run_disable_hooks() -> None:
    for a in adapters():
        if a.on_disable is not None:
            a.on_disable()
