"""Multi-rank support: combining row-sparse gradients, shard modes (replicated, partitioned, broadcast)."""
from ds_maximus.distributed.collectives import Collectives  # noqa: F401
from ds_maximus.distributed.partition import RowPartition  # noqa: F401
from ds_maximus.distributed.partitioned_embedding import PartitionedEmbedding  # noqa: F401
from ds_maximus.distributed.sparse_grads import allreduce_sparse_rows  # noqa: F401
