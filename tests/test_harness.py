from benchmarks.harness import Bench


def test_table_has_conditions_and_ratios(tmp_path):
    b = Bench("unit", dtype="fp32", sizes={"V": 10})
    b.add("fast", 1.0, 0.5, hit_rate=0.9)
    b.add("slow", 4.0, 1.0)
    b.add("broken", None, error="OOM")
    text = b.table(baseline="slow")
    assert "dtype: fp32" in text and "V=10" in text and "commit:" in text
    assert "| fast | 1.00 | 0.50 | 4.00x | 0.9 |" in text
    assert "| broken | OOM |" in text
    assert b.write_csv(tmp_path).read_text().count("\n") == 4
