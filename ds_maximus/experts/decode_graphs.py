"""``moe.decode_graphs``: a batch-1 decode step replays one CUDA graph per layer for everything but the experts.

An offloaded layer's decode step is bound by the host: HF's eager attention, norms and router are some forty small
launches a layer (about half a millisecond of Python and dispatch each), and the layer's one sync (the routing
the expert cache needs on the host) keeps the host from running ahead of the GPU to hide them. Here each decoder
layer of an offloaded model runs, for a one-token step of one sequence with a static KV cache
(``generate(..., cache_implementation="static")``), as:

1. one CUDA graph replay of ``input_layernorm -> self_attn (KV written into the static cache) -> + residual ->
   post_attention_layernorm -> router``, captured from the layer's own modules (the same kernels: the same numbers);
2. the offloaded experts on the graph's routing, eagerly (the expert cache decides on the host what to load);
3. the residual add.

The static cache keeps its fill level in a device tensor (or takes it from a ``cache_position`` argument) and writes
the new key and value there, so the captured step is valid for every later token of the same cache. The graph's
inputs (the hidden state and every tensor argument: the rotary ``cos`` and ``sin``, the mask, the positions) are
copied into static buffers before each replay, those every layer shares once a step; a new cache, a new shape or a
non-tensor argument that changed is a new graph. The arguments reach the layer's attention as the layer got them,
under the cache's name in the caller's transformers version (``cache`` or ``past_key_values``). Each layer runs its
first step of a cache eagerly, on the stream the capture uses (it warms cuBLAS and the attention kernels up there,
which capture must not do), and captures at the second.

Anything else (a prefill, a batch, a dynamic cache, grad mode, a CPU model) runs the layer's own forward. On a CPU
the same split runs without a graph (what the CPU tests compare against the layer's own forward).
"""
from __future__ import annotations

import logging
import types
from typing import Dict, List, Optional

import torch
from torch import nn

from ds_maximus.errors import ConfigError

log = logging.getLogger(__name__)

# decoder layers whose forward is exactly: residual + self_attn(input_layernorm(h)), then residual +
# mlp(post_attention_layernorm(h)) with mlp an HF sparse-MoE block (view(-1, H) -> gate -> experts -> reshape);
# the split below reproduces that forward, so only these are accepted
LAYER_CLASSES = ("MixtralDecoderLayer", "Qwen3MoeDecoderLayer")


def decoder_layers(model: nn.Module, blocks) -> List[nn.Module]:
    """The decoder layers holding the MoE ``blocks`` (``MoEBlockInfo``), or a ``ConfigError`` naming a layer class
    the split forward does not reproduce (called before anything is offloaded)."""
    moe_blocks = {id(b.block) for b in blocks}
    layers = []
    for m in model.modules():
        mlp = getattr(m, "mlp", None)
        if mlp is None or id(mlp) not in moe_blocks:
            continue
        if type(m).__name__ not in LAYER_CLASSES:
            raise ConfigError(f"moe.decode_graphs captures the decoder layers of {', '.join(LAYER_CLASSES)}; this "
                              f"model's are {type(m).__name__}: set moe.decode_graphs to false",
                              "maximus.moe.decode_graphs")
        gate = getattr(mlp, "gate", None)
        if not type(gate).__name__.endswith("TopKRouter"):  # the split unpacks (logits, weights, ids) from it
            raise ConfigError(f"moe.decode_graphs needs the MoE block's router to return (logits, weights, expert "
                              f"ids) as transformers' *TopKRouter does; this model's is {type(gate).__name__}: "
                              f"set moe.decode_graphs to false", "maximus.moe.decode_graphs")
        layers.append(m)
    if len(layers) != len(blocks):
        raise ConfigError(f"moe.decode_graphs found {len(layers)} decoder layers holding this model's {len(blocks)} "
                          f"MoE blocks as their 'mlp'; set moe.decode_graphs to false", "maximus.moe.decode_graphs")
    return layers


class _Step:
    """One layer's graph: its static inputs and outputs, and what it was captured for."""

    def __init__(self, key, graph, inputs: Dict[str, torch.Tensor], outputs):
        self.key, self.graph, self.inputs, self.outputs = key, graph, inputs, outputs


class DecodeGraphs:
    """Installs the split forward on every decoder layer holding an offloaded MoE block; ``enabled`` (the handle's
    ``moe.decode_graphs``) is read at each call, so it can be switched between generations."""

    def __init__(self, layers: List[nn.Module], enabled):
        self.enabled = enabled  # a callable: the handle's current moe.decode_graphs
        self.layers = layers    # from decoder_layers()
        self.steps: Dict[int, _Step] = {}     # by id(layer)
        self.seen: Dict[int, tuple] = {}      # by id(layer): the key of its last eager (warm-up) step
        self.pool = None
        self.stream = None
        self.shared: Dict[tuple, torch.Tensor] = {}  # static buffers of the shared inputs, by name and shape
        self.copied: Dict[int, tuple] = {}  # by id(buffer): (the tensor last copied in, its version then)
        self.eager_split = 0  # steps of the split forward run without a graph (CPU, or a cache's first step)
        self.captures = 0
        self.replays = 0
        self._warned = False
        self.failed: Optional[str] = None  # why a capture failed: the handle's decode then runs without graphs
        for layer in self.layers:
            layer.__dict__["_maximus_forward"] = layer.forward
            layer.forward = types.MethodType(_split_forward(self), layer)

    def buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The static buffer every graph of ``t``'s shape reads input ``name`` from, holding ``t``'s values."""
        k = (name, tuple(t.shape), t.dtype, t.device)
        buf = self.shared.get(k)
        if buf is None:
            buf = self.shared[k] = torch.empty_like(t)
        self.refresh(name, t, buf)
        return buf

    def refresh(self, name: str, t: torch.Tensor, buf: torch.Tensor) -> None:
        """Copies ``t`` into ``buf`` unless it is the tensor (same object, unmodified) copied there last: the
        layers of one step share their rotary, mask and position tensors, so the first layer copies them."""
        k = id(buf)
        last = self.copied.get(k)
        if last is None or last[0] is not t or last[1] != t._version:  # identity, never a tensor comparison
            buf.copy_(t)
            self.copied[k] = (t, t._version)

    def side_stream(self, device) -> torch.cuda.Stream:
        """The stream every capture and its warm-up step run on (the legacy default stream cannot capture)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def stats(self) -> dict:
        return {"decode_graph_replays": self.replays, "decode_graph_captures": self.captures,
                "decode_graph_eager_steps": self.eager_split, "decode_graph_failed": self.failed}

    def reset_stats(self) -> None:
        self.replays = self.captures = self.eager_split = 0

    def close(self) -> None:
        for layer in self.layers:
            orig = layer.__dict__.pop("_maximus_forward", None)
            if orig is None:
                continue
            if getattr(orig, "__self__", None) is layer and getattr(orig, "__func__", None) is type(layer).forward:
                layer.__dict__.pop("forward", None)  # the class's own forward again
            else:
                layer.forward = orig  # a wrapper someone installed before us (an accelerate hook)
        self.steps.clear()
        self.seen.clear()
        self.shared.clear()
        self.copied.clear()
        self.pool = None

    # -- which calls a graph serves -------------------------------------------------------------
    def eligible(self, hidden: torch.Tensor, cache) -> bool:
        if (not self.enabled() or self.failed or torch.is_grad_enabled() or hidden.dim() != 3
                or hidden.shape[:2] != (1, 1)):
            return False
        if cache is None or not getattr(cache, "is_compileable", False):
            if not self._warned:
                log.warning("moe.decode_graphs needs a static KV cache: generate(..., cache_implementation="
                            "\"static\"); this decode runs without graphs")
                self._warned = True
            return False
        return True

    @staticmethod
    def key(layer, hidden, inputs: Dict[str, torch.Tensor], consts: dict, cache) -> Optional[tuple]:
        """What a captured step depends on besides its inputs' values: the cache's storage, every input's shape and
        the constant arguments; None where the cache's storage cannot be told (no graph then)."""
        i = getattr(layer.self_attn, "layer_idx", None)
        layers = getattr(cache, "layers", None)
        lay = layers[i] if layers is not None and i is not None and i < len(layers) else None
        if lay is None or not getattr(lay, "is_initialized", False) or getattr(lay, "keys", None) is None:
            return None
        storage = tuple(t.data_ptr() for t in (lay.keys, lay.values, getattr(lay, "cumulative_length", None))
                        if isinstance(t, torch.Tensor))
        shapes = tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in [("hidden", hidden), *inputs.items()])
        return storage, shapes, tuple(sorted((k, repr(v)) for k, v in consts.items()))


def _pre_moe(layer, hidden, inputs: Dict[str, torch.Tensor], consts: dict, cache_name: str, cache):
    """The layer up to its experts: (residual after attention, the MoE input rows, routing weights, expert ids).
    ``inputs``: the layer's tensor arguments (``cos``/``sin`` of its rotary, the mask, positions...), ``consts`` the
    others; the attention gets them all, as the layer's own forward passes them on."""
    kw = {k: v for k, v in inputs.items() if k not in ("cos", "sin")}
    residual = hidden
    h = layer.input_layernorm(hidden)
    h, _ = layer.self_attn(hidden_states=h, position_embeddings=(inputs["cos"], inputs["sin"]),
                           **{cache_name: cache}, **kw, **consts)
    h = residual + h
    residual = h
    h = layer.post_attention_layernorm(h)
    rows = h.view(-1, h.shape[-1])
    _, weights, ids = layer.mlp.gate(rows)
    return residual, rows, weights, ids


def _split_forward(graphs: DecodeGraphs):
    def forward(layer, hidden_states, *args, **kwargs):
        # the arguments pass on as they came (HF versions name the cache "cache" or "past_key_values")
        cache_name = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(cache_name)
        pe = kwargs.get("position_embeddings")
        if args or not isinstance(pe, tuple) or len(pe) != 2 or not graphs.eligible(hidden_states, cache):
            return layer._maximus_forward(hidden_states, *args, **kwargs)
        inputs = {"cos": pe[0], "sin": pe[1]}
        consts = {}
        for k, v in kwargs.items():
            if k in (cache_name, "position_embeddings"):
                continue
            if isinstance(v, torch.Tensor):
                inputs[k] = v
            else:
                consts[k] = v
        if hidden_states.device.type != "cuda":  # the CPU twin: the same split, no graph
            graphs.eager_split += 1
            residual, rows, weights, ids = _pre_moe(layer, hidden_states, inputs, consts, cache_name, cache)
        else:
            residual, rows, weights, ids = _replay(graphs, layer, hidden_states, inputs, consts, cache_name, cache)
        out = layer.mlp.experts(rows, ids, weights)
        return residual + out.reshape(residual.shape)
    return forward


def _replay(graphs: DecodeGraphs, layer, hidden, inputs, consts, cache_name, cache):
    key = graphs.key(layer, hidden, inputs, consts, cache)
    lid = id(layer)
    step = graphs.steps.get(lid)
    if key is None or step is None or step.key != key:
        if key is None or graphs.seen.get(lid) != key:  # a new cache or shape: eager now, captured at the next step
            # the layer's old step stays (see _capture: the pool needs a live graph)
            graphs.seen[lid] = key
            graphs.eager_split += 1
            if key is None:
                return _pre_moe(layer, hidden, inputs, consts, cache_name, cache)
            # the warm-up runs on the stream the capture will use, as torch.cuda.graph's recipe does: what the
            # kernels set up lazily per stream (cuBLAS's workspace) is then made outside the capture
            return _on_side(graphs, hidden.device,
                            lambda: _pre_moe(layer, hidden, inputs, consts, cache_name, cache))
        try:
            step = _capture(graphs, layer, hidden, inputs, consts, cache_name, cache, key)
        except RuntimeError as e:  # an op of this layer that cannot be captured: nothing of it ran, run it eagerly
            graphs.failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            graphs.steps.clear()
            log.warning("moe.decode_graphs: capturing the decode step of %s (layer %s) failed (%s); this model's "
                        "decode runs without graphs from now on (the same numbers, the eager speed)",
                        type(layer).__name__, getattr(layer.self_attn, "layer_idx", "?"), graphs.failed)
            graphs.eager_split += 1
            return _pre_moe(layer, hidden, inputs, consts, cache_name, cache)
        graphs.steps[lid] = step
    step.inputs["hidden"].copy_(hidden)
    for name, t in inputs.items():  # the step's rotary, mask, positions: copied once for all layers
        graphs.refresh(name, t, step.inputs[name])
    step.graph.replay()
    graphs.replays += 1
    return step.outputs


def _on_side(graphs: DecodeGraphs, device: torch.device, fn):
    """``fn()`` on the capture's side stream, after the current stream's work so far and before its next (on a CPU:
    ``fn()``). Waiting for the current stream first also orders the side stream's reuse of blocks freed after the
    current stream read them."""
    if device.type != "cuda":
        return fn()
    side, main = graphs.side_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn()
    main.wait_stream(side)
    return out


def _capture(graphs: DecodeGraphs, layer, hidden, inputs, consts, cache_name, cache, key) -> _Step:
    # one memory pool for every graph: they are captured and replayed in the same order (layer by layer) on one
    # stream, and each one's outputs stay referenced by its step, so no graph's memory is another's live tensor.
    # The pool must hold a live graph whenever one is captured into it: once all of a pool's graphs are destroyed,
    # CUDA's caching allocator keeps the pool (freeable, not freed) and refuses a new capture into it with an
    # internal assert (use_count > 0) until an empty_cache. So _replay replaces a layer's old graph only once its
    # new one is captured, never drops it at a new cache's first step.
    if graphs.pool is None:
        graphs.pool = torch.cuda.graph_pool_handle()
    static = {"hidden": hidden.clone()}
    static.update({name: graphs.buffer(name, t) for name, t in inputs.items()})
    graph = torch.cuda.CUDAGraph()

    def capture():
        # on the side stream (the legacy default stream cannot capture), without torch.cuda.graph's synchronize,
        # gc.collect and empty_cache at every layer; "thread_local": the expert cache's copy thread keeps issuing
        # its transfers while this thread captures
        graph.capture_begin(pool=graphs.pool, capture_error_mode="thread_local")
        try:
            return _pre_moe(layer, static["hidden"], {n: static[n] for n in inputs}, consts, cache_name, cache)
        finally:
            graph.capture_end()
    outputs = _on_side(graphs, hidden.device, capture)
    graphs.captures += 1
    return _Step(key, graph, static, outputs)
