"""``MaximusModule``: the one contract between the engine and the modules it drives.

The engine (:class:`~ds_maximus.engine.runtime.MaximusRuntime`, :func:`~ds_maximus.engine.initialize`) updates,
reduces, clips, saves and prefetches every swapped module through these methods only: it never asks a module
whether it has a method (``hasattr``) and never decides by a module's name what it is. A module states its
:class:`ModuleRole`, whether it owns a partition of a table spread over the ranks, and which optional
capabilities it has by overriding the concrete defaults below.

Abstract (every module implements them): the row-sparse gradient (``sparse_grads`` / ``set_sparse_grads_`` /
``sparse_grad_norm_sq`` / ``scale_sparse_grads_`` / ``sparse_grads_finite`` / ``zero_sparse_grads``), the update
(``sparse_step``), the write-back (``flush``), the checkpoint state (``maximus_state_dict`` /
``load_maximus_state_dict``), the norm carrier's anchor (``set_grad_anchor``) and the figures (``stats``).

Concrete defaults (override where the module differs): ``reduce_grads(group)`` sums the shared rows over the
data-parallel ranks, ``reduce_norm_sq`` is the identity, ``prefetch`` does nothing, ``owns_partition`` is
False, ``engine_driven`` is True, ``set_out_dtype`` and ``configure_from_engine`` do nothing,
``defer_step_to`` defers nothing, ``grad_anchor_host`` is the module itself, ``removed_params`` is empty,
``load_maximus_state_dicts`` loads rank 0's state, ``train_padding_row`` has no padding row to release.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from ds_maximus.engine.protocol import MaximusModule, ModuleRole
    >>> class Rows(MaximusModule, nn.Module):
    ...     role = ModuleRole.ROWS
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.ids, self.rows = torch.zeros(0, dtype=torch.long), torch.zeros(0, 4)
    ...     def sparse_grads(self): return self.ids, self.rows
    ...     def set_sparse_grads_(self, ids, rows): self.ids, self.rows = ids, rows
    ...     def sparse_grad_norm_sq(self): return self.rows.float().pow(2).sum()
    ...     def scale_sparse_grads_(self, factor): self.rows = self.rows * factor
    ...     def sparse_grads_finite(self): return bool(torch.isfinite(self.rows).all())
    ...     def zero_sparse_grads(self): self.set_sparse_grads_(self.ids[:0], self.rows[:0])
    ...     def sparse_step(self, lr=None, weight_decay=None): self.zero_sparse_grads()
    ...     def flush(self): pass
    ...     def maximus_state_dict(self): return {}
    ...     def load_maximus_state_dict(self, d): pass
    ...     def set_grad_anchor(self, fn): pass
    ...     def stats(self): return {}
    >>> m = Rows()
    >>> m.set_sparse_grads_(torch.tensor([3]), torch.ones(1, 4))
    >>> m.reduce_grads(None); float(m.sparse_grad_norm_sq())    # one process: the sum is its own rows
    4.0
"""
from __future__ import annotations

import abc
import enum
from typing import Callable, Iterable, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn


class ModuleRole(enum.Enum):
    """What a driven module is to the engine (and to its wiring report)."""

    ROWS = "rows"          # an input table looked up by token id (embedding): the backward's last sparse module
    HEAD = "head"          # an LM head whose rows live outside autograd
    EXPERTS = "experts"    # MoE experts trained as partitions


class MaximusModule(abc.ABC):
    """Mixin for the ``nn.Module`` classes whose sparse state the engine drives (list it before ``nn.Module``)."""

    @property
    @abc.abstractmethod
    def role(self) -> ModuleRole:
        """The module's :class:`ModuleRole` (a class attribute ``role = ModuleRole.X`` of each concrete class)."""

    removed_params: Sequence[nn.Parameter] = ()
    """Parameters that left the model when this module replaced a part of it: the engine keeps them away from
    DeepSpeed and the client optimizer."""

    # -- the row-sparse gradient ---------------------------------------------------------------------
    @abc.abstractmethod
    def sparse_grads(self) -> Tuple[Tensor, Tensor]:
        """``(ids, rows)``: the ids holding a gradient and their gradient rows."""

    @abc.abstractmethod
    def set_sparse_grads_(self, ids: Tensor, rows: Tensor) -> None:
        """Replace the gradient by ``rows`` at ``ids`` (the reduced gradient coming back)."""

    @abc.abstractmethod
    def sparse_grad_norm_sq(self) -> Tensor:
        """The squared 2-norm of this rank's sparse gradient (a scalar tensor)."""

    @abc.abstractmethod
    def scale_sparse_grads_(self, factor: float) -> None:
        """Multiply the gradient by ``factor`` (loss-scale removal and clipping, one product)."""

    @abc.abstractmethod
    def sparse_grads_finite(self) -> bool:
        """False when the gradient holds an inf or a NaN."""

    @abc.abstractmethod
    def zero_sparse_grads(self) -> None:
        """Drop the gradient (a skipped step)."""

    # -- the update, the write-back, the checkpoint -----------------------------------------------------
    @abc.abstractmethod
    def sparse_step(self, lr: Optional[float] = None, weight_decay: Optional[float] = None) -> None:
        """Run the module's optimizer on the rows with gradient, with the engine's current ``lr`` and decay."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Write every pending change back to the module's tiers (before a checkpoint is saved)."""

    @abc.abstractmethod
    def maximus_state_dict(self) -> dict:
        """The module's own state (rows, optimizer state, counters) for the engine's checkpoint."""

    @abc.abstractmethod
    def load_maximus_state_dict(self, d: dict) -> None:
        """Restore what :meth:`maximus_state_dict` returned."""

    # -- wiring and figures ---------------------------------------------------------------------------
    @abc.abstractmethod
    def set_grad_anchor(self, fn: Callable[[], Tensor]) -> None:
        """Route the module's backward through ``fn()`` (the engine's norm carrier)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Cumulative figures and ``last_*`` per-step figures (see :mod:`ds_maximus.observability`)."""

    # -- optional capabilities: concrete defaults -----------------------------------------------------
    @property
    def owns_partition(self) -> bool:
        """True when each rank holds the gradient of its own share of the rows (a partitioned table): its
        gradient is not summed over ranks, its norm is (:meth:`reduce_norm_sq`)."""
        return False

    @property
    def engine_driven(self) -> bool:
        """True when the engine must run this module's step (its rows live outside DeepSpeed's parameters)."""
        return True

    def reduce_grads(self, group=None) -> None:
        """Sum the sparse gradient over the data-parallel ``group`` (every rank then holds the same rows).

        Default: gather every rank's ``(ids, rows)``, sum by id, and set the result."""
        from ds_maximus.distributed.sparse_grads import allreduce_sparse_rows
        ids, rows = self.sparse_grads()
        ids, rows = allreduce_sparse_rows(ids, rows, group=group)
        self.set_sparse_grads_(ids, rows)

    def reduce_norm_sq(self, local: Tensor) -> Tensor:
        """The global squared norm from this rank's ``local`` share; default ``local`` (after
        :meth:`reduce_grads` every rank holds the same gradient). Partition owners sum over the ranks."""
        return local

    def prefetch(self, ids: Tensor) -> None:
        """Start bringing ``ids``' rows in for the next forward; default: nothing to bring in."""

    def set_out_dtype(self, dtype: torch.dtype) -> None:
        """The dtype DeepSpeed trains in (it casts parameters, not modules); default: the module has none."""

    def configure_from_engine(self, engine, cfg) -> None:
        """Take settings from the built DeepSpeed ``engine`` (optimizer betas/eps); default: none to take."""

    def take_zero_grad_steps(self, steps: int, lr: Optional[float], weight_decay: Optional[float]) -> None:
        """DeepSpeed's dense optimizer took ``steps`` steps with every gradient zero when it was built (its ZeRO-0
        fp16/bf16 wrappers do, at the configured ``lr`` and ``weight_decay``): a module whose optimizer is to
        match the dense one takes them too. Default: none (the module's step semantics are its own)."""

    def defer_step_to(self, module: nn.Module) -> bool:
        """Start this module's step copies at ``module``'s next forward instead of at ``engine.step()``; returns
        whether it does. Default: it does not (its step runs where the engine calls it)."""
        return False

    def grad_anchor_host(self) -> nn.Module:
        """The module that holds the norm carrier parameter and whose backward feeds its anchor; default self."""
        return self

    def load_maximus_state_dicts(self, states: Iterable[dict]) -> None:
        """Restore from the states every rank saved in the partitioned shard mode (one dict per rank, in rank
        order, each read when reached). Default: rank 0's, through :meth:`load_maximus_state_dict` (a module
        the ranks replicate saved the same state on each); a table cut over the ranks re-partitions them."""
        self.load_maximus_state_dict(next(iter(states)))

    def train_padding_row(self) -> None:
        """A tied LM head now reads this module's rows, and its gradient reaches every row, the ``padding_idx``
        row's included (only the lookup's gradient stops there): the optimizer must update that row too.
        Default: the module has no padding row."""


def align_adam_with_engine(row_optimizer, engine, optimizer_config) -> None:
    """Give ``row_optimizer`` (an Adam-family sparse optimizer) the DeepSpeed optimizer's ``betas``/``eps``
    where ``optimizer_config`` (the pydantic section) does not set them, so exact mode equals dense AdamW.
    Optimizers without betas (Adagrad) are left as they are."""
    opt = getattr(engine, "basic_optimizer", None) or engine.optimizer
    groups = getattr(opt, "param_groups", None)
    if not groups or row_optimizer is None or getattr(row_optimizer, "beta1", None) is None:
        return
    g = groups[0]
    if "betas" not in optimizer_config.model_fields_set and "betas" in g:
        row_optimizer.beta1, row_optimizer.beta2 = (float(b) for b in g["betas"])
    if "eps" not in optimizer_config.model_fields_set and "eps" in g:
        row_optimizer.eps = float(g["eps"])
