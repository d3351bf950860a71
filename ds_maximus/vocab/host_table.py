"""``HostTable``: a frozen vocabulary table (an embedding or a linear head) that stays in host memory.

PEFT's ``modules_to_save`` keeps the frozen ``original_module`` of every wrapped table beside the trained copy
(which maximus turns into row partitions). The original is read only with the adapters disabled
(``with model.disable_adapter():``, ``unload()``), yet as a Parameter it would go to the compute device with the
model: a dense V x d table (1.25 GiB for Gemma-3-4B in bf16, twice that for an untied 8B head) on a 16 GB card.
``HostTable`` holds the original module in host memory, outside the module tree: no Parameter and no buffer,
so ``.to(device)``, DeepSpeed's casts and ZeRO never see the table. Its forward is the original's:

* an embedding gathers its rows on the host (the original module's own forward, scales included) and sends
  the ``[tokens, d]`` result to the ids' device;
* a plain ``nn.Linear`` head streams ``chunk_rows`` rows at a time to the input's device, so at most one chunk
  of the table is there at once (the logits are what a plain forward returns anyway);
* any other module runs its own forward on the host.

``state_dict`` keeps the original's keys and dtype (``...original_module.weight``), and ``load_state_dict``
writes into the host copy. Tables that shared a Parameter (a tied head) keep sharing it.

Example::

    >>> import torch
    >>> from torch import nn
    >>> emb = nn.Embedding(10, 4)
    >>> host = HostTable(emb)
    >>> list(host.parameters()), host.weight.device.type
    ([], 'cpu')
    >>> torch.equal(host(torch.tensor([[1, 2]])), emb(torch.tensor([[1, 2]])))
    True
    >>> sorted(host.state_dict())
    ['weight']
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class HostTable(nn.Module):
    """A frozen ``nn.Embedding`` or ``nn.Linear`` (or a subclass) held in host memory; see the module docstring.

    ``chunk_rows``: rows of a linear head sent to the compute device at a time.
    """

    def __init__(self, module: nn.Module, chunk_rows: int = 8192):
        super().__init__()
        if not isinstance(module, (nn.Embedding, nn.Linear)):
            raise TypeError(f"HostTable holds an nn.Embedding or nn.Linear, got {type(module).__name__}")
        module.requires_grad_(False)
        module.to("cpu")   # in place: a Parameter shared with another table (a tied head) moves once, stays shared
        self.__dict__["host"] = module   # not a submodule: nothing of it is moved, cast or partitioned
        self.chunk_rows = int(chunk_rows)

    # -- the original's attributes (weight, num_embeddings, padding_idx, out_features ...) ----------------------
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "host" in self.__dict__ and not name.startswith("_"):
                return getattr(self.__dict__["host"], name)
            raise

    @property
    def table_dtype(self) -> torch.dtype:
        return self.host.weight.dtype

    def _apply(self, fn, recurse=True):
        """A dtype cast (``.half()``, ``.to(torch.bfloat16)``) reaches the host copy as it would the original's
        Parameter; a move to a device does not (that is the point)."""
        probe = fn(torch.zeros((), dtype=self.table_dtype))
        if probe.is_floating_point() and probe.dtype != self.table_dtype:
            self.host.to(probe.dtype)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        w = self.host.weight
        return f"{type(self.host).__name__}({w.shape[0]} x {w.shape[1]}, {w.dtype}), host memory, frozen"

    # -- forward ---------------------------------------------------------------------------------------------------
    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        host = self.host
        if type(host).forward is nn.Linear.forward and not args and not kwargs:
            return self._streamed_linear(x)
        out = host(x.to("cpu"), *args, **kwargs)
        return out.to(x.device)

    def _streamed_linear(self, x: Tensor) -> Tensor:
        w, b = self.host.weight, self.host.bias
        rows = w.shape[0]
        if self.chunk_rows >= rows:
            return F.linear(x, w.to(x.device), None if b is None else b.to(x.device))
        out, parts = None, []
        for lo in range(0, rows, self.chunk_rows):
            hi = min(lo + self.chunk_rows, rows)
            y = F.linear(x, w[lo:hi].to(x.device), None if b is None else b[lo:hi].to(x.device))
            if y.requires_grad:       # autograd through the chunks: one concatenation at the end
                parts.append(y)
                continue
            if out is None:           # no graph: the chunks land in the logits, no second copy of them
                out = y.new_empty(*y.shape[:-1], rows)
            out[..., lo:hi] = y
        return torch.cat(parts, dim=-1) if parts else out

    # -- state dict: the original's keys -----------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for k, v in self.host.state_dict(keep_vars=keep_vars).items():
            destination[prefix + k] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for k, v in self.host.state_dict(keep_vars=True).items():
            key = prefix + k
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            src = state_dict[key]
            if tuple(src.shape) != tuple(v.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(src.shape)}, the "
                                  f"host table has {tuple(v.shape)}")
                continue
            with torch.no_grad():
                v.copy_(src.to(v.device, v.dtype))
