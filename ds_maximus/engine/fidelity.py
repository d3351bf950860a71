"""What a swapped module must reproduce of the module it replaces, or the reason it is refused.

A ``ShardedEmbedding`` computes ``nn.Embedding.forward``: a plain row gather. Hugging Face models use
``nn.Embedding`` subclasses whose own ``forward`` does more; the ones whose whole ``forward`` is the gather
times a scale (Gemma, Gemma-2, Gemma-3, MiniCPM3: ``* self.embed_scale.to(self.weight.dtype)`` with a
tensor buffer; M2M100, BART-style models: ``* self.embed_scale`` with a float) are reproduced by
:class:`EmbedScale`, a forward hook on the sharded module that multiplies its output the same way.
Any other overridden ``forward`` (positional offsets, normed embeddings) is refused with a
``ConfigError`` naming the class, as are ``max_norm`` and ``scale_grad_by_freq``, which the row cache
does not implement. The forward is recognised by its statements (Python's AST), not by the class name,
so a new family with the same forward is covered and a changed one is refused.

Example::

    >>> from torch import nn
    >>> from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding
    >>> embedding_scale(Gemma3TextScaledWordEmbedding(10, 4, 0, embed_scale=2.0), "model.embed_tokens")
    EmbedScale(tensor)
    >>> embedding_scale(nn.Embedding(10, 4), "model.embed_tokens") is None
    True
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Optional

import torch
from torch import nn

from ds_maximus.errors import ConfigError

# the statements of a forward that is the row gather times the module's ``embed_scale``
_TENSOR_SCALE = "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)"
_VALUE_SCALE = "return super().forward(input_ids) * self.embed_scale"


def _statements(fn) -> Optional[str]:
    """The body of ``fn`` without its docstring, normalised by ``ast.unparse`` (None if the source is unreadable)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return "\n".join(ast.unparse(s) for s in body)


def _norm(src: str) -> str:
    return "\n".join(ast.unparse(s) for s in ast.parse(src).body)


class EmbedScale:
    """A forward hook multiplying a sharded embedding's output by the replaced module's ``embed_scale``.

    ``tensor`` (a 0-d tensor, kept as the non-persistent buffer ``embed_scale`` on the sharded module so that
    dtype casts reach it as they reach the original's) is cast to the output's dtype first, as
    ``self.embed_scale.to(self.weight.dtype)`` does (the output dtype is the weight dtype there);
    ``value`` (a Python number) multiplies as it is.
    """

    def __init__(self, value: Optional[float] = None, tensor: bool = False):
        self.value = value
        self.tensor = tensor

    def attach(self, module: nn.Module, original: nn.Module) -> None:
        if self.tensor:
            module.register_buffer("embed_scale", original.embed_scale.detach().clone(), persistent=False)
        module.register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.tensor:
            return output * module.embed_scale.to(output.dtype)
        return output * self.value

    def __repr__(self) -> str:
        return "EmbedScale(tensor)" if self.tensor else f"EmbedScale(value={self.value})"


def embedding_scale(module: nn.Module, name: str) -> Optional[EmbedScale]:
    """What the sharded replacement of embedding ``name`` must add to the row gather: None (nothing), an
    :class:`EmbedScale`, or a ``ConfigError`` when its forward cannot be reproduced."""
    cls = type(module)
    where = f"maximus.embedding: {name} ({cls.__module__}.{cls.__name__})"
    if getattr(module, "max_norm", None) is not None or getattr(module, "scale_grad_by_freq", False):
        raise ConfigError(f"{where} uses max_norm / scale_grad_by_freq, which a sharded table does not implement; "
                          "leave it unswapped (list other modules in maximus.embedding.modules or raise min_rows)",
                          "maximus.embedding.modules")
    if not isinstance(module, nn.Embedding) or cls.forward is nn.Embedding.forward:
        return None
    body = _statements(cls.forward)
    scale = getattr(module, "embed_scale", None)
    if body == _norm(_TENSOR_SCALE) and torch.is_tensor(scale) and scale.numel() == 1:
        return EmbedScale(tensor=True)
    if body == _norm(_VALUE_SCALE) and isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return EmbedScale(value=scale)
    raise ConfigError(f"{where} overrides nn.Embedding.forward with computation maximus does not reproduce "
                      "(it reproduces only a forward that is the row gather times self.embed_scale); leave it "
                      "unswapped: list the other embeddings in maximus.embedding.modules or raise min_rows",
                      "maximus.embedding.modules")
