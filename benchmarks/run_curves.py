"""Training curves of one run from DeepSpeed's ``csv_monitor`` output: loss, hit rate, bytes moved.

``"csv_monitor": {"enabled": true, "output_path": "runs/", "job_name": "llama"}`` in the ds_config
makes rank 0 write one CSV per series under ``runs/llama/``: the series ``A/B/C`` goes to
``A_B_C.csv`` with the header ``step,C`` and one ``step,value`` row per event (DeepSpeed's engine
passes the global sample count as ``step``). ds_maximus writes ``Maximus/<module>/<key>`` every
``logging.interval_steps`` optimizer steps (:data:`ds_maximus.observability.MONITOR_KEYS`: the last
step's ``hit_rate``, ``bytes_h2d``, ``bytes_d2h``, ``expert_hit_rate``, ``expert_bytes``, ...).
The loss is any series named ``...loss`` (DeepSpeed's pipeline engine writes
``Train/Samples/train_loss``; a plain script writes its own with ``engine.monitor.write_events``).

    python -m benchmarks.plot --run runs/llama            # -> runs/llama/training_curves.png

Three panels, x = the series' step column: loss; hit rate per module (rows or experts already on
the GPU); bytes moved per step per module (host->device plus device->host, log scale when the
values span more than :data:`benchmarks.plot.LOG_SPAN`).
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ds_maximus.observability import MONITOR_KEYS

MAXIMUS_PREFIX = "Maximus_"
_KEYS = sorted(MONITOR_KEYS + ("hit_rate_cumulative",), key=len, reverse=True)  # longest suffix first
HIT_KEYS = ("hit_rate", "expert_hit_rate")
BYTE_KEYS = ("bytes_h2d", "bytes_d2h", "expert_bytes")

Series = List[Tuple[float, float]]


class NoRunData(Exception):
    """The folder holds no csv_monitor series that the curves use."""


def read_series(path: Path) -> Series:
    """(step, value) rows of one csv_monitor file (header row skipped, unreadable rows ignored)."""
    out: Series = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            try:
                out.append((float(row[0]), float(row[1])))
            except (IndexError, ValueError):
                continue  # the header, or a row cut short by a run that was killed
    return out


def split_maximus(stem: str) -> Optional[Tuple[str, str]]:
    """(module, key) of a ``Maximus_<module>_<key>`` file stem, or None for another series."""
    if not stem.startswith(MAXIMUS_PREFIX):
        return None
    rest = stem[len(MAXIMUS_PREFIX):]
    for key in _KEYS:
        if rest.endswith("_" + key):
            return rest[:-len(key) - 1], key
    return None


def collect(run_dir: Path) -> Dict[str, Dict[str, Series]]:
    """``{"loss": {name: series}, "hit_rate": {module: series}, "bytes": {module: series}}`` of a run."""
    out: Dict[str, Dict[str, Series]] = {"loss": {}, "hit_rate": {}, "bytes": {}}
    for path in sorted(run_dir.rglob("*.csv")):
        stem = path.stem
        mk = split_maximus(stem)
        if mk is None:
            if stem.lower().endswith("loss"):
                out["loss"][stem] = read_series(path)
            continue
        module, key = mk
        if key in HIT_KEYS:
            out["hit_rate"][f"{module} ({key})" if key != "hit_rate" else module] = read_series(path)
        elif key in BYTE_KEYS:  # summed per module and step: one "bytes moved" curve each
            acc = dict(out["bytes"].get(module, []))
            for step, v in read_series(path):
                acc[step] = acc.get(step, 0.0) + v
            out["bytes"][module] = sorted(acc.items())
    return {k: {n: s for n, s in v.items() if s} for k, v in out.items()}


def plot_run(run_dir: Path, out: Optional[Path] = None) -> Path:
    """Draw the run's curves to ``out`` (default ``run_dir/training_curves.png``); returns the path."""
    from benchmarks.plot import use_log_scale
    if not run_dir.is_dir():
        raise NoRunData(f"{run_dir} is not a folder; pass the csv_monitor folder of a run "
                        "(its ds_config's csv_monitor.output_path/job_name)")
    data = collect(run_dir)
    panels = [(k, t) for k, t in (("loss", "loss"), ("hit_rate", "hit rate (share already on the GPU)"),
                                   ("bytes", "bytes moved per step (H2D + D2H)")) if data[k]]
    if not panels:
        raise NoRunData(f"no loss or Maximus/* series in {run_dir}; enable \"csv_monitor\" in the ds_config "
                        "(and maximus logging.interval_steps) and run again")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.0), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for name, series in data[key].items():
            xs, ys = zip(*series)
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=name)
        if key == "bytes" and use_log_scale([y for s in data[key].values() for _, y in s if y > 0]):
            ax.set_yscale("log")
        if key == "hit_rate":
            ax.set_ylim(0, 1.02)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step (DeepSpeed's monitor x: samples seen)", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"training curves: {run_dir}", fontsize=9)
    fig.tight_layout()
    out = out or run_dir / "training_curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
