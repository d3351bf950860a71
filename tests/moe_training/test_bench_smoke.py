"""The MoE training benchmark runs end to end on the CPU (``--tiny``): ours' split step as a subprocess peer, its row
with the split's sides and the host-memory estimate. Nothing here is timed; the figures live in docs/bench."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_moe_training_tiny_runs_ours_split(tmp_path):
    out = tmp_path / "moe.md"
    # the peer picks a free port itself: not the one this pytest process's own process group may hold
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["DS_ACCELERATOR"] = "cpu"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_moe_training", "--tiny", "--peers", "ours_split",
                        "--warmup", "1", "--steps", "1", "--budget-s", "200", "--slot-s", "200", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    table = out.read_text()
    header = next(ln for ln in table.splitlines() if ln.startswith("| provider"))
    row = next(ln for ln in table.splitlines() if ln.startswith("| ours"))
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert float(cells["ms"]) > 0, row
    assert "GB/s" in cells["host GB/step (est.)"] and "/" in cells["sides ms: CPU/device (experts)"], row
