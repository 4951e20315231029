"""The kernels' emulated groups on the CPU emulation, for the unit tests of the code around them (the
`native` dispatcher behind `kernels_cuda.rank_views`, one thread per rank): 2 channels so that a launch
is quick, buffers sized for the widest rows a test sends, and a record of the calls made. The
emulation is built on first use when missing or stale; a machine without a C++ compiler skips."""
from __future__ import annotations

from typing import Any

import pytest

from kernels_cuda import Config, EmulatedGroup, EmulatedInternodeGroup, InternodeConfig, build_cpu

SMS = 4  # 2 channels


def _require_emulation() -> None:
    problem = build_cpu.ensure_built()
    if problem is not None:
        pytest.skip(f"the CPU emulation cannot be built here: {problem}")


class RecordingGroup:
    """An emulated group's list API, recording each call: layout, dispatch, cached_dispatch, combine."""

    def __init__(self, group: Any) -> None:
        self.group, self.num_ranks = group, group.num_ranks
        self.calls: list[str] = []

    def get_dispatch_layout(self, topk_idx, num_experts):
        self.calls.append("layout")
        return self.group.get_dispatch_layout(topk_idx, num_experts)

    def dispatch(self, xs, topk_idx=None, topk_weights=None, num_experts=None, handles=None):
        self.calls.append("dispatch" if handles is None else "cached_dispatch")
        return self.group.dispatch(xs, topk_idx, topk_weights, num_experts, handles)

    def combine(self, ys, handles, topk_weights=None):
        self.calls.append("combine")
        return self.group.combine(ys, handles, topk_weights)


def intranode_group(num_ranks: int, max_hidden_bytes: int, num_topk: int) -> RecordingGroup:
    """`EmulatedGroup` of `num_ranks` on the CPU, for rows of up to `max_hidden_bytes`."""
    _require_emulation()
    config = Config(num_sms=SMS)
    return RecordingGroup(EmulatedGroup(num_ranks, config.buffer_size_hint(num_ranks, max_hidden_bytes, num_topk),
                                        config, device="cpu"))


def internode_group(num_nodes: int, gpus_per_node: int, max_hidden_bytes: int, num_topk: int) -> RecordingGroup:
    """`EmulatedInternodeGroup` of `num_nodes` x `gpus_per_node` on the CPU, for rows of up to `max_hidden_bytes`."""
    _require_emulation()
    config = InternodeConfig.for_nodes(num_nodes, num_sms=SMS)
    rdma, nvl = config.buffer_size_hints(num_nodes, gpus_per_node, max_hidden_bytes, num_topk)
    return RecordingGroup(EmulatedInternodeGroup(num_nodes, gpus_per_node, rdma, nvl, config, device="cpu"))
