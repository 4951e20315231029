"""The CPU model of the kernels' ring-buffer protocol: delivery, order, capacity, termination, deadlocks."""
from __future__ import annotations

import random

import pytest

from kernels_cuda import constants as C
from kernels_cuda.config import validate
from tests.kernels.protocol_model import (Deadlock, ModelConfig, ProtocolViolation, Ring, build_combine,
                                         build_dispatch, check_combine, check_dispatch, combine_inputs, explore,
                                         random_routing, rewrite_send_head, run_random, simulate, start)


def _cfg(num_ranks: int, chunk: int, capacity: int, channels: int = 1, reducers: int = 3, **kw) -> ModelConfig:
    return ModelConfig(num_ranks, channels, chunk, capacity, reducers, **kw)


def test_model_uses_the_kernels_warp_split():
    assert ModelConfig(num_ranks=2).num_reducers == C.COMBINE_WARPS - C.COMBINE_KEEPER_WARPS


def test_rewrite_send_head_points_absent_tokens_at_the_next_present_slot():
    assert rewrite_send_head([-1, 0, -1, -1, 1, -1], past_end=2) == [-1, 0, -2, -2, 1, -3]
    assert rewrite_send_head([-1, -1], past_end=0) == [-1, -1]
    rewritten = rewrite_send_head([-1, 0, -1, -1, 1, -1], past_end=2)
    assert rewrite_send_head(rewritten, past_end=2) == rewritten  # idempotent: combine may run twice


def test_ring_rejects_overwrites_and_unpublished_reads():
    ring = Ring(capacity=2)
    ring.write(0, "a")
    with pytest.raises(ProtocolViolation):
        ring.read(0)  # written but its tail not released yet
    ring.write(1, "b")
    with pytest.raises(ProtocolViolation):
        ring.write(2, "c")  # slot 0 not consumed
    ring.publish_tail(2)
    assert ring.read(1) == "b"
    ring.head = 3
    with pytest.raises(ProtocolViolation):
        ring.check()  # head past tail


@pytest.mark.parametrize("seed", range(60))
def test_random_interleavings_deliver_exactly_once_in_order(seed):
    rng = random.Random(seed)
    num_ranks = rng.choice([1, 2, 3, 4, 8])
    chunk = rng.randint(1, 4)
    cfg = _cfg(num_ranks, chunk, chunk + rng.randint(0, 3), channels=rng.randint(1, 3), reducers=rng.randint(1, 4))
    routing = random_routing(rng, num_ranks, rng.randint(0, 14), max_dests=min(num_ranks, 4))
    simulate(cfg, routing, seed)


@pytest.mark.parametrize("seed", range(4))
def test_kernel_warp_counts_with_eight_ranks(seed):
    rng = random.Random(100 + seed)
    cfg = ModelConfig(num_ranks=8, num_channels=2, chunk=2, capacity=3)
    simulate(cfg, random_routing(rng, 8, 24, max_dests=4), seed)


def _skewed(name: str, num_ranks: int, tokens: int) -> list[list[list[int]]]:
    if name == "all_to_one_rank":
        return [[[num_ranks - 1] for _ in range(tokens)] for _ in range(num_ranks)]
    if name == "rank_receives_nothing":
        return [[[r for r in range(num_ranks) if r != 1 and (t + r) % 2 == 0] for t in range(tokens)]
                for _ in range(num_ranks)]
    if name == "tokens_without_expert":
        return [[[] if t % 3 else [t % num_ranks] for t in range(tokens)] for _ in range(num_ranks)]
    if name == "nothing_at_all":
        return [[[] for _ in range(tokens)] for _ in range(num_ranks)]
    if name == "every_token_everywhere":
        return [[list(range(num_ranks)) for _ in range(tokens)] for _ in range(num_ranks)]
    raise ValueError(name)


@pytest.mark.parametrize("name", ["all_to_one_rank", "rank_receives_nothing", "tokens_without_expert",
                                  "nothing_at_all", "every_token_everywhere"])
@pytest.mark.parametrize("seed", range(5))
def test_skewed_routings_terminate(name, seed):
    cfg = _cfg(4, chunk=1 + seed % 2, capacity=2, channels=1 + seed % 2, reducers=2 + seed % 3)
    simulate(cfg, _skewed(name, 4, 11), seed)


TINY = [
    (_cfg(1, 1, 1, reducers=2), [[[0], [0], [], [0]]]),
    (_cfg(2, 1, 1, reducers=2), [[[0, 1], [1], []], [[0], [0, 1], [1]]]),
    (_cfg(2, 1, 2, reducers=2), [[[0, 1], [1], [0], [1]], [[0], [0, 1], [1], [0]]]),
    (_cfg(2, 2, 2, reducers=3), [[[0, 1], [1], [0], [1]], [[0], [0, 1], [1], [0]]]),
]
# Channels share no words (every ring, keeper and reducer belongs to one channel), so one channel is
# exhaustive for all; several channels are covered by the random tests.


@pytest.mark.parametrize("case", range(len(TINY)))
def test_exhaustive_tiny_cases(case):
    """Every interleaving of the roles around each consumer rank ends with exact delivery."""
    cfg, routing = TINY[case]
    world, roles, send_head = build_dispatch(cfg, routing)
    run_random(start(world, roles), 0)
    rows, heads = combine_inputs(cfg, routing, send_head)
    for consumer in range(cfg.num_ranks):
        latest: dict = {}  # send_head of the run being replayed (on_final follows its replay)

        def make_dispatch(consumer=consumer):
            world, roles, latest["send_head"] = build_dispatch(cfg, routing, consumer)
            return start(world, roles)

        def dispatch_final(run, consumer=consumer):
            check_dispatch(cfg, routing, run.world, latest["send_head"], consumer)

        assert explore(make_dispatch, dispatch_final) > 1
        finals: list = []
        states = explore(lambda consumer=consumer: start(*build_combine(cfg, rows, heads, consumer)), finals.append)
        assert states > 1 and finals
        for run in finals:
            check_combine(cfg, routing, run.world, consumer)


def test_chunk_larger_than_ring_is_rejected_and_deadlocks():
    chunk, capacity = 3, 2
    assert "chunk" in validate(1, chunk, capacity, num_ranks=2, hidden_bytes=256, num_topk=2, num_local_experts=4)
    routing = [[[0, 1], [1]], [[0], [1]]]
    with pytest.raises(Deadlock, match="room for 3"):
        simulate(_cfg(2, chunk, capacity), routing, seed=0)


def test_without_the_negative_head_rewrite_combine_deadlocks():
    # Reducer 0 handles the even tokens (all for rank 1), reducer 1 the odd ones (all for rank 0):
    # each reducer's head for the ring it never reads would stay at 0 and block that ring's producer.
    routing = [[[1], [0]] * 3, [[0], [1]] * 3]
    cfg = _cfg(2, chunk=1, capacity=1, reducers=2)
    simulate(cfg, routing, seed=0)
    with pytest.raises(Deadlock, match="combine"):
        simulate(_cfg(2, chunk=1, capacity=1, reducers=2, rewrite_heads=False), routing, seed=0)
