"""The low-latency reference over gloo processes (ProcessGroupComm: the send is an asynchronous
all-to-all, the hook waits for it), checked on every rank against the oracle of
tests/unit/test_low_latency.py, in hook mode and synchronously."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.dispatch.comm import ProcessGroupComm
from parallel.dispatch.low_latency import LowLatencyExchange
from tests.unit.test_low_latency import E, H, R, T_MAX, check_dispatch, combined_oracle, expert_outputs, routing


def hooked_round_trip(seed: int) -> bool:
    rank = dist.get_rank()
    print(f"rank {rank}: seed {seed}")
    inputs = [routing(seed, r, 4 + 2 * r) for r in range(R)]
    ll = LowLatencyExchange(ProcessGroupComm(dist.group.WORLD))
    x, idx, w = inputs[rank]
    stats = torch.zeros(E // R, dtype=torch.int32)
    recv_x, count, handle, _, hook = ll.low_latency_dispatch(x, idx, T_MAX, E, stats, use_fp8=False,
                                                             return_recv_hook=True)
    hook()
    check_dispatch(rank, inputs, recv_x, count, handle, stats, False, False, False)
    combined, _, _ = ll.low_latency_combine(expert_outputs(recv_x, handle, rank, False), idx, w, handle)
    torch.testing.assert_close(combined.float(), combined_oracle(x, idx, w).float(), rtol=1e-2, atol=1e-2)
    return True


def test_low_latency_over_processes(pools):
    assert pools.get(R).run(hooked_round_trip, 13, deadline_s=120) == [True] * R
