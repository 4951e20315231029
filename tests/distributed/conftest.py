"""Session-wide worker pools for the gloo tests; see tests/distributed/pool.py for how to use them."""
import pytest

from tests.distributed.pool import PoolSet


@pytest.fixture(scope="session")
def pools():
    pool_set = PoolSet()
    yield pool_set
    pool_set.close()


@pytest.fixture(scope="session")
def kernels_cpu():
    """The CPU emulation of kernels_cuda, built (or rebuilt when stale) once per session for the tests
    that run the real kernels in worker processes; skipped with the reason where it cannot be built."""
    import kernels_cuda
    from kernels_cuda import build_cpu

    problem = build_cpu.ensure_built()
    if problem is not None:
        pytest.skip(f"the CPU emulation cannot be built here: {problem}")
    if not kernels_cuda.is_built("cpu"):
        pytest.skip(kernels_cuda.build_status())
