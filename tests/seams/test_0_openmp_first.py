"""Runs first in tests/seams (file order): OpenMP regions on two threads in the test process, as any earlier
multi-threaded test of the suite leaves them. With ranks forked from the test process, every seam group after
this hung in its first GEMM (libgomp's pool does not survive fork); _seam_groups starts them from a forkserver.
"""

import torch


def test_openmp_regions_on_two_threads_before_the_seam_groups():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(384, 384, dtype=torch.bfloat16)
        x = torch.randn(256, 256, dtype=torch.float32)
        assert torch.isfinite((a @ a).float()).all() and torch.isfinite(x @ x).all()
    finally:
        torch.set_num_threads(threads)
