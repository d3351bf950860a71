"""#38: where the host's time goes in a step of ours at the Gemma-3-4B shape (capped at 16 GiB): cProfile of the
last ``--profiled`` steps of bench_peft_vocab's ours_capped peer, run in this process, sorted by cumulative and by
own time. On the GPU machine, after ``. .device/env.sh`` and ``. scripts/gpu/common.sh``:
``python scripts/gpu/peft_host_profile.py --steps 4 --profiled 2``."""
import argparse
import contextlib
import cProfile
import pstats
import sys

from step_watch import run_watched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profiled", type=int, default=2)
    ap.add_argument("--rows", type=int, default=45, help="functions printed per table")
    ap.add_argument("--callers", default="torch.empty|ynchronize|method 'item'|method 'tolist'|pin_memory",
                    help="regex: who calls the functions it matches (host waits and allocations)")
    a, rest = ap.parse_known_args()
    prof = cProfile.Profile()

    @contextlib.contextmanager
    def profiled():
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
    run_watched("ours_capped", a.steps, a.profiled, rest, around=profiled)
    st = pstats.Stats(prof, stream=sys.stdout)
    st.sort_stats("cumulative").print_stats(a.rows)
    st.sort_stats("tottime").print_stats(a.rows)
    st.print_callers(a.callers)


if __name__ == "__main__":
    main()
