"""`import deep_ep` as kernels_cuda.deep_ep for the length of a test task (tests/distributed/
test_deep_ep_dropin.py, tests/kernels/test_deep_ep_port.py)."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def deep_ep_installed(nvl_peers: int) -> Iterator[Any]:
    """`import deep_ep` gives kernels_cuda.deep_ep, with nodes of `nvl_peers` ranks; undone on exit (pool
    workers run task after task)."""
    import kernels_cuda.deep_ep as deep_ep
    from kernels_cuda.deep_ep import config

    saved = config.NUM_MAX_NVL_PEERS, deep_ep.Buffer.num_sms
    config.NUM_MAX_NVL_PEERS = nvl_peers
    deep_ep.install()
    try:
        yield deep_ep
    finally:
        config.NUM_MAX_NVL_PEERS, deep_ep.Buffer.num_sms = saved
        for name in ("deep_ep", "deep_ep.utils"):
            sys.modules.pop(name, None)
