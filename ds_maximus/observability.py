"""Maximus statistics: a typed snapshot, the periodic one-line log and DeepSpeed monitor events.

``ds_maximus.stats(engine)`` returns a :class:`MaximusStats`; each sharded module's ``.stats()`` feeds it.
Units are in the names: ``bytes_h2d`` (bytes), ``stall_ms`` (milliseconds), ``hit_rate`` and
``row_sparsity`` (fractions in [0, 1]).

Example::

    s = ds_maximus.stats(engine)
    print(s.modules["model.embed_tokens"]["hit_rate"], s.steps)
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Dict

logger = logging.getLogger("ds_maximus")

# figures written to DeepSpeed's monitors (tensorboard / csv_monitor / wandb), per module
MONITOR_KEYS = ("hit_rate", "bytes_h2d", "bytes_d2h", "stall_ms", "row_sparsity", "rows_fetched",
                "rows_evicted", "overflow_rows", "expert_hit_rate", "experts_moved", "expert_bytes",
                "bytes_sent", "bytes_recv", "comm_ms", "collectives")  # the last four: a table's collectives

# (tag, format) of the figures the stats line and the Trainer's logs carry, per module (cumulative values)
LINE_KEYS = (("hit_rate", "{:.3f}"), ("row_sparsity", "{:.4f}"), ("bytes_h2d", "{:.3g}B"), ("stall_ms", "{:.1f}ms"),
             ("expert_hit_rate", "{:.3f}"), ("bytes_sent", "{:.3g}B"), ("comm_ms", "{:.1f}ms"))

# runtimes whose figures reach the user through a host's own logging (HF Trainer's on_log), not printed lines
_REPORTED_ELSEWHERE: "weakref.WeakSet" = weakref.WeakSet()
# runtime -> the global step its line was last printed at (a line is printed once per step)
_LAST_PRINTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# model (the module the engine wraps) -> weak reference to its runtime, for hosts that see only the model
_RUNTIMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class MaximusStats:
    """Snapshot of every maximus counter of an engine (or a single module)."""

    steps: int
    """Sparse optimizer steps applied."""
    skipped_steps: int
    """Steps skipped for fp16 overflow (dense and sparse together)."""
    clip_coef: float
    """Clip coefficient applied to the last step (1.0 = not clipped)."""
    modules: Dict[str, Dict[str, float]]
    """Per module: its ``.stats()`` dict (cumulative and ``last_*`` per-step figures)."""
    global_step: int = 0
    """The engine's ``global_steps`` (optimizer steps taken, skipped ones included): the step a log names."""


def stats(engine_or_module) -> MaximusStats:
    """Stats of a maximus engine (``ds_maximus.initialize``) or of one sharded module."""
    rt = getattr(engine_or_module, "maximus", None)
    if rt is None:
        if hasattr(engine_or_module, "stats") and callable(engine_or_module.stats):
            return MaximusStats(0, 0, 1.0, {"module": dict(engine_or_module.stats())})
        raise TypeError(f"{type(engine_or_module).__name__} is neither a maximus engine nor a maximus module; "
                        "create the engine with ds_maximus.initialize")
    return MaximusStats(rt.steps, rt.skipped_steps, rt.last_clip_coef,
                        {n: dict(m.stats()) for n, m in rt.modules.items()},
                        int(getattr(engine_or_module, "global_steps", rt.steps)))


def _short(name: str) -> str:
    return name.split(".")[-1] or name


def format_line(s: MaximusStats) -> str:
    parts = [f"maximus step={s.global_step}"]
    for name, st in s.modules.items():
        bits = [f"{key}=" + fmt.format(float(st[key])) for key, fmt in LINE_KEYS if key in st]
        parts.append(f"{_short(name)}[{' '.join(bits)}]")
    if s.skipped_steps:
        parts.append(f"skipped={s.skipped_steps}")
    if s.clip_coef != 1.0:
        parts.append(f"clip={s.clip_coef:.3g}")
    return " ".join(parts)


def monitor_events(s: MaximusStats, sample: int):
    """(tag, value, x) events in DeepSpeed's monitor format: per-step figures of the last optimizer
    step (``Maximus/<module>/<key>``) plus the cumulative hit rate (``.../hit_rate_cumulative``)."""
    events = []
    for name, st in s.modules.items():
        last = st.get("last_step") or st
        for key in MONITOR_KEYS:
            if key in last:
                events.append((f"Maximus/{name}/{key}", float(last[key]), sample))
        if "hit_rate" in st:
            events.append((f"Maximus/{name}/hit_rate_cumulative", float(st["hit_rate"]), sample))
    return events


def register(model, runtime) -> None:
    """Remember which runtime drives ``model`` (``ds_maximus.initialize`` calls this)."""
    _RUNTIMES[model] = weakref.ref(runtime)


def runtime_of(model):
    """The runtime that drives ``model`` (the module a maximus engine wraps), or ``None``."""
    ref = _RUNTIMES.get(model) if model is not None else None
    return ref() if ref is not None else None


def report_elsewhere(runtime) -> None:
    """Stop printing ``runtime``'s stats lines: a host (HF Trainer's callback) logs the figures itself.
    Monitor events (csv_monitor, tensorboard, wandb of the ds_config) are written as before."""
    _REPORTED_ELSEWHERE.add(runtime)


def log_fields(s: MaximusStats, prefix: str = "maximus/") -> Dict[str, float]:
    """The stats line's figures as a flat dict for a host's logs (``maximus/embed_tokens/hit_rate``: 0.97)."""
    out: Dict[str, float] = {}
    for name, st in s.modules.items():
        for key, _ in LINE_KEYS:
            if key in st:
                v = float(st[key])
                out[f"{prefix}{_short(name)}/{key}"] = int(v) if key.startswith("bytes_") else round(v, 4)
    if s.skipped_steps:
        out[f"{prefix}skipped_steps"] = s.skipped_steps
    if s.clip_coef != 1.0:
        out[f"{prefix}clip_coef"] = round(s.clip_coef, 4)
    return out


def log_stats(runtime, final: bool = False) -> None:
    """At every ``logging.interval_steps``-th global step of the engine (or, with ``final``, at the end of a
    run): monitor events and one stats line on rank 0, never twice for the same step."""
    engine = runtime.engine
    step = int(getattr(engine, "global_steps", runtime.steps))
    if step == 0 or (not final and step % runtime.cfg.logging.interval_steps):
        return
    if getattr(engine, "global_rank", 0) != 0 or _LAST_PRINTED.get(runtime) == step:
        return
    _LAST_PRINTED[runtime] = step
    s = stats(engine)
    if runtime not in _REPORTED_ELSEWHERE:
        # printed (not logged) so it shows beside DeepSpeed's own step lines whatever logging is configured
        print(format_line(s), flush=True)
    monitor = getattr(engine, "monitor", None)
    if monitor is not None and getattr(monitor, "enabled", False):
        monitor.write_events(monitor_events(s, engine.global_samples))
