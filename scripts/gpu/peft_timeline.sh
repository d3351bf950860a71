#!/usr/bin/env bash
# #38, one call (~8 min), results in $OUT (pack_out): peft_copies.sh without variants and with the host profile, i.e.
# our row ops built; the vocabulary, engine and PEFT GPU tests; bench_peft_vocab at the Gemma-3-4B shape: ours capped
# at 16 GiB and plain PEFT uncapped, timed over applied steps, each with two more steps under torch.profiler
# (timeline_<peer>.txt: per-stream busy time, the compute stream's idle gaps, the host's annotated ranges and waits);
# a cProfile of two applied steps of ours (host_profile.txt).
VARIANTS=none PROFILE=1 exec bash "$(dirname "$0")/peft_copies.sh" "$@"
