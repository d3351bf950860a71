"""Model-specific glue: find the MoE blocks of a model, their expert tensors and how they are computed."""
from ds_maximus.experts.adapters.hf_fused import MoEBlockInfo, find_moe_blocks  # noqa: F401
from ds_maximus.experts.adapters.projection import FusedExpertsForm  # noqa: F401
