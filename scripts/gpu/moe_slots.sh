#!/usr/bin/env bash
# #37, one H200 call (~6 min): int4 at the 32-layer Mixtral shape, GPU capped at 16 GiB, batch-1 decode, with 3
# slots a layer (the cap's default reserve) and with 4 (--reserve-gib 1.0). With 3 slots the decode moves ~4.0 GB a
# token (a link floor of ~13.7 tokens/s, docs/bench/moe_offload.md); a fourth slot cuts that to ~3.2 GB. Each
# setting runs twice in its process (--prefetch-top-k 1,1: a fresh offload each), because the first offloaded run of
# a process took 1.4-1.6x the ms a token of the next ones at 24 layers. Tables: $OUT/slots3.md, $OUT/slots4.md.
# Run as `timeout 575 bash scripts/gpu/moe_slots.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
build_ops cuda expert
PEERS=full,int4 EXTRA="--tokens ${TOKENS:-64} --agree-tokens ${AGREE:-64} --prefetch-top-k 1,1" \
  TOTAL_S="${TOTAL_S3:-270}" bash scripts/gpu/moe_scale.sh > "$OUT/slots3.out" 2>&1
cp "$OUT/moe_scale_mixtral.md" "$OUT/slots3.md"; grep "^| " "$OUT/slots3.md"
PEERS=int4 EXTRA="--tokens ${TOKENS:-64} --agree-tokens 16 --reserve-gib 1.0 --prefetch-top-k 1,1" \
  TOTAL_S="${TOTAL_S4:-240}" bash scripts/gpu/moe_scale.sh > "$OUT/slots4.out" 2>&1
cp "$OUT/moe_scale_mixtral.md" "$OUT/slots4.md"; grep "^| ours" "$OUT/slots4.md"
