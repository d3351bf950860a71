"""Model-specific glue: find the MoE blocks of a model and their expert tensors."""
from ds_maximus.moe.adapters.hf_fused import MoEBlockInfo, find_moe_blocks  # noqa: F401
