"""Session-wide worker pools for the gloo tests; see tests/distributed/pool.py for how to use them."""
import pytest

from tests.distributed.pool import PoolSet


@pytest.fixture(scope="session")
def pools():
    pool_set = PoolSet()
    yield pool_set
    pool_set.close()
