"""The emulated groups make every call a DeepEP user makes (issue 30, item 11), against the references:
per-node counts from `get_dispatch_layouts`, a fresh dispatch without top-k on given layouts (no layout
recomputed), the low-latency region of `EmulatedInternodeGroup`, `clean_low_latency_buffer` and
`destroy`; under the suite's schedules, relaxed memory included (tests/kernels/runs.py)."""
from __future__ import annotations

import pytest
import torch

from kernels_cuda import Buffer, Config, EmulatedGroup, EmulatedInternodeGroup, InternodeConfig
from parallel.dispatch.layout import compute_layout
from tests.kernels.cases import payload, routing
from tests.kernels.reference import reference_dispatch
from tests.kernels.runs import Run, cases
from tests.kernels.test_low_latency import (E_PER_RANK, FP8_MODES, H, T_MAX, _reference, assert_same, expert_outputs,
                                            inputs_for)

HIDDEN, TOKENS, TOPK = 128, 24, 3
TIMEOUT_CYCLES = 4_000_000_000


def _group(nodes: int, gpus: int, run: Run, low_latency: bool = False):
    ll = Buffer.get_low_latency_rdma_size_hint(T_MAX, H, nodes * gpus, E_PER_RANK * nodes * gpus) if low_latency else 0
    if nodes == 1:
        config = Config(num_sms=4, num_max_send_tokens=4, num_max_recv_tokens=16)
        return EmulatedGroup(gpus, config.buffer_size_hint(gpus, 2 * H, 8), config, timeout_cycles=TIMEOUT_CYCLES,
                             num_rdma_bytes=ll, **run.group_kwargs())
    config = InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=4 * nodes, rdma_chunk=2, rdma_capacity=12)
    rdma, nvl = config.buffer_size_hints(nodes, gpus, 2 * H, 8)
    return EmulatedInternodeGroup(nodes, gpus, max(rdma, ll), nvl, config, timeout_cycles=TIMEOUT_CYCLES,
                                  low_latency_mode=low_latency, **run.group_kwargs())


@pytest.mark.parametrize("layout,run", cases([(1, 4), (2, 2)], 2, family=51, relaxed=1))
def test_layouts_with_node_counts_and_a_dispatch_without_topk(layout, run):
    nodes, gpus = layout
    R, E = nodes * gpus, 2 * nodes * gpus
    print(f"data seed {51 + R}: {nodes} x {gpus}")
    topk = routing("random", R, TOKENS, E, TOPK, seed=51 + R, device=run.device)
    xs = payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=51 + R, device=run.device)
    group = _group(nodes, gpus, run)
    layouts = group.get_dispatch_layouts(topk, E)
    for (per_rank, per_node, per_expert, in_rank), idx in zip(layouts, topk):
        want = compute_layout(idx, E, R, gpus)
        assert torch.equal(per_rank.long(), want.num_tokens_per_rank.long()) and torch.equal(in_rank, want.is_token_in_rank)
        assert torch.equal(per_expert.long(), want.num_tokens_per_expert.long())
        assert per_node is None if nodes == 1 else torch.equal(per_node.long(), want.num_tokens_per_node.long())
    received = group.dispatch(xs, layouts=layouts)  # no top-k: rows only, on the layouts given
    for rank, ((recv_x, recv_idx, recv_w, per_expert, _), want) in enumerate(
            zip(received, reference_dispatch(xs, topk, [torch.ones(TOKENS, TOPK)] * R, E))):
        assert torch.equal(recv_x, want.x), f"rank {rank}: rows"
        assert recv_idx is None and recv_w is None
    group.destroy()
    with pytest.raises((RuntimeError, AttributeError)):
        group.dispatch(xs, layouts=layouts)


@pytest.mark.parametrize("mode,run", cases(["bf16", "ue8m0"], 2, family=52, relaxed=1))
def test_internode_group_low_latency_calls_match_the_reference(mode, run):
    nodes, gpus = 2, 2
    R, fp8 = nodes * gpus, FP8_MODES[mode]
    group = _group(nodes, gpus, run, low_latency=True)
    inputs = inputs_for("random", R, 53)
    want = _reference(inputs, fp8)
    stats = [torch.zeros(E_PER_RANK, dtype=torch.int32) for _ in range(R)]
    got = group.low_latency_dispatch([x for x, _, _ in inputs], [idx for _, idx, _ in inputs], T_MAX, E_PER_RANK * R,
                                     stats, *fp8)
    assert_same(got, stats, want, R)
    combined = group.low_latency_combine([expert_outputs(g[0], r, fp8) for r, g in enumerate(got)],
                                         [idx for _, idx, _ in inputs], [w for _, _, w in inputs], [g[2] for g in got])
    for rank, ((out, _, _), (_, _, expect)) in enumerate(zip(combined, want)):
        assert torch.equal(out, expect), f"rank {rank}: combine"
    group.clean_low_latency_buffer()
    again = group.low_latency_dispatch([x for x, _, _ in inputs], [idx for _, idx, _ in inputs], T_MAX,
                                       E_PER_RANK * R, None, *fp8)
    for (a, count_a, *_), (b, count_b, *_) in zip(again, got):
        assert torch.equal(count_a, count_b)
    group.destroy()
    with pytest.raises(RuntimeError, match="low-latency"):
        group.low_latency_dispatch([x for x, _, _ in inputs], [idx for _, idx, _ in inputs], T_MAX, E_PER_RANK * R)
