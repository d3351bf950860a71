"""``torch_threads(n)``: torch's intra-op thread count is ``n`` inside the block (tiny matmuls that would stall on
OpenMP barriers on a busy 2-core machine; comparisons whose BLAS rounding depends on the thread count)."""
import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
