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
from typing import Dict

logger = logging.getLogger("ds_maximus")

# figures written to DeepSpeed's monitors (tensorboard / csv_monitor / wandb), per module
MONITOR_KEYS = ("hit_rate", "bytes_h2d", "bytes_d2h", "stall_ms", "row_sparsity", "rows_fetched",
                "rows_evicted", "expert_hit_rate", "experts_moved", "expert_bytes")


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


def stats(engine_or_module) -> MaximusStats:
    """Stats of a maximus engine (``ds_maximus.initialize``) or of one sharded module."""
    rt = getattr(engine_or_module, "maximus", None)
    if rt is None:
        if hasattr(engine_or_module, "stats") and callable(engine_or_module.stats):
            return MaximusStats(0, 0, 1.0, {"module": dict(engine_or_module.stats())})
        raise TypeError(f"{type(engine_or_module).__name__} is neither a maximus engine nor a maximus module; "
                        "create the engine with ds_maximus.initialize")
    return MaximusStats(rt.steps, rt.skipped_steps, rt.last_clip_coef,
                        {n: dict(m.stats()) for n, m in rt.modules.items()})


def _short(name: str) -> str:
    return name.split(".")[-1] or name


def format_line(s: MaximusStats) -> str:
    parts = [f"maximus step={s.steps}"]
    for name, st in s.modules.items():
        bits = []
        for key, fmt in (("hit_rate", "{:.3f}"), ("row_sparsity", "{:.4f}"), ("bytes_h2d", "{:.3g}B"),
                         ("stall_ms", "{:.1f}ms"), ("expert_hit_rate", "{:.3f}")):
            if key in st:
                bits.append(f"{key}=" + fmt.format(float(st[key])))
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


def log_stats(runtime) -> None:
    """Every ``logging.interval_steps`` optimizer steps: monitor events and a log line on rank 0."""
    interval = runtime.cfg.logging.interval_steps
    if runtime.steps == 0 or runtime.steps % interval:
        return
    engine = runtime.engine
    if getattr(engine, "global_rank", 0) != 0:
        return
    s = stats(engine)
    # printed (not logged) so it shows beside DeepSpeed's own step lines whatever logging is configured
    print(format_line(s), flush=True)
    monitor = getattr(engine, "monitor", None)
    if monitor is not None and getattr(monitor, "enabled", False):
        monitor.write_events(monitor_events(s, engine.global_samples))
