"""benchmarks.plot: the README's charts from docs/bench/csv, clear failures, log scale, a run's curves."""
import csv
from pathlib import Path

import pytest
import torch

from benchmarks.harness import Bench
from benchmarks.plot import DEFAULT_CSV_DIR, main, use_log_scale
from benchmarks.run_curves import collect, split_maximus

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_draws_png_per_csv(tmp_path, capsys):
    b = Bench("unit_plot", dtype="bf16", sizes={"V": 8})
    b.add("ours", 2.0, 1.0, tokens_per_s=1000.0)
    b.add("plain DeepSpeed", 4.0, 3.0, tokens_per_s=500.0)
    b.add("zero-3 offload", None, error="OOM")
    b.write_csv(tmp_path / "csv")
    assert main(["--csv-dir", str(tmp_path / "csv"), "--out", str(tmp_path / "png")]) == 0
    data = (tmp_path / "png" / "unit_plot.png").read_bytes()
    assert data[:8] == PNG and len(data) > 5000
    assert "wrote" in capsys.readouterr().out


def test_default_draws_every_readme_csv(tmp_path, monkeypatch):
    """No arguments: docs/bench/csv/*.csv, each to a PNG of the same name (the README's charts)."""
    monkeypatch.chdir(ROOT)
    csvs = sorted(Path(DEFAULT_CSV_DIR).glob("*.csv"))
    assert csvs, "docs/bench/csv holds the CSVs the README cites"
    assert main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(p.stem + ".png" for p in csvs)
    # the committed charts are the ones drawn from those CSVs (regenerate them with `python -m benchmarks.plot`)
    assert sorted(p.name for p in (ROOT / "docs/bench").glob("*.png")) == sorted(p.stem + ".png" for p in csvs)


def test_nothing_to_draw_exits_non_zero(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["--csv-dir", str(tmp_path / "empty"), "--out", str(tmp_path)]) == 1
    assert "no CSV" in capsys.readouterr().err
    assert main(["--csv-dir", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 1
    assert "not a folder" in capsys.readouterr().err
    assert main(["--run", str(tmp_path / "empty")]) == 1
    assert "no loss or Maximus/* series" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_log_scale_when_peers_span_orders_of_magnitude():
    assert use_log_scale([3.72, 16.8, 2.5, None, 719.3])  # the sharded embedding against ZeRO-2 + CPU offload
    assert not use_log_scale([221.3, 207.3, 182.4, 153.5])  # the LM head's peers: a linear scale reads better
    assert not use_log_scale([5.0, None])


def test_split_maximus_names():
    assert split_maximus("Maximus_model.embed_tokens_hit_rate") == ("model.embed_tokens", "hit_rate")
    assert split_maximus("Maximus_model.embed_tokens_hit_rate_cumulative") == ("model.embed_tokens",
                                                                               "hit_rate_cumulative")
    assert split_maximus("Maximus_model.layers.0.mlp_expert_hit_rate") == ("model.layers.0.mlp", "expert_hit_rate")
    assert split_maximus("Train_Samples_lr") is None


def test_run_curves_from_a_real_csv_monitor(tmp_path):
    """A DeepSpeed engine with csv_monitor on: the curves read what it wrote (loss, hit rate, bytes)."""
    import ds_maximus
    from tests.engine.llama_utils import maximus_section
    from tests.helpers.models import ds_config, tiny_llama
    sec = maximus_section(cache_rows=384)
    sec["logging"] = {"interval_steps": 1}
    cfg = ds_config(2, "fp32", maximus=sec, lr=1e-3)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}
    model = tiny_llama(0)
    e, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(0)
    losses, fetched = [], []
    for _ in range(4):
        ids = torch.randint(0, 200, (2, 16), generator=g)
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss)
        e.step()
        losses.append(loss.item())
        fetched.append(ds_maximus.stats(e).modules["model.embed_tokens"]["last_step"])
        e.monitor.write_events([("Train/Samples/train_loss", loss.item(), e.global_samples)])
    run = tmp_path / "run"
    data = collect(run)
    assert [v for _, v in data["loss"]["Train_Samples_train_loss"]] == pytest.approx(losses)
    assert [v for _, v in data["hit_rate"]["model.embed_tokens"]] == pytest.approx([f["hit_rate"] for f in fetched])
    moved = [f["bytes_h2d"] + f["bytes_d2h"] for f in fetched]
    assert [v for _, v in data["bytes"]["model.embed_tokens"]] == pytest.approx(moved)
    assert moved[0] > 0  # the first step fetched every row it used
    assert [s for s, _ in data["loss"]["Train_Samples_train_loss"]] == [2.0, 4.0, 6.0, 8.0]  # samples seen
    assert main(["--run", str(run)]) == 0
    png = run / "training_curves.png"
    assert png.read_bytes()[:8] == PNG
    # a row cut short by a killed run is skipped, not fatal
    with open(run / "Train_Samples_train_loss.csv", "a", newline="") as f:
        csv.writer(f).writerow(["10"])
    assert main(["--run", str(run), "--out", str(tmp_path / "c.png")]) == 0 and (tmp_path / "c.png").exists()


def _numbers(cells):
    out = []
    for c in cells:
        try:
            out.append(float(str(c).replace(",", "")))
        except ValueError:
            pass
    return out


def test_readme_table_and_charts_come_from_the_same_csvs():
    """Every CSV the README's results table links exists, the first bold figure of each such row is one of the
    CSV's values (at the README's precision), and every chart the README shows is drawn from a CSV it links."""
    import re
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [ln for ln in readme.splitlines() if ln.startswith("|") and "](docs/bench/csv/" in ln]
    assert len(rows) >= 6
    linked = set()
    for row in rows:
        path = ROOT / re.search(r"\]\((docs/bench/csv/[^)]+\.csv)\)", row).group(1)
        assert path.is_file(), path
        linked.add(path.stem)
        bold = re.search(r"\*\*([0-9][0-9,]*(?:\.[0-9]+)?)", row)
        if bold is None:
            continue  # a row of peers only
        text = bold.group(1)
        decimals = len(text.split(".")[1]) if "." in text else 0
        want = float(text.replace(",", ""))
        values = [v for r in csv.reader(open(path, newline="")) for v in _numbers(r)]
        assert any(round(v, decimals) == want for v in values), (path.name, text)
    charts = re.findall(r"!\[[^]]*\]\(docs/bench/([^)]+)\.png\)", readme)
    assert charts and all((ROOT / "docs/bench" / f"{c}.png").is_file() for c in charts)
    assert set(charts) <= linked, set(charts) - linked
