"""benchmarks.trace_timeline on a synthetic chrome trace: busy time, bytes and rate per copy direction, and the time
two copying streams overlapped (how session 16 found the MoE step's link directions taking turns)."""
from benchmarks.trace_timeline import gaps, phases, timeline


def _copy(name, ts, dur, tid, nbytes):
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {"bytes": nbytes}}


def test_copy_rates_and_overlap_of_two_streams():
    h2d, d2h = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"
    events = [_copy(h2d, 0, 1000, 7, 50_000_000), _copy(h2d, 3000, 1000, 7, 50_000_000),  # 2 ms busy, 100 MB
              _copy(d2h, 500, 1000, 8, 40_000_000), _copy(d2h, 3500, 2000, 8, 60_000_000),  # 3 ms, 100 MB
              {"ph": "X", "cat": "kernel", "name": "k", "ts": 1600, "dur": 400, "tid": 9}]
    text = timeline(events, bucket_ms=1.0)
    assert "span 5.5 ms, 5 GPU events" in text
    assert "0.10 GB at 50.0 GB/s" in text and "0.10 GB at 33.3 GB/s" in text
    assert "streams 8 and 7: both busy 1.0 ms" in text  # 0.5 + 0.5 ms of the two pairs' overlap
    assert "stream 9: busy 0.4 ms (kernel 0.4)" in text and "streams 9" not in text  # no copies: not paired


def test_gaps_of_the_compute_stream_and_what_ran_meanwhile():
    def k(name, ts, dur, tid=9):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid}
    events = [k("a", 0, 1000), k("b", 1000, 500), k("c", 4500, 1000), k("d", 5700, 300),  # gaps 3.0 and 0.2 ms
              k("side", 9000, 5, tid=3),  # less kernel time: not the compute stream
              _copy("Memcpy HtoD (Pinned -> Device)", 2000, 2000, 7, 1)]            # 2 ms inside the 3 ms gap
    text = gaps(events, min_ms=0.5)
    assert "compute stream 9: 6.0 ms from its first to its last op, 1 gaps over 0.5 ms, 3.0 ms idle" in text
    assert "1.5 +   3.0 ms  after 'b' before 'c'  others busy ms 7:2.0" in text


def test_phases_list_host_ranges_and_long_waits_with_the_compute_streams_use():
    def k(ts, dur):
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "tid": 9}
    events = [k(0, 1000), k(3000, 1000),
              {"ph": "X", "cat": "user_annotation", "name": "bench.step", "ts": 0, "dur": 4000, "tid": 1},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1000, "dur": 2000, "tid": 1},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 3000, "dur": 10, "tid": 1}]
    text = phases(events, min_ms=1.0)
    assert "     0.0      4.0 ms  gpu  50%  user_annotat bench.step" in text
    assert "     1.0      2.0 ms  gpu   0%  cuda_runtime cudaStreamSynchronize" in text
    assert "cudaLaunchKernel" not in text  # shorter than min_ms
