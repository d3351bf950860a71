#!/usr/bin/env bash
# One GPU call: MoE offload GPU tests + quick decode bench (staged guesses), then the sharded embedding
# at steady state (bench without the DeepSpeed peers + profile with a trace). About 5 min on an H200.
set -x
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export MAXIMUS_BENCH_OUT="$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# our CUDA op builds while the MoE GPU tests run (they need no custom op)
python -u -c "from ds_maximus.ops import sharded_embedding as o; assert o.load_op('cuda') is not None; print('op built')" \
  > "$OUT/op_build.log" 2>&1 &
build=$!
timeout 150 python -m pytest -q -m gpu tests/moe/test_offload_gpu.py -x > "$OUT/moe_gpu_tests.log" 2>&1
echo "moe gpu tests rc=$?"; tail -3 "$OUT/moe_gpu_tests.log"
wait $build; echo "build rc=$?"; tail -2 "$OUT/op_build.log"
timeout 120 python -u -m benchmarks.bench_moe_offload --quick --tokens 64 --budget-s 110 --out "$OUT/moe_offload.md" \
  > "$OUT/moe_offload_bench.log" 2>&1
echo "moe bench rc=$?"; grep -v -i warning "$OUT/moe_offload_bench.log" | tail -14
timeout 110 python -u -m benchmarks.bench_sharded_embedding --no-deepspeed --budget-s 100 --out "$OUT/sharded_embedding.md" \
  > "$OUT/sharded_embedding_bench.log" 2>&1
echo "emb bench rc=$?"; tail -12 "$OUT/sharded_embedding_bench.log"
timeout 90 python -u -m benchmarks.profile_sharded_embedding --out "$OUT/emb_profile.txt" --trace "$OUT/emb_trace.json" \
  > "$OUT/emb_profile.log" 2>&1
echo "profile rc=$?"; head -12 "$OUT/emb_profile.txt"
python -m benchmarks.trace_timeline "$OUT/emb_trace.json" --bucket-ms 2 > "$OUT/emb_timeline.txt" 2>&1
head -40 "$OUT/emb_timeline.txt"
gzip -f "$OUT/emb_trace.json"
