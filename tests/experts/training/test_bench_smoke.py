"""The MoE training benchmark runs end to end on the CPU (``--tiny``): ours' split step as a subprocess peer, its row
with the split's sides and the host-memory estimate. Nothing here is timed; the figures live in docs/bench."""
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_moe_training_tiny_runs_ours_split(tmp_path):
    out = tmp_path / "moe.md"
    held = socket.socket()  # a MASTER_PORT already taken, as CI's pytest process held one: each peer takes its own
    held.bind(("127.0.0.1", 0))
    held.listen()
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(held.getsockname()[1]))
    with held:
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
