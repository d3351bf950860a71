"""``MaximusConfig``: the ``"maximus"`` section of a DeepSpeed ds_config, as one pydantic model.

Every field has a default, a unit in its name where it has one, and a docstring. Unknown keys,
wrong types and out-of-range values raise :class:`ds_maximus.errors.ConfigError` naming the full
key path, what is allowed and the closest valid key.

Example::

    >>> from ds_maximus.config import MaximusConfig
    >>> cfg = MaximusConfig.from_ds_config({"maximus": {"embedding": {"gpu_cache_rows": 4096}}})
    >>> cfg.enabled, cfg.embedding.gpu_cache_rows, cfg.embedding.cache_policy.value
    (True, 4096, 'lfu')
"""
from __future__ import annotations

import difflib
import enum
import json
import os
from typing import Any, List, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ds_maximus.errors import ConfigError

SECTION = "maximus"


class CachePolicy(str, enum.Enum):
    """Eviction policy of a partition cache."""

    LRU = "lru"
    LFU = "lfu"


class NewRowInit(str, enum.Enum):
    """How :func:`ds_maximus.vocab.resize.resize_token_embeddings` fills the rows a grown vocabulary adds.

    ``mean_of_pieces``: each new token's row is the mean of the rows of the pieces the old tokenizer splits
    its text into (the usual practice: the new token starts where the model already reads that text);
    ``mean``: the mean of all old rows; ``normal``: drawn per dimension from N(mean of the old rows, their
    standard deviation) with a fixed seed."""

    MEAN_OF_PIECES = "mean_of_pieces"
    MEAN = "mean"
    NORMAL = "normal"


class OverflowPolicy(str, enum.Enum):
    """What a row cache does with a batch that needs more distinct rows than it can hold.

    ``serve``: the rows that do not fit are read from and written back to the tier directly (results equal
    a cache large enough for the batch; a one-time warning names the size that would hold it); ``error``:
    raise ``CapacityError``."""

    SERVE = "serve"
    ERROR = "error"


class OptimizerType(str, enum.Enum):
    ADAMW = "adamw"
    ADAGRAD = "adagrad"


class SparseMode(str, enum.Enum):
    """``exact`` replays skipped steps' decay so results equal dense AdamW; ``lazy`` is SparseAdam."""

    EXACT = "exact"
    LAZY = "lazy"


class OffloadDevice(str, enum.Enum):
    """Where the full table (or the experts) lives: pinned CPU memory, or NVMe with a CPU cache."""

    CPU = "cpu"
    NVME = "nvme"


class HeadPlacement(str, enum.Enum):
    """Where the LM head's weight lives: on the GPU, or in the CPU tier streamed chunk by chunk, or its fp32
    master on the GPU with only the AdamW moments and gradient in the CPU tier (``cpu_optimizer``)."""

    GPU = "gpu"
    CPU = "cpu"
    CPU_OPTIMIZER = "cpu_optimizer"


class ShardMode(str, enum.Enum):
    REPLICATED = "replicated"
    PARTITIONED = "partitioned"
    BROADCAST = "broadcast"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=False, validate_assignment=True,
                              use_attribute_docstrings=True)


class OffloadConfig(_Section):
    device: OffloadDevice = OffloadDevice.CPU
    """Tier that holds the full table: ``cpu`` (pinned RAM) or ``nvme`` (shard store, CPU tier as cache)."""
    nvme_path: Optional[str] = None
    """Folder of the shard store when ``device`` is ``nvme``. Required then."""
    cpu_cache_shards: int = Field(8, ge=1)
    """With ``device: nvme``: how many shards the CPU tier keeps (a bounded cache)."""
    pin_memory: bool = True
    """Pin the CPU tier (page-locked) so copies to the GPU are asynchronous."""

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.device == OffloadDevice.NVME and not self.nvme_path:
            raise ValueError("offload.device is 'nvme' but offload.nvme_path is not set; "
                             "set nvme_path to a folder on a fast local disk, or use device 'cpu'")
        return self


class EmbeddingOptimizerConfig(_Section):
    type: OptimizerType = OptimizerType.ADAMW
    """Sparse optimizer of the table's rows: ``adamw`` or ``adagrad``."""
    mode: SparseMode = SparseMode.EXACT
    """``exact`` (equals dense AdamW) or ``lazy`` (equals torch.optim.SparseAdam)."""
    lr: Optional[float] = Field(None, gt=0)
    """Learning rate; ``None`` follows the DeepSpeed optimizer's (and its scheduler's) lr."""
    betas: List[float] = Field(default_factory=lambda: [0.9, 0.999], min_length=2, max_length=2)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: Optional[float] = Field(None, ge=0)
    """Decoupled weight decay; ``None`` follows the DeepSpeed optimizer's."""


class EmbeddingConfig(_Section):
    enabled: bool = True
    """Swap qualifying ``nn.Embedding`` modules for ``ShardedEmbedding``."""
    modules: List[str] = Field(default_factory=list)
    """Module names to swap (``model.embed_tokens``); empty means by size (``min_rows``)."""
    min_rows: int = Field(32768, ge=1)
    """With ``modules`` empty: swap every embedding with at least this many rows."""
    token_map_dir: Optional[str] = None
    """Folder written by ``maximus-tokenizer build`` (frequency-ordered ids); optional."""
    gpu_cache_rows: int = Field(65536, ge=1)
    """Rows (with optimizer state) the GPU row cache holds."""
    cache_policy: CachePolicy = CachePolicy.LFU
    """Eviction policy of the row cache."""
    on_overflow: OverflowPolicy = OverflowPolicy.SERVE
    """A batch with more distinct rows than the cache can hold: ``serve`` reads and steps the extra rows in the
    tier directly (same results, slower), ``error`` raises ``CapacityError``."""
    rows_per_shard: int = Field(32768, ge=1)
    """Rows per shard file (the unit of NVMe I/O and of the CPU tier)."""
    prefetch: bool = True
    """Stage the next batch's rows while this batch trains."""
    optimizer: EmbeddingOptimizerConfig = Field(default_factory=EmbeddingOptimizerConfig)
    """Sparse optimizer of the rows."""
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    """Where the full table lives."""
    new_row_init: NewRowInit = NewRowInit.MEAN_OF_PIECES
    """How ``ds_maximus.resize_token_embeddings`` initialises the rows a grown vocabulary adds (embedding and an
    untied head alike): the mean of the new token's old sub-token pieces' rows, the mean of all old rows, or
    normal draws around that mean."""


class ExpertOptimizerDevice(str, enum.Enum):
    """Where the optimizer step of a trained expert runs: on the compute device (its fp32 master and
    moments are streamed in and out), on the CPU beside the CPU tier (only the gradient moves), or
    ``split``: both at once, the experts shared between them in the ratio of their measured speeds (the
    link and the host's cores work in parallel; a CUDA device and the tier in CPU memory)."""

    COMPUTE = "compute"
    CPU = "cpu"
    SPLIT = "split"


class HeadGradOnDevice(str, enum.Enum):
    """Where a CPU-tier LM head accumulates its weight gradient: in pinned RAM (``off``: it crosses PCIe
    twice a step, out in backward and back for the step), or on the compute device in fp32 or bf16."""

    OFF = "off"
    FP32 = "fp32"
    BF16 = "bf16"


class ReuseRows(str, enum.Enum):
    """Whether a streamed LM head keeps the rows its forward copied to the device for its backward."""

    AUTO = "auto"
    """On a CUDA device, when the head's weight in the compute dtype fits the device's free memory (a
    per-process cap included) beside the backward's own buffers."""
    ON = "on"
    """Always, on any device."""
    OFF = "off"
    """Never: the backward copies every row again."""


class EvalLogits(str, enum.Enum):
    """What a streamed head's model returns for a call with labels and no gradient (an evaluation)."""

    AUTO = "auto"
    """The streamed loss and no logits (the memory bound kept: a DeepSpeed script's own evaluation loop), except
    where the caller reads the logits: the HF Trainer's evaluation with ``compute_metrics`` or
    ``preprocess_logits_for_metrics``, which gets the plain model's logits and loss."""
    ON = "on"
    """The plain model's logits and loss for every such call (a dense ``[tokens, V]`` tensor), except inside
    ``ds_maximus.integrations.hf_lm_head.loss_only()`` (the HF Trainer's loss-only evaluation)."""
    OFF = "off"
    """The streamed loss and no logits for every call with labels, the HF Trainer's metrics included."""


class LMHeadConfig(_Section):
    enabled: bool = False
    """Compute the causal-LM loss with ``ShardedLMHead`` (no full logits)."""
    chunk_rows: int = Field(16384, ge=1)
    """Vocabulary rows per chunk of the streamed cross-entropy."""
    eval_logits: EvalLogits = EvalLogits.AUTO
    """A call with labels and no gradient (an evaluation): ``auto`` streams the loss (no logits) unless the caller
    reads the logits (the HF Trainer's ``compute_metrics``, which then gets the plain model's logits and loss);
    ``on`` computes the plain logits for every such call; ``off`` streams every call."""
    placement: HeadPlacement = HeadPlacement.GPU
    """Where the head's weight lives: ``gpu`` (a resident Parameter), ``cpu`` (fp32 master, AdamW moments and
    gradient in the CPU tier, streamed chunk by chunk), or ``cpu_optimizer`` (the fp32 master stays on the GPU,
    4 B/param, and only the moments and gradient cross PCIe: 20 instead of 38 B/param per step)."""
    reuse_rows: ReuseRows = ReuseRows.AUTO
    """With ``placement: cpu``, ``cpu_optimizer`` or a tied head: keep the rows the loss's forward copied to the
    device, in the compute dtype, until its backward has used them, instead of copying every row a second time.
    This halves the head's host-to-device traffic. It holds the head's weight in the compute dtype (1.34 GB at
    262,144 x 2560 in bf16) from the loss's forward to its backward, which frees it chunk by chunk. The
    backward of plain PyTorch uses the forward's weight too."""
    grad_on_device: HeadGradOnDevice = HeadGradOnDevice.OFF
    """With ``placement: cpu`` or ``cpu_optimizer``: keep the accumulated weight gradient on the compute
    device (``fp32``: 4 B/param of GPU memory; ``bf16``: 2 B/param, the rounding plain bf16 DeepSpeed applies
    to this gradient) instead of pinned RAM, so it never crosses PCIe (8 B/param less per step)."""


#: keys the ``moe`` section no longer has, and why: a config that still sets one is refused with the reason
_REMOVED_MOE_KEYS = {
    "host_grad_accumulate": "adding a later micro-batch's expert gradient on the host measured slower than the "
                            "default round trip through the device, with the same results (docs/bench/moe_training.md)",
    "host_grad_parts": "keeping later micro-batches' expert gradients on the host as parts measured slower than the "
                       "default round trip through the device, with the same results (docs/bench/moe_training.md)",
    "device_fetch": "a batch-1 decode step whose kernel fetched missed experts over the link from the mapped CPU "
                    "tier measured slower than the default path on the GPU (the copy engine moves missed experts "
                    "faster than a kernel reading them over the link; docs/bench/moe_offload.md)",
    "device_fetch_refresh_tokens": "it set the slot refreshes of moe.device_fetch, which measured slower than the "
                                   "default path on the GPU (the copy engine moves missed experts faster than a "
                                   "kernel reading them over the link; docs/bench/moe_offload.md)",
}


class ExpertCPUCompute(str, enum.Enum):
    """Where a decode step computes an expert its layer routes to but that is not resident on the GPU."""

    OFF = "off"
    """Copy it to the GPU (into a slot) and compute it there."""
    MISSES = "misses"
    """Compute every missed expert on the host from its CPU-tier weights (the ``maximus_expert_cpu`` op) while the
    GPU computes the resident ones: one token through an expert reads it once from host memory, where a copy
    moves all of it over the link."""
    AUTO = "auto"
    """Per missed expert, from the tokens routed to it: at most ``cpu_compute_max_tokens`` on the host, more (a
    prefill) on the GPU, whose GEMM is faster once the copy is shared by many tokens. On a CUDA device the light
    misses are split between the host and the link so that both finish together: the link loads its share into
    free slots (they stay for later tokens) while the host computes the rest."""


class ExpertQuantConfig(_Section):
    bits: Optional[int] = None
    """Code width of the quantized expert tier: 8, 4, 3 or 2. ``None``: off, experts stay exact (bf16). Group-wise
    affine quantization with fp16 scales and offsets (``ds_maximus.experts.quant``): the tier holds and the link
    moves the packed form, a fraction ``(bits + 32 / group_size) / 16`` of bf16."""
    group_size: int = Field(64, gt=0)
    """Consecutive weights of a row that share one scale and offset; a multiple of 8 that divides the experts'
    hidden and ffn sizes (checked when experts are quantized). Smaller groups: less error, more bytes."""

    @model_validator(mode="after")
    def _valid(self):
        if self.bits is not None and self.bits not in (8, 4, 3, 2):
            raise ValueError(f"moe.quant.bits={self.bits} is not supported; use 8, 4, 3 or 2, or null for exact bf16")
        if self.group_size % 8:
            raise ValueError(f"moe.quant.group_size={self.group_size} must be a multiple of 8 (a group is whole packed "
                             f"bytes at every width); e.g. 64 or 128")
        return self


class MoEConfig(_Section):
    enabled: bool = False
    """Offload MoE experts into the partition cache."""
    gpu_experts_per_layer: int = Field(2, ge=1)
    """GPU expert-cache slots per MoE layer."""
    gpu_expert_bytes: Optional[int] = Field(None, ge=1)
    """Alternative budget per layer in bytes; overrides ``gpu_experts_per_layer`` when set."""
    gpu_expert_total_bytes: Optional[int] = Field(None, ge=1)
    """GPU bytes for the expert slots of all MoE layers together (what is left of the card after the rest of the
    model); overrides ``gpu_experts_per_layer`` and ``gpu_expert_bytes``. ``bytes // expert`` slots are spread over
    the layers, the remainder one more each to layers spaced evenly through the model, so no slot's worth of
    budget is left unused when it does not divide by the layer count."""
    cache_policy: CachePolicy = CachePolicy.LRU
    """Eviction policy of the expert cache."""
    speculative_prefetch: bool = True
    """Apply the next layer's router to the current hidden state and load its likely experts early. In
    inference a guess stages its first 96 MiB in a buffer on the device (evicting nothing); the next
    layer's routing drops it or loads only the rest (measurements: docs/bench/moe_offload.md)."""
    prefetch_top_k: Optional[int] = Field(1, ge=1)
    """Guesses per layer (``None``: the model's top-k), best first. Staged (the CPU tier, ``cpu_compute`` off or
    ``auto``): each of the first ``prefetch_top_k`` guesses that is not resident stages its head in a
    buffer of its own (96 MiB of device memory each; a wrong one costs link time, never an eviction). Into
    slots (an NVMe tier, or with ``cpu_compute: misses``): a wrong guess evicts a resident expert the next layer needs.
    1 measured best both ways on Mixtral-shaped models (staged: an int4 decode at 24 layers, 3 slots a layer,
    took 67.0-68.2 ms a token with 1 and 68.2-68.4 with 2, which moved 10% more bytes; docs/bench/moe_offload.md)."""

    prefetch_skip_resident: bool = False
    """Inference (``offload_experts``): guesses skip experts already resident. A layer's ``prefetch_top_k``
    guesses are the best-ranked experts of the whole predicted routing (its top-k) that are not in a slot, so a
    layer whose best guess is resident still stages its next one. Off: the guesses are the prediction's first
    ``prefetch_top_k``, and a resident one stages nothing. Either way a layer stages at most ``prefetch_top_k``
    experts. MoE training (``moe.train``) keeps its own guesses."""

    def guesses(self, top_k: int) -> int:
        """Guesses a layer for a model routing ``top_k`` experts a token: ``prefetch_top_k``, or ``top_k`` for
        ``None`` (callers cap it by what they can hold).

        >>> MoEConfig().guesses(2), MoEConfig(prefetch_top_k=None).guesses(8), MoEConfig(prefetch_top_k=3).guesses(2)
        (1, 8, 3)
        """
        return int(self.prefetch_top_k or top_k)

    quant: ExpertQuantConfig = Field(default_factory=ExpertQuantConfig)
    """Inference: the quantized expert tier (``bits: null`` = off, exact bf16)."""
    cpu_compute: ExpertCPUCompute = ExpertCPUCompute.OFF
    """Inference: where a decode step computes a routed expert that is not resident (see :class:`ExpertCPUCompute`)."""
    cpu_compute_max_tokens: int = Field(8, ge=1)
    """With ``cpu_compute: auto``: the most tokens routed to a missed expert that the host computes it for."""
    decode_graphs: bool = False
    """Inference (``offload_experts``): a batch-1 decode step with a static KV cache
    (``generate(..., cache_implementation="static")``) replays one CUDA graph a layer for its attention, norms
    and router, and runs only the offloaded experts eagerly; the same kernels, so the same tokens and logits. For
    Mixtral- and Qwen3-MoE-style decoder layers (others are refused). Each layer captures at a cache's second
    decode step; with a dynamic cache, a prefill or a batch it runs its own forward
    (:mod:`ds_maximus.experts.decode_graphs`; speed: docs/moe_inference.md)."""
    train: bool = False
    """Train experts as swappable partitions (under ``ds_maximus.initialize``)."""
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    """Where the experts live."""
    optimizer: EmbeddingOptimizerConfig = Field(default_factory=EmbeddingOptimizerConfig)
    """With ``train``: optimizer of the experts (each expert is one row); ``exact`` mode equals dense AdamW."""
    optimizer_device: ExpertOptimizerDevice = ExpertOptimizerDevice.COMPUTE
    """With ``train``: where the experts' optimizer step runs (``compute``: GPU; ``cpu``: beside the CPU tier;
    ``split``: both at once, see :class:`ExpertOptimizerDevice`)."""
    cpu_step_share: Optional[float] = Field(None, ge=0.0, le=1.0)
    """With ``optimizer_device: split``: the share of the experts stepped on the CPU. ``None``: measured
    (from 0.5, it follows the two sides' time per expert so that they finish together)."""
    overlap_step: bool = False
    """With ``optimizer_device: split``: the step returns once it is queued and runs on into the next forward,
    which waits for each layer's experts only when it reaches that layer (same results, bit for bit). Whether it
    is faster depends on the host: both sides and the forward's loads share the link and host memory
    (measurements: docs/bench/moe_training.md). Sets DeepSpeed's
    ``timers.throughput.synchronized`` false unless the config sets it (it would sync the device at every
    forward)."""
    step_chunk_bytes: int = Field(512 << 20, ge=1 << 16)
    """With ``train`` and ``optimizer_device: compute``: fp32 masters, moments and gradients staged on the
    device at once (a large expert is stepped in pieces)."""
    gpu_grad_experts: Optional[int] = Field(None, ge=1)
    """With ``train``: expert gradients kept on the compute device, most recently used first; older ones move
    to pinned CPU memory until the step. Counted as the backward makes them (bf16 in a bf16 run): one summed in
    fp32 over micro-batches counts as two. ``None``: ``gpu_experts_per_layer``."""
    backward_prefetch: bool = True
    """With ``train``: while a layer runs backward, load the experts the layer before it used in forward."""
    gpu_state_experts: int = Field(0, ge=0)
    """With ``train`` and ``optimizer_device: split`` (tier in CPU memory): the first this many experts (in uid
    order, ``layer * num_experts + expert``: layer 0 first) keep their fp32 master and optimizer state on the
    compute device as well. The step takes them on the device side with no state crossing the link, only
    the gradient (when it waits on the host) in and the compute copy out; the CPU tier's rows are brought up
    to date when something reads them (catch-up, checkpoints, export). Costs 12 bytes a parameter each (AdamW)
    on the device, e.g. 2.1 GB for a Mixtral expert."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, data):
        if isinstance(data, Mapping):
            gone = [k for k in _REMOVED_MOE_KEYS if k in data]
            if gone:
                raise ValueError("; ".join(f"moe.{k} was removed: {_REMOVED_MOE_KEYS[k]}; drop the key" for k in gone))
        return data

    @model_validator(mode="after")
    def _train_needs_enabled(self):
        if self.train and not self.enabled:
            raise ValueError("moe.train is true but moe.enabled is false; set \"enabled\": true to train the "
                             "experts as swappable partitions, or drop \"train\"")
        if self.gpu_state_experts and self.optimizer_device != ExpertOptimizerDevice.SPLIT:
            raise ValueError(f"moe.gpu_state_experts={self.gpu_state_experts} needs \"optimizer_device\": \"split\" "
                             f"(got \"{self.optimizer_device.value}\"); set it, or set gpu_state_experts to 0")
        if self.gpu_state_experts and self.offload.device == OffloadDevice.NVME:
            raise ValueError("moe.gpu_state_experts needs the experts' tier in CPU memory (offload.device: cpu); "
                             "with an NVMe tier set it to 0")
        return self


class IOConfig(_Section):
    threads: int = Field(8, ge=1, le=256)
    """Worker threads of the async NVMe loader."""
    block_bytes: int = Field(1 << 20, ge=4096)
    """Bytes per I/O request; a multiple of 4096 for O_DIRECT."""
    queue_depth: int = Field(32, ge=1)
    """Requests in flight at once."""
    o_direct: bool = True
    """Bypass the page cache (falls back to buffered I/O, logged, where refused)."""

    @model_validator(mode="after")
    def _aligned(self):
        if self.block_bytes % 4096:
            raise ValueError(f"io.block_bytes={self.block_bytes} is not a multiple of 4096; "
                             f"use {max(4096, self.block_bytes // 4096 * 4096)}")
        return self


class DistributedConfig(_Section):
    shard_mode: ShardMode = ShardMode.REPLICATED
    """``replicated`` (each rank the whole table), ``partitioned`` (rows owned by ranks) or ``broadcast``."""
    master_rank: int = Field(0, ge=0)
    """Rank that reads the store in ``broadcast`` mode."""
    timeout_s: float = Field(600.0, gt=0)
    """Seconds a maximus collective may wait before failing with an error naming it."""


class LoggingConfig(_Section):
    interval_steps: int = Field(100, ge=1)
    """Optimizer steps between maximus stats lines (and monitor events)."""


class MaximusConfig(_Section):
    """The whole ``"maximus"`` section. A missing section, or ``enabled: false``, means off."""

    enabled: bool = True
    """Master switch (a section that is present is on unless this is false)."""
    embedding: EmbeddingConfig = Field(default_factory=EmbeddingConfig)
    lm_head: LMHeadConfig = Field(default_factory=LMHeadConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    io: IOConfig = Field(default_factory=IOConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    trust_checkpoint: bool = False
    """Resume (``engine.load_checkpoint``) also loads checkpoint files that need types outside the safe allow-list,
    with plain ``torch.load``: pickled code in them can run. Only for checkpoints you wrote yourself."""

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "MaximusConfig":
        """Validate the contents of a ``"maximus"`` section (the dict under the key)."""
        if not isinstance(section, Mapping):
            raise ConfigError(f"'{SECTION}' must be a JSON object, got {type(section).__name__}", SECTION)
        try:
            return cls.model_validate(dict(section))
        except ValidationError as e:
            raise _to_config_error(e) from None

    @classmethod
    def from_ds_config(cls, ds_config: Union[None, str, os.PathLike, Mapping[str, Any]]) -> "MaximusConfig":
        """Read the ``"maximus"`` section of a ds_config (a dict or a JSON file path)."""
        if ds_config is None:
            return cls(enabled=False)
        if isinstance(ds_config, (str, os.PathLike)):
            try:
                with open(ds_config) as f:
                    ds_config = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"ds_config file not found: {ds_config}") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"ds_config {ds_config} is not valid JSON: {e}") from None
        if not isinstance(ds_config, Mapping):
            # DeepSpeed also accepts a DeepSpeedConfig-like object; read its raw dict when present
            raw = getattr(ds_config, "_param_dict", None)
            if raw is None:
                raise ConfigError(f"ds_config must be a dict or a JSON path, got {type(ds_config).__name__}")
            ds_config = raw
        if SECTION not in ds_config:
            _refuse_near_miss(ds_config)
            return cls(enabled=False)
        return cls.from_dict(ds_config[SECTION])

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def _refuse_near_miss(ds_config: Mapping[str, Any]) -> None:
    """A ds_config without a ``"maximus"`` section but with a top-level key that is a misspelling of it
    (``"maximsu"``, ``"Maximus"``, ``"maximus_"``) would silently run without maximus: refuse it."""
    for key in ds_config:
        if isinstance(key, str) and difflib.get_close_matches(key.lower(), [SECTION], n=1, cutoff=0.8):
            raise ConfigError(f"ds_config has a top-level key \"{key}\" and no \"{SECTION}\" section; did you mean "
                              f"'{SECTION}'? Rename the key to \"{SECTION}\" (or drop it to run plain DeepSpeed)", key)


def _allowed_keys(model: type, loc: tuple) -> List[str]:
    """Field names of the sub-model that ``loc`` (up to its last part) points into."""
    cur = model
    for part in loc[:-1]:
        field = cur.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cur = ann
        else:
            return []
    return list(cur.model_fields)


def _to_config_error(e: ValidationError) -> ConfigError:
    lines = []
    first_path = None
    for err in e.errors():
        loc = tuple(p for p in err["loc"])
        path = ".".join([SECTION] + [str(p) for p in loc])
        first_path = first_path or path
        kind = err["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(MaximusConfig, loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.5)
            hint = f"; did you mean \"{close[0]}\"?" if close else ""
            lines.append(f"unknown key \"{path}\"{hint} (allowed: {', '.join(allowed)})")
        elif kind == "enum":
            expected = err.get("ctx", {}).get("expected", "")
            lines.append(f"\"{path}\" = {err.get('input')!r} is not allowed; allowed values: {expected}")
        elif kind == "value_error":
            lines.append(f"\"{path or SECTION}\": {err['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"\"{path}\" = {err.get('input')!r}: {err['msg']}")
    return ConfigError("invalid maximus config: " + "; ".join(lines), first_path)
