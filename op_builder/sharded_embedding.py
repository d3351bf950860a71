"""Builders of the ``maximus_sharded_embedding`` ops: CPU (C++/OpenMP) and CUDA.

>>> from ds_maximus.ops import builder
>>> builder("sharded_embedding", "ShardedEmbeddingBuilder").absolute_name()
'ds_maximus.ops.maximus_sharded_embedding_op'
"""
from .builder import MaximusCUDAOpBuilder, MaximusOpBuilder

# The optimizer math fuses exactly where row_math.h says (explicit fmaf), as the CUDA op does: a gradient
# scaled by the clip factor is then rounded before the update uses it, as torch's grad.mul_ is.
NO_CONTRACTION = ["-ffp-contract=off"]


class ShardedEmbeddingBuilder(MaximusOpBuilder):
    NAME = "sharded_embedding"

    def sources(self):
        return [self.csrc("sharded_embedding", "cpu", "sharded_embedding_cpu.cpp"),
                self.csrc("sharded_embedding", "cpu", "slot_map.cpp"),
                self.csrc("sharded_embedding", "cpu", "batch_plan.cpp"),
                self.csrc("sharded_embedding", "cpu", "grad_sum.cpp"),
                self.csrc("sharded_embedding", "bindings.cpp")]

    def cxx_args(self):
        return super().cxx_args() + NO_CONTRACTION


class ShardedEmbeddingCUDABuilder(MaximusCUDAOpBuilder):
    NAME = "sharded_embedding_cuda"

    def sources(self):
        return [self.csrc("sharded_embedding", "cpu", "sharded_embedding_cpu.cpp"),
                self.csrc("sharded_embedding", "cpu", "slot_map.cpp"),
                self.csrc("sharded_embedding", "cpu", "batch_plan.cpp"),
                self.csrc("sharded_embedding", "cpu", "grad_sum.cpp"),
                self.csrc("sharded_embedding", "cuda", "sharded_embedding_cuda.cu"),
                self.csrc("sharded_embedding", "bindings.cpp")]

    def cxx_args(self):
        return super().cxx_args() + NO_CONTRACTION + ["-DMAXIMUS_WITH_CUDA"]

    def nvcc_args(self):
        # no --use_fast_math (DeepSpeed's default): IEEE division and square root, no flushed subnormals, so
        # the row update gives the CPU op's bits (row_math.h)
        return [a for a in super().nvcc_args() if a != "--use_fast_math"] + ["-DMAXIMUS_WITH_CUDA"]
