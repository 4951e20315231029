"""The GPU tests' oracles and inputs, checked on CPU so that a GPU session's failures are the kernels':
tests/kernels/reference.py against the `alltoall` backend, tests/kernels/reference_internode.py's per-hop
counting against a torch model of the two-hop kernels, and tests/kernels/cases.py's routings doing what
their names promise."""
from __future__ import annotations

import pytest
import torch

from parallel.dispatch import AllToAllDispatcher
from parallel.dispatch.fp8 import dequantize_e4m3
from parallel.dispatch.simulated import SimulatedEPGroup
from tests.kernels.cases import node_limited_routing, payload, quantize, routing, weights
from tests.kernels.reference import layouts_of, reference_combine, reference_dispatch
from tests.kernels.reference_internode import kernel_hop_rows, run_hierarchical
from tests.unit.emulated_kernels import internode_group

TOKENS, HIDDEN, TOPK = 24, 64, 4


@pytest.mark.parametrize("kind", ["random", "all_to_one_rank", "rank_receives_nothing"])
def test_reference_dispatch_and_combine_equal_the_alltoall_backend(kind):
    R, E = 4, 16
    topk = routing(kind, R, TOKENS, E, TOPK, seed=3, device="cpu")
    xs = payload("random", R, TOKENS, HIDDEN, torch.float32, seed=3, device="cpu")
    ws = weights(R, TOKENS, TOPK, seed=3, device="cpu")
    ref = reference_dispatch(xs, topk, ws, E)
    ys = [r.x * (1 + rank) for rank, r in enumerate(ref)]  # what experts would send back, per rank

    def step(rank, comms):
        d = AllToAllDispatcher(comms.ep, E, R)
        recv_x, local, recv_w, counts, handle = d.dispatch(xs[rank], topk[rank], ws[rank], d.layout(topk[rank], E))
        return recv_x, local, recv_w, counts, d.combine(ys[rank], handle)

    got = SimulatedEPGroup(R, R).run(step)
    want_combined = reference_combine(ys, ref, [TOKENS] * R)
    for rank, ((recv_x, local, recv_w, counts, combined), want) in enumerate(zip(got, ref)):
        assert torch.equal(recv_x, want.x) and torch.equal(local, want.topk_idx), f"rank {rank}"
        assert torch.equal(recv_w, want.topk_weights) and counts == want.per_expert, f"rank {rank}"
        assert torch.equal(want.src_idx, torch.cat([layouts_of(topk, E)[s].is_token_in_rank[:, rank].nonzero().flatten()
                                                    for s in range(R)]))
        torch.testing.assert_close(combined, want_combined[rank], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (2, 4), (4, 2)])
def test_hop_counts_of_the_two_hop_model_equal_the_hierarchical_counters(nodes, gpus):
    """What tests/kernels/test_internode.py asserts of the kernels' handles holds for a torch model
    of the same protocol, so a mismatch there points at the kernels, not at the counting."""
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = node_limited_routing(nodes, gpus, TOKENS, E, TOPK, max_nodes=2, seed=R, device="cpu")
    xs = payload("random", R, TOKENS, HIDDEN, torch.float32, seed=R, device="cpu")
    ws = weights(R, TOKENS, TOPK, seed=R, device="cpu")
    handles = [r[4] for r in internode_group(nodes, gpus, HIDDEN * 4, TOPK).dispatch(xs, topk, ws, E)]
    ref = run_hierarchical(nodes, gpus, xs, topk, ws, E, lambda rank, recv_x: recv_x)
    for rank, (got, want) in enumerate(zip(kernel_hop_rows(nodes, gpus, handles), ref)):
        assert got == {k: v for k, v in want.rows.items() if v}, f"rank {rank}"


def test_routings_do_what_their_names_say():
    R, E = 4, 16
    local = E // R
    for kind in ("random", "all_to_one_rank", "rank_receives_nothing"):
        for idx in routing(kind, R, 70, E, TOPK, seed=1, device="cpu"):
            assert bool((idx[torch.arange(70) % 7 == 3] == -1).all())  # tokens with no expert
            chosen = idx[idx >= 0]
            assert chosen.numel() > 0
            if kind == "all_to_one_rank":  # the last rank's experts
                assert bool((chosen >= E - local).all())
            if kind == "rank_receives_nothing":
                assert not bool(((chosen >= local) & (chosen < 2 * local)).any())
    nodes, gpus = 4, 2
    per_node = E * 2 // nodes
    for idx in node_limited_routing(nodes, gpus, 70, E * 2, TOPK, max_nodes=2, seed=2, device="cpu"):
        node_of = torch.where(idx >= 0, idx // per_node, -1)
        spans = [len(set(row.tolist()) - {-1}) for row in node_of]
        assert max(spans) == 2 and min(spans) == 0


def test_quantize_gives_column_major_scales_that_dequantize_back():
    x = payload("random", 1, TOKENS, 256, torch.bfloat16, seed=4, device="cpu")[0]
    q, scales = quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (TOKENS, 2) and scales.stride() == (1, TOKENS)
    torch.testing.assert_close(dequantize_e4m3(q, scales, torch.float32), x.float(), rtol=0.07, atol=0.02)
