"""Token maps: frequency-ordered vocabularies, rewritten tokenizers, checkpoint conversion, CLI.

>>> from ds_maximus.tokenmap import TokenMap, MultiTokenMap, convert_checkpoint
"""
from ds_maximus.tokenmap.convert import ADAMW_STATE_NAMES, convert_checkpoint
from ds_maximus.tokenmap.multi import MultiTokenMap
from ds_maximus.tokenmap.report import inspect_token_map
from ds_maximus.tokenmap.token_map import TokenMap

__all__ = ["TokenMap", "MultiTokenMap", "convert_checkpoint", "inspect_token_map", "ADAMW_STATE_NAMES"]
