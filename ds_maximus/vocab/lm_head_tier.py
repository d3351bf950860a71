"""The CPU tier of a ``placement: cpu`` LM head, and the chunk sources of streamed heads.

:class:`HeadTier` keeps the head's fp32 master rows, its AdamW moments and its accumulated gradient
in the partition core's pinned CPU tier (a :class:`~ds_maximus.partition.tier.TensorTier`, each table
mapped when first used), plus a pinned copy of the rows in the compute dtype (bf16 halves the bytes
crossing PCIe), refreshed chunk by chunk after each optimizer step. As a :class:`ChunkSource` it
copies a chunk to the GPU through the core's transfer engine
(:class:`~ds_maximus.partition.transfer.CudaTransfer`: its fill stream; the compute stream waits on an
event, never on the host); the next chunk's copy is issued while the current one computes, so two chunks
are in flight at most. Gradient chunks go back the same way (device-to-host on its write-back stream), added on the GPU
to what earlier micro-batches accumulated, or stay on the device (``grad_on_device``): that part is
:class:`~ds_maximus.vocab.lm_head_grads.HeadGradients`.

The AdamW step runs where ``update_device`` says: ``"auto"`` (default) on the device the gradients
came from (a GPU: :class:`~ds_maximus.vocab.lm_head_update.StagedAdamW` streams the state through
it in blocks of ``update_rows`` rows, asynchronously), ``"host"`` on the CPU, or an explicit device.
With a device update, the gradient norm is summed on the device as gradient chunks arrive and the
clipping scale is applied on the device, so the host never walks the ``[V, d]`` gradient.

:class:`TiedSource` reads rows from, and gives gradients to, a ``ShardedEmbedding``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ds_maximus.config import EmbeddingOptimizerConfig
from ds_maximus.partition.tier import TensorTier
from ds_maximus.partition.transfer import CudaTransfer
from ds_maximus.vocab.lm_head_grads import HeadGradients
from ds_maximus.vocab.lm_head_update import PendingStep, StagedAdamW, device_with_index

_TABLES = ("weight", "exp_avg", "exp_avg_sq", "grad")  # the fp32 [V, dim] tables of the CPU tier


def _one_piece(tier: TensorTier, name: str, vocab: int, dim: int) -> torch.Tensor:
    """Table ``name`` of ``tier`` as one ``[vocab, dim]`` tensor (mapped, zeroed, when first used)."""
    return tier.host_table(name).whole.view(vocab, dim)


def _row_tier(vocab: int, dim: int, names, dtype: torch.dtype, pin: bool, what: str) -> TensorTier:
    """A CPU tier of ``vocab`` rows of ``dim`` elements per name, each table one piece (the step and the
    chunk copies slice whole tables), pinned when ``pin``; refused before anything is allocated where the
    host's free memory cannot hold it."""
    item = torch.empty((), dtype=dtype).element_size()
    return TensorTier.allocate(vocab, {n: ((dim,), dtype) for n in names}, pin=pin,
                               piece_bytes=max(1, vocab * dim * item), what=what,
                               fix="keep the head on the GPU (lm_head.placement = 'gpu') or free host memory")


class HeadTier(HeadGradients):
    """fp32 master rows, AdamW state and gradient of a CPU-placed head; a streaming ChunkSource."""

    def __init__(self, weight: torch.Tensor, chunk_rows: int, optimizer: Optional[EmbeddingOptimizerConfig] = None,
                 pin_memory: bool = True, update_device="auto", update_rows: int = 4096,
                 master_on_device: bool = False, grad_on_device: Optional[torch.dtype] = None):
        self.vocab_size, self.dim = (int(n) for n in weight.shape)
        self.pin = pin_memory
        # the whole tier is planned against free host memory before anything is allocated or copied
        self.host_tier = _row_tier(self.vocab_size, self.dim, _TABLES, torch.float32, self.pin,
                                   f"the {tuple(weight.shape)} head's fp32 master, AdamW moments and gradient")
        # ``master_on_device`` (placement cpu_optimizer): the fp32 rows move to the compute device on first
        # use and stay there; chunks are cast from them, the step updates them in place, and only the
        # AdamW moments and the gradient live here.
        self.master_on_device = bool(master_on_device)
        self.chunk_rows = int(chunk_rows)
        self.weight = self._table("weight")
        self.weight.copy_(weight.detach())     # a copy, in fp32
        self.opt = optimizer or EmbeddingOptimizerConfig()
        # AdamW constants; the engine sets them from the DeepSpeed optimizer unless the config names them
        self.beta1, self.beta2 = (float(b) for b in self.opt.betas)
        self.eps = float(self.opt.eps)
        self.exp_avg: Optional[torch.Tensor] = None
        self.exp_avg_sq: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None
        # ``grad_on_device`` (a dtype): the accumulated gradient lives on the device its chunks come from, in
        # that dtype, never in pinned RAM (``dgrad``); the step reads it where it is
        self.grad_on_device = grad_on_device
        self.dgrad: Optional[torch.Tensor] = None
        self.grad_rows = torch.zeros(self.vocab_size, dtype=torch.bool)   # rows holding a gradient
        self.step = 0
        self.lr_history: List[float] = []
        self._mirrors: Dict[torch.dtype, torch.Tensor] = {}
        # per device index: chunk copies in on its fill stream, gradient copies out on its write-back stream
        self._transfers: Dict[int, CudaTransfer] = {}
        self._staged: Dict[Tuple, Tuple[torch.Tensor, torch.cuda.Event]] = {}
        self._pending: List[torch.cuda.Event] = []
        self.counters = {"rows_fetched": 0, "bytes_h2d": 0, "bytes_d2h": 0, "stall_ms": 0.0}
        if update_device not in ("auto", "host"):
            update_device = torch.device(update_device)
        self.update_device = update_device
        self.update_rows = int(update_rows)
        self._grad_device: Optional[torch.device] = None
        self._staged_opt: Optional[StagedAdamW] = None
        self._step_event: Optional[torch.cuda.Event] = None   # end of an in-flight device step
        self._grad_scale = 1.0                                # deferred clipping scale (device update)
        self._sq: Dict[Tuple[int, int], torch.Tensor] = {}    # chunk -> sum of squares of its grad
        self._sq_ok = True                                    # _sq covers exactly the rows with grads
        # ``defer_steps``: a device step is prepared at ``step_`` but its copies start at
        # ``launch_deferred_step()`` (the runtime calls it when the next forward's embedding has issued its
        # own host->device copies) or at the first use of the state, whichever comes first
        self.defer_steps = False
        self._deferred = None

    @property
    def _step_event(self) -> Optional[torch.cuda.Event]:
        """End event of the in-flight device step: launches a deferred one, joins the thread still issuing it."""
        self.launch_deferred_step()
        p = self._step_pending
        if isinstance(p, PendingStep):
            self._step_pending = p = p.event()
        return p

    @_step_event.setter
    def _step_event(self, value) -> None:
        self._step_pending = value

    def launch_deferred_step(self) -> None:
        """Start the copies of a step ``defer_steps`` held back (no-op when none is). Returns at once: the
        worker thread issues the step's blocks while the caller goes on (joining it here would hold the
        forward's host thread for the whole issue loop, with the compute stream idle)."""
        launch, self._deferred = self._deferred, None
        if launch is not None:
            launch()

    # -- rows out ------------------------------------------------------------------------------
    def host_rows(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.float32:
            return self.weight[lo:hi]
        if dtype not in self._mirrors:
            if self._step_event is not None:
                self.sync()
            tier = _row_tier(self.vocab_size, self.dim, ("weight",), dtype, self.pin,
                             f"the ({self.vocab_size}, {self.dim}) head's {dtype} copy of its rows")
            mirror = _one_piece(tier, "weight", self.vocab_size, self.dim)
            mirror.copy_(self.weight)           # the same cast as weight.to(dtype)
            self._mirrors[dtype] = mirror
        return self._mirrors[dtype][lo:hi]

    def _table(self, name: str) -> torch.Tensor:
        """Table ``name`` of the CPU tier (one of ``_TABLES``) as one ``[V, dim]`` fp32 tensor."""
        return _one_piece(self.host_tier, name, self.vocab_size, self.dim)

    def _transfer(self, device: torch.device) -> CudaTransfer:
        """The copy engine of CUDA ``device`` (one per device): chunks in on its fill stream and gradients out
        on its write-back stream, so the two directions overlap."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._transfers:
            self._transfers[idx] = CudaTransfer(torch.device("cuda", idx), timing=False, write_back=True)
        return self._transfers[idx]

    def _ensure_master(self, device: torch.device) -> bool:
        """Move the fp32 master to ``device`` (cpu_optimizer, once); True when it lives there."""
        if not self.master_on_device or device.type != "cuda":
            return False
        device = device_with_index(device)
        if self.weight.device != device:
            self.sync()
            self.weight = self.weight.to(device)
            self.host_tier.release("weight")    # the device copy is the master from now on
            self._mirrors.clear()
        return True

    def master_cpu(self) -> torch.Tensor:
        """The fp32 master rows on the CPU (the tensor itself, or a copy of the device master)."""
        self.sync()
        return self.weight if self.weight.device.type == "cpu" else self.weight.cpu()

    def prefetch(self, lo: int, hi: int, device: torch.device, dtype: torch.dtype) -> None:
        device = torch.device(device)
        if self._ensure_master(device):
            return                               # cast from the device master on fetch
        key = (lo, hi, dtype, device)
        if device.type != "cuda" or key in self._staged:
            return
        host = self.host_rows(lo, hi, dtype)
        # after an in-flight step, which writes the mirror
        self._staged[key] = self._transfer(device).load_chunk(host, after=self._step_event)
        self.counters["rows_fetched"] += hi - lo
        self.counters["bytes_h2d"] += host.numel() * host.element_size()

    def version(self) -> int:
        """The step count: the rows change only in a step."""
        return int(self.step)

    def zero_grad_step_(self, lr: float, weight_decay: Optional[float]) -> None:
        """An AdamW step in which every gradient is zero, as DeepSpeed's ZeRO-0 fp16/bf16 wrappers take one when they
        are built: the moments stay zero, every row decays by ``1 - lr * weight_decay``, the step count (and so the
        next step's bias correction) advances."""
        self.sync()
        lr, wd = float(lr), float(weight_decay or 0.0)
        self.step += 1
        self.lr_history.append(lr)
        if wd:
            self.weight.mul_(1.0 - lr * wd)
            for mirror in self._mirrors.values():
                mirror.copy_(self.weight)

    def release_rows(self) -> None:
        """Nothing is kept for the head's passes: each chunk is copied when fetched."""

    def fetch(self, lo: int, hi: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        device = torch.device(device)
        if self._ensure_master(device):
            cur = torch.cuda.current_stream(device)
            if self._step_event is not None:
                cur.wait_event(self._step_event)  # the in-flight step writes the master in place
            self.counters["rows_fetched"] += hi - lo
            return self.weight[lo:hi].to(dtype, copy=True)
        if device.type != "cuda" and self._step_event is not None:
            self.sync()
        if device.type != "cuda":
            self.counters["rows_fetched"] += hi - lo
            return self.host_rows(lo, hi, dtype).to(device)
        key = (lo, hi, dtype, device)
        if key not in self._staged:
            self.prefetch(lo, hi, device, dtype)
        t, ev = self._staged.pop(key)
        return self._transfer(device).take(t, ev)

    # -- optimizer -----------------------------------------------------------------------------
    def step_(self, lr: Optional[float], weight_decay: Optional[float]) -> bool:
        """One AdamW step over every row (rows without a gradient take a zero-gradient step)."""
        from ds_maximus.errors import ConfigError
        from ds_maximus.optim.sparse_adamw import adamw_rows_
        dev = self._device_update()
        if dev is None:
            self._apply_scale()
            self.sync()
        if not self.has_grads():
            return False
        lr = self.opt.lr if lr is None else lr
        if lr is None:
            raise ConfigError("no learning rate for the CPU-placed LM head: pass sparse_step(lr=...) or set "
                              "maximus.embedding.optimizer.lr", "maximus.embedding.optimizer.lr")
        wd = self.opt.weight_decay if weight_decay is None else weight_decay
        wd = float(wd or 0.0)
        b1, b2 = self.beta1, self.beta2
        if self.exp_avg is None:
            self.exp_avg = self._table("exp_avg")
            self.exp_avg_sq = self._table("exp_avg_sq")
        self.step += 1
        if dev is not None:
            self._step_on_device(dev, float(lr), wd, b1, b2)
            return True
        for lo in range(0, self.vocab_size, self.chunk_rows):
            hi = min(self.vocab_size, lo + self.chunk_rows)
            have = self.grad_rows[lo:hi]
            g = self._grads()[lo:hi].to("cpu", torch.float32)
            if not bool(have.all()):
                g = g.clone()
                g[~have] = 0
            adamw_rows_(self.weight[lo:hi], g, self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], step=self.step,
                        lr=float(lr), beta1=b1, beta2=b2, eps=self.eps, weight_decay=wd)
            for mirror in self._mirrors.values():
                mirror[lo:hi].copy_(self.weight[lo:hi])
        self.lr_history.append(float(lr))
        self.grad_rows.zero_()
        self._clear_grad_meta()
        return True

    def _step_on_device(self, dev: torch.device, lr: float, wd: float, b1: float, b2: float) -> None:
        """The step by :class:`StagedAdamW` on ``dev``; returns before a GPU finishes (see ``_step_event``)."""
        if self._staged_opt is None or self._staged_opt.device != dev:
            self._staged_opt = StagedAdamW(dev, min(self.update_rows, self.vocab_size), self.dim)
        after = reads = None
        if dev.type == "cuda":
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            if idx in self._transfers:            # the backward's gradient copies
                after = self._transfers[idx].record_store()
            self._pending.clear()
            if self._step_event is not None:
                self._staged_opt.h2d.wait_event(self._step_event)
            on_dev = self.weight.device == self._staged_opt.device or (
                self.dgrad is not None and self.dgrad.device == self._staged_opt.device)
            if on_dev:  # the forward/backward's reads of the master, and writes of a device gradient, first
                reads = torch.cuda.Event()
                reads.record(torch.cuda.current_stream(dev))
        grads = self._grads()
        if grads.device != dev and grads.device.type != "cpu":
            grads = grads.to(dev)  # a device gradient from another device than the step's (explicit device)
        host = {"weight": self.weight, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "grad": grads}
        staged, grad_rows, mirrors = self._staged_opt, self.grad_rows.clone(), self._mirrors
        kw = dict(step=self.step, lr=lr, beta1=b1, beta2=b2, eps=self.eps, weight_decay=wd,
                  grad_scale=self._grad_scale, after=after)

        def launch():
            if reads is not None:
                staged.opt.wait_event(reads)
            self._step_event = staged.step(host, grad_rows, mirrors, background=True, **kw)
        if self.defer_steps:
            self._deferred = launch
        else:
            launch()
        resident = 4 if self.weight.device == self._staged_opt.device else 0
        grad_resident = 4 if grads.device == self._staged_opt.device else 0
        self.counters["bytes_h2d"] += self.vocab_size * self.dim * (16 - resident - grad_resident)
        self.counters["bytes_d2h"] += self.vocab_size * self.dim * (12 - resident + sum(
            torch.empty((), dtype=dt).element_size() for dt in self._mirrors))
        self.lr_history.append(lr)
        self.grad_rows.zero_()
        self._clear_grad_meta()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"weight": self.master_cpu(), "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "step": self.step, "lr_history": list(self.lr_history)}

    def load_state_dict(self, d: dict) -> None:
        self.sync()
        if tuple(d["weight"].shape) != (self.vocab_size, self.dim):
            raise ValueError(f"state has weight {tuple(d['weight'].shape)}, the head is "
                             f"({self.vocab_size}, {self.dim})")
        self.weight.copy_(d["weight"])
        for name in ("exp_avg", "exp_avg_sq"):
            v = d.get(name)
            if v is None:
                setattr(self, name, None)
                self.host_tier.release(name)     # zeros again when a step next needs it
            else:
                if getattr(self, name) is None:
                    setattr(self, name, self._table(name))
                getattr(self, name).copy_(v)
        self.step = int(d["step"])
        self.lr_history = list(d.get("lr_history", []))
        for dtype, mirror in self._mirrors.items():
            mirror.copy_(self.weight)
        self.grad_rows.zero_()
        self._clear_grad_meta()


class TiedSource:
    """Rows of a ``ShardedEmbedding`` as a ChunkSource (``rows_for_compute`` in, its sparse gradient out).

    ``reuse`` (``lm_head.reuse_rows``): the table's step leaves the new weights of the rows it steps outside its
    cache on the device for the head's next forward and backward (``ShardedEmbedding.keep_step_rows``); None
    leaves that as it is (a read of ``emb.weight``, beside a tied head that set it)."""

    def __init__(self, emb, reuse: Optional[str] = "off"):
        self.emb = emb
        self.vocab_size = int(emb.num_embeddings)
        self.dim = int(emb.embedding_dim)
        if reuse is not None:
            emb.keep_step_rows(reuse)

    def fetch(self, lo, hi, device, dtype):
        return self.emb.rows_for_compute(lo, hi, device, dtype)

    def prefetch(self, lo, hi, device, dtype):
        self.emb.stage_rows_for_compute(lo, hi, device)

    def version(self) -> int:
        """The table's optimizer step count: its rows change only in a step."""
        return int(self.emb.optimizer.step)

    def release_rows(self) -> None:
        self.emb.release_step_rows()

    def add_grad_(self, lo, hi, grad):
        """Every row's gradient, the padding row's included: ``padding_idx`` stops only the lookup's gradient,
        and in the unswapped model a tied head's gradient reaches that row too."""
        if tuple(grad.shape) != (hi - lo, self.dim):
            raise ValueError(f"grad has shape {tuple(grad.shape)}, expected ({hi - lo}, {self.dim})")
        self.emb.add_head_grad_(torch.arange(lo, hi), grad)
