"""Multi-rank support: combining row-sparse gradients, shard modes."""
from ds_maximus.distributed.sparse_grads import allreduce_sparse_rows  # noqa: F401
