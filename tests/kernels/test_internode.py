"""Internode (two-hop) kernels on one GPU: 2x2, 2x4 and 4x2 (nodes x GPUs) emulated ranks against the
pure-torch `hierarchical` backend: bit-exact dispatch, per-hop record counts, combine within
tolerance, node-limited and skewed routings, tiny rings, cached mode, FP8, a stalled rank."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels_cuda import EmulatedInternodeGroup, InternodeConfig
from tests.kernels.cases import node_limited_routing, payload, quantize, routing, weights
from tests.kernels.reference import reference_dispatch
from tests.kernels.reference_internode import kernel_hop_rows, run_hierarchical

TOPOLOGIES = [(2, 2), (2, 4), (4, 2)]
HIDDEN, TOKENS, TOPK = 512, 96, 4
TIMEOUT_CYCLES = 4_000_000_000  # ~2 s: a hang fails fast with diagnostics


def small_config(num_nodes: int) -> InternodeConfig:
    return InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=4 * num_nodes, rdma_chunk=2, rdma_capacity=12)


def _group(nodes: int, gpus: int, config: InternodeConfig | None = None) -> EmulatedInternodeGroup:
    config = config or small_config(nodes)
    rdma, nvl = config.buffer_size_hints(nodes, gpus, 4 * HIDDEN, TOPK)  # room for float32 rows too
    return EmulatedInternodeGroup(nodes, gpus, rdma, nvl, config, timeout_cycles=TIMEOUT_CYCLES, timeout_s=20.0)


def _routing(kind: str, nodes: int, gpus: int, experts: int, seed: int) -> list[torch.Tensor]:
    if kind == "node_limited":
        return node_limited_routing(nodes, gpus, TOKENS, experts, TOPK, max_nodes=2, seed=seed)
    return routing(kind, nodes * gpus, TOKENS, experts, TOPK, seed)


def _check_dispatch(results, topk, xs, ws, experts) -> None:
    ref = reference_dispatch(xs, topk, ws, experts)
    for rank, ((recv_x, idx, w, per_expert, handle), want) in enumerate(zip(results, ref)):
        assert torch.equal(recv_x, want.x), f"rank {rank}: recv_x differs"
        assert torch.equal(handle.recv_src_idx.long(), want.src_idx), f"rank {rank}: source indices differ"
        assert torch.equal(idx, want.topk_idx), f"rank {rank}: recv_topk_idx differs"
        assert torch.equal(w, want.topk_weights), f"rank {rank}: recv_topk_weights differ"
        assert per_expert == want.per_expert, f"rank {rank}: per-expert counts differ"


@pytest.mark.parametrize("nodes,gpus", TOPOLOGIES)
@pytest.mark.parametrize("kind", ["random", "node_limited", "all_to_one_rank", "rank_receives_nothing"])
def test_dispatch_and_combine_match_hierarchical(nodes, gpus, kind):
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = _routing(kind, nodes, gpus, E, seed=R + len(kind))
    xs = payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=R)
    ws = weights(R, TOKENS, TOPK, seed=R)
    group = _group(nodes, gpus)
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

    combined = group.combine([r[0] for r in results], [r[4] for r in results], [r[2] for r in results])
    for rank, ((x, cw), want) in enumerate(zip(combined, ref)):
        torch.testing.assert_close(x.float(), want.combined.float(), rtol=2e-2, atol=2e-2, msg=f"rank {rank}: combine")
        valid = topk[rank] >= 0  # each top-k slot is non-zero on exactly one rank
        torch.testing.assert_close(cw[valid], ws[rank][valid])


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (4, 2)])
def test_float32_combine_is_exact_for_integers(nodes, gpus):
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = routing("random", R, TOKENS, E, TOPK, seed=3)
    xs = [torch.randint(-8, 8, (TOKENS, HIDDEN), device="cuda").float() for _ in range(R)]
    ws = weights(R, TOKENS, TOPK, 3)
    group = _group(nodes, gpus)
    results = group.dispatch(xs, topk, ws, E)
    _check_dispatch(results, topk, xs, ws, E)
    ref = run_hierarchical(nodes, gpus, xs, topk, ws, E, lambda rank, recv_x: recv_x)
    for (x, _), want in zip(group.combine([r[0] for r in results], [r[4] for r in results]), ref):
        assert torch.equal(x, want.combined)


def test_cached_dispatch_reproduces_the_data():
    nodes, gpus = 2, 4
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = routing("random", R, TOKENS, E, TOPK, seed=11)
    xs = payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=11)
    group = _group(nodes, gpus)
    first = group.dispatch(xs, topk, weights(R, TOKENS, TOPK, 11), E)
    group.combine([r[0] for r in first], [r[4] for r in first])  # rewrites the head tables in place
    again = group.dispatch(xs, handles=[r[4] for r in first])
    for a, b in zip(first, again):
        assert torch.equal(a[0], b[0])


def test_fp8_payload_and_strided_scales_travel_bit_exactly():
    nodes, gpus = 4, 2
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = routing("random", R, TOKENS, E, TOPK, seed=5)
    quantized = [quantize(x) for x in payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=5)]
    ws = weights(R, TOKENS, TOPK, 5)
    results = _group(nodes, gpus).dispatch(quantized, topk, ws, E)
    rows = reference_dispatch([q for q, _ in quantized], topk, ws, E)
    scales = reference_dispatch([s.contiguous() for _, s in quantized], topk, ws, E)
    for (recv, *_), want_rows, want_scales in zip(results, rows, scales):
        assert torch.equal(recv[0].view(torch.uint8), want_rows.x.view(torch.uint8))
        assert torch.equal(recv[1], want_scales.x)


def test_num_worst_tokens_pads_without_host_sync_and_combines_the_same():
    nodes, gpus = 2, 2
    R, E = nodes * gpus, 4 * nodes * gpus
    topk = routing("random", R, TOKENS, E, TOPK, seed=17)
    xs = payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=17)
    ws = weights(R, TOKENS, TOPK, 17)
    group = _group(nodes, gpus)
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


@pytest.mark.parametrize("config", [
    InternodeConfig(num_sms=2, nvl_chunk=1, nvl_capacity=2, rdma_chunk=1, rdma_capacity=7),
    InternodeConfig(num_sms=6, nvl_chunk=1, nvl_capacity=4, rdma_chunk=2, rdma_capacity=10),
    InternodeConfig(num_sms=4, nvl_chunk=2, nvl_capacity=4, rdma_chunk=3, rdma_capacity=12),
])
def test_tiny_rings_and_chunk_one(config):
    nodes, gpus = 2, 2
    R, E = nodes * gpus, 4 * nodes * gpus
    for kind in ("random", "all_to_one_rank", "rank_receives_nothing", "node_limited"):
        topk = _routing(kind, nodes, gpus, E, seed=13)
        xs = payload("random", R, TOKENS, HIDDEN, torch.bfloat16, seed=13)
        ws = weights(R, TOKENS, TOPK, 13)
        group = _group(nodes, gpus, config)
        results = group.dispatch(xs, topk, ws, E)
        _check_dispatch(results, topk, xs, ws, E)
        ref = run_hierarchical(nodes, gpus, xs, topk, ws, E, lambda rank, recv_x: recv_x)
        for (x, _), want in zip(group.combine([r[0] for r in results], [r[4] for r in results]), ref):
            torch.testing.assert_close(x.float(), want.combined.float(), rtol=2e-2, atol=2e-2)


def test_invalid_config_is_refused_on_the_host():
    with pytest.raises(ValueError, match="rdma_capacity must be >="):
        _group(2, 2, InternodeConfig(num_sms=2, nvl_chunk=1, nvl_capacity=2, rdma_chunk=4, rdma_capacity=8)).dispatch(
            payload("random", 4, 8, HIDDEN, torch.bfloat16, 0), routing("random", 4, 8, 16, TOPK, 0),
            weights(4, 8, TOPK, 0), 16)


def test_stalled_rank_ends_in_timeout_diagnostics():
    script = Path(__file__).with_name("stalled_rank_internode.py")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    output = proc.stdout + proc.stderr
    print(output[-4000:])
    assert proc.returncode != 0, output
    assert "ERROR_RECORD code=1" in output and "role_name=none" not in output, output
