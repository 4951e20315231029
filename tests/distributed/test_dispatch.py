"""Dispatch backends on gloo with simulated nodes, checked DeepEP-style against local references.

Every rank regenerates every rank's inputs from one seed, so the references (who receives what,
in which order, counts, bytes per link) are computed on each rank with plain loops; gradients
and MoE outputs are compared with the single-process LocalDispatcher / MoE.
"""
import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from model.args import ModelArgs
from model.dispatcher import LocalDispatcher
from model.moe import MoE
from parallel.dispatch import (
    COMBINE,
    DISPATCH,
    INTER_NODE,
    INTRA_NODE,
    DispatcherUnavailable,
    make_dispatcher,
)
from parallel.topology import GROUP_KINDS, build_topology, group_ranks
from tests.distributed.pool import WorkerError

TIMEOUT_S = 30
BACKENDS = ("alltoall", "hierarchical")
TOKENS, HIDDEN, EXPERTS, TOPK = 48, 256, 32, 6
NODE_LAYOUTS = [(4, 2), (8, 2)]  # (world size = EP size, ranks per node): 2 and 4 simulated nodes


def kept_nodes(nodes: int) -> int:
    """Nodes a token may reach in the test routing (DeepEP's node-limited recipe keeps half here)."""
    return max(1, nodes // 2)


def routed_inputs(seed: int, rank: int, ranks: int, per_node: int, experts: int, hidden: int,
                  topk: int = TOPK, drop: bool = True):
    """DeepEP's node-limited test routing, rank-encoded x, random weights; optional empty slots."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    nodes = ranks // per_node
    scores = torch.randn(TOKENS, experts, generator=gen).abs() + 1
    kept = scores.view(TOKENS, nodes, -1).amax(-1).topk(kept_nodes(nodes), dim=-1).indices
    node_mask = torch.zeros(TOKENS, nodes, dtype=torch.bool).scatter_(1, kept, True)
    scores = scores.view(TOKENS, nodes, -1).masked_fill(~node_mask.unsqueeze(-1), 0).view(TOKENS, experts)
    topk_idx = scores.topk(topk, dim=-1).indices
    if drop:
        topk_idx = topk_idx.masked_fill(torch.rand(TOKENS, topk, generator=gen) < 0.1, -1)
        topk_idx[0] = -1  # a token routed nowhere
    x = torch.randn(TOKENS, hidden, generator=gen)
    x[:, 0], x[:, 1] = rank, torch.arange(TOKENS)  # rank-encoded: source rank and token id
    return x, topk_idx, torch.rand(TOKENS, topk, generator=gen)


def expected_receive(inputs, rank: int, experts_per_rank: int):
    """Rows rank `rank` must receive: by source rank, then token; local ids, -1 and 0 elsewhere."""
    rows, ids, weights = [], [], []
    for x, topk_idx, topk_weights in inputs:
        for t, (row_ids, row_weights) in enumerate(zip(topk_idx.tolist(), topk_weights.tolist())):
            local = [e - rank * experts_per_rank if e >= 0 and e // experts_per_rank == rank else -1 for e in row_ids]
            if max(local) >= 0:
                rows.append(x[t])
                ids.append(local)
                weights.append([w if i >= 0 else 0.0 for w, i in zip(row_weights, local)])
    return torch.stack(rows), torch.tensor(ids), torch.tensor(weights)


def destination_ranks(topk_idx: torch.Tensor, experts_per_rank: int) -> list[set[int]]:
    return [{e // experts_per_rank for e in row if e >= 0} for row in topk_idx.tolist()]


def check_layout(layout, topk_idx, dests, ranks: int, per_node: int) -> None:
    in_rank = torch.tensor([[r in d for r in range(ranks)] for d in dests])
    assert torch.equal(layout.is_token_in_rank, in_rank)
    assert layout.num_tokens_per_rank.tolist() == [sum(r in d for d in dests) for r in range(ranks)]
    assert layout.num_tokens_per_node.tolist() == [sum(any(r // per_node == n for r in d) for d in dests)
                                                   for n in range(ranks // per_node)]
    assert layout.num_tokens_per_expert.tolist() == [(topk_idx == e).sum().item() for e in range(EXPERTS)]


def expected_rows(inputs, rank: int, per_node: int, experts_per_rank: int) -> dict:
    """Rows this rank sends per (backend, direction, link) during one dispatch + combine."""
    node, local = divmod(rank, per_node)
    dests = [destination_ranks(t, experts_per_rank) for _, t, _ in inputs]
    mine = dests[rank]
    rows = {("alltoall", DISPATCH, INTER_NODE): sum(r // per_node != node for d in mine for r in d),
            ("alltoall", DISPATCH, INTRA_NODE): sum(r // per_node == node and r != rank for d in mine for r in d),
            ("hierarchical", DISPATCH, INTER_NODE): sum(len({r // per_node for r in d} - {node}) for d in mine)}
    rail_sources = [s for s in range(len(inputs)) if s % per_node == local]
    # as forwarder: fan out what the rail peers (and this rank itself) sent to this node
    rows["hierarchical", DISPATCH, INTRA_NODE] = sum(
        r // per_node == node and r != rank for s in rail_sources for d in dests[s] for r in d)
    # combine: one partial sum per (token, node) back to each remote source on the rail
    rows["hierarchical", COMBINE, INTER_NODE] = sum(
        any(r // per_node == node for r in d) for s in rail_sources if s != rank for d in dests[s])
    rows["alltoall", COMBINE, INTER_NODE] = sum(
        rank in d for s in range(len(inputs)) if s // per_node != node for d in dests[s])
    return rows


def check_dispatch_contract(seed: int, per_node: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = build_topology(1, world, per_node, TIMEOUT_S)
    try:
        lists = group_ranks(world, 1, world, per_node)
        for kind in GROUP_KINDS:
            assert dist.get_process_group_ranks(topology.group(kind)) == lists.containing(kind, rank), kind
        per_rank = EXPERTS // world
        inputs = [routed_inputs(seed, r, world, per_node, EXPERTS, HIDDEN) for r in range(world)]
        x, topk_idx, weights = inputs[rank]
        dests = destination_ranks(topk_idx, per_rank)
        want_x, want_idx, want_w = expected_receive(inputs, rank, per_rank)
        want_counts = [sum((t == rank * per_rank + e).sum().item() for _, t, _ in inputs) for e in range(per_rank)]
        want_combined = x * torch.tensor([float(len(d)) for d in dests]).unsqueeze(1)
        want_rows = expected_rows(inputs, rank, per_node, per_rank)
        results = {}
        for name in BACKENDS:
            dispatcher = make_dispatcher(name, topology, EXPERTS)
            layout = dispatcher.layout(topk_idx, EXPERTS)
            check_layout(layout, topk_idx, dests, world, per_node)
            recv_x, recv_idx, recv_w, counts, handle = dispatcher.dispatch(x, topk_idx, weights, layout)
            assert torch.equal(recv_x, want_x) and torch.equal(recv_idx, want_idx) and torch.equal(recv_w, want_w)
            order = (recv_x[:, 0] * TOKENS + recv_x[:, 1]).tolist()
            assert order == sorted(order) and len(set(order)) == len(order)
            assert counts == want_counts
            combined = dispatcher.combine(recv_x, handle)
            assert torch.allclose(combined, want_combined, rtol=1e-6, atol=0)
            record_bytes = {DISPATCH: HIDDEN * 4 + TOPK * 8, COMBINE: HIDDEN * 4}  # x, ids and weights / y
            for (backend, direction, link), expected in want_rows.items():
                if backend == name:
                    got = (dispatcher.traffic.rows[direction, link], dispatcher.traffic.bytes[direction, link])
                    assert got == (expected, expected * record_bytes[direction]), (name, direction, link, got, expected)
            results[name] = (recv_x, recv_idx, recv_w, counts, combined)
            check_fp8(name, topology, x, topk_idx, weights, layout, want_x, want_idx, want_w, want_combined,
                      want_rows[name, DISPATCH, INTER_NODE])
        # node-limited routing: the counters (checked equal to want_rows) show <= kept nodes per token
        assert want_rows["hierarchical", DISPATCH, INTER_NODE] <= kept_nodes(world // per_node) * TOKENS
        flat, hierarchical = results["alltoall"], results["hierarchical"]
        assert all(torch.equal(a, b) for a, b in zip(flat[:3], hierarchical[:3])) and flat[3] == hierarchical[3]
        assert torch.allclose(flat[4], hierarchical[4], rtol=1e-6, atol=0)
    finally:
        topology.destroy_groups()


def check_fp8(name, topology, x, topk_idx, weights, layout, want_x, want_idx, want_w, want_combined,
              inter_rows: int) -> None:
    """e4m3 payload with a power-of-two scale per 128 channels (DeepSeek-V3's dispatch: at most twice
    amax / 448): per-element error within half an e4m3 step at that scale."""
    dispatcher = make_dispatcher(name, topology, EXPERTS, fp8=True)
    recv_x, recv_idx, recv_w, _, handle = dispatcher.dispatch(x, topk_idx, weights, layout)
    assert torch.equal(recv_idx, want_idx) and torch.equal(recv_w, want_w)
    blocks = want_x.view(want_x.shape[0], -1, 128)
    scale = 2 * blocks.abs().amax(-1, keepdim=True) / 448  # the power-of-two scale is below twice amax / 448
    error = (recv_x - want_x).view_as(blocks).abs()
    assert (error <= blocks.abs() / 16 + scale / 1024 + 1e-7).all()
    assert dispatcher.traffic.bytes[DISPATCH, INTER_NODE] == inter_rows * (HIDDEN + HIDDEN // 128 * 4 + TOPK * 8)
    combined = dispatcher.combine(recv_x, handle)
    assert torch.allclose(combined, want_combined, rtol=1 / 16, atol=2e-3)


@pytest.mark.parametrize("world,per_node", NODE_LAYOUTS, ids=["4ranks-2nodes", "8ranks-4nodes"])
def test_dispatch_contract(pools, world, per_node):
    pools.get(world).run(check_dispatch_contract, random.randrange(1 << 20), per_node)


def expert_compute(x, local_idx, weights, expert_weights):
    """sum_k w_k * tanh(x W_k) over the slots whose expert is local: a stand-in for the experts."""
    out = torch.zeros_like(x)
    for k in range(local_idx.shape[1]):
        valid = local_idx[:, k] >= 0
        h = torch.tanh(torch.einsum("nh,nhd->nd", x[valid], expert_weights[local_idx[valid, k]]))
        out = out.index_add(0, valid.nonzero().squeeze(1), h * weights[valid, k:k + 1])
    return out


def run_expert_step(dispatcher, expert_weights, x0, topk_idx, w0, grad_out, experts):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    layout = dispatcher.layout(topk_idx, experts)
    recv_x, recv_idx, recv_w, _, handle = dispatcher.dispatch(x, topk_idx, w, layout)
    out = dispatcher.combine(expert_compute(recv_x, recv_idx, recv_w, expert_weights), handle)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad, w.grad


def check_autograd(seed: int, per_node: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = build_topology(1, world, per_node, TIMEOUT_S)
    try:
        experts, hidden = 16, 32
        x, topk_idx, weights = routed_inputs(seed, rank, world, per_node, experts, hidden, topk=4, drop=False)
        gen = torch.Generator().manual_seed(seed)
        expert_weights = torch.randn(experts, hidden, hidden, generator=gen) / hidden ** 0.5
        grad_out = torch.randn(TOKENS, hidden, generator=torch.Generator().manual_seed(seed + rank + 1))
        want = run_expert_step(LocalDispatcher(), expert_weights, x, topk_idx, weights, grad_out, experts)
        for name in BACKENDS:
            dispatcher = make_dispatcher(name, topology, experts)
            local = dispatcher.local_experts(experts)
            got = run_expert_step(dispatcher, expert_weights[local.start:local.stop], x, topk_idx, weights,
                                  grad_out, experts)
            for label, a, b in zip(("output", "grad x", "grad topk_weights"), got, want):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{name}: {label}"
            assert dispatcher.traffic.rows[COMBINE, INTER_NODE] > 0  # the weight gradients did travel back
            # each top-k slot is live on exactly one destination rank, so its weight's gradient is 1
            w = weights.clone().requires_grad_()
            recv_w = dispatcher.dispatch(x, topk_idx, w, dispatcher.layout(topk_idx, experts))[2]
            recv_w.sum().backward()
            assert torch.equal(w.grad, torch.ones_like(w)), f"{name}: weight slots"
    finally:
        topology.destroy_groups()


@pytest.mark.parametrize("world,per_node", NODE_LAYOUTS, ids=["4ranks-2nodes", "8ranks-4nodes"])
def test_gradients_match_local_dispatcher(pools, world, per_node):
    pools.get(world).run(check_autograd, random.randrange(1 << 20), per_node)


def moe_args(nodes: int) -> ModelArgs:
    return ModelArgs(hidden_size=32, num_moe_experts=16, moe_ffn_hidden_size=16,
                     moe_shared_expert_intermediate_size=16, moe_router_topk=4, moe_router_num_groups=nodes,
                     moe_router_group_topk=1, moe_aux_loss_coeff=1e-2)


def moe_batch(seed: int, rank: int):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(2, 6, 32, generator=gen), torch.randn(2, 6, 32, generator=gen)


def check_moe_block(seed: int, ep: int, per_node: int) -> None:
    """MoE with experts split over the EP group == one-process MoE; expert grads summed over the group."""
    rank = dist.get_rank()
    topology = build_topology(1, ep, per_node, TIMEOUT_S)
    try:
        args = moe_args(ep // per_node)
        torch.manual_seed(seed)
        reference = MoE(args)
        reference.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
        x, grad_out = moe_batch(seed, rank)
        x_ref = x.clone().requires_grad_()
        out_ref = reference(x_ref, aux_grad_scale=1.0)
        (out_ref * grad_out).sum().backward()
        own_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if not n.startswith("experts.")}
        for source in topology.ranks("ep"):
            if source != rank:
                other_x, other_grad = moe_batch(seed, source)
                (reference(other_x, aux_grad_scale=1.0) * other_grad).sum().backward()
        for name in BACKENDS:
            dispatcher = make_dispatcher(name, topology, args.num_moe_experts)
            local = dispatcher.local_experts(args.num_moe_experts)
            moe = MoE(args, dispatcher)
            moe.load_state_dict({k: v[local.start:local.stop] if k.startswith("experts.") else v
                                 for k, v in reference.state_dict().items()})
            x_dist = x.clone().requires_grad_()
            out = moe(x_dist, aux_grad_scale=1.0)
            (out * grad_out).sum().backward()
            assert torch.allclose(out, out_ref, rtol=1e-5, atol=1e-6), f"{name}: output"
            assert torch.allclose(x_dist.grad, x_ref.grad, rtol=1e-5, atol=1e-6), f"{name}: grad x"
            for param_name, param in moe.named_parameters():
                ref = reference.get_parameter(param_name).grad
                want = ref[local.start:local.stop] if param_name.startswith("experts.") else own_grads[param_name]
                assert torch.allclose(param.grad, want, rtol=1e-5, atol=1e-6), f"{name}: grad {param_name}"
    finally:
        topology.destroy_groups()


@pytest.mark.parametrize("world,ep,per_node", [(4, 4, 2), (8, 4, 2)], ids=["ep4-2nodes", "dp8-ep4-2nodes"])
def test_moe_block_matches_single_process(pools, world, ep, per_node):
    pools.get(world).run(check_moe_block, random.randrange(1 << 20), ep, per_node)


def test_unavailable_and_misused_backends_say_why():
    with pytest.raises(DispatcherUnavailable, match="kernels_cuda for cuda is not built"):
        make_dispatcher("native", None, 8)
    with pytest.raises(DispatcherUnavailable, match="deep_ep package is not installed"):
        make_dispatcher("deepep", None, 8)
    with pytest.raises(ValueError, match="unknown dispatcher 'nccl'"):
        make_dispatcher("nccl", None, 8)
    with pytest.raises(ValueError, match="needs a topology"):
        make_dispatcher("hierarchical", None, 8)
    assert make_dispatcher("local", None, 8).local_experts(8) == range(8)


def fail_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"planned failure on rank {bad_rank}")
    return dist.get_rank()


def wait_for_absent_peer() -> None:
    """Rank 0 waits in a collective that rank 1 never joins: the group timeout must end it."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    try:
        if dist.get_rank() == 0:
            dist.barrier(group=group)
        elif dist.get_rank() == 1:
            time.sleep(1.5)  # keeps its end of the group open past rank 0's timeout
    finally:
        if dist.get_rank() in (0, 1):
            dist.destroy_process_group(group)


def sleep_on_rank(sleeper: int, seconds: float) -> None:
    if dist.get_rank() == sleeper:
        time.sleep(seconds)


def test_pool_reports_failing_rank_with_traceback(pools):
    pool = pools.get(4)
    with pytest.raises(WorkerError) as info:
        pool.run(fail_on_rank, 2)
    message = str(info.value)
    assert "rank(s) [2]" in message and "planned failure on rank 2" in message and "Traceback" in message
    # a failed task may have broken the gloo group, so the pool is replaced by a fresh one
    with pytest.raises(RuntimeError, match="torn down"):
        pool.run(fail_on_rank, -1)
    assert pools.get(4).run(fail_on_rank, -1) == [0, 1, 2, 3]
    with pytest.raises(WorkerError, match=r"(?s)rank\(s\) \[0\].*[Tt]imed? ?out"):
        pools.get(4).run(wait_for_absent_peer)


def test_pool_deadline_tears_down_and_restarts(pools):
    assert pools.get(4).run(fail_on_rank, -1) == [0, 1, 2, 3]  # started: the deadline below times the task only
    with pytest.raises(WorkerError, match=r"ranks \[3\] did not finish"):
        pools.get(4).run(sleep_on_rank, 3, 60, deadline_s=5)
    assert pools.get(4).run(fail_on_rank, -1) == [0, 1, 2, 3]
