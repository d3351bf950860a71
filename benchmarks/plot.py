"""Draw PNG charts from the benchmarks' CSV output: ours against each peer (time, memory, throughput).

    python -m benchmarks.plot [--csv-dir bench_out] [--out docs/bench]

Each ``<feature>.csv`` written by ``benchmarks.harness.Bench`` becomes ``<feature>.png`` with one panel
per figure it has (ms per call, peak GiB, and tokens/s when present). Our rows (named "maximus ..." or
"ours ...") are red, peers grey. Failed peers (OOM, ...) are drawn as a hatched, labelled stub so a
missing bar is never mistaken for a small one.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Dict, List

PANELS = [("ms", "time per call (ms, lower is better)"), ("peak_gib", "peak memory (GiB, lower is better)"),
          ("tokens_per_s", "throughput (tokens/s, higher is better)"),
          ("tokens/s", "throughput (tokens/s, higher is better)"), ("GB/s", "bandwidth (GB/s, higher is better)")]


def read_csv(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(v: str):
    try:
        x = float(v)
        return x if x == x else None  # NaN -> None
    except (TypeError, ValueError):
        return None


def plot_feature(rows: List[Dict[str, str]], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in PANELS if any(_num(r.get(k)) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 0.55 * len(rows) + 2.0), squeeze=False)
    names = [r["provider"] for r in rows]
    for ax, (key, title) in zip(axes[0], panels):
        vals = [_num(r.get(key)) for r in rows]
        top = max([v for v in vals if v is not None] or [1.0])
        for i, (name, v) in enumerate(zip(names, vals)):
            ours = any(tag in name.lower() for tag in ("maximus", "ours"))
            if v is None:
                ax.barh(i, top * 0.03, color="white", edgecolor="grey", hatch="//")
                ax.text(top * 0.04, i, rows[i].get("error") or "n/a", va="center", fontsize=8, color="grey")
            else:
                ax.barh(i, v, color="#d62728" if ours else "#7f7f7f")
                ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, top * 1.35)
    first = rows[0]
    import textwrap
    title = (f"{first['feature']}: {first.get('device', '')}, {first.get('dtype', '')}, "
             f"{first.get('sizes', '').replace(';', ', ')} (commit {first.get('commit', '')})")
    fig.suptitle("\n".join(textwrap.wrap(title, 60 * len(panels) // 2 + 40)), fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> List[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv-dir", default="bench_out")
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args(argv)
    made = []
    for path in sorted(Path(args.csv_dir).glob("*.csv")):
        rows = read_csv(path)
        if rows:
            made.append(plot_feature(rows, Path(args.out) / f"{path.stem}.png"))
            print(f"wrote {made[-1]}")
    if not made:
        print(f"no CSV files in {args.csv_dir}; run a benchmark first (python -m benchmarks.bench_<feature>)")
    return made


if __name__ == "__main__":
    main()
