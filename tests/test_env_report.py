"""``python -m ds_maximus.env_report``: the op table holds only op rows; what the builders print comes after it."""
from ds_maximus import env_report


def test_builder_warnings_print_after_the_op_table(capsys):
    assert env_report.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("op ") and "status" in ln))
    rows = []
    for ln in lines[head + 1:]:
        if ln.startswith("-" * 20):
            break
        rows.append(ln)
    names = {b.name for b in env_report.builders()}
    assert sorted(ln.split()[0] for ln in rows) == sorted(names), rows  # one row per op, nothing else
    assert not any("WARNING" in ln or "\x1b[" in ln for ln in rows)
    incompatible = [ln for ln in rows if ln.split()[1] == "incompatible"]
    if incompatible:  # a CPU-only torch: the CUDA op's warning comes after the table, without colour codes
        tail = lines[head + 1 + len(rows):]
        assert "warnings:" in tail
        assert any("[WARNING]" in ln and "needs a CUDA build" in ln for ln in tail), tail
