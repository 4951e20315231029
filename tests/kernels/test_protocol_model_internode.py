"""The CPU model of the two-hop (RDMA + NVLink forwarding) protocol: delivery, order, capacity,
termination over random interleavings and skewed node-limited routings; violating configs deadlock."""
from __future__ import annotations

import random

import pytest

from kernels_cuda import constants as C
from kernels_cuda.config import InternodeConfig, rdma_ring_is_safe, validate_internode
from tests.kernels.protocol_model import Deadlock
from tests.kernels.protocol_model_internode import TwoHopConfig, node_limited_routing, simulate


def _safe_random_config(rng: random.Random) -> TwoHopConfig:
    nodes, gpus, warps, chunk = rng.choice([2, 3, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 7]), rng.randint(1, 3)
    nvl_chunk = rng.randint(1, 2)
    return TwoHopConfig(nodes, gpus, num_channels=rng.randint(1, 2), nvl_chunk=nvl_chunk,
                        nvl_capacity=nodes * (nvl_chunk + rng.randint(0, 1)), rdma_chunk=chunk,
                        rdma_capacity=warps + 2 * chunk - 2 + rng.randint(0, 2), sender_warps=warps,
                        receiver_warps=rng.randint(1, 3))


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_deliver_exactly_once_in_order(seed):
    rng = random.Random(seed)
    cfg = _safe_random_config(rng)
    assert rdma_ring_is_safe(cfg.rdma_chunk, cfg.rdma_capacity, cfg.sender_warps)
    routing = node_limited_routing(rng, cfg, rng.randint(0, 12), max_nodes=2, max_dests=4)
    simulate(cfg, routing, seed)


@pytest.mark.parametrize("seed", range(3))
def test_kernel_warp_counts(seed):
    rng = random.Random(50 + seed)
    cfg = TwoHopConfig(2, 2, nvl_chunk=1, nvl_capacity=4, rdma_chunk=2, rdma_capacity=C.RDMA_SENDER_WARPS + 2)
    assert (cfg.sender_warps, cfg.receiver_warps) == (C.RDMA_SENDER_WARPS, C.RDMA_RECEIVER_WARPS)
    simulate(cfg, node_limited_routing(rng, cfg, 20, max_nodes=2, max_dests=4), seed)


def _skewed(name: str, cfg: TwoHopConfig, tokens: int) -> list[list[list[int]]]:
    R, G = cfg.num_ranks, cfg.gpus_per_node
    if name == "all_to_one_rank":
        return [[[R - 1] for _ in range(tokens)] for _ in range(R)]
    if name == "all_to_one_node":
        return [[[G + t % G] for t in range(tokens)] for _ in range(R)]
    if name == "node_receives_nothing":
        return [[[d for d in range(R) if d // G != 1 and (t + d) % 2 == 0] for t in range(tokens)] for _ in range(R)]
    if name == "tokens_without_expert":
        return [[[] if t % 3 else [t % R] for t in range(tokens)] for _ in range(R)]
    if name == "every_token_everywhere":
        return [[list(range(R)) for _ in range(tokens)] for _ in range(R)]
    raise ValueError(name)


@pytest.mark.parametrize("name", ["all_to_one_rank", "all_to_one_node", "node_receives_nothing",
                                  "tokens_without_expert", "every_token_everywhere"])
@pytest.mark.parametrize("seed", range(3))
def test_skewed_routings_terminate(name, seed):
    cfg = TwoHopConfig(3, 2, num_channels=1 + seed % 2, nvl_chunk=1, nvl_capacity=3, rdma_chunk=1 + seed % 2,
                       rdma_capacity=2 + 2 * (1 + seed % 2), sender_warps=2, receiver_warps=2)
    simulate(cfg, _skewed(name, cfg, 9), seed)


def _first_deadlock(cfg: TwoHopConfig, routing, seeds: int = 50) -> str | None:
    for seed in range(seeds):
        try:
            simulate(cfg, routing, seed)
        except Deadlock as error:
            return str(error)
    return None


def test_a_round_of_unreleased_records_needs_room_in_the_rdma_ring():
    # three sender warps, one node's ring of capacity 2: the round's third record waits for room that
    # only the release of the round's first two (after the round barrier) could make
    unsafe = TwoHopConfig(2, 1, rdma_chunk=1, rdma_capacity=2, sender_warps=3, receiver_warps=2)
    assert not rdma_ring_is_safe(1, 2, sender_warps=3)
    routing = [[[1] for _ in range(8)], [[] for _ in range(8)]]
    assert "round barrier" in (_first_deadlock(unsafe, routing) or "")
    simulate(TwoHopConfig(2, 1, rdma_chunk=1, rdma_capacity=3, sender_warps=3, receiver_warps=2), routing, 0)


def test_combine_sub_ring_smaller_than_a_chunk_deadlocks():
    routing = [[[2 + t % 2] for t in range(10)] for _ in range(4)]
    unsafe = TwoHopConfig(2, 2, nvl_chunk=3, nvl_capacity=4, rdma_chunk=1, rdma_capacity=4, sender_warps=1)
    assert "nvl_capacity / num_nodes" in validate_internode(1, 3, 4, 1, 12, 2, 2, 256, 2, 4)
    assert "combine" in (_first_deadlock(unsafe, routing, seeds=5) or "")


def test_without_the_negative_head_rewrite_combine_deadlocks():
    cfg = TwoHopConfig(2, 2, rdma_chunk=1, rdma_capacity=3, sender_warps=2, receiver_warps=3)
    routing = node_limited_routing(random.Random(3), cfg, 10, max_nodes=2, max_dests=3)
    simulate(cfg, routing, 3)
    off = TwoHopConfig(2, 2, rdma_chunk=1, rdma_capacity=3, sender_warps=2, receiver_warps=3, rewrite_heads=False)
    assert "combine" in (_first_deadlock(off, routing) or "")


def test_default_config_is_safe_and_violations_are_named():
    assert InternodeConfig().validate(4, 8, 7168 * 2, 8, 8) is None
    assert "rdma_capacity must be >=" in InternodeConfig(rdma_chunk=64, rdma_capacity=128).validate(4, 8, 14336, 8, 8)
    assert "multiple of rdma_chunk" in InternodeConfig(rdma_chunk=10, rdma_capacity=128).validate(4, 8, 14336, 8, 8)
    assert "multiple of num_nodes" in InternodeConfig(nvl_capacity=290).validate(4, 8, 14336, 8, 8)
    assert "num_nodes" in InternodeConfig().validate(1, 8, 14336, 8, 8)
    assert "gpus_per_node" in InternodeConfig().validate(2, 9, 14336, 8, 8)


def test_kernel_blocks_hold_every_role_of_the_model():
    # dispatch sender SM: the model's sender warps, their coordinator and one NVLink receiver per GPU;
    # combine: NVLink senders + RDMA receivers + coordinator, and one forwarder per node + coordinator
    parsed = C.CONSTANTS
    assert parsed["INTERNODE_DISPATCH_WARPS"] == C.RDMA_SENDER_WARPS + 1 + C.MAX_NVL_PEERS
    assert parsed["INTERNODE_COMBINE_WARPS"] == max(C.MAX_NVL_PEERS + C.RDMA_RECEIVER_WARPS + 1, C.MAX_RDMA_PEERS + 1)
    assert C.MAX_RDMA_PEERS <= C.WARP_SIZE and C.MAX_NVL_PEERS <= C.WARP_SIZE  # one lane per node / GPU
