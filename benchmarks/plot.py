"""Draw the benchmark charts (ours against each peer) from CSVs, or a run's training curves.

    python -m benchmarks.plot                          # the README's charts: docs/bench/csv/*.csv -> docs/bench/*.png
    python -m benchmarks.plot --csv-dir bench_out --out bench_out   # charts of your own benchmark runs
    python -m benchmarks.plot --run RUN_DIR [--out curves.png]     # loss, hit rate, bytes moved per step

Each ``<name>.csv`` written by ``benchmarks.harness.Bench`` becomes ``<name>.png`` with one panel per
figure it has (ms per call, peak GiB, tokens/s, GB/s when present), so a chart always shows exactly
the figures of the CSV a table cites. Our rows (named "maximus ..." or "ours ...") are red with bold
labels, peers grey. A panel whose values span more than :data:`LOG_SPAN` (largest / smallest) uses a
log scale, so a 3 ms bar stays visible beside a 719 ms peer. Failed peers (OOM, ...) are drawn as a
hatched, labelled stub so a missing bar is never mistaken for a small one. ``--run`` reads a
DeepSpeed ``csv_monitor`` folder (see :mod:`benchmarks.run_curves`). Exits with status 1 and a message
when there is nothing to draw.
"""
from __future__ import annotations

import argparse
import csv
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

DEFAULT_CSV_DIR = "docs/bench/csv"
DEFAULT_OUT_DIR = "docs/bench"
LOG_SPAN = 20.0  # a panel whose largest value is more than this many times its smallest is drawn on a log scale
OURS_COLOR, PEER_COLOR = "#d62728", "#7f7f7f"
PANELS = [("ms", "time per call (ms, lower is better)"), ("peak_gib", "peak memory (GiB, lower is better)"),
          ("tokens_per_s", "throughput (tokens/s, higher is better)"),
          ("tokens/s", "throughput (tokens/s, higher is better)"), ("GB/s", "bandwidth (GB/s, higher is better)")]


def read_csv(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(v: Optional[str]) -> Optional[float]:
    try:
        x = float(str(v).replace(",", ""))
        return x if x == x and x > 0 else None  # NaN, zero and negatives are not drawable bars
    except (TypeError, ValueError):
        return None


def is_ours(name: str) -> bool:
    return any(tag in name.lower() for tag in ("maximus", "ours"))


def use_log_scale(values: List[Optional[float]]) -> bool:
    """True when the drawable values span more than :data:`LOG_SPAN`."""
    vals = [v for v in values if v is not None]
    return len(vals) > 1 and max(vals) / min(vals) > LOG_SPAN


def plot_feature(rows: List[Dict[str, str]], out: Path) -> Path:
    """One chart of a benchmark CSV's rows: a panel per figure, ours highlighted; returns ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in PANELS if any(_num(r.get(k)) is not None for r in rows)]
    if not panels:
        raise ValueError(f"no drawable figure ({', '.join(k for k, _ in PANELS)}) in the rows for {out.name}")
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 0.55 * len(rows) + 2.2), squeeze=False)
    names = [r["provider"] for r in rows]
    for ax, (key, title) in zip(axes[0], panels):
        vals = [_num(r.get(key)) for r in rows]
        drawn = [v for v in vals if v is not None]
        lo, hi = min(drawn), max(drawn)
        log = use_log_scale(vals)
        if log:
            ax.set_xscale("log")
            left, right = lo / 3, hi * 6
        else:
            left, right = 0.0, hi * 1.35
        for i, (name, v) in enumerate(zip(names, vals)):
            if v is None:
                stub = left * 1.6 if log else hi * 0.03
                ax.barh(i, stub - left, left=left, color="white", edgecolor="grey", hatch="//")
                ax.text(stub * (1.1 if log else 1.3), i, rows[i].get("error") or "n/a", va="center", fontsize=8,
                        color="grey")
            else:
                ax.barh(i, v - left, left=left, color=OURS_COLOR if is_ours(name) else PEER_COLOR)
                ax.text(v, i, f" {v:,.0f}" if v >= 1000 else f" {v:.3g}", va="center", fontsize=8,
                        fontweight="bold" if is_ours(name) else None)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        for label, name in zip(ax.get_yticklabels(), names):
            if is_ours(name):
                label.set_fontweight("bold")
                label.set_color(OURS_COLOR)
        ax.invert_yaxis()
        ax.set_title(title + ("\nlog scale" if log else ""), fontsize=9)
        ax.set_xlim(left, right)
    first = rows[0]
    commit = first.get("commit", "")
    title = (f"{first['feature']}: {first.get('device', '')}, {first.get('dtype', '')}, "
             f"{first.get('sizes', '').replace(';', ', ')}" + (f" (commit {commit})" if commit not in ("", "unknown")
                                                                 else ""))
    fig.suptitle("\n".join(textwrap.wrap(title, 60 * len(panels) // 2 + 40)), fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_csv_dir(csv_dir: Path, out_dir: Path) -> List[Path]:
    """A chart per ``*.csv`` of ``csv_dir`` into ``out_dir`` (same stem, ``.png``)."""
    made = []
    for path in sorted(csv_dir.glob("*.csv")):
        rows = read_csv(path)
        if rows:
            made.append(plot_feature(rows, out_dir / f"{path.stem}.png"))
            print(f"wrote {made[-1]} (from {path})")
    return made


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv-dir", default=DEFAULT_CSV_DIR, help=f"benchmark CSVs to draw (default {DEFAULT_CSV_DIR})")
    ap.add_argument("--out", default=None,
                    help=f"folder for the charts (default {DEFAULT_OUT_DIR}); with --run, the PNG file "
                         "(default RUN_DIR/training_curves.png)")
    ap.add_argument("--run", default=None, metavar="RUN_DIR",
                    help="draw a training run's curves from its DeepSpeed csv_monitor folder instead")
    args = ap.parse_args(argv)
    if args.run is not None:
        from benchmarks.run_curves import NoRunData, plot_run
        try:
            out = plot_run(Path(args.run), Path(args.out) if args.out else None)
        except NoRunData as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"wrote {out}")
        return 0
    csv_dir = Path(args.csv_dir)
    if not csv_dir.is_dir():
        print(f"error: {csv_dir} is not a folder; pass --csv-dir with the benchmarks' CSVs "
              "(python -m benchmarks.bench_<feature> writes them)", file=sys.stderr)
        return 1
    made = plot_csv_dir(csv_dir, Path(args.out or DEFAULT_OUT_DIR))
    if not made:
        print(f"error: no CSV with rows in {csv_dir}; run a benchmark first (python -m benchmarks.bench_<feature>) "
              "or pass --csv-dir", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
