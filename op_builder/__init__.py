"""ds_maximus op builders (installed as ``ds_maximus.op_builder``).

Never define ``__deepspeed__`` here: DeepSpeed's accelerators probe ``from op_builder import
__deepspeed__`` to decide whether a top-level ``op_builder`` is DeepSpeed's own.
"""
from .builder import MaximusCUDAOpBuilder, MaximusOpBuilder, sanitize_cuda_arch_list  # noqa: F401
