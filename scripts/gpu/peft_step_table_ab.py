"""#38: A/B in one tree of the tied head's reads of the step's table. ``new``: this tree (the first read after a step
brings the whole table up to date, every chunk is then a view). ``old``: the per-chunk bookkeeping of the tree before
(each chunk's cached rows looked up and written over its view of the table), patched in. Runs bench_peft_vocab's
``ours_capped`` in this process (``--peer``) and prints its ms a step. On the GPU machine, after ``. .device/env.sh``
and ``. scripts/gpu/common.sh``: ``python scripts/gpu/peft_step_table_ab.py old --steps 10 --warmup 2``."""
import json
import sys
import tempfile

import torch

import benchmarks.bench_peft_vocab as bench
from ds_maximus.vocab.sharded_embedding import ShardedEmbedding

ONE_PASS = ShardedEmbedding.rows_for_compute


def per_chunk(self, lo, hi, device=None, dtype=None):
    """The tree before: each chunk's cached rows written over its own view of the step's table."""
    kept = self._step_rows_for(lo, hi, torch.device(device or self.compute_device), dtype or self.out_dtype)
    if kept is None:   # no step table: the same path in both trees
        return ONE_PASS(self, lo, hi, device, dtype)
    self._current_rows_into(kept[0], lo, hi, kept[0].device, kept[0].dtype, kept[1])
    return kept[0]


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "old":
        ShardedEmbedding.rows_for_compute = per_chunk
    elif mode != "new":
        raise SystemExit("usage: peft_step_table_ab.py old|new [bench options]")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        bench.main(["--peer", "ours_capped", "--batch", "4", "--json-out", f.name, *rest])
        res = json.load(open(f.name))
    print(f"step table {mode}: " + (res.get("error") or f"{res['ms']:.1f} ms/step, peak {res.get('peak_gib')} GiB, "
                                    f"losses {[round(x, 4) for x in res.get('losses', [])]}"), flush=True)


if __name__ == "__main__":
    main()
