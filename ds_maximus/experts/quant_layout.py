"""How one quantized expert sits in its flat byte buffer: the packed form the quantized tier holds and moves.

With ``"moe": {"quant": {"bits": b, "group_size": g}}`` an expert's weights (``gate_up_proj`` ``[2F, H]``,
``down_proj`` ``[H, F]``) are quantized once, when they enter the tier (:mod:`ds_maximus.experts.quant`), and
from then on exist only as bytes: per weight its packed codes (uint8 ``[rows, cols * b / 8]``), then its fp16
scales and offsets (``[rows, cols / g]`` each). :class:`QuantizedExpertLayout` puts these parts of every weight one
after another in a uint8 buffer of ``numel`` bytes, each part starting on a 512-byte boundary. It offers the
interface of :class:`~ds_maximus.experts.layout.ExpertLayout` that the stores and the cache use (``numel``,
``dtype``, ``nbytes``, ``pack_``), so the CPU tier, the NVMe tier's shard files and the GPU slots hold and copy
the packed bytes unchanged; :meth:`view` hands the compute a :class:`~ds_maximus.experts.quant.QuantizedTensor`
of views into a slot or a host buffer (no copy, no dequantized weight).

    >>> import torch
    >>> from ds_maximus.experts.layout import ExpertLayout
    >>> experts = {"gate_up_proj": torch.zeros(2, 128, 64), "down_proj": torch.zeros(2, 64, 64)}  # fp32
    >>> lay = QuantizedExpertLayout.from_layout(ExpertLayout.from_stacked(experts, 2), bits=4, group_size=64)
    >>> lay.numel, lay.dtype, lay.exact_nbytes
    (8192, torch.uint8, 49152)
    >>> flat = torch.zeros(lay.numel, dtype=torch.uint8)
    >>> _ = lay.pack_(flat, {"gate_up_proj": torch.ones(128, 64), "down_proj": torch.ones(64, 64)})
    >>> q = lay.view(flat, "down_proj"); q.shape, q.bits, float(dequantize(q).sum())
    ((64, 64), 4, 4096.0)
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Tuple

import torch

from ds_maximus.errors import ConfigError
from ds_maximus.experts.layout import ExpertLayout
from ds_maximus.experts.quant import QuantizedTensor, check_layout, dequantize, quantize  # noqa: F401 (doctest)

ALIGN_BYTES = 512  # every part starts on a 512-byte boundary, as the exact layout's tensors do


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclasses.dataclass(frozen=True)
class QuantizedExpertLayout:
    """Byte offsets of each weight's packed codes, scales and offsets in one expert's uint8 buffer.

    ``base``: the exact layout (names, shapes and dtype of the model's experts); ``parts[name]``: the byte offsets
    of its ``(packed, scales, zeros)``; ``numel``: the buffer's bytes (a multiple of 512).
    """

    base: ExpertLayout
    bits: int
    group_size: int
    parts: Dict[str, Tuple[int, int, int]]
    numel: int
    dtype: torch.dtype = torch.uint8

    @property
    def names(self):
        return self.base.names

    @property
    def shapes(self):
        return self.base.shapes

    @property
    def nbytes(self) -> int:
        """Bytes of one expert in the tier, on the link and in a slot."""
        return self.numel

    @property
    def exact_nbytes(self) -> int:
        """Bytes of one expert in the exact layout (the model's dtype): ``exact_nbytes / nbytes`` is the packing
        ratio."""
        return self.base.nbytes

    @classmethod
    def from_layout(cls, base: ExpertLayout, bits: int, group_size: int) -> "QuantizedExpertLayout":
        """The packed layout of ``base``'s experts; a ``ConfigError`` (``moe.quant``) when a weight cannot be
        quantized at ``bits`` / ``group_size`` (a width other than 8/4/3/2, a group size that does not divide a
        weight's columns, a tensor that is not a 2-D weight such as a bias)."""
        parts, pos = {}, 0
        for name in base.names:
            shape = base.shapes[name]
            try:
                check_layout(shape, bits, group_size)
            except ValueError as e:
                raise ConfigError(f"moe.quant cannot quantize the experts' '{name}' {tuple(shape)}: {e}",
                                  "maximus.moe.quant") from None
            rows, cols = shape
            offs = []
            for n in (rows * cols * bits // 8, 2 * rows * (cols // group_size), 2 * rows * (cols // group_size)):
                offs.append(pos)
                pos = _align(pos + n)
            parts[name] = tuple(offs)
        return cls(base, int(bits), int(group_size), parts, max(pos, ALIGN_BYTES))

    def _bytes(self, name: str) -> Tuple[int, int]:
        rows, cols = self.base.shapes[name]
        return rows * cols * self.bits // 8, 2 * rows * (cols // self.group_size)

    def view(self, flat: torch.Tensor, name: str) -> QuantizedTensor:
        """Weight ``name`` of one expert as a :class:`QuantizedTensor` of views into ``flat`` (uint8, 1-D)."""
        rows, cols = self.base.shapes[name]
        p, s, z = self.parts[name]
        nq, ns = self._bytes(name)
        groups = cols // self.group_size
        return QuantizedTensor(flat[p:p + nq].view(rows, -1), flat[s:s + ns].view(torch.float16).view(rows, groups),
                               flat[z:z + ns].view(torch.float16).view(rows, groups), (rows, cols), self.bits,
                               self.group_size, self.base.dtype)

    def pack_(self, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Quantize one expert's exact ``tensors`` and write the packed form into ``flat`` (uint8, ``numel``
        bytes; padding zeroed). The quantization runs on each tensor's own device (a model on the GPU quantizes
        there), so only the packed bytes travel to the tier."""
        assert flat.numel() == self.numel and flat.dim() == 1 and flat.dtype == torch.uint8
        flat.zero_()
        for name in self.names:
            q = quantize(tensors[name], self.bits, self.group_size)
            dst = self.view(flat, name)
            for d, src in ((dst.packed, q.packed), (dst.scales, q.scales), (dst.zeros, q.zeros)):
                d.copy_(src)
        return flat
