"""Vocabulary-sized layers as swappable partitions: ``ShardedEmbedding`` (row cache + sparse backward).

>>> from ds_maximus.vocab import ShardedEmbedding
"""
from ds_maximus.vocab.lm_head import ShardedLMHead, linear_cross_entropy  # noqa: F401
from ds_maximus.vocab.sharded_embedding import ShardedEmbedding, plain_weight  # noqa: F401
