"""scripts/gpu/mixtral_32l_offload.py at tiny dims on the CPU: the meta-built model with CPU experts offloads
into the pieced CPU tier and generates the same greedy tokens as before offload."""
import json

from ds_maximus.partition import host_memory as hm
from tests.helpers import scripts


def load_script():
    return scripts.load_script("scripts/gpu/mixtral_32l_offload.py")


def test_tiny_run_offloads_in_pieces_and_generates_the_same_tokens(tmp_path, monkeypatch):
    script = load_script()
    shape = script.TINY
    expert_bytes = 3 * shape["hidden"] * shape["ffn"] * 4  # fp32 on the CPU
    monkeypatch.setattr(hm, "PIECE_BYTES", 2 * expert_bytes)  # 2 experts a piece
    out = tmp_path / "fig.json"
    fig = script.main(["--tiny", "--check", "--tokens", "6", "--prompt-len", "5", "--device", "cpu",
                       "--out", str(out)])
    assert fig["tokens_equal_before_offload"] is True
    n = shape["layers"] * shape["experts"]
    assert fig["pieces"] == n // 2 and fig["expert_table_gb"] == round(n * expert_bytes / 1e9, 2)
    # the tiny offload can take under 5 ms, which the script's two-decimal figures print as 0.0
    assert fig["setup_s"] >= fig["offload_s"] >= 0 and fig["tokens_per_s"] > 0
    assert json.loads(out.read_text())["new_tokens"] == 6


def test_the_default_shape_is_mixtral_8x7b():
    s = load_script().MIXTRAL_8X7B
    assert (s["layers"], s["hidden"], s["ffn"], s["experts"], s["top_k"]) == (32, 4096, 14336, 8, 2)
    assert s["layers"] * s["experts"] * 3 * s["hidden"] * s["ffn"] * 2 > 90e9  # the 90 GB expert table
