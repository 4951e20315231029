"""DeepEP's own test files' checks (tests/legacy/test_intranode.py, test_internode.py and
test_low_latency.py), written here and run through `kernels_cuda.deep_ep` on per-process buffers of the
CPU emulation (one gloo worker per rank), under the suite's scheduler seeds (tests/kernels/runs.py: PCT
and random, alternating), in the sequential memory mode only: the relaxed mode needs every rank in one
launch, which per-process buffers are not.

What is checked, as DeepEP checks it:
- normal kernels, one node of 4 and 2 simulated nodes of 2: the layout (per rank, per node, per
  expert, is_token_in_rank) against counts computed here and all-reduced; dispatch of rank-encoded
  rows (every row from rank i is i, so each source's block in the handle's rank prefix is exactly
  i), random rows, FP8 rows with float scales and with UE8M0-packed int32 scales, with and without
  top-k; received counts per rank and per expert, top-k ids in range and counted, rank-encoded top-k
  weights; `num_worst_tokens` (padded with -1 ids, the head equal to the exact dispatch); cached
  dispatch; combine back, divided by the number of ranks each token went to, within DeepEP's
  `calc_diff` thresholds (5e-6 for rows, 1e-9 for top-k weights, 5e-4 for FP8 random rows); the
  `previous_event` / `async_finish` variants;
- low-latency kernels: rows (rank - 128) with their token index in the last 128 channels, so each
  received row names its source rank and token; per expert the received count, the cumulative
  stats, each source's row count and the src_info against the token index; combine within 1e-5
  (bf16) or 9e-4 (FP8) of x times the sum of its valid weights, with and without hooks and zero-copy;
- the pressure test: the same seed run again under another schedule gives the same hash of every
  output (DeepEP runs it again on the same GPU); low-latency rows are hashed by source and token, as
  their packed order follows the arrivals.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from kernels_cuda import Schedule
from parallel.dispatch.fp8 import dequantize_e4m3, pack_ue8m0, quantize_e4m3, unpack_ue8m0
from tests.distributed.pool import PoolSet
from tests.kernels.deep_ep_alias import deep_ep_installed
from tests.kernels.runs import Run, cases

TOKENS, HIDDEN, TOPK, EXPERTS_PER_RANK = 24, 512, 3, 2
LL_TOKENS, LL_MAX_TOKENS = 10, 12
RANK_OFFSET = 128  # low-latency rows carry rank - 128 (DeepEP's encoding)
TIMEOUT_CYCLES = 60_000_000_000  # 30 s of wall clock: processes time-slice 2 cores


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure: 1 - 2<x+1, y+1> / (|x+1|^2 + |y+1|^2), in float64."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def add_hash(digest: int, t: torch.Tensor) -> int:
    """`digest` extended by an order-sensitive hash of `t`'s bytes (DeepEP xors one hash per output; equal
    outputs of two variants would cancel there)."""
    words = t.detach().contiguous().view(torch.uint8).flatten().long()
    return (digest * 1_000_003 + int((words * torch.arange(1, words.numel() + 1)).sum())) & 0xFFFFFFFF


def _buffer(deep_ep, schedule: Schedule, low_latency: bool = False):
    rank, group = dist.get_rank(), dist.group.WORLD
    options = {"device": "cpu", "schedule": dataclasses.replace(schedule, seed=schedule.seed * 16 + rank),
               "timeout_cycles": TIMEOUT_CYCLES}
    print(f"rank {rank}: schedule {options['schedule']}")
    if low_latency:
        size = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_MAX_TOKENS, HIDDEN, group.size(),
                                                             EXPERTS_PER_RANK * group.size())
        return deep_ep.Buffer(group, 0, size, low_latency_mode=True, num_qps_per_rank=EXPERTS_PER_RANK,
                              explicitly_destroy=True, **options)
    deep_ep.Buffer.set_num_sms(4)  # 2 channels: the emulation runs every SM's threads as fibers
    nvl = rdma = 0
    for config in (deep_ep.Buffer.get_dispatch_config(group.size()), deep_ep.Buffer.get_combine_config(group.size())):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(HIDDEN * 2, group.size()))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(HIDDEN * 2, group.size()))
    return deep_ep.Buffer(group, nvl, rdma, explicitly_destroy=True, **options)


# Normal kernels (test_intranode.py, test_internode.py).

def normal_rank(nvl_peers: int, schedule: Schedule, seed: int) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = EXPERTS_PER_RANK * world
    print(f"rank {rank}: data seed {seed}")
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16) * rank
    x_rand = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    q, scales = quantize_e4m3(x)
    x_e4m3 = (q, scales.T.contiguous().T)  # column-major scales, as DeepEP's test passes them
    q, scales = quantize_e4m3(x, round_scale=True)
    x_ue8m0 = (q, pack_ue8m0(scales))
    q, scales = quantize_e4m3(x_rand)
    x_rand_e4m3 = (q, scales)
    scores = torch.randn(TOKENS, experts, generator=g).abs() + 1
    topk_idx = scores.topk(TOPK, dim=-1, sorted=False).indices
    topk_idx[torch.rand(TOKENS, TOPK, generator=g) < 0.1] = -1
    topk_weights = torch.ones(TOKENS, TOPK) * rank
    topk_weights_rand = torch.randn(TOKENS, TOPK, generator=g)

    with deep_ep_installed(nvl_peers) as deep_ep:
        assert topk_idx.dtype == deep_ep.topk_idx_t
        buffer = _buffer(deep_ep, schedule)
        internode = world > nvl_peers
        nodes = world // nvl_peers if internode else 1
        rank_of = torch.where(topk_idx >= 0, topk_idx // EXPERTS_PER_RANK, -1)
        in_rank = torch.stack([(rank_of == r).any(1) for r in range(world)], 1)
        in_node = torch.stack([(rank_of // nvl_peers == n).any(1) for n in range(nodes)], 1)  # -1 // 2 = -1
        per_rank, per_expert = in_rank.sum(0).int(), torch.stack([(topk_idx == e).sum() for e in range(experts)]).int()
        gbl_per_rank, gbl_per_expert = per_rank.clone(), per_expert.clone()
        dist.all_reduce(gbl_per_rank)
        dist.all_reduce(gbl_per_expert)
        layout = buffer.get_dispatch_layout(topk_idx, experts)
        assert torch.equal(layout[0], per_rank) and torch.equal(layout[2], per_expert)
        assert torch.equal(layout[3], in_rank), f"rank {rank}: is_token_in_rank"
        assert (layout[1] is None) if not internode else torch.equal(layout[1], in_node.sum(0).int())
        # the handle field holding the per-source row prefix, at DeepEP's positions
        prefix_of = (lambda h: h[-4]) if internode else (lambda h: h[0][:, rank])

        def check_data(rows: torch.Tensor, prefix: torch.Tensor) -> None:
            assert torch.equal(rows.amin(1), rows.amax(1)), f"rank {rank}: a rank-encoded row is not constant"
            start = 0
            for i in range(world):
                end = int(prefix[i])
                assert int((rows[start:end].int() - i).abs().sum()) == 0, f"rank {rank}: rows from rank {i}"
                start = end

        digest = 0
        variants = [(x_rand, False, False), (x, True, False), (x_e4m3, False, True), (x_ue8m0, True, True)]
        if internode:
            variants.append((x_rand_e4m3, True, True))
        for current, previous_mode, async_mode in variants:
            rand = current is x_rand or current is x_rand_e4m3
            for with_topk in (False, True):
                args = {"x": current, "num_tokens_per_rank": layout[0], "num_tokens_per_rdma_rank": layout[1],
                        "is_token_in_rank": in_rank, "num_tokens_per_expert": layout[2], "async_finish": async_mode}
                if with_topk:
                    args.update(topk_idx=topk_idx, topk_weights=topk_weights_rand if rand else topk_weights)
                if previous_mode:
                    args["previous_event"] = buffer.capture()
                recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(**args)
                if async_mode:
                    event.current_stream_wait()
                assert isinstance(handle, tuple) and len(handle) == (10 if internode else 6)
                rows = dequantize_rows(recv_x)
                assert rows.shape[0] == int(gbl_per_rank[rank]), f"rank {rank}: received rows"
                if not rand:
                    check_data(rows, prefix_of(handle))
                if with_topk:
                    assert counts == gbl_per_expert.view(world, -1)[rank].tolist(), f"rank {rank}: per-expert counts"
                    assert bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < EXPERTS_PER_RANK))).all())
                    assert [int((recv_idx == e).sum()) for e in range(EXPERTS_PER_RANK)] == counts
                    if not rand:  # empty slots carry 0: fill them with the row's value, then rank-encoded
                        recv_w = torch.where(recv_idx == -1, recv_w.amax(1, keepdim=True), recv_w)
                        check_data(recv_w, prefix_of(handle))
                    worst = buffer.dispatch(**{**args, "num_worst_tokens": TOKENS * world, "previous_event": None,
                                               "async_finish": False})
                    n = rows.shape[0]
                    assert worst[3] == [] and worst[1].shape[0] == TOKENS * world
                    assert torch.equal(dequantize_rows(worst[0])[:n], rows)
                    assert torch.equal(worst[1][:n], recv_idx) and bool((worst[1][n:] == -1).all())
                    assert rand or torch.equal(worst[2][:n].masked_fill(recv_idx == -1, 0), recv_w.masked_fill(
                        recv_idx == -1, 0)), f"rank {rank}: num_worst_tokens weights"
                else:
                    assert recv_idx is None and recv_w is None
                cached = buffer.dispatch(current, handle=handle)
                assert cached[1:5] == (None, None, None, None)
                assert torch.equal(dequantize_rows(cached[0]), rows), f"rank {rank}: cached dispatch"
                combine_args = {"x": rows, "handle": handle, "async_finish": async_mode}
                if with_topk:
                    combine_args["topk_weights"] = recv_w
                if previous_mode:
                    combine_args["previous_event"] = buffer.capture()
                combined, combined_w, event = buffer.combine(**combine_args)
                if async_mode:
                    event.current_stream_wait()
                fanout = in_rank.sum(1, keepdim=True).clamp(min=1)
                want = dequantize_rows(current).float() * (in_rank.sum(1, keepdim=True) > 0)
                assert calc_diff(combined.float() / fanout, want) < (5e-4 if isinstance(current, tuple) and rand
                                                                     else 5e-6), f"rank {rank}: combine"
                if with_topk:
                    ref_w = (topk_weights_rand if rand else topk_weights).masked_fill(topk_idx < 0, 0)
                    got_w = combined_w if rand else combined_w / fanout
                    got_w = got_w.masked_fill(topk_idx < 0, 0)
                    assert calc_diff(got_w, ref_w) < 1e-9, f"rank {rank}: combined top-k weights"
                for t in (rows, combined):
                    digest = add_hash(digest, t)
        bias = (torch.randn(TOKENS, HIDDEN, generator=g).bfloat16(), torch.randn(TOKENS, HIDDEN, generator=g).bfloat16())
        recv = buffer.dispatch(x_rand, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                               is_token_in_rank=in_rank, num_tokens_per_expert=layout[2])
        plain = buffer.combine(recv[0], recv[4])[0]
        with_bias = buffer.combine(recv[0], recv[4], bias=bias)[0]
        assert calc_diff(with_bias.float(), plain.float() + bias[0].float() + bias[1].float()) < 1e-5
        buffer.destroy()
    return digest


def dequantize_rows(x) -> torch.Tensor:
    """bf16 rows of a payload: as they are, or FP8 rows times float or UE8M0-packed scales."""
    if not isinstance(x, tuple):
        return x
    q, scales = x
    return dequantize_e4m3(q, unpack_ue8m0(scales) if scales.dtype == torch.int32 else scales, torch.bfloat16)


# Low-latency kernels (test_low_latency.py).

LL_MODES = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]  # fp8, round, ue8m0


def low_latency_rank(schedule: Schedule, seed: int) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = EXPERTS_PER_RANK * world
    print(f"rank {rank}: data seed {seed}")
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.ones(LL_TOKENS, HIDDEN, dtype=torch.bfloat16) * (rank - RANK_OFFSET)
    x[:, -128:] = torch.arange(LL_TOKENS).bfloat16().view(-1, 1)
    scores = torch.randn(LL_TOKENS, experts, generator=g).abs() + 1
    topk_idx = scores.topk(TOPK, dim=-1).indices
    for _ in range(3):
        topk_idx[int(torch.randint(LL_TOKENS, (1,), generator=g)), int(torch.randint(TOPK, (1,), generator=g))] = -1
    topk_weights = torch.randn(LL_TOKENS, TOPK, generator=g).abs()
    all_topk_idx = [torch.empty_like(topk_idx) for _ in range(world)]
    dist.all_gather(all_topk_idx, topk_idx)
    all_topk_idx = torch.stack(all_topk_idx)

    with deep_ep_installed(8) as deep_ep:
        buffer = _buffer(deep_ep, schedule, low_latency=True)
        stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32)
        wait_stats = torch.zeros(world, dtype=torch.int64)
        digest, times = 0, 0
        for hook_mode in (False, True):
            for use_fp8, round_scale, use_ue8m0 in LL_MODES:
                recv_x, count, handle, event, hook = buffer.low_latency_dispatch(
                    x, topk_idx, LL_MAX_TOKENS, experts, cumulative_local_expert_recv_stats=stats,
                    dispatch_wait_recv_cost_stats=wait_stats, use_fp8=use_fp8, round_scale=round_scale,
                    use_ue8m0=use_ue8m0, async_finish=not hook_mode, return_recv_hook=hook_mode)
                hook() if hook_mode else event.current_stream_wait()
                times += 1
                assert isinstance(handle, tuple) and len(handle) == 5
                rows = recv_x if not use_fp8 else packed_dequantize(recv_x, use_ue8m0)
                for i in range(EXPERTS_PER_RANK):
                    expert_id = rank * EXPERTS_PER_RANK + i
                    n = int(count[i])
                    assert n == int((all_topk_idx == expert_id).sum()), f"rank {rank} expert {i}: count"
                    assert int(stats[i]) == n * times, f"rank {rank} expert {i}: cumulative stats"
                    digest = add_hash(digest, canonical_rows(rows[i], handle[0][i], handle[1][i]))
                    layout_range = handle[1][i]
                    assert n == int((layout_range & 0xFFFFFFFF).sum()), f"rank {rank} expert {i}: layout range"
                    got, src = rows[i, :n].float(), (handle[0][i, :n] % LL_TOKENS).float()
                    amin = got[:, :-128].amin(-1)
                    assert torch.equal(amin, got[:, :-128].amax(-1)), f"rank {rank} expert {i}: rows not constant"
                    if round_scale:  # power-of-two scales: the encodings survive only approximately
                        assert n == 0 or calc_diff(got[:, -1], src) < 0.007, f"rank {rank} expert {i}: token index"
                        continue
                    assert int((got[:, -128:] - src.view(-1, 1)).abs().sum()) == 0, f"rank {rank}: token index"
                    for j in range(world):
                        begin, size = int(layout_range[j]) >> 32, int(layout_range[j]) & 0xFFFFFFFF
                        assert int((amin == j - RANK_OFFSET).sum()) == int((all_topk_idx[j] == expert_id).sum())
                        assert int((got[begin:begin + size, :-128] - j + RANK_OFFSET).abs().sum()) == 0
                for zero_copy in (False, True):
                    if zero_copy:
                        buffer.get_next_low_latency_combine_buffer(handle)[:] = rows
                    combined, event, hook = buffer.low_latency_combine(
                        rows, topk_idx, topk_weights, handle, zero_copy=zero_copy, async_finish=not hook_mode,
                        return_recv_hook=hook_mode, combine_wait_recv_cost_stats=wait_stats)
                    hook() if hook_mode else event.current_stream_wait()
                    want = x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(1, keepdim=True)
                    assert not bool(combined.isnan().any())
                    assert calc_diff(want, combined) < (9e-4 if use_fp8 else 1e-5), f"rank {rank}: combine"
                    digest = add_hash(digest, combined)
        with pytest.raises(ValueError, match="use_logfmt"):
            buffer.low_latency_combine(rows, topk_idx, topk_weights, handle, use_logfmt=True)
        buffer.clean_low_latency_buffer(LL_MAX_TOKENS, HIDDEN, experts)
        buffer.destroy()
    return digest


def canonical_rows(rows: torch.Tensor, src_info: torch.Tensor, layout_range: torch.Tensor) -> torch.Tensor:
    """One expert's received rows by source rank, then source token: the order of the blocks and of the rows
    inside a block follows the arrivals, which the schedule decides."""
    blocks = []
    for packed in layout_range.tolist():
        begin, size = packed >> 32, packed & 0xFFFFFFFF
        blocks.append(rows[begin:begin + size][src_info[begin:begin + size].argsort()])
    return torch.cat(blocks)


def packed_dequantize(recv_x: tuple[torch.Tensor, torch.Tensor], use_ue8m0: bool) -> torch.Tensor:
    """[E_local, slots, H] FP8 rows and their column-major scales -> bf16 rows."""
    q, scales = recv_x
    local, slots, hidden = q.shape
    scales = unpack_ue8m0(scales) if use_ue8m0 else scales
    return dequantize_e4m3(q.reshape(-1, hidden), scales.reshape(-1, scales.shape[-1]),
                           torch.bfloat16).view(local, slots, hidden)


# Parameters: the suite's schedules (tests/kernels/runs.py), CPU only (the workers are CPU processes).

def _cpu_cases(configs: list, count: int, family: int) -> list:
    """Sequential-memory schedules only: the relaxed memory mode needs every rank in one launch (an emulated
    group), and these buffers are one per process (KERNELS_CPU_MEMORY=relaxed is therefore not honoured)."""
    return [p for p in cases(configs, count, family, relaxed=0)
            if p.values[1].device == "cpu" and p.values[1].schedule.memory == "sequential"]


@pytest.fixture(scope="module")
def pools():
    pool_set = PoolSet()
    yield pool_set
    pool_set.close()


@pytest.mark.parametrize("layout,run", _cpu_cases([(4, 8), (4, 2)], 2, family=41))
def test_deepep_normal_checks(pools, layout, run: Run):
    world, nvl_peers = layout
    assert len(pools.get(world).run(normal_rank, nvl_peers, run.schedule, 81, deadline_s=240)) == world


@pytest.mark.parametrize("world,run", _cpu_cases([4], 2, family=42))
def test_deepep_low_latency_checks(pools, world, run: Run):
    assert len(pools.get(world).run(low_latency_rank, run.schedule, 82, deadline_s=240)) == world


@pytest.mark.parametrize("layout,run", _cpu_cases([(4, 2)], 1, family=43))
def test_deepep_pressure_same_seed_same_hash_under_another_schedule(pools, layout, run: Run):
    world, nvl_peers = layout
    other = dataclasses.replace(run.schedule, seed=run.schedule.seed + 500_000, policy="random")
    for seed in (91, 92):
        first = pools.get(world).run(normal_rank, nvl_peers, run.schedule, seed, deadline_s=240)
        again = pools.get(world).run(normal_rank, nvl_peers, other, seed, deadline_s=240)
        print(f"seed {seed}: hashes {first} / {again}")
        assert first == again, f"seed {seed}: outputs differ between schedules {run.schedule} and {other}"
    low_latency = [pools.get(world).run(low_latency_rank, s, 93, deadline_s=240) for s in (run.schedule, other)]
    assert low_latency[0] == low_latency[1], "low-latency outputs differ between schedules"
