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
