"""Builders of the ``maximus_row_ops`` ops: CPU (C++/OpenMP) and CUDA.

>>> from ds_maximus.ops import builder
>>> builder("row_ops", "RowOpsBuilder").absolute_name()
'ds_maximus.ops.maximus_row_ops_op'
"""
from .builder import MaximusCUDAOpBuilder, MaximusOpBuilder

# The optimizer math fuses exactly where row_math.h says (explicit fmaf), as the CUDA op does: a gradient
# scaled by the clip factor is then rounded before the update uses it, as torch's grad.mul_ is.
NO_CONTRACTION = ["-ffp-contract=off"]


def host_args(builder) -> list:
    """The host compiler's flags for the CPU kernels, the same in both builds: OpenMP threads (``at::parallel_for``
    is a header template, so without ``-fopenmp`` its loop runs on one thread), the machine's vector units, and
    vectorisable ``sqrtf`` (``-fno-math-errno``, as ``MaximusOpBuilder`` has it).
    The CUDA build serves host tensors too (``ops.row_ops.host_op``): built without these, its host loops run on
    one thread, several times slower on a many-core host (docs/bench/code_history.md)."""
    return [builder.cpu_arch(), "-fopenmp", builder.simd_width(), "-fno-math-errno"] + NO_CONTRACTION


class RowOpsBuilder(MaximusOpBuilder):
    NAME = "row_ops"

    def sources(self):
        return [self.csrc("row_ops", "cpu", "row_ops_cpu.cpp"),
                self.csrc("row_ops", "cpu", "slot_map.cpp"),
                self.csrc("row_ops", "cpu", "batch_plan.cpp"),
                self.csrc("row_ops", "cpu", "grad_sum.cpp"),
                self.csrc("row_ops", "bindings.cpp")]

    def cxx_args(self):
        return super().cxx_args() + NO_CONTRACTION


class RowOpsCUDABuilder(MaximusCUDAOpBuilder):
    NAME = "row_ops_cuda"

    def sources(self):
        return [self.csrc("row_ops", "cpu", "row_ops_cpu.cpp"),
                self.csrc("row_ops", "cpu", "slot_map.cpp"),
                self.csrc("row_ops", "cpu", "batch_plan.cpp"),
                self.csrc("row_ops", "cpu", "grad_sum.cpp"),
                self.csrc("row_ops", "cuda", "row_ops_cuda.cu"),
                self.csrc("row_ops", "bindings.cpp")]

    def cxx_args(self):
        return [a for a in super().cxx_args() if a] + host_args(self) + ["-DMAXIMUS_WITH_CUDA"]

    def nvcc_args(self):
        # no --use_fast_math (DeepSpeed's default): IEEE division and square root, no flushed subnormals, so
        # the row update gives the CPU op's bits (row_math.h)
        return [a for a in super().nvcc_args() if a != "--use_fast_math"] + ["-DMAXIMUS_WITH_CUDA"]
