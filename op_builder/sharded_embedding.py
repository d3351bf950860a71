"""Builders of the ``maximus_sharded_embedding`` ops: CPU (C++/OpenMP) and CUDA.

>>> from ds_maximus.ops import builder
>>> builder("sharded_embedding", "ShardedEmbeddingBuilder").absolute_name()
'ds_maximus.ops.maximus_sharded_embedding_op'
"""
from .builder import MaximusCUDAOpBuilder, MaximusOpBuilder


class ShardedEmbeddingBuilder(MaximusOpBuilder):
    NAME = "sharded_embedding"

    def sources(self):
        return [self.csrc("sharded_embedding", "cpu", "sharded_embedding_cpu.cpp"),
                self.csrc("sharded_embedding", "cpu", "slot_map.cpp"),
                self.csrc("sharded_embedding", "cpu", "batch_plan.cpp"),
                self.csrc("sharded_embedding", "bindings.cpp")]


class ShardedEmbeddingCUDABuilder(MaximusCUDAOpBuilder):
    NAME = "sharded_embedding_cuda"

    def sources(self):
        return [self.csrc("sharded_embedding", "cpu", "sharded_embedding_cpu.cpp"),
                self.csrc("sharded_embedding", "cpu", "slot_map.cpp"),
                self.csrc("sharded_embedding", "cpu", "batch_plan.cpp"),
                self.csrc("sharded_embedding", "cuda", "sharded_embedding_cuda.cu"),
                self.csrc("sharded_embedding", "bindings.cpp")]

    def cxx_args(self):
        return super().cxx_args() + ["-DMAXIMUS_WITH_CUDA"]

    def nvcc_args(self):
        # no --use_fast_math (DeepSpeed's default): IEEE division and square root, no flushed subnormals, so
        # the row update gives the CPU op's bits (row_math.h)
        return [a for a in super().nvcc_args() if a != "--use_fast_math"] + ["-DMAXIMUS_WITH_CUDA"]
