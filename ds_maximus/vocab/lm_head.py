"""``ShardedLMHead``: an LM head whose loss is a streamed cross-entropy (no ``[N, V]`` logits ever).

Three ways to hold the weight:

* ``placement: "gpu"`` (default): an ordinary ``nn.Parameter [V, d]`` (DeepSpeed/ZeRO own it); the
  loss is :func:`~ds_maximus.vocab.linear_cross_entropy` (3 GEMMs, token blocks x vocab chunks).
* ``placement: "cpu"``: no Parameter; the fp32 rows, AdamW moments and gradient live in the CPU tier
  (:class:`~ds_maximus.vocab.lm_head_tier.HeadTier`) and stream through the GPU chunk by chunk
  (``chunk_rows`` rows, double-buffered on a side stream). The head implements the maximus module
  protocol (``sparse_grad_norm_sq``, ``sparse_step``, ...) so the maximus engine updates it; the
  AdamW step itself runs on the GPU (``update_device="auto"``), the state streamed through it in
  blocks of ``update_rows`` rows (:mod:`~ds_maximus.vocab.lm_head_update`).
* ``tied_to=emb`` (a ``ShardedEmbedding``): rows come from ``emb.rows_for_compute`` and gradients go
  to the embedding's sparse gradient, so one store holds the table and it receives both gradients.

Called without labels, a streamed or tied head returns logits that autograd differentiates (the model
computes its own loss from them, as Hugging Face models do): the backward streams the rows again and
hands their gradient to the tier or the tied embedding. ``bias=`` (a tied decoder's bias, BERT-style
MLM heads) is an ordinary parameter added to the logits and trained by DeepSpeed.

``chunk_rows`` is the vocabulary width of every tile of the streamed softmax and, for streamed
heads, the unit of transfer, gradient hand-off and optimizer update.

Example::

    >>> import torch
    >>> from ds_maximus.vocab import ShardedLMHead
    >>> head = ShardedLMHead(1000, 16, config={"chunk_rows": 256, "placement": "cpu"})
    >>> h = torch.randn(2, 5, 16, requires_grad=True)
    >>> loss = head(h, labels=torch.randint(0, 1000, (2, 5)))
    >>> loss.backward(); head.sparse_step(lr=1e-3)
    >>> head(h[:, -1:]).shape          # no labels: logits (generation)
    torch.Size([2, 1, 1000])
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ds_maximus.config import EmbeddingOptimizerConfig, HeadPlacement, LMHeadConfig, MaximusConfig
from ds_maximus.engine.protocol import MaximusModule, ModuleRole, align_adam_with_engine
from ds_maximus.errors import ConfigError
from ds_maximus.vocab.linear_cross_entropy import MIB, LCEOptions, linear_cross_entropy
from ds_maximus.vocab.lm_head_stream import streamed_linear_cross_entropy, streamed_logits, streamed_weight
from ds_maximus.vocab.lm_head_tier import HeadTier, TiedSource


def _configs(config) -> tuple:
    if config is None:
        return LMHeadConfig(), None
    if isinstance(config, MaximusConfig):
        return config.lm_head, config.embedding.optimizer
    if isinstance(config, LMHeadConfig):
        return config, None
    if isinstance(config, dict):
        return MaximusConfig.from_dict({"lm_head": config}).lm_head, None
    raise ConfigError(f"ShardedLMHead config must be an LMHeadConfig, a MaximusConfig or a dict of the "
                      f"'lm_head' section, got {type(config).__name__}", "maximus.lm_head")


class ShardedLMHead(MaximusModule, nn.Module):
    """An LM head computing ``cross_entropy(hidden @ W.T, labels)`` by streaming vocab chunks (see module doc).

    ``forward(hidden, labels)`` returns the fp32 loss; ``forward(hidden)`` returns logits (a streamed head
    computes them chunk by chunk; with grad enabled they are differentiable).
    """

    def __init__(self, vocab_size: Optional[int] = None, hidden_size: Optional[int] = None, *,
                 config: Union[LMHeadConfig, MaximusConfig, dict, None] = None, tied_to=None,
                 weight: Optional[torch.Tensor] = None, device=None, dtype=None,
                 optimizer: Optional[EmbeddingOptimizerConfig] = None, block_bytes: int = 512 * MIB,
                 fp32_weight_grad: bool = False, update_device="auto", update_rows: int = 4096,
                 bias: Optional[nn.Parameter] = None):
        super().__init__()
        # the given Parameter itself, so a bias HF ties elsewhere (``cls.predictions.bias``) stays one tensor
        self.bias = bias
        cfg, opt_cfg = _configs(config)
        self.config = cfg
        self.chunk_rows = int(cfg.chunk_rows)
        self.block_bytes = int(block_bytes)
        self.fp32_weight_grad = bool(fp32_weight_grad)
        self.tier: Optional[HeadTier] = None
        self.source = None
        self._anchor = torch.zeros((), requires_grad=True)   # not a Parameter: makes backward run
        self._anchor_fn = None
        self._prev: dict = {}
        self._last: dict = {}
        if tied_to is not None:
            self.placement = "tied"
            self.source = TiedSource(tied_to, cfg.reuse_rows.value)
            self.vocab_size, self.hidden_size = self.source.vocab_size, self.source.dim
            self.tied_to = [tied_to]  # a list: not registered as a submodule (the model owns it)
            return
        if weight is not None:
            vocab_size, hidden_size = weight.shape
        if vocab_size is None or hidden_size is None:
            raise ValueError("ShardedLMHead needs vocab_size and hidden_size (or weight=, or tied_to=)")
        self.vocab_size, self.hidden_size = int(vocab_size), int(hidden_size)
        if weight is None:
            bound = 1.0 / math.sqrt(self.hidden_size)   # nn.Linear's default initialisation
            weight = torch.empty(self.vocab_size, self.hidden_size).uniform_(-bound, bound)
        if cfg.placement in (HeadPlacement.CPU, HeadPlacement.CPU_OPTIMIZER):
            self.placement = cfg.placement.value
            grad_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(cfg.grad_on_device.value)
            self.tier = HeadTier(weight, self.chunk_rows, optimizer or opt_cfg, update_device=update_device,
                                 update_rows=update_rows,
                                 master_on_device=cfg.placement == HeadPlacement.CPU_OPTIMIZER,
                                 grad_on_device=grad_dtype)
            self.source = self.tier
        else:
            self.placement = "gpu"
            self.weight = nn.Parameter(weight.detach().to(device=device, dtype=dtype or weight.dtype).clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, config=None, **kwargs) -> "ShardedLMHead":
        """A head holding ``linear``'s weight (copied; fp32 master in the CPU tier for ``placement: cpu``)."""
        kwargs.setdefault("bias", getattr(linear, "bias", None))
        return cls(config=config, weight=linear.weight.detach(), device=linear.weight.device, **kwargs)

    @property
    def optimizer(self) -> Optional[HeadTier]:
        """The CPU tier, whose ``beta1/beta2/eps`` the engine aligns with DeepSpeed's optimizer."""
        return self.tier

    @property
    def owns_weights(self) -> bool:
        """True when this head keeps its own rows outside autograd (the engine must call ``sparse_step``)."""
        return self.tier is not None

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, placement={self.placement}, chunk_rows={self.chunk_rows}"

    def set_grad_anchor(self, fn) -> None:
        """Route the backward anchor through ``fn()`` (the engine's norm carrier)."""
        self._anchor_fn = fn

    # -- compute -------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, labels: Optional[torch.Tensor] = None, *, ignore_index: int = -100,
                reduction: str = "mean", label_smoothing: float = 0.0,
                logit_softcap: Optional[float] = None) -> torch.Tensor:
        if labels is None:
            logits = self.logits(hidden)
            return logits if self.bias is None else logits + self.bias
        if self.bias is not None:
            raise ValueError("this ShardedLMHead has a bias, which the streamed loss does not add; call it without "
                             "labels (logits) and compute the loss from them")
        if self.placement == "gpu":
            return linear_cross_entropy(hidden, self.weight, labels, ignore_index, reduction, label_smoothing,
                                        logit_softcap, chunk_rows=self.chunk_rows, block_bytes=self.block_bytes,
                                        fp32_weight_grad=self.fp32_weight_grad)
        opts = LCEOptions(ignore_index, reduction, float(label_smoothing),
                          None if logit_softcap is None else float(logit_softcap), self.chunk_rows, None,
                          self.block_bytes)
        anchor = self._anchor_fn() if self._anchor_fn is not None else self._anchor
        return streamed_linear_cross_entropy(hidden, self.source, labels, opts, anchor,
                                             reuse=self.config.reuse_rows.value)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ W.T`` (no bias); streamed heads run it chunk by chunk, differentiable under grad mode."""
        if self.placement == "gpu":
            return F.linear(hidden, self.weight)
        anchor = self._anchor
        if torch.is_grad_enabled() and self._anchor_fn is not None:
            anchor = self._anchor_fn()
        return streamed_logits(hidden, self.source, self.chunk_rows, anchor)

    def __getattr__(self, name: str):
        # ``head.weight`` of a tied or CPU-placed head (no Parameter of its own): code written for nn.Linear heads
        # reads it and computes with it itself (TRL's fused LM head, Liger, Cut CE)
        if name == "weight" and self.__dict__.get("placement") in ("tied", "cpu", "cpu_optimizer"):
            return self.compute_weight()
        return super().__getattr__(name)

    def set_out_dtype(self, dtype: torch.dtype) -> None:
        self.__dict__["out_dtype"] = dtype

    def take_zero_grad_steps(self, steps: int, lr: Optional[float], weight_decay: Optional[float]) -> None:
        """A CPU-placed head's tier takes them (:meth:`HeadTier.zero_grad_step_`); a tied head's rows are the
        table's, which takes them itself; a GPU head's weight is DeepSpeed's."""
        if self.tier is not None:
            for _ in range(int(steps)):
                self.tier.zero_grad_step_(lr if lr is not None else (self.tier.opt.lr or 0.0), weight_decay)

    def compute_weight(self) -> torch.Tensor:
        """The whole ``[V, d]`` weight on the compute device in the dtype the model computes in, as one tensor whose
        gradient (under grad mode) goes where the head's gradient goes: the tied table's rows, or the CPU tier.
        It costs a dense head's memory (``V x d`` in the compute dtype) while it is held; a tied head's step
        table (``reuse_rows``), when the step left one on the device, is returned without a copy."""
        if self.placement == "gpu":
            return self.weight
        if self.placement == "tied":
            emb = self.tied_to[0]
            device, dtype = emb.compute_device, emb.out_dtype
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
            dtype = self.__dict__.get("out_dtype") or torch.float32
        anchor = self._anchor_fn() if torch.is_grad_enabled() and self._anchor_fn is not None else self._anchor
        return streamed_weight(self.source, self.chunk_rows, anchor, device, dtype)

    # -- maximus module protocol (CPU-placed heads) ---------------------------------------------
    role = ModuleRole.HEAD

    @property
    def engine_driven(self) -> bool:
        """The engine steps this head when it keeps its rows in the CPU tier (:attr:`owns_weights`)."""
        return self.owns_weights

    def configure_from_engine(self, engine, cfg: MaximusConfig) -> None:
        """The tier's AdamW betas/eps follow DeepSpeed's unless ``embedding.optimizer`` sets them."""
        align_adam_with_engine(self.tier, engine, cfg.embedding.optimizer)

    def defer_step_to(self, module: nn.Module) -> bool:
        """Beside a sharded embedding, the tier's device step (moments and gradient streamed through the GPU)
        starts its copies when ``module``'s next forward has issued its own, not at ``engine.step()``, where
        they held up the next step's first host-to-device copies while the compute stream idled. The head's
        forward still waits for the step's end."""
        tier = self.tier
        if not isinstance(tier, HeadTier):
            return False
        tier.defer_steps = True
        module.register_forward_hook(lambda *_: tier.launch_deferred_step())
        return True

    def _tier(self) -> HeadTier:
        if self.tier is None:
            raise RuntimeError(f"this ShardedLMHead (placement={self.placement}) owns no offloaded rows: its "
                               "weight is a Parameter (gpu) or the tied ShardedEmbedding's (tied)")
        return self.tier

    def sparse_grad_norm_sq(self) -> torch.Tensor:
        return self._tier().grad_norm_sq()

    def scale_sparse_grads_(self, factor: float) -> None:
        self._tier().scale_grads_(factor)

    def sparse_grads_finite(self) -> bool:
        return self._tier().grads_finite()

    def sparse_step(self, lr: Optional[float] = None, weight_decay: Optional[float] = None) -> None:
        tier = self._tier()
        if tier.step_(lr, weight_decay):
            self._last = {k: tier.counters[k] - self._prev.get(k, 0) for k in tier.counters}
            self._prev = dict(tier.counters)

    def zero_sparse_grads(self) -> None:
        self._tier().zero_grads()

    def sparse_grads(self):
        """``(ids, rows)``: the rows holding a gradient and their fp32 gradient (for data-parallel sums)."""
        tier = self._tier()
        tier._apply_scale()
        tier.sync()
        grads = tier._grads()   # in the CPU tier, or on the device (``grad_on_device``: fp32 or bf16)
        if grads is not None and bool(tier.grad_rows.all()):   # dense: no copy (a 262K-row head)
            return torch.arange(self.vocab_size), grads
        ids = tier.grad_rows.nonzero().squeeze(1)
        rows = grads.index_select(0, ids.to(grads.device)) if grads is not None else torch.zeros(0, self.hidden_size)
        return ids, rows

    def set_sparse_grads_(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        tier = self._tier()
        if rows is tier._grads() and ids.numel() == self.vocab_size:
            return          # what sparse_grads returned, unchanged (one rank): nothing to copy
        tier.zero_grads()
        if tier.grad_on_device is not None:  # the reduced rows go back where the gradient lives
            buf = tier._device_grad_buffer(tier.dgrad.device if tier.dgrad is not None else rows.device)
        else:
            buf = tier._grad_buffer()
        tier._sq_ok = False
        ids = ids.to("cpu", torch.long)
        buf.index_copy_(0, ids.to(buf.device), rows.to(buf.device, buf.dtype))
        tier.grad_rows[ids] = True
        tier._grad_device = tier._grad_device or rows.device

    def maximus_state_dict(self) -> dict:
        return self._tier().state_dict()

    def load_maximus_state_dict(self, d: dict) -> None:
        self._tier().load_state_dict(d)

    def stats(self) -> dict:
        tier = self._tier()
        cum = _stat_view(tier.counters, tier.step)
        cum["steps"] = tier.step
        cum["last_step"] = _stat_view(self._last, 1) if self._last else {}
        return cum

    def prefetch(self, ids) -> None:
        """Nothing to do: every step streams every row of the head."""

    def flush(self) -> None:
        if self.tier is not None:
            self.tier.sync()

    def full_weight(self) -> torch.Tensor:
        """The head's rows as a CPU fp32 tensor (the CPU tier's master itself for ``placement: cpu``, a copy
        of the GPU master for ``cpu_optimizer``)."""
        if self.placement == "tied":
            return self.tied_to[0].full_weight()
        if self.tier is not None:
            return self.tier.master_cpu()
        return self.weight.detach().float().cpu()

    # -- checkpoints: the CPU tier's rows appear as "weight" in the module's state_dict -----------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tier is not None:
            destination[prefix + "weight"] = self.full_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.tier is not None and prefix + "weight" in state_dict:
            self.tier.sync()
            self.tier.weight.copy_(state_dict[prefix + "weight"])
            for mirror in self.tier._mirrors.values():
                mirror.copy_(self.tier.weight)
            state_dict = {k: v for k, v in state_dict.items() if k != prefix + "weight"}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _stat_view(c: dict, steps: int) -> dict:
    return {"hit_rate": 0.0, "rows_fetched": int(c.get("rows_fetched", 0)), "rows_evicted": 0,
            "bytes_h2d": int(c.get("bytes_h2d", 0)), "bytes_d2h": int(c.get("bytes_d2h", 0)),
            "stall_ms": float(c.get("stall_ms", 0.0)), "row_sparsity": 1.0 if steps else 0.0}
