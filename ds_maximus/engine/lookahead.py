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

from typing import Any, Iterable, List, Optional

import torch
from torch import nn

from ds_maximus.engine.protocol import MaximusModule


def unique_ids(batch: Any) -> Optional[torch.Tensor]:
    """The unique token ids of a batch: its ``input_ids`` (a dict's key or an attribute), else the first tensor
    of a tuple/list batch, else the batch itself when it is an integer tensor (a loader of token-id tensors);
    ``None`` when it has none."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else getattr(batch, "input_ids", None)
    if ids is None and isinstance(batch, (tuple, list)) and batch and torch.is_tensor(batch[0]):
        ids = batch[0]
    if ids is None and torch.is_tensor(batch):
        ids = batch
    if ids is None or not torch.is_tensor(ids) or ids.is_floating_point() or ids.is_complex():
        return None
    return torch.unique(ids.reshape(-1))


def lookahead(loader: Iterable, modules: Iterable[MaximusModule]) -> Iterable:
    """Iterate ``loader`` one batch ahead, prefetching the next batch's rows into ``modules`` before yielding
    this one."""
    modules = list(modules)
    it = iter(loader)
    try:
        cur = next(it)
    except StopIteration:
        return
    while True:  # not ``for nxt in it``: DeepSpeed's loader restarts itself in __iter__
        try:
            nxt = next(it)
        except StopIteration:
            break
        with torch.profiler.record_function("maximus.prefetch"):
            ids = unique_ids(nxt)
            if ids is not None:
                for m in modules:
                    m.prefetch(ids)
        yield cur
        cur = nxt
    yield cur


class LookaheadLoader:
    """Wraps a loader; ``iter()`` runs one batch ahead with row prefetch. Other attributes pass through."""

    def __init__(self, loader, modules: List[MaximusModule]):
        self._loader = loader
        self._modules = modules
        self._it = None

    def __iter__(self):
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
    mods = [m for m in modules if isinstance(m, MaximusModule)]
    if loader is None or not mods:
        return loader
    return LookaheadLoader(loader, mods)
