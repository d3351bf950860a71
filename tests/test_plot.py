from benchmarks.harness import Bench
from benchmarks.plot import main


def test_plot_draws_png_per_csv(tmp_path):
    b = Bench("unit_plot", dtype="bf16", sizes={"V": 8})
    b.add("ours", 2.0, 1.0, tokens_per_s=1000.0)
    b.add("plain DeepSpeed", 4.0, 3.0, tokens_per_s=500.0)
    b.add("zero-3 offload", None, error="OOM")
    b.write_csv(tmp_path / "csv")
    made = main(["--csv-dir", str(tmp_path / "csv"), "--out", str(tmp_path / "png")])
    assert [p.name for p in made] == ["unit_plot.png"]
    data = made[0].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
