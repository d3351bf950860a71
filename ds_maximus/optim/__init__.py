"""Sparse optimizers of row tables: AdamW / Adagrad on touched rows, ``exact`` (replays skipped steps,
equals dense AdamW) and ``lazy`` (SparseAdam semantics) modes.

>>> from ds_maximus.optim import adamw_rows_, RowOptimizer, SparseRowGrad
"""
from ds_maximus.optim.row_optimizer import RowOptimizer  # noqa: F401
from ds_maximus.optim.sparse_adamw import adagrad_rows_, adamw_rows_, sparse_adam_rows_  # noqa: F401
from ds_maximus.optim.sparse_grad import SparseRowGrad  # noqa: F401
