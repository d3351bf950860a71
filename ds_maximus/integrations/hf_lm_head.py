"""Hugging Face causal LMs compute their ``labels=`` loss with the streamed cross-entropy.

``patch_causal_lm_loss(model)`` works on any ``XForCausalLM`` of transformers 5.x that has
``.lm_head`` and ``forward(..., labels=None, logits_to_keep=0, **kwargs)`` computing
``logits = self.lm_head(hidden)`` then ``self.loss_function(logits=logits, labels=labels, ...)``
(Llama, Mistral, Qwen2, Mixtral, Gemma2, GPT-2, OPT ...; :func:`check_streamable` says which). How:

* ``model.forward`` is wrapped: a call with ``labels`` (or ``shift_labels``) arms a one-shot loss request
  holding the labels and the loss kwargs (``num_items_in_batch``, ``ignore_index``);
* ``model.lm_head.forward`` is overridden on the instance: when armed, it returns the loss
  ``linear_cross_entropy(hidden, lm_head.weight, shifted labels)`` instead of logits. Computing it
  inside the head's own forward keeps ZeRO-3's gather hooks around the weight use;
* ``model.loss_function`` passes that loss through, so the model's own code still adds its extras
  (Mixtral's router aux loss); the output's ``logits`` is removed (``None``).

Without labels nothing changes: generation gets the original logits (``logits_to_keep`` included). An evaluation
that reads the logits (:func:`logits_wanted`: the HF Trainer's evaluation with ``compute_metrics``) gets the plain
model's logits and loss (``lm_head.eval_logits``).
What the forward does to its logits before the loss is applied inside the streamed loss (:func:`logit_transforms`:
Gemma-style ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``); anything else there
is refused with a ``ConfigError``.

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import torch
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
    ...                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4))
    >>> _ = patch_causal_lm_loss(model)
    >>> ids = torch.randint(0, 128, (2, 9))
    >>> out = model(input_ids=ids, labels=ids)
    >>> out.logits is None, out.loss.dim()
    (True, 0)
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import re
import threading
import types
from typing import Optional, Union

import torch
from torch import nn

from ds_maximus.config import HeadPlacement, LMHeadConfig, MaximusConfig
from ds_maximus.errors import ConfigError
from ds_maximus.vocab.linear_cross_entropy import linear_cross_entropy

_ATTR = "_maximus_lm_head_patch"


class _LossRequest:
    def __init__(self, labels, shift_labels, num_items_in_batch, ignore_index, softcap, scale=None):
        self.labels = labels
        self.shift_labels = shift_labels
        self.num_items_in_batch = num_items_in_batch
        self.ignore_index = ignore_index
        self.softcap = softcap
        self.scale = scale   # the model multiplies its logits by this before any soft-capping (None: 1)


class _Patch:
    """What one patched model holds: its config, the head, and the armed request of the running call."""

    def __init__(self, cfg: LMHeadConfig, head):
        self.cfg = cfg
        self.head = head
        self.local = threading.local()
        self.orig_forward = None
        self.orig_head_forward = None
        self.last_loss = None

    @property
    def request(self) -> Optional[_LossRequest]:
        return getattr(self.local, "request", None)

    @request.setter
    def request(self, value):
        self.local.request = value

    def loss(self, head_module: nn.Module, hidden: torch.Tensor, req: _LossRequest) -> torch.Tensor:
        labels = req.shift_labels
        if labels is None:
            labels = nn.functional.pad(req.labels, (0, 1), value=req.ignore_index)[..., 1:]
        labels = labels.to(hidden.device)
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(f"labels {tuple(labels.shape)} do not match the hidden states {tuple(hidden.shape[:-1])}"
                             "; with labels, call the model with logits_to_keep=0 (the default)")
        reduction = "mean" if req.num_items_in_batch is None else "sum"
        if req.scale is not None:   # scale * (h @ W^T) = (scale * h) @ W^T; the gradient flows through the product
            hidden = hidden * req.scale
        from ds_maximus.vocab.lm_head import ShardedLMHead
        if isinstance(head_module, ShardedLMHead):
            loss = head_module(hidden, labels, ignore_index=req.ignore_index, reduction=reduction,
                               logit_softcap=req.softcap)
        else:
            weight = head_module.weight   # a frozen table kept in host memory (HostTable) comes for this call
            loss = linear_cross_entropy(hidden, weight.to(hidden.device), labels, req.ignore_index, reduction,
                                        logit_softcap=req.softcap, chunk_rows=self.cfg.chunk_rows)
        if req.num_items_in_batch is not None:
            n = req.num_items_in_batch
            loss = loss / (n.to(loss.device) if torch.is_tensor(n) else n)
        return loss


def _lm_cfg(config) -> LMHeadConfig:
    if config is None:
        return LMHeadConfig(enabled=True)
    if isinstance(config, MaximusConfig):
        return config.lm_head
    if isinstance(config, LMHeadConfig):
        return config
    if isinstance(config, dict):
        return MaximusConfig.from_dict({"lm_head": config}).lm_head
    raise ConfigError(f"config must be an LMHeadConfig, a MaximusConfig or a dict, got {type(config).__name__}",
                      "maximus.lm_head")


def _build_cpu_head(model: nn.Module, cfg: LMHeadConfig, config):
    """A ``placement: cpu`` head replacing ``model.lm_head`` (tied to a ShardedEmbedding when the model ties)."""
    from ds_maximus.vocab import ShardedEmbedding, ShardedLMHead, plain_weight
    parent, attr = _head_slot(model)
    old = getattr(parent, attr)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tie = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tie and isinstance(emb, ShardedEmbedding):
        head = ShardedLMHead(tied_to=emb, config=config if isinstance(config, MaximusConfig) else cfg)
    elif tie and emb is not None and (w := plain_weight(emb)) is not None and w is plain_weight(old):
        raise ConfigError("lm_head.placement is 'cpu' but the head is tied to an ordinary nn.Embedding; swap the "
                          "embedding too (maximus.embedding) or use placement 'gpu'", "maximus.lm_head.placement")
    else:
        head = ShardedLMHead.from_linear(old, config if isinstance(config, MaximusConfig) else cfg)
    head.removed_params = [p for p in old.parameters()]
    setattr(parent, attr, head)
    return head


def _trained_head(model: nn.Module) -> nn.Module:
    parent, attr = _head_slot(model)
    return getattr(parent, attr)


def _head_slot(model: nn.Module):
    """``(module, attribute)`` of the head ``model.lm_head`` computes with: ``lm_head`` itself, or the trained
    copy inside a wrapper that forwards ``.weight`` to it and calls it (PEFT's ModulesToSaveWrapper)."""
    head = model.lm_head
    if "weight" in head._parameters or isinstance(head, nn.Linear) or _is_sharded_head(head):
        return model, "lm_head"   # (a ShardedLMHead's .weight of a tied or CPU head is the whole table, built)
    from ds_maximus.vocab import plain_weight
    w = plain_weight(head)
    for name, m in head.named_modules():
        if m is not head and (_is_sharded_head(m) or (w is not None and m._parameters.get("weight") is w)):
            owner, _, attr = name.rpartition(".")
            return head.get_submodule(owner) if owner else head, attr
    return model, "lm_head"


def patch_causal_lm_loss(model: nn.Module, head=None, config: Union[LMHeadConfig, MaximusConfig, dict, None] = None):
    """Make ``model(..., labels=...)`` compute its loss with the streamed cross-entropy; no full logits.

    ``head``: a ``ShardedLMHead`` to use instead of ``model.lm_head`` (it replaces it). With
    ``config.placement == "cpu"`` and no head, one is built (tied to the model's ``ShardedEmbedding``
    when the model ties its embeddings) and its replaced parameters are listed in
    ``head.removed_params`` (drop them from the optimizer). Returns the ``ShardedLMHead`` in use, or
    ``None`` when the model's own ``lm_head`` weight is used. Calling it again updates the patch.
    """
    cfg = _lm_cfg(config)
    if not hasattr(model, "loss_function"):
        raise TypeError(f"{type(model).__name__} has no .loss_function; patch_causal_lm_loss needs an HF XForCausalLM")
    if head is None:
        check_streamable(model)
    if head is not None:
        model.lm_head = head
    elif _is_sharded_head(_trained_head(model)):
        head = _trained_head(model)
    elif cfg.placement in (HeadPlacement.CPU, HeadPlacement.CPU_OPTIMIZER):
        head = _build_cpu_head(model, cfg, config)
    lm_head = model.lm_head
    if head is None and (getattr(lm_head, "bias", None) is not None or getattr(lm_head, "weight", None) is None):
        raise TypeError("model.lm_head must be a bias-free linear layer with a .weight [V, d] (or pass head=)")

    patch = getattr(model, _ATTR, None)
    if patch is None:
        patch = _Patch(cfg, head)
        object.__setattr__(model, _ATTR, patch)
        _wrap_model_forward(model, patch)
        _wrap_loss_function(model, patch)
    patch.cfg, patch.head = cfg, head
    _override_head_forward(lm_head, patch)
    return head


def check_streamable(model: nn.Module) -> None:
    """A ``ConfigError`` unless ``model``'s forward computes ``self.loss_function(...)`` from ``self.lm_head(...)``
    logits with a bias-free head: the pattern the patch relies on (masked LMs and T5 compute their loss
    otherwise), and whatever it does to the logits in between is a transform the streamed loss applies itself
    (:func:`logit_transforms`)."""
    cls = type(model).__name__
    src = _forward_source(model)
    if not isinstance(getattr(model, "lm_head", None), nn.Module) or "self.loss_function(" not in src \
            or "self.lm_head(" not in src:
        raise ConfigError(f"maximus.lm_head.enabled streams the labels= loss of Hugging Face causal LMs whose forward "
                          f"computes self.loss_function(self.lm_head(...)); {cls} does not: {_FIX}",
                          "maximus.lm_head.enabled")
    if getattr(model.lm_head, "bias", None) is not None:
        raise ConfigError(f"maximus.lm_head.enabled: {cls}.lm_head has a bias, which the streamed loss does not add: "
                          f"{_FIX}", "maximus.lm_head.enabled")
    logit_transforms(model)


_FIX = ("set \"lm_head\": {\"enabled\": false} in the maximus section (a head tied to a swapped embedding is "
        "swapped with it and trains either way)")


@functools.lru_cache(maxsize=None)
def _class_forward_source(cls) -> str:
    """The source of a class's forward, read once ("" where it is not readable)."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _forward_source(model: nn.Module) -> str:
    return _class_forward_source(type(model))


@functools.lru_cache(maxsize=None)
def _class_head_statements(cls) -> Optional[tuple]:
    """:func:`_head_statements` of a class's forward, once per class (a patched model asks at every call with
    labels)."""
    lines = _head_statements(_class_forward_source(cls))
    return None if lines is None else tuple(lines)


# What a causal LM's forward may do to its logits between ``self.lm_head(...)`` and ``self.loss_function(...)``,
# one statement a line (transformers 5.x): multiply or divide by a number the model holds (Cohere's
# ``logit_scale``, Granite's ``logits_scaling``), Gemma-style soft-capping (``x / c``, ``tanh``, ``* c``), a cast
# to fp32. The patched head returns the loss, not logits, and the model's own code then applies these statements
# to that scalar; so the streamed loss applies them to its logits instead, and for the call the numbers they read
# are set to values that leave the scalar as it is (1, or None for soft-capping, whose block the model skips).
_SCALE = re.compile(r"^logits\s*=\s*logits\s*([*/])\s*(self(?:\.\w+)+)$")
_CAP_DIV_MUL = re.compile(r"^logits\s*=\s*logits(?:\.float\(\))?\s*([*/])\s*((?:\w+\.)*\w*soft_?cap\w*)$")
_CAP_TANH = re.compile(r"^logits\s*=\s*(?:torch|nn\.functional|F)\.tanh\(logits\)$")
_CAP_IF = re.compile(r"^if\s+.*soft_?cap.*\bis not None\s*:$")
_CAP_ONE_LINE = re.compile(r"^logits\s*=\s*(?:torch|nn\.functional|F)\.tanh\(logits\s*/\s*([\w.]+)\)\s*\*\s*\1$")
_LOCAL = re.compile(r"^(\w+)\s*=\s*(self(?:\.\w+)+)$")
_HEAD_TAIL = re.compile(r"^((?:\.float\(\)|\.contiguous\(\))*)\s*(?:([*/])\s*(self(?:\.\w+)+))?$")
_HARMLESS = re.compile(r"^(logits\s*=\s*logits(?:\.float\(\)|\.contiguous\(\))+|loss\s*=\s*None"
                       r"|if\s+labels\s+is\s+not\s+None\s*:)$")
_WORD = re.compile(r"\blogits\b")


class LogitTransforms:
    """What ``model``'s forward does to its logits before its loss, resolved to numbers for one call:
    ``scale`` (applied first) and ``softcap`` (``c * tanh(x / c)``), either ``None``; :meth:`neutralized` sets the
    model attributes they come from to values that make the model's own statements leave the loss unchanged."""

    def __init__(self, scale: Optional[float] = None, softcap: Optional[float] = None, knobs=()):
        self.scale = scale
        self.softcap = softcap
        self.knobs = list(knobs)   # (object, attribute, neutral value)

    @contextlib.contextmanager
    def neutralized(self):
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in self.knobs]
        try:
            for obj, attr, neutral in self.knobs:
                setattr(obj, attr, neutral)
            yield self
        finally:
            for obj, attr, value in reversed(saved):
                setattr(obj, attr, value)


def _refuse(model: nn.Module, what: str):
    raise ConfigError(f"maximus.lm_head.enabled: {type(model).__name__}.forward {what}, which the streamed loss "
                      f"cannot reproduce: {_FIX}", "maximus.lm_head.enabled")


def _head_statements(src: str) -> Optional[list]:
    """The statements between the forward's ``self.lm_head(...)`` call and its ``self.loss_function(``, stripped
    and without comments; ``None`` where the source does not have both. The first entry is what follows the head
    call's closing parenthesis on its own line."""
    i = src.find("self.lm_head(")
    j = src.find("self.loss_function(", i + 1) if i >= 0 else -1
    if i < 0 or j < 0:
        return None
    k, depth = i + len("self.lm_head("), 1
    while k < len(src) and depth:
        depth += {"(": 1, ")": -1}.get(src[k], 0)
        k += 1
    stop = src.rfind("\n", 0, j)
    lines = src[k:max(stop, k)].split("\n")
    return [line.split("#", 1)[0].strip() for line in lines]


def _attr_path(model: nn.Module, path: str):
    """``(owner, attribute, value)`` of a dotted ``self.a.b`` path; ``None`` where it does not resolve."""
    parts = path.split(".")[1:]
    obj = model
    for name in parts[:-1]:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    if not hasattr(obj, parts[-1]):
        return None
    return obj, parts[-1], getattr(obj, parts[-1])


def _softcap_owners(model: nn.Module, name: str):
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else None
    owners = []
    for obj in (model, cfg, text):
        if obj is not None and all(obj is not o for o in owners) and name in getattr(obj, "__dict__", {}):
            owners.append(obj)
    return owners


def logit_transforms(model: nn.Module) -> LogitTransforms:
    """The logit transforms of ``model``'s forward (see above), with today's values; a ``ConfigError`` naming the
    statement for anything else between its head and its loss (a learned scale, a mask, a slice of the vocabulary).
    A forward whose source is not readable gets only ``config.final_logit_softcapping``."""
    cfg = getattr(model, "config", None)
    lines = _class_head_statements(type(model))
    lines = None if lines is None else list(lines)
    if lines is None:
        cap = getattr(cfg, "final_logit_softcapping", None)
        return LogitTransforms(softcap=cap, knobs=[(cfg, "final_logit_softcapping", None)] if cap is not None else [])
    head_tail = _HEAD_TAIL.match(lines[0]) if lines else None
    if lines and head_tail is None:
        _refuse(model, f"computes `self.lm_head(...){lines[0]}`")
    if head_tail is not None and head_tail.group(2):   # `self.lm_head(h) * self.multiplier`
        lines[0] = f"logits = logits {head_tail.group(2)} {head_tail.group(3)}"
    else:
        lines = lines[1:]
    scale, cap_name, cap_path, knobs, local, guarded = None, None, None, [], {}, False
    for line in lines:
        if _CAP_IF.match(line):
            guarded = True   # the soft-capping block is skipped when its value is None
            continue
        if not line or _HARMLESS.match(line) or _CAP_TANH.match(line):
            continue
        m = _LOCAL.match(line)
        if m and not _WORD.search(line):
            local[m.group(1)] = m.group(2)
            continue
        m = _CAP_DIV_MUL.match(line) or _CAP_ONE_LINE.match(line)
        if m:
            if not guarded:   # no value of c makes c * tanh(x / c) leave the loss as it is
                _refuse(model, f"soft-caps its logits unconditionally (`{line}`)")
            token = m.group(m.lastindex)
            cap_path = local.get(token, token if token.startswith("self.") else None)
            cap_name = token.rsplit(".", 1)[-1]
            continue
        m = _SCALE.match(line)
        if m:
            if cap_name is not None:
                _refuse(model, f"scales its logits after soft-capping them (`{line}`)")
            found = _attr_path(model, m.group(2))
            value = None if found is None else found[2]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _refuse(model, f"scales its logits by {m.group(2)} = {value!r} (`{line}`), not a number it holds")
            factor = float(value) if m.group(1) == "*" else 1.0 / float(value)
            scale = factor if scale is None else scale * factor
            knobs.append((found[0], found[1], 1))
            continue
        if _WORD.search(line):
            _refuse(model, f"changes its logits with `{line}`")
    softcap = None
    if cap_path is not None:   # read through a path from the model (or a local set from one)
        found = _attr_path(model, cap_path)
        if found is None:
            _refuse(model, f"soft-caps its logits by {cap_path}, which does not resolve")
        knobs.append((found[0], found[1], None))
        softcap = found[2]
    elif cap_name is not None:
        owners = _softcap_owners(model, cap_name)
        values = {getattr(o, cap_name) for o in owners} - {None}
        if len(values) > 1:
            _refuse(model, f"reads {cap_name} from objects that disagree ({sorted(values)})")
        softcap = next(iter(values), None)
        knobs += [(o, cap_name, None) for o in owners]
    return LogitTransforms(scale, softcap, knobs)


def _is_sharded_head(m) -> bool:
    from ds_maximus.vocab.lm_head import ShardedLMHead
    return isinstance(m, ShardedLMHead)


def _override_head_forward(lm_head: nn.Module, patch: _Patch) -> None:
    if getattr(lm_head, "_maximus_orig_forward", None) is None:
        lm_head._maximus_orig_forward = lm_head.forward   # the bound class forward
    orig = lm_head._maximus_orig_forward

    def forward(self, hidden, *args, **kwargs):
        req = patch.request
        if req is None:
            return orig(hidden, *args, **kwargs)
        patch.request = None                      # one shot: a second call is an ordinary one
        head = patch.head if patch.head is not None else self
        original = getattr(self, "original_module", None)
        if isinstance(original, nn.Module) and getattr(self, "disable_adapters", False):
            head = original   # a PEFT wrapper with its adapters off computes with its frozen original
        loss = patch.loss(head, hidden, req)
        patch.last_loss = loss
        return loss

    lm_head.forward = types.MethodType(forward, lm_head)


def _wrap_loss_function(model: nn.Module, patch: _Patch) -> None:
    orig = getattr(model, "loss_function", None)

    def loss_function(logits, labels=None, vocab_size=None, **kwargs):
        # the head's loss, possibly re-wrapped on the way out of the head (ZeRO-3's module hooks return a new
        # tensor object of the same scalar)
        if patch.last_loss is not None and torch.is_tensor(logits) and logits.dim() == 0:
            patch.last_loss = None
            return logits
        if orig is None:
            raise RuntimeError("the patched model has no loss_function of its own")
        return orig(logits, labels, vocab_size, **kwargs)

    model.loss_function = loss_function


def _wrap_model_forward(model: nn.Module, patch: _Patch) -> None:
    orig = model.forward
    patch.orig_forward = orig
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        labels = bound.get("labels")
        extra = bound.get("kwargs", {}) if isinstance(bound.get("kwargs"), dict) else {}
        shift_labels = extra.get("shift_labels", kwargs.get("shift_labels"))
        if labels is None and shift_labels is None:
            return orig(*args, **kwargs)
        if not torch.is_grad_enabled() and _plain_evaluation(patch.cfg.eval_logits):
            return orig(*args, **kwargs)   # an evaluation that reads the logits: the plain model's logits and loss
        transforms = logit_transforms(model)   # applied inside the streamed loss instead of to its scalar
        n_items = extra.get("num_items_in_batch", kwargs.get("num_items_in_batch"))
        ignore = extra.get("ignore_index", kwargs.get("ignore_index", -100))
        patch.request = _LossRequest(labels, shift_labels, n_items, ignore, transforms.softcap, transforms.scale)
        if labels is None:   # the model computes a loss only when labels are given
            kwargs["labels"] = shift_labels
        try:
            with transforms.neutralized():
                out = orig(*args, **kwargs)
        finally:
            patch.request = None
            patch.last_loss = None
        return _drop_logits(out)

    model.forward = forward


class _Wanted(threading.local):
    """The innermost of :func:`loss_only` / :func:`logits_wanted` the calling thread is in: "loss", "logits" or
    None."""
    stack: tuple = ()


_WANTED = _Wanted()


@contextlib.contextmanager
def _wanting(what: str):
    _WANTED.stack = _WANTED.stack + (what,)
    try:
        yield
    finally:
        _WANTED.stack = _WANTED.stack[:-1]


def loss_only():
    """Inside it, a patched model's calls with labels and no gradient stream their loss without logits (also with
    ``lm_head.eval_logits: on``). The HF Trainer's loss-only evaluation runs inside it after ``ds_maximus.enable()``."""
    return _wanting("loss")


def logits_wanted():
    """Inside it, a patched model's calls with labels and no gradient compute the plain model's logits and loss
    (with ``lm_head.eval_logits: auto``, the default): for an evaluation that reads the logits. The HF Trainer's
    evaluation with ``compute_metrics`` runs inside it after ``ds_maximus.enable()``."""
    return _wanting("logits")


def _plain_evaluation(mode) -> bool:
    """Whether a call with labels and no gradient runs the plain model (logits) rather than the streamed loss."""
    mode = getattr(mode, "value", mode)
    wanted = _WANTED.stack[-1] if _WANTED.stack else None
    if mode == "off" or wanted == "loss":
        return False
    return mode == "on" or wanted == "logits"


def _drop_logits(out):
    if isinstance(out, tuple):
        return out[:1] + out[2:]
    if "logits" in out.keys():
        collections.OrderedDict.__delitem__(out, "logits")
    object.__setattr__(out, "logits", None)
    return out
