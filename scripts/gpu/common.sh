# Sourced by the GPU scripts beside it (`. "$(dirname "$0")/common.sh"`): the repository root as the working
# folder, $OUT (default ./bench_out) for what comes back, and the environment every GPU run shares: our op
# builds for sm_90 (the image's 9.0a crashes DeepSpeed 0.19.8's builder), DeepSpeed on CUDA, benchmark CSVs
# into $OUT, the project importable, and no NVLink multicast (the host's rule: see the device tool's KINDS.md).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
export MAXIMUS_BENCH_OUT="$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The older tree's op builds ($OLD, before_after.sh): ours' folder by default, since the trees' op names differ (give
# it a folder of its own for a tree whose ops share our names but not our sources).
export OLD_EXT="${OLD_EXT:-$TORCH_EXTENSIONS_DIR}"

# build_ops NAME...: build ops before any time-limited step, one process each (a JIT build is mostly
# single-threaded; a killed one leaves torch's lock behind: BUILD_S, 300 s, only guards a hung build), and wait
# for them all. Names: cuda, cpu (maximus_row_ops), expert (maximus_expert_cpu), nvme (maximus_nvme_loader), ds
# (DeepSpeed's CPU and fused Adam, async_io where it can), old ($OLD's own op, into $OLD_EXT). Logs:
# $OUT/build_<name>.log.
build_ops() {
  local name code pids=()
  for name in "$@"; do
    case "$name" in
      cuda|cpu) code="from ds_maximus.ops import row_ops as o; print('row_ops $name', o.load_op('$name') is not None)" ;;
      expert) code="from ds_maximus.ops import expert_cpu as o; print('expert_cpu', o.load_op() is not None)" ;;
      nvme) code="from ds_maximus.ops import nvme_loader as o; print('nvme_loader', o.nvme_loader_available())" ;;
      ds) code="from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
from deepspeed.ops.op_builder.async_io import AsyncIOBuilder as A
CPUAdamBuilder().load(); FusedAdamBuilder().load()
print('ds adams built, async_io', A().is_compatible(verbose=False) and A().load(verbose=False) is not None)" ;;
      old) code="from ds_maximus.ops import sharded_embedding as o
print('old op', o.load_op('cuda') is not None, o.load_op('cpu') is not None)" ;;
      *) echo "build_ops: unknown op $name" >&2; return 2 ;;
    esac
    if [ "$name" = old ]; then
      (cd "$OLD" && PYTHONPATH="$OLD:/tmp/site" TORCH_EXTENSIONS_DIR="$OLD_EXT" timeout "${BUILD_S:-300}" python -u -c "$code") \
        > "$OUT/build_$name.log" 2>&1 &
    else
      timeout "${BUILD_S:-300}" python -u -c "$code" > "$OUT/build_$name.log" 2>&1 &
    fi
    pids+=($!)
  done
  wait "${pids[@]}"
  tail -qn1 "$OUT"/build_*.log
}

# tied_gpu_tests LOG: the tied-head and staged tier-step GPU tests (test_lm_head.py, test_sharded_embedding_gpu.py)
# within TEST_S seconds (default 150), with -rA into LOG; prints the summary lines and the failures in full, returns
# pytest's status. Run it in another tree from a subshell: (cd "$PREV" && PYTHONPATH=... tied_gpu_tests LOG).
tied_gpu_tests() {
  local log=$1 rc
  timeout "${TEST_S:-150}" python -m pytest -q -rA -p no:cacheprovider -m gpu tests/vocab/test_lm_head.py \
    tests/vocab/test_sharded_embedding_gpu.py -k "tied or staged_tier_update or written_while or overlapping" \
    > "$log" 2>&1
  rc=$?
  echo "tied gpu tests ($PWD) rc=$rc"; grep -E "^(FAILED|ERROR)|passed|failed" "$log" | tail -30
  grep -A40 "^_____" "$log" | head -100
  return $rc
}

# slim_traces: each bench trace under $OUT (trace_<peer>.json.gz, too large to bring back) replaced by its slim form
# (slim_<peer>.json.gz: benchmarks.trace_timeline --slim, read here with the same tool)
slim_traces() {
  local f p
  for f in "$OUT"/trace_*.json.gz; do
    [ -e "$f" ] || continue
    p=$(basename "$f" .json.gz); timeout 60 python -m benchmarks.trace_timeline "$f" --slim "$OUT/slim_${p#trace_}.json.gz"
    rm -f "$f"
  done
}

# pack_out: everything under $OUT into one $OUT/results.tgz (the device tool returns at most 8 files; a script that
# writes more calls this last, inside its own time limit, so a cut run still returns what it wrote; a second call, as
# after a script that packed already, leaves the one archive as it is)
pack_out() {
  local tmp
  if [ "$(ls -A "$OUT")" = results.tgz ]; then ls -la "$OUT"; return 0; fi
  tmp=$(mktemp /tmp/results.XXXXXX.tgz)
  tar czf "$tmp" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$tmp" "$OUT/results.tgz"
  ls -la "$OUT"
}
