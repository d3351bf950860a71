"""The engine's look-ahead for plain scripts that hand DeepSpeed their data (``training_data=``).

``ds_maximus.initialize`` returns this wrapper in place of DeepSpeed's data loader: iterating it yields
the same batches, but fetches batch t+1 and prefetches its rows into the sharded modules' caches
before batch t is handed out, so the copies overlap batch t's step.

Example::

    engine, _, loader, _ = ds_maximus.initialize(model=model, training_data=dataset, config=cfg, ...)
    for batch in loader:                     # batch t+1's rows are already on their way
        engine.backward(engine(**batch).loss); engine.step()
"""
from __future__ import annotations

from typing import Iterable, List

from torch import nn


class LookaheadLoader:
    """Wraps a loader; ``iter()`` runs one batch ahead with row prefetch. Other attributes pass through."""

    def __init__(self, loader, modules: List[nn.Module]):
        self._loader = loader
        self._modules = modules
        self._it = None

    def __iter__(self):
        from ds_maximus.integrations.hf import lookahead
        return iter(lookahead(self._loader, self._modules))

    def __next__(self):
        if self._it is None:
            self._it = self.__iter__()
        return next(self._it)

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def wrap_loader(loader, modules: Iterable[nn.Module]):
    """``loader`` wrapped for look-ahead, or unchanged when there is nothing to prefetch into."""
    mods = [m for m in modules if hasattr(m, "prefetch")]
    if loader is None or not mods:
        return loader
    return LookaheadLoader(loader, mods)
