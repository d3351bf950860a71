"""MoE experts trained as swappable partitions (``"moe": {"train": true}`` under ``ds_maximus.initialize``).

    >>> from ds_maximus.experts.training import ExpertTrainer, attach_expert_training
"""
from ds_maximus.experts.training.build import attach_expert_training  # noqa: F401
from ds_maximus.experts.training.trainer import ExpertTrainer, LayerSpec  # noqa: F401

__all__ = ["attach_expert_training", "ExpertTrainer", "LayerSpec"]
