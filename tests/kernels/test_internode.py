"""Internode (two-hop) kernels: 2x2, 2x4 and 4x2 (nodes x GPUs) ranks of an EmulatedInternodeGroup, and
17, 18 and 20 nodes of one GPU (more than 16, up to kMaxRdmaPeers), against the pure-torch
`hierarchical` backend, bit-exact: dispatch, per-hop record counts and combine,
node-limited and skewed routings (every token to one rank or one node, a rank that receives nothing,
tokens with no expert), tiny rings and chunk 1, cached mode, FP8, num_worst_tokens, a stalled rank.
Each case runs on the CPU emulation under several scheduler seeds and once on CUDA when present."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels_cuda import EmulatedInternodeGroup, InternodeConfig, InternodeHandle
from kernels_cuda import constants as C
from tests.kernels.cases import node_limited_routing, payload, quantize, routing, weights
from tests.kernels.reference import reference_dispatch
from tests.kernels.reference_internode import kernel_hop_rows, run_hierarchical
from tests.kernels.runs import Run, cases
from tests.kernels.traps import internode_stall, internode_worst_tokens_overflow, run_trap

TOPOLOGIES = [(2, 2), (2, 4), (4, 2)]
HIDDEN, TOKENS, TOPK = 256, 48, 4
TIMEOUT_CYCLES = 4_000_000_000  # a hang ends in diagnostics (the emulator finds deadlocks sooner)


def small_config(num_nodes: int) -> InternodeConfig:
    return InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=4 * num_nodes, rdma_chunk=2, rdma_capacity=12)


def _group(nodes: int, gpus: int, run: Run, config: InternodeConfig | None = None) -> EmulatedInternodeGroup:
    config = config or small_config(nodes)
    rdma, nvl = config.buffer_size_hints(nodes, gpus, 4 * HIDDEN, TOPK)  # room for float32 rows too
    return EmulatedInternodeGroup(nodes, gpus, rdma, nvl, config, timeout_cycles=TIMEOUT_CYCLES, timeout_s=20.0,
                                  **run.group_kwargs())


def _routing(kind: str, nodes: int, gpus: int, experts: int, seed: int, device: str,
             tokens: int = TOKENS) -> list[torch.Tensor]:
    print(f"data seed {seed}: routing {kind}, {nodes} x {gpus} ranks, {tokens} tokens each")
    if kind == "node_limited":
        return node_limited_routing(nodes, gpus, tokens, experts, TOPK, max_nodes=2, seed=seed, device=device)
    if kind == "all_to_one_node":  # every token's experts on the last node
        R, per_node = nodes * gpus, experts // nodes
        g = torch.Generator().manual_seed(seed)
        first = experts - per_node
        return [(first + torch.rand(tokens, per_node, generator=g).topk(TOPK, dim=1).indices).to(device)
                for _ in range(R)]
    return routing(kind, nodes * gpus, tokens, experts, TOPK, seed, device=device)


def _check_dispatch(results, topk, xs, ws, experts) -> None:
    ref = reference_dispatch(xs, topk, ws, experts)
    for rank, ((recv_x, idx, w, per_expert, handle), want) in enumerate(zip(results, ref)):
        assert torch.equal(recv_x, want.x), f"rank {rank}: recv_x differs"
        assert torch.equal(handle.recv_src_idx.long(), want.src_idx), f"rank {rank}: source indices differ"
        assert torch.equal(idx, want.topk_idx), f"rank {rank}: recv_topk_idx differs"
        assert torch.equal(w, want.topk_weights), f"rank {rank}: recv_topk_weights differ"
        assert per_expert == want.per_expert, f"rank {rank}: per-expert counts differ"


DISPATCH_CASES = [(nodes, gpus, kind) for nodes, gpus in TOPOLOGIES
                  for kind in ("random", "node_limited", "all_to_one_rank", "all_to_one_node", "rank_receives_nothing")]


def _dispatch_and_combine_match_hierarchical(group, nodes: int, gpus: int, kind: str, tokens: int, hidden: int,
                                             device: str) -> list[InternodeHandle]:
    """Dispatch (rows, top-k, per-expert counts, per-hop record counts) and combine (rows, weights) of every
    rank against the `hierarchical` backend; returns the handles."""
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = _routing(kind, nodes, gpus, E, seed=R + len(kind), device=device, tokens=tokens)
    xs = payload("random", R, tokens, hidden, torch.bfloat16, seed=R, device=device)
    ws = weights(R, tokens, TOPK, seed=R, device=device)
    results = group.dispatch(xs, topk, ws, E)
    ref = run_hierarchical(nodes, gpus, xs, topk, ws, E, lambda rank, recv_x: recv_x)
    hops = kernel_hop_rows(nodes, gpus, [r[4] for r in results])
    for rank, ((recv_x, idx, w, per_expert, _), want, got_rows) in enumerate(zip(results, ref, hops)):
        assert torch.equal(recv_x, want.recv_x), f"rank {rank}: recv_x differs from hierarchical"
        assert torch.equal(idx, want.recv_topk_idx) and torch.equal(w, want.recv_topk_weights), f"rank {rank}: top-k"
        assert per_expert == want.per_expert, f"rank {rank}: per-expert counts"
        assert got_rows == {k: v for k, v in want.rows.items() if v}, f"rank {rank}: per-hop record counts"
    if kind == "node_limited":  # a token costs at most max_nodes RDMA records, whatever its top-k
        for r in results:
            assert int((r[4].send_rdma_head >= 0).sum(1).max()) <= 2
    handles = [r[4] for r in results]

    combined = group.combine([r[0] for r in results], handles, [r[2] for r in results])
    for rank, ((x, cw), want) in enumerate(zip(combined, ref)):
        assert torch.equal(x, want.combined), f"rank {rank}: combine differs from hierarchical"
        valid = topk[rank] >= 0  # each top-k slot is non-zero on exactly one rank
        assert torch.equal(cw[valid], ws[rank][valid]) and bool((cw[~valid] == 0).all()), f"rank {rank}: weights"
    return handles


@pytest.mark.parametrize("case,run", cases(DISPATCH_CASES, 20, family=21))
def test_dispatch_and_combine_match_hierarchical(case, run):
    nodes, gpus, kind = case
    _dispatch_and_combine_match_hierarchical(_group(nodes, gpus, run), nodes, gpus, kind, TOKENS, HIDDEN, run.device)


# More nodes than 16, up to kMaxRdmaPeers (DeepEP's 20): one GPU each (an emulated launch holds at most
# kMaxEmulatedRanks ranks), so every lane, forwarder warp and per-node slot past 16 is used.
MANY_NODES = [(20, "random"), (18, "node_limited"), (20, "all_to_one_node"), (17, "rank_receives_nothing")]
MANY_NODES_TOKENS, MANY_NODES_HIDDEN = 16, 64


@pytest.mark.parametrize("case,run", [p for p in cases(MANY_NODES, 4, family=29, relaxed=1)
                                      if p.values[1].device == "cpu"])  # (the notify grid is sized for the emulation)
def test_more_than_sixteen_nodes_match_hierarchical(case, run):
    nodes, kind = case
    assert nodes <= C.MAX_RDMA_PEERS and nodes > 16
    config = InternodeConfig(num_sms=2, nvl_chunk=1, nvl_capacity=nodes, rdma_chunk=2, rdma_capacity=12)
    rdma, nvl = config.buffer_size_hints(nodes, 1, 2 * MANY_NODES_HIDDEN, TOPK)
    schedule = replace(run.schedule, sm_count=nodes * (1 + nodes))  # the notify grid: 1 + nodes blocks per rank
    group = EmulatedInternodeGroup(nodes, 1, rdma, nvl, config, timeout_cycles=TIMEOUT_CYCLES, timeout_s=20.0,
                                   device=run.device, schedule=schedule)
    handles = _dispatch_and_combine_match_hierarchical(group, nodes, 1, kind, MANY_NODES_TOKENS, MANY_NODES_HIDDEN,
                                                       run.device)
    assert sum(int((h.send_rdma_head[:, 16:] >= 0).sum()) for h in handles) > 0, "no record went past node 15"


@pytest.mark.parametrize("case,run", cases([(2, 2), (4, 2)], 4, family=22))
def test_float32_combine_is_exact_for_integers(case, run):
    nodes, gpus = case
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = routing("random", R, TOKENS, E, TOPK, seed=3, device=run.device)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randint(-8, 8, (TOKENS, HIDDEN), generator=g).float().to(run.device) for _ in range(R)]
    ws = weights(R, TOKENS, TOPK, 3, device=run.device)
    group = _group(nodes, gpus, run)
    results = group.dispatch(xs, topk, ws, E)
    _check_dispatch(results, topk, xs, ws, E)
    ref = run_hierarchical(nodes, gpus, xs, topk, ws, E, lambda rank, recv_x: recv_x)
    for (x, _), want in zip(group.combine([r[0] for r in results], [r[4] for r in results]), ref):
        assert torch.equal(x, want.combined)


@pytest.mark.parametrize("case,run", cases([(2, 4)], 20, family=23))
def test_cached_dispatch_reproduces_the_data(case, run):
    nodes, gpus = case
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = routing("random", R, TOKENS, E, TOPK, seed=11, device=run.device)
    xs = payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=11, device=run.device)
    group = _group(nodes, gpus, run)
    first = group.dispatch(xs, topk, weights(R, TOKENS, TOPK, 11, device=run.device), E)
    group.combine([r[0] for r in first], [r[4] for r in first])  # rewrites the head tables in place
    again = group.dispatch(xs, handles=[r[4] for r in first])
    for a, b in zip(first, again):
        assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("case,run", cases([(4, 2)], 20, family=24))
def test_fp8_payload_and_strided_scales_travel_bit_exactly(case, run):
    nodes, gpus = case
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = routing("random", R, TOKENS, E, TOPK, seed=5, device=run.device)
    quantized = [quantize(x) for x in payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=5, device=run.device)]
    ws = weights(R, TOKENS, TOPK, 5, device=run.device)
    results = _group(nodes, gpus, run).dispatch(quantized, topk, ws, E)
    rows = reference_dispatch([q for q, _ in quantized], topk, ws, E)
    scales = reference_dispatch([s.contiguous() for _, s in quantized], topk, ws, E)
    for (recv, *_), want_rows, want_scales in zip(results, rows, scales):
        assert torch.equal(recv[0].view(torch.uint8), want_rows.x.view(torch.uint8))
        assert torch.equal(recv[1], want_scales.x)


@pytest.mark.parametrize("case,run", cases([(2, 2)], 20, family=25))
def test_num_worst_tokens_pads_without_host_sync_and_combines_the_same(case, run):
    nodes, gpus = case
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = routing("random", R, TOKENS, E, TOPK, seed=17, device=run.device)
    xs = payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=17, device=run.device)
    ws = weights(R, TOKENS, TOPK, 17, device=run.device)
    group = _group(nodes, gpus, run)
    exact = group.dispatch(xs, topk, ws, E)
    worst = TOKENS * R
    padded = group.dispatch(xs, topk, ws, E, num_worst_tokens=worst)
    for a, b in zip(exact, padded):  # before any combine rewrites the head tables
        rows, records = a[0].shape[0], a[4].send_nvl_head.shape[0]
        assert b[0].shape[0] == worst and b[3] == []
        assert torch.equal(a[0], b[0][:rows]) and torch.equal(a[1], b[1][:rows]) and torch.equal(a[2], b[2][:rows])
        assert bool((b[1][rows:] == -1).all()) and bool((b[2][rows:] == 0).all())
        assert torch.equal(a[4].send_nvl_head, b[4].send_nvl_head[:records])
        assert bool((b[4].send_nvl_head[records:] == -1).all())
    want = group.combine([r[0] for r in exact], [r[4] for r in exact], [r[2] for r in exact])
    got = group.combine([r[0] for r in padded], [r[4] for r in padded], [r[2] for r in padded])
    for (x, w), (x_want, w_want) in zip(got, want):
        assert torch.equal(x, x_want) and torch.equal(w, w_want)


TINY_CONFIGS = [InternodeConfig(num_sms=2, nvl_chunk=1, nvl_capacity=2, rdma_chunk=1, rdma_capacity=7),
                InternodeConfig(num_sms=6, nvl_chunk=1, nvl_capacity=4, rdma_chunk=2, rdma_capacity=10),
                InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=4, rdma_chunk=3, rdma_capacity=12)]
TINY = [(config, kind) for config in TINY_CONFIGS
        for kind in ("random", "all_to_one_rank", "all_to_one_node", "rank_receives_nothing", "node_limited")]


@pytest.mark.parametrize("case,run", cases(TINY, 20, family=26))
def test_tiny_rings_and_chunk_one(case, run):
    config, kind = case
    nodes, gpus = 2, 2
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = _routing(kind, nodes, gpus, E, seed=13, device=run.device)
    xs = payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=13, device=run.device)
    ws = weights(R, TOKENS, TOPK, 13, device=run.device)
    group = _group(nodes, gpus, run, config)
    results = group.dispatch(xs, topk, ws, E)
    _check_dispatch(results, topk, xs, ws, E)
    ref = run_hierarchical(nodes, gpus, xs, topk, ws, E, lambda rank, recv_x: recv_x)
    for rank, ((x, _), want) in enumerate(zip(group.combine([r[0] for r in results], [r[4] for r in results]), ref)):
        assert torch.equal(x, want.combined), f"rank {rank}: combine differs from hierarchical"


def test_invalid_config_is_refused_on_the_host():
    run = Run("cpu")
    bad = InternodeConfig(num_sms=2, nvl_chunk=1, nvl_capacity=2, rdma_chunk=4, rdma_capacity=8)
    with pytest.raises(ValueError, match="rdma_capacity must be >="):
        _group(2, 2, run, bad).dispatch(
            payload("random", 4, 8, HIDDEN, torch.bfloat16, 0, device="cpu"),
            routing("random", 4, 8, 16, TOPK, 0, device="cpu"), weights(4, 8, TOPK, 0, device="cpu"), 16)


@pytest.mark.parametrize("config,run", cases([None], 4, family=27))
def test_stalled_rank_ends_in_timeout_diagnostics(config, run):
    record, output = run_trap(internode_stall, run)
    assert record["code"] == 1 and record["role_name"] != "none" and record["rank"] != 1, (record, output)
    assert "kernels_cuda timeout: role=" in output, output


@pytest.mark.parametrize("config,run", cases([None], 4, family=28))
def test_num_worst_tokens_too_small_traps_with_a_record(config, run):
    record, output = run_trap(internode_worst_tokens_overflow, run)
    # All tokens go to rank 3 (node 1, GPU 1), through rank 2's RDMA region (its rail peer of node 0's GPU 0):
    # whichever overflows first records it.
    assert record["code"] == 2 and record["rank"] in (2, 3) and record["tail"] > 32, (record, output)
    assert record["expected"] == 32 and "num_worst_tokens is 32" in output, output
