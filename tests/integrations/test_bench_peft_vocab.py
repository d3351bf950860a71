"""benchmarks/bench_peft_vocab.py --small runs end to end on the CPU: every peer in its own process, the rows that
need CUDA or a missing package (Liger, bitsandbytes) skip with their reason, ours' loss curve tracks the
reference's. Nothing here is timed; the real sizes run on the GPU."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_peft_vocab_small(tmp_path):
    out = tmp_path / "peft_vocab.md"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_peft_vocab", "--small", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = out.read_text().splitlines()
    header = [c.strip() for c in next(ln for ln in lines if ln.startswith("| provider")).split("|")]
    rows = {}
    for ln in lines:
        if ln.startswith("| ") and not ln.startswith("| provider"):
            cells = [c.strip() for c in ln.split("|")]
            rows[cells[1]] = dict(zip(header, cells))
    assert set(rows) == {"peft_mts", "peft_mts_capped", "peft_mts_liger_capped", "peft_tti_capped", "ours_capped",
                         "qlora_peft_mts_capped", "qlora_ours_capped"}
    for name in ("peft_mts", "peft_mts_capped", "peft_tti_capped", "ours_capped"):
        assert float(rows[name]["ms"]) > 0 and float(rows[name]["tokens/s"]) > 0, rows[name]
    assert rows["qlora_ours_capped"]["ms"].startswith("skipped:")
    assert float(rows["ours_capped"]["loss diff"]) < 0.005   # the curve tracks plain PEFT's
