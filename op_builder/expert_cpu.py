"""Builder of the ``maximus_expert_cpu`` op: SwiGLU experts on the host (C++/OpenMP), from bf16 or quantized weights.

>>> from ds_maximus.ops import builder
>>> builder("expert_cpu", "ExpertCPUBuilder").absolute_name()
'ds_maximus.ops.maximus_expert_cpu_op'
"""
from .builder import MaximusOpBuilder

# the dequantization is code * scale + zero with two roundings, as the PyTorch reference has it
NO_CONTRACTION = ["-ffp-contract=off"]


class ExpertCPUBuilder(MaximusOpBuilder):
    NAME = "expert_cpu"

    def sources(self):
        return [self.csrc("expert_cpu", "common", "expert_kernels.cpp"),
                self.csrc("expert_cpu", "bindings.cpp")]

    def cxx_args(self):
        return super().cxx_args() + NO_CONTRACTION
