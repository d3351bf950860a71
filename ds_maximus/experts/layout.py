"""How one expert's tensors sit in its flat buffer.

Every expert of a layer has the same tensors (``gate_up_proj`` [2F, H], ``down_proj`` [H, F], maybe
biases), so one :class:`ExpertLayout` describes them all: names, per-expert shapes, and element
offsets into a flat 1-D buffer of ``numel`` elements. Offsets are aligned to ``ALIGN_ELEMS`` elements
so every view starts on a 512-byte boundary (vectorised kernels see the same alignment as in the
original stacked parameter), and ``numel`` is padded the same way so a slot buffer ``[S, numel]``
can be viewed as ``[S, *shape]`` per tensor with a uniform stride.

    >>> import torch
    >>> lay = ExpertLayout.from_stacked({"w": torch.zeros(4, 3, 5)}, num_experts=4)
    >>> lay.shapes["w"], lay.offsets["w"], lay.numel
    ((3, 5), 0, 256)
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Tuple

import torch

from ds_maximus.errors import ConfigError

ALIGN_ELEMS = 256  # 512 bytes in bf16, 1 KiB in fp32


def _align(n: int) -> int:
    return (n + ALIGN_ELEMS - 1) // ALIGN_ELEMS * ALIGN_ELEMS


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Names, shapes and offsets of one expert's tensors inside its flat buffer."""

    names: Tuple[str, ...]
    shapes: Dict[str, Tuple[int, ...]]
    offsets: Dict[str, int]
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def from_stacked(cls, tensors: Mapping[str, torch.Tensor], num_experts: int) -> "ExpertLayout":
        """Layout of experts stored stacked along dim 0 (``gate_up_proj`` of shape [E, 2F, H], ...)."""
        names, shapes, offsets, pos, dtype = [], {}, {}, 0, None
        for name, t in tensors.items():
            if t.dim() < 2 or t.shape[0] != num_experts:
                raise ConfigError(f"expert tensor '{name}' has shape {tuple(t.shape)}; expected [num_experts="
                                  f"{num_experts}, ...] (fused HF experts); this MoE layout is not supported")
            if dtype is not None and t.dtype != dtype:
                raise ConfigError(f"expert tensors mix dtypes ({dtype} and {t.dtype} for '{name}'); "
                                  "cast the model to one dtype (model.to(torch.bfloat16)) before offloading")
            dtype = t.dtype
            names.append(name)
            shapes[name] = tuple(t.shape[1:])
            offsets[name] = pos
            pos = _align(pos + int(torch.Size(t.shape[1:]).numel()))
        if not names:
            raise ConfigError("no expert tensors to offload")
        return cls(tuple(names), shapes, offsets, max(pos, ALIGN_ELEMS), dtype)

    def size_of(self, name: str) -> int:
        return int(torch.Size(self.shapes[name]).numel())

    def pack_(self, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Copy one expert's tensors into ``flat`` (1-D, ``numel`` elements); padding is zeroed."""
        assert flat.numel() == self.numel and flat.dim() == 1
        flat.zero_()
        for name in self.names:
            o = self.offsets[name]
            flat[o:o + self.size_of(name)].view(self.shapes[name]).copy_(tensors[name])
        return flat

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor ``name`` of one expert, as a view of its flat buffer (1-D)."""
        o = self.offsets[name]
        return flat[o:o + self.size_of(name)].view(self.shapes[name])

    def stacked_view(self, slots: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor ``name`` of every slot of a ``[S, numel]`` buffer, as a ``[S, *shape]`` view."""
        assert slots.dim() == 2 and slots.shape[1] == self.numel
        o = self.offsets[name]
        part = slots[:, o:o + self.size_of(name)]
        shape = self.shapes[name]
        strides = [slots.stride(0)]
        acc = 1
        inner = []
        for s in reversed(shape):
            inner.append(acc)
            acc *= s
        strides += list(reversed(inner))
        return part.as_strided((slots.shape[0], *shape), strides, part.storage_offset())
