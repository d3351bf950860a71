"""Shard modes in combination, under the ``deepspeed`` launcher on CPU ranks (gloo): 2 ranks equal 1 rank with
the same global batch (tiny Llama, fp32, exact AdamW, clipping on) for partitioned, broadcast and replicated, with
tied and untied heads, gradient accumulation 1 and 4, ZeRO-1/2/3, and a Mixtral whose experts train as partitions
beside a partitioned table; exact prefetch in partitioned mode; checkpoints moving between rank counts; the LM
head streamed from its CPU tier (``lm_head.placement: cpu``) beside every mode; PEFT models (LoRA, both tables in
``modules_to_save``, or one tied copy) in every mode, whose ``save_peft`` adapter holds the trained tables.

CI runs one launch of 2 ranks (many configurations in sequence: start-up costs more than their steps on 2
cores) and the 1-rank references in this process; every combination of mode x head x accumulation x stage, and
4 ranks, are ``slow``. The 1-rank reference is the replicated mode (one plain ``ShardedEmbedding``).
"""
import itertools
import json
from pathlib import Path

import pytest
import torch

from tests.distributed.ranks import launch

WORKER = Path(__file__).parent / "combo_worker.py"
STEPS, BATCH, SAVE_AT = 5, 8, 3

pytestmark = pytest.mark.distributed


def cfg(key, mode, stage, gas, tie=False, **kw):
    return {"key": key, "mode": mode, "stage": stage, "gas": gas, "tie": tie, "steps": STEPS, "batch": BATCH, **kw}


# every mode with tied and untied heads, accumulation 1 and 4, and every ZeRO stage 1-3 at least once
CI_COMBOS = [
    cfg("partitioned_tied_gas1_z2", "partitioned", 2, 1, True, save_at=SAVE_AT),
    cfg("partitioned_gas4_z1", "partitioned", 1, 4, cache_rows=64),
    cfg("partitioned_gas4_z1_prefetch", "partitioned", 1, 4, cache_rows=64, prefetch=True),
    cfg("broadcast_tied_gas4_z1", "broadcast", 1, 4, True),
    cfg("broadcast_gas1_z3", "broadcast", 3, 1),
    cfg("replicated_tied_gas4_z3", "replicated", 3, 4, True),
    cfg("replicated_gas1_z2", "replicated", 2, 1),
    cfg("moe_partitioned_gas1_z2", "partitioned", 2, 1, model="mixtral"),
    cfg("partitioned_streamed_head_gas1_z2", "partitioned", 2, 1, head="streamed"),
    cfg("partitioned_peft_gas4_z1", "partitioned", 1, 4, peft=True),
    cfg("broadcast_peft_gas1_z3", "broadcast", 3, 1, peft=True),
]
MODES = ("partitioned", "broadcast", "replicated")


def ref_key(c):
    return (c.get("model", "llama"), c["stage"], c["gas"], bool(c.get("tie")), c.get("head"), bool(c.get("peft")))


def head_of(c):
    """The head's class and placement: a tied head reads the swapped table; a streamed one its CPU tier."""
    if c["tie"]:
        return "ShardedLMHead", "tied"
    return ("ShardedLMHead", "cpu") if c.get("head") == "streamed" else ("Linear", None)


PEFT_EMB, PEFT_HEAD = "base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"


def check_adapter(got, c):
    """``save_peft``'s adapter (written on 2 ranks) holds the trained tables whole and the trained LoRA weights."""
    saved = got["adapter"]
    torch.testing.assert_close(saved[PEFT_EMB], got["embedding"], rtol=0, atol=0)
    head = got["embedding"] if c["tie"] else got["dense"]["lm_head.weight" if c.get("head") == "streamed" else
                                                          "base_model.model.lm_head.modules_to_save.default.weight"]
    torch.testing.assert_close(saved[PEFT_HEAD], head, rtol=0, atol=0)
    lora = [n for n in got["dense"] if ".lora_" in n]
    assert len(lora) == 12, lora   # A and B of 3 projections in 2 layers
    for n in lora:
        torch.testing.assert_close(saved[n.replace(".default.", ".")], got["dense"][n], rtol=0, atol=0)


def run_refs(combos, tmp):
    """1-rank references (replicated) in this process, one per (model, stage, gas, tie)."""
    from tests.distributed.combo_worker import run_config
    refs = {}
    for c in combos:
        k = ref_key(c)
        if k not in refs:
            refs[k] = run_config({**c, "mode": "replicated", "prefetch": False, "save_at": 0}, 0, 1)
    return refs


def close(got, ref, start=0):
    """Losses rtol 1e-5; weights as in tests/engine: 99.5% of elements within 1e-5, all within 1e-2 (ranks sum a
    row's gradient in another order than one rank; Adam's 1/sqrt(v) amplifies that where it nearly cancels)."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][start:]), rtol=1e-5, atol=1e-6)
    pairs = [(got["embedding"], ref["embedding"])] + [(got["dense"][n], ref["dense"][n]) for n in ref["dense"]]
    for g, r in pairs:
        diff = (g - r).abs()
        assert float((diff > 1e-5).float().mean()) < 5e-3, float((diff > 1e-5).float().mean())
        assert float(diff.max()) < 1e-2, float(diff.max())


def write_spec(tmp, name, spec):
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec, default=str))
    return path


@pytest.fixture(scope="module")
def ci(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("combos")
    from tests.distributed.combo_worker import run_config
    base = cfg("", "replicated", 0, 1)
    # 1 rank writes a checkpoint in every mode (ZeRO-0: any world size may load it)
    one = {m: run_config({**base, "key": m, "mode": m, "save_at": SAVE_AT, "save_dir": str(tmp / f"one_{m}")}, 0, 1)
           for m in MODES}
    spec = list(CI_COMBOS)
    spec[0] = {**spec[0], "save_dir": str(tmp / "two_z2")}
    # 2 ranks save a partitioned checkpoint at ZeRO-0 (for 2 -> 1; the other modes' 2 -> 1 are in the slow test)
    spec.append({**base, "key": "save_partitioned", "mode": "partitioned", "save_at": SAVE_AT,
                 "save_dir": str(tmp / "two_partitioned")})
    for m in MODES:  # and resume 1 rank's checkpoints (1 -> 2)
        src = "partitioned" if m == "partitioned" else "replicated"
        spec.append({**base, "key": f"resume_{m}", "mode": m, "resume_dir": str(tmp / f"one_{src}"),
                     "resume_tag": f"step{SAVE_AT}"})
    # a replicated checkpoint resumed in the partitioned mode
    spec.append({**base, "key": "resume_replicated_as_partitioned", "mode": "partitioned",
                 "resume_dir": str(tmp / "one_replicated"), "resume_tag": f"step{SAVE_AT}"})
    launch(2, WORKER, "--spec", write_spec(tmp, "two", spec), "--out", tmp / "two.pt")
    two = torch.load(tmp / "two.pt", weights_only=False)
    refs = run_refs(CI_COMBOS + [base], tmp)
    back = run_config({**base, "key": "back", "mode": "partitioned", "resume_dir": str(tmp / "two_partitioned"),
                       "resume_tag": f"step{SAVE_AT}"}, 0, 1)
    z2 = run_config({**CI_COMBOS[0], "resume_dir": str(tmp / "two_z2"), "resume_tag": f"step{SAVE_AT}",
                     "expect_error": True, "save_at": 0}, 0, 1)
    as_replicated = run_config({**base, "key": "as_replicated", "resume_dir": str(tmp / "two_partitioned"),
                                "resume_tag": f"step{SAVE_AT}", "expect_error": True}, 0, 1)
    broadcast_as_replicated = run_config({**base, "key": "broadcast_as_replicated", "resume_tag": f"step{SAVE_AT}",
                                          "resume_dir": str(tmp / "one_broadcast"), "expect_error": True}, 0, 1)
    return {"two": two, "refs": refs, "one": one, "back": back, "z2": z2, "base": base,
            "as_replicated": as_replicated, "broadcast_as_replicated": broadcast_as_replicated}


@pytest.mark.parametrize("key", [c["key"] for c in CI_COMBOS])
def test_two_ranks_equal_one(ci, key):
    c = next(c for c in CI_COMBOS if c["key"] == key)
    got = ci["two"][key]
    assert got["steps"] == STEPS and len(got["losses"]) == STEPS
    assert got["type"] == {"partitioned": "PartitionedEmbedding", "broadcast": "BroadcastEmbedding",
                           "replicated": "ShardedEmbedding"}[c["mode"]]
    assert (got["head"], got["head_placement"]) == head_of(c)
    close(got, ci["refs"][ref_key(c)])


@pytest.mark.parametrize("key", [c["key"] for c in CI_COMBOS if c.get("peft")])
def test_peft_adapter_saved_on_two_ranks_holds_the_trained_tables(ci, key):
    check_adapter(ci["two"][key], next(c for c in CI_COMBOS if c["key"] == key))


@pytest.mark.parametrize("key", [c["key"] for c in CI_COMBOS if c["mode"] == "broadcast"])
def test_broadcast_table_is_held_by_the_master_only(ci, key):
    """The master (rank 0) holds the table (tier, cache, optimizer state); rank 1 holds no rows and counts the
    collectives that brought it its rows (bytes, ms; per step too)."""
    from tests.engine.llama_utils import VOCAB
    got = ci["two"][key]
    master, other = (r["table_bytes"] for r in got["per_rank"])
    assert master >= VOCAB * 32 * 4 * 3 and other == 0, got["per_rank"]
    st = got["stats"]
    assert st["bytes_recv"] > 0 and st["comm_ms"] > 0 and st["last_step"]["collectives"] > 0


def test_moe_experts_trained_as_partitions_beside_a_partitioned_table(ci):
    got = ci["two"]["moe_partitioned_gas1_z2"]
    assert any(k.startswith("experts.") for k in got["dense"])  # compared with the 1-rank experts above


def test_partitioned_prefetch_changes_no_result_and_raises_owner_hit_rate(ci):
    off, on = ci["two"]["partitioned_gas4_z1"], ci["two"]["partitioned_gas4_z1_prefetch"]
    torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(on["embedding"], off["embedding"], rtol=1e-5, atol=1e-6)
    assert on["stats"]["prefetches"] == STEPS * 4 - 1 and off["stats"]["prefetches"] == 0
    for r, (a, b) in enumerate(zip(off["per_rank"], on["per_rank"])):
        # every batch after the first was staged at its owners before the forward asked for it
        assert b["owner_hit_rate"] > a["owner_hit_rate"], (r, a, b)
        assert b["owner_hit_rate"] > 0.9, (r, b)
        assert b["stall_ms"] >= 0 and b["owner_serve_ms"] > 0
    assert on["stats"]["last_step"]["owner_rows_asked"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_moves_from_one_rank_to_two(ci, mode):
    got, ref = ci["two"][f"resume_{mode}"], ci["refs"][ref_key(ci["base"])]
    assert got["start"] == SAVE_AT and got["steps"] == STEPS
    close(got, ref, start=SAVE_AT)


def test_partitioned_checkpoint_moves_from_two_ranks_to_one(ci):
    ref = ci["refs"][ref_key(ci["base"])]
    close(ci["two"]["save_partitioned"], ref)  # the ZeRO-0 run equals one rank too
    got = ci["back"]
    assert got["start"] == SAVE_AT and got["steps"] == STEPS
    close(got, ref, start=SAVE_AT)


def test_replicated_checkpoint_resumes_partitioned(ci):
    close(ci["two"]["resume_replicated_as_partitioned"], ci["refs"][ref_key(ci["base"])], start=SAVE_AT)


def test_partitioned_checkpoint_in_replicated_mode_is_a_typed_error(ci):
    got = ci["as_replicated"]
    assert got["error"] == "ShardStoreError", got
    assert "saved in the partitioned shard mode" in got["message"] and "shard_mode 'partitioned'" in got["message"]


def test_broadcast_checkpoint_in_replicated_mode_is_a_typed_error(ci):
    got = ci["broadcast_as_replicated"]
    assert got["error"] == "DistributedError" and "MaximusError" in got["mro"], got
    assert "saved in the broadcast shard mode" in got["message"], got["message"]
    assert "'broadcast' or 'partitioned'" in got["message"], got["message"]


def test_one_rank_broadcast_equals_one_plain_table(ci):
    close(ci["one"]["broadcast"], ci["refs"][ref_key(ci["base"])])


def test_one_rank_partitioned_equals_one_plain_table(ci):
    close(ci["one"]["partitioned"], ci["refs"][ref_key(ci["base"])])


def test_zero2_checkpoint_on_another_world_size_is_a_typed_error(ci):
    got = ci["z2"]
    assert got["error"] == "DistributedError" and "MaximusError" in got["mro"], got
    msg = got["message"]
    assert "written by 2 data-parallel ranks and this run has 1" in msg and "ZeRO stage 2" in msg, msg
    assert "fix: resume with 2 ranks" in msg and "ZeRO stage 0" in msg, msg


# -- slow: every combination on 2 ranks, a subset on 4 ---------------------------------------------------------
ALL_COMBOS = [cfg(f"{m}_{'tied' if t else 'untied'}_gas{g}_z{z}", m, z, g, t)
              for m, t, g, z in itertools.product(MODES, (False, True), (1, 4), (1, 2, 3))]
FOUR_COMBOS = [cfg("partitioned_tied_z2", "partitioned", 2, 1, True),
               cfg("partitioned_gas2_z3", "partitioned", 3, 2),
               cfg("broadcast_tied_z1", "broadcast", 1, 1, True),
               cfg("replicated_gas2_z2", "replicated", 2, 2),
               cfg("moe_partitioned_z2", "partitioned", 2, 1, model="mixtral")]


@pytest.mark.slow
def test_every_combination_on_two_ranks_and_a_subset_on_four(tmp_path):
    base = cfg("", "replicated", 0, 1)
    spec4 = list(FOUR_COMBOS)
    for m in MODES:  # 2 -> 4: the 2-rank run saves at ZeRO-0 (after its combinations), the 4-rank run resumes
        spec4.append({**base, "key": f"resume_{m}", "mode": m, "resume_dir": str(tmp_path / f"two_{m}"),
                      "resume_tag": f"step{SAVE_AT}"})
    spec2 = ALL_COMBOS + [{**base, "key": f"save_{m}", "mode": m, "save_at": SAVE_AT,
                           "save_dir": str(tmp_path / f"two_{m}")} for m in MODES]
    launch(2, WORKER, "--spec", write_spec(tmp_path, "two", spec2), "--out", tmp_path / "two.pt", timeout=1800)
    launch(4, WORKER, "--spec", write_spec(tmp_path, "four", spec4), "--out", tmp_path / "four.pt", timeout=1200)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    four = torch.load(tmp_path / "four.pt", weights_only=False)
    refs = run_refs(ALL_COMBOS + FOUR_COMBOS + [base], tmp_path)
    from tests.distributed.combo_worker import run_config
    back = {m: run_config({**base, "key": m, "mode": m, "resume_dir": str(tmp_path / f"two_{m}"),
                           "resume_tag": f"step{SAVE_AT}"}, 0, 1) for m in MODES}
    failed = []
    for got, combos in ((two, ALL_COMBOS), (four, FOUR_COMBOS)):
        for c in combos:
            try:
                close(got[c["key"]], refs[ref_key(c)])
            except AssertionError as e:
                failed.append(f"{c['key']}: {e}")
    for m in MODES:
        for what, got, start in (("saved on 2", two[f"save_{m}"], 0), ("2 -> 4", four[f"resume_{m}"], SAVE_AT),
                                 ("2 -> 1", back[m], SAVE_AT)):
            try:
                close(got, refs[ref_key(base)], start=start)
            except AssertionError as e:
                failed.append(f"{m} {what}: {e}")
    assert not failed, "\n".join(failed)


# -- slow: the streamed head and PEFT in every mode ------------------------------------------------------------
HEAD_PEFT_COMBOS = (
    [cfg(f"{m}_streamed_head_{'tied' if t else 'untied'}_gas{g}_z{z}", m, z, g, t, head="streamed")
     for m in MODES for t in (False, True) for g, z in ((1, 1), (4, 3))]
    + [cfg(f"{m}_peft_{'tied' if t else 'untied'}_gas{g}_z{z}", m, z, g, t, peft=True)
       for m in MODES for t in (False, True) for g, z in ((1, 2), (4, 3))]
    + [cfg(f"{m}_peft_streamed_head_gas4_z2", m, 2, 4, peft=True, head="streamed") for m in MODES])


# saved on 2 ranks at ZeRO-0 and resumed on 1 in the same mode (2 -> 1)
HEAD_PEFT_SAVES = [cfg(f"save_{m}_{k}", m, 0, 1, save_at=SAVE_AT, **kw) for m in ("partitioned", "broadcast")
                   for k, kw in (("streamed_head", {"head": "streamed"}), ("peft", {"peft": True}))]


@pytest.mark.slow
def test_streamed_head_and_peft_in_every_mode(tmp_path):
    saves = [{**c, "save_dir": str(tmp_path / c["key"])} for c in HEAD_PEFT_SAVES]
    launch(2, WORKER, "--spec", write_spec(tmp_path, "two", HEAD_PEFT_COMBOS + saves), "--out", tmp_path / "two.pt",
           timeout=1800)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    refs = run_refs(HEAD_PEFT_COMBOS + HEAD_PEFT_SAVES, tmp_path)
    from tests.distributed.combo_worker import run_config
    failed = []
    for c in saves:
        back = run_config({**c, "save_at": 0, "resume_dir": c["save_dir"], "resume_tag": f"step{SAVE_AT}"}, 0, 1)
        for what, got, start in (("saved on 2", two[c["key"]], 0), ("2 -> 1", back, SAVE_AT)):
            try:
                assert got["start"] == start and got["steps"] == STEPS, (got["start"], got["steps"])
                close(got, refs[ref_key(c)], start=start)
            except AssertionError as e:
                failed.append(f"{c['key']} {what}: {e}")
    for c in HEAD_PEFT_COMBOS:
        got = two[c["key"]]
        try:
            assert (got["head"], got["head_placement"]) == head_of(c), (got["head"], got["head_placement"])
            close(got, refs[ref_key(c)])
            if c.get("peft"):
                check_adapter(got, c)
        except AssertionError as e:
            failed.append(f"{c['key']}: {e}")
    assert not failed, "\n".join(failed)
