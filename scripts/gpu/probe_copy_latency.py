"""#38: how long a small device-to-host read (``.item()``, a lookup's ids) waits while big copies run in both link
directions on side streams, as during the tied table's step; for several sizes of the big copies' pieces. On the GPU
machine, after ``. .device/env.sh``: ``python scripts/gpu/probe_copy_latency.py``."""
import statistics
import time

import torch


def main() -> None:
    dev = torch.device("cuda")
    total = 3 << 30
    host_in = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    d_in = torch.empty(total, dtype=torch.uint8, device=dev)
    d_out = torch.empty(total, dtype=torch.uint8, device=dev)
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()
    hi = torch.cuda.Stream(priority=-1)
    scalar = torch.ones((), device=dev)
    ids = torch.arange(8192, device=dev)
    pinned_ids = torch.empty(8192, dtype=torch.long, pin_memory=True)

    def reads(stream, n=12):
        out = []
        with torch.cuda.stream(stream):
            for k in range(n):
                t0 = time.perf_counter()
                if k % 2:
                    float(scalar)
                else:
                    pinned_ids.copy_(ids, non_blocking=True)
                    stream.synchronize()
                out.append((time.perf_counter() - t0) * 1e3)
                time.sleep(0.002)
        return out

    torch.cuda.synchronize()
    print(f"idle link: small read ms median {statistics.median(reads(torch.cuda.current_stream())):.3f}")
    for piece_mb in (168, 32, 8, 2):
        for name, stream in (("default", torch.cuda.current_stream()), ("high-priority", hi)):
            piece = piece_mb << 20
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for lo in range(0, total, piece):
                with torch.cuda.stream(s_in):
                    d_in[lo:lo + piece].copy_(host_in[lo:lo + piece], non_blocking=True)
                with torch.cuda.stream(s_out):
                    host_out[lo:lo + piece].copy_(d_out[lo:lo + piece], non_blocking=True)
            queued = (time.perf_counter() - t0) * 1e3
            lat = reads(stream)
            s_in.synchronize()
            s_out.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            print(f"pieces {piece_mb:4d} MB, reads on the {name:13} stream: queued in {queued:6.1f} ms, "
                  f"3 GiB each way in {wall:6.1f} ms ({2 * total / wall / 1e6:5.1f} GB/s both ways), small read ms "
                  f"median {statistics.median(lat):6.2f} max {max(lat):6.2f}")


if __name__ == "__main__":
    main()
