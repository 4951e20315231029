"""DeepEP's own test files' checks (tests/legacy/test_intranode.py, test_internode.py and
test_low_latency.py), written here and run through DeepEP's API (`kernels_cuda.deep_ep`) under the
suite's scheduler seeds (tests/kernels/runs.py: PCT and random, alternating) on two set-ups
(tests/kernels/deep_ep_calls.py):
- per-process buffers, one gloo worker per rank, as DeepEP runs them: the sequential memory mode only,
  as the relaxed mode needs every rank in one launch;
- emulated groups, every rank in one launch: the relaxed memory mode (the suite's relaxed runs) and the
  sequential one, and once on CUDA where present.
By default a representative subset runs: per-process, per layout one or two sequential schedules and
the pressure test; emulated, per layout one relaxed schedule. `KERNELS_CUDA_SOAK=N` (opt-in, as the
suite's soaks) adds N sequential schedules of each emulated check and the emulated pressure test, and
with `KERNELS_CPU_MEMORY=relaxed` the emulated runs are all relaxed.

What is checked, as DeepEP checks it (every rank's inputs are drawn from its own seed, so each process
knows the whole group's and the global counts DeepEP all-reduces are sums over them):
- normal kernels, one node of 4 and 2 simulated nodes of 2: the layout (per rank, per node, per
  expert, is_token_in_rank) against counts computed here; dispatch of rank-encoded rows (every row
  from rank i is i, so each source's block in the handle's rank prefix is exactly i), random rows,
  FP8 rows with float scales and with UE8M0-packed int32 scales, with and without top-k; received
  counts per rank and per expert, top-k ids in range and counted, rank-encoded top-k weights;
  `num_worst_tokens` (padded with -1 ids, the head equal to the exact dispatch); cached dispatch;
  combine back, divided by the number of ranks each token went to, within DeepEP's `calc_diff`
  thresholds (5e-6 for rows, 1e-9 for top-k weights, 5e-4 for FP8 random rows); the
  `previous_event` / `async_finish` variants; `combine(bias=...)`;
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
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kernels_cuda import EmulatedGroup, EmulatedInternodeGroup, Schedule
from kernels_cuda.deep_ep.config import nodes_of
from parallel.dispatch.fp8 import dequantize_e4m3, pack_ue8m0, quantize_e4m3, unpack_ue8m0
from tests.distributed.pool import PoolSet
from tests.kernels.deep_ep_alias import deep_ep_installed
from tests.kernels.deep_ep_calls import GroupCalls, ProcessCalls
from tests.kernels.runs import SOAK, Run, cases

TOKENS, HIDDEN, TOPK, EXPERTS_PER_RANK = 24, 512, 3, 2
LL_TOKENS, LL_MAX_TOKENS = 10, 12
RANK_OFFSET = 128  # low-latency rows carry rank - 128 (DeepEP's encoding)
TIMEOUT_CYCLES = 60_000_000_000  # 30 s of wall clock: processes time-slice 2 cores
NUM_SMS = 4  # 2 channels: the emulation runs every SM's threads as fibers


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure: 1 - 2<x+1, y+1> / (|x+1|^2 + |y+1|^2), in float64."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def add_hash(digest: int, t: torch.Tensor) -> int:
    """`digest` extended by an order-sensitive hash of `t`'s bytes (DeepEP xors one hash per output; equal
    outputs of two variants would cancel there)."""
    words = t.detach().contiguous().view(torch.uint8).flatten().long()
    return (digest * 1_000_003 + int((words * torch.arange(1, words.numel() + 1)).sum())) & 0xFFFFFFFF


# Buffers: DeepEP's sizing (the recommended configs' hints) for a per-process buffer or an emulated group.

def _normal_bytes(deep_ep: ModuleType, world: int) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) for the recommended dispatch and combine configs at NUM_SMS SMs."""
    deep_ep.Buffer.set_num_sms(NUM_SMS)
    nvl = rdma = 0
    for config in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(HIDDEN * 2, world))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(HIDDEN * 2, world))
    return nvl, rdma


def _low_latency_bytes(deep_ep: ModuleType, world: int) -> int:
    return deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_MAX_TOKENS, HIDDEN, world, EXPERTS_PER_RANK * world)


def _process_calls(deep_ep: ModuleType, schedule: Schedule, low_latency: bool = False) -> ProcessCalls:
    """This process's deep_ep.Buffer, its scheduler seeded per rank."""
    rank, group = dist.get_rank(), dist.group.WORLD
    options = {"device": "cpu", "schedule": dataclasses.replace(schedule, seed=schedule.seed * 16 + rank),
               "timeout_cycles": TIMEOUT_CYCLES}
    print(f"rank {rank}: schedule {options['schedule']}")
    if low_latency:
        return ProcessCalls(deep_ep.Buffer(group, 0, _low_latency_bytes(deep_ep, group.size()), low_latency_mode=True,
                                           num_qps_per_rank=EXPERTS_PER_RANK, explicitly_destroy=True, **options))
    nvl, rdma = _normal_bytes(deep_ep, group.size())
    return ProcessCalls(deep_ep.Buffer(group, nvl, rdma, explicitly_destroy=True, **options))


def _group_calls(deep_ep: ModuleType, world: int, run: Run, low_latency: bool = False) -> GroupCalls:
    """Every rank of the group in one emulated launch, nodes as deep_ep's (NUM_MAX_NVL_PEERS)."""
    print(f"emulated group of {world}: {run.id}")
    options = {"timeout_cycles": TIMEOUT_CYCLES, **run.group_kwargs()}
    if low_latency:
        return GroupCalls(deep_ep, EmulatedGroup(world, 0, num_rdma_bytes=_low_latency_bytes(deep_ep, world),
                                                 **options))
    nvl, rdma = _normal_bytes(deep_ep, world)
    nodes, gpus = nodes_of(world)
    if nodes == 1:
        return GroupCalls(deep_ep, EmulatedGroup(world, nvl, **options))
    return GroupCalls(deep_ep, EmulatedInternodeGroup(nodes, gpus, rdma, nvl, **options))


# Normal kernels (test_intranode.py, test_internode.py).

@dataclasses.dataclass
class NormalInputs:
    """One rank's inputs, drawn from its own generator in DeepEP's order."""

    x: torch.Tensor  # rank-encoded bf16 rows
    x_rand: torch.Tensor
    x_e4m3: tuple[torch.Tensor, torch.Tensor]  # column-major float scales, as DeepEP's test passes them
    x_ue8m0: tuple[torch.Tensor, torch.Tensor]
    x_rand_e4m3: tuple[torch.Tensor, torch.Tensor]
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor  # rank-encoded
    topk_weights_rand: torch.Tensor
    bias: tuple[torch.Tensor, torch.Tensor]


def normal_inputs(rank: int, world: int, seed: int) -> NormalInputs:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16) * rank
    x_rand = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    q, scales = quantize_e4m3(x)
    x_e4m3 = (q, scales.T.contiguous().T)
    q, scales = quantize_e4m3(x, round_scale=True)
    x_ue8m0 = (q, pack_ue8m0(scales))
    x_rand_e4m3 = quantize_e4m3(x_rand)
    scores = torch.randn(TOKENS, EXPERTS_PER_RANK * world, generator=g).abs() + 1
    topk_idx = scores.topk(TOPK, dim=-1, sorted=False).indices
    topk_idx[torch.rand(TOKENS, TOPK, generator=g) < 0.1] = -1
    topk_weights = torch.ones(TOKENS, TOPK) * rank
    topk_weights_rand = torch.randn(TOKENS, TOPK, generator=g)
    bias = (torch.randn(TOKENS, HIDDEN, generator=g).bfloat16(), torch.randn(TOKENS, HIDDEN, generator=g).bfloat16())
    return NormalInputs(x, x_rand, x_e4m3, x_ue8m0, x_rand_e4m3, topk_idx, topk_weights, topk_weights_rand, bias)


def normal_checks(calls: Any, world: int, nvl_peers: int, seed: int) -> list[int]:
    """DeepEP's normal-kernel checks for the ranks `calls` drives; per rank the hash of its outputs."""
    print(f"ranks {calls.ranks} of {world}: data seed {seed}")
    experts = EXPERTS_PER_RANK * world
    inputs = [normal_inputs(r, world, seed) for r in range(world)]
    internode = world > nvl_peers
    nodes = world // nvl_peers if internode else 1
    in_rank, in_node = {}, {}
    for r, inp in enumerate(inputs):
        rank_of = torch.where(inp.topk_idx >= 0, inp.topk_idx // EXPERTS_PER_RANK, -1)
        in_rank[r] = torch.stack([(rank_of == d).any(1) for d in range(world)], 1)
        in_node[r] = torch.stack([(rank_of // nvl_peers == n).any(1) for n in range(nodes)], 1)  # -1 // 2 = -1
    per_expert = {r: torch.stack([(inp.topk_idx == e).sum() for e in range(experts)]).int()
                  for r, inp in enumerate(inputs)}
    gbl_per_rank = sum(in_rank[r].sum(0).int() for r in range(world))  # DeepEP all-reduces these
    gbl_per_expert = sum(per_expert.values())
    mine = calls.ranks

    layouts = calls.get_dispatch_layout([inputs[r].topk_idx for r in mine], experts)
    for r, layout in zip(mine, layouts):
        assert torch.equal(layout[0], in_rank[r].sum(0).int()) and torch.equal(layout[2], per_expert[r])
        assert torch.equal(layout[3], in_rank[r]), f"rank {r}: is_token_in_rank"
        assert (layout[1] is None) if not internode else torch.equal(layout[1], in_node[r].sum(0).int())
    # the handle field holding the per-source row prefix, at DeepEP's positions
    prefix_of = (lambda h, r: h[-4]) if internode else (lambda h, r: h[0][:, r])

    def check_data(rows: torch.Tensor, prefix: torch.Tensor, rank: int) -> None:
        assert torch.equal(rows.amin(1), rows.amax(1)), f"rank {rank}: a rank-encoded row is not constant"
        start = 0
        for i in range(world):
            end = int(prefix[i])
            assert int((rows[start:end].int() - i).abs().sum()) == 0, f"rank {rank}: rows from rank {i}"
            start = end

    digests = {r: 0 for r in mine}
    variants = [("x_rand", False, False), ("x", True, False), ("x_e4m3", False, True), ("x_ue8m0", True, True)]
    if internode:
        variants.append(("x_rand_e4m3", True, True))
    for name, previous_mode, async_mode in variants:
        rand = name.startswith("x_rand")
        for with_topk in (False, True):
            args = []
            for i, r in enumerate(mine):
                a = {"x": getattr(inputs[r], name), "num_tokens_per_rank": layouts[i][0],
                     "num_tokens_per_rdma_rank": layouts[i][1], "is_token_in_rank": in_rank[r],
                     "num_tokens_per_expert": layouts[i][2], "async_finish": async_mode}
                if with_topk:
                    a.update(topk_idx=inputs[r].topk_idx,
                             topk_weights=inputs[r].topk_weights_rand if rand else inputs[r].topk_weights)
                if previous_mode:
                    a["previous_event"] = calls.capture()
                args.append(a)
            results = calls.dispatch(args)
            if async_mode:
                for *_, event in results:
                    event.current_stream_wait()
            worst = calls.dispatch([{**a, "num_worst_tokens": TOKENS * world, "previous_event": None,
                                     "async_finish": False} for a in args]) if with_topk else [None] * len(mine)
            combine_args = []
            for r, (recv_x, recv_idx, recv_w, counts, handle, _), padded in zip(mine, results, worst):
                assert isinstance(handle, tuple) and len(handle) == (10 if internode else 6)
                rows = dequantize_rows(recv_x)
                assert rows.shape[0] == int(gbl_per_rank[r]), f"rank {r}: received rows"
                if not rand:
                    check_data(rows, prefix_of(handle, r), r)
                if with_topk:
                    assert counts == gbl_per_expert.view(world, -1)[r].tolist(), f"rank {r}: per-expert counts"
                    assert bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < EXPERTS_PER_RANK))).all())
                    assert [int((recv_idx == e).sum()) for e in range(EXPERTS_PER_RANK)] == counts
                    if not rand:  # empty slots carry 0: fill them with the row's value, then rank-encoded
                        recv_w = torch.where(recv_idx == -1, recv_w.amax(1, keepdim=True), recv_w)
                        check_data(recv_w, prefix_of(handle, r), r)
                    n = rows.shape[0]
                    assert padded[3] == [] and padded[1].shape[0] == TOKENS * world
                    assert torch.equal(dequantize_rows(padded[0])[:n], rows)
                    assert torch.equal(padded[1][:n], recv_idx) and bool((padded[1][n:] == -1).all())
                    assert rand or torch.equal(padded[2][:n].masked_fill(recv_idx == -1, 0), recv_w.masked_fill(
                        recv_idx == -1, 0)), f"rank {r}: num_worst_tokens weights"
                else:
                    assert recv_idx is None and recv_w is None
                c = {"x": rows, "handle": handle, "async_finish": async_mode}
                if with_topk:
                    c["topk_weights"] = recv_w
                if previous_mode:
                    c["previous_event"] = calls.capture()
                combine_args.append(c)
            cached = calls.dispatch([{"x": a["x"], "handle": c["handle"]} for a, c in zip(args, combine_args)])
            for r, again, c in zip(mine, cached, combine_args):
                assert again[1:5] == (None, None, None, None)
                assert torch.equal(dequantize_rows(again[0]), c["x"]), f"rank {r}: cached dispatch"
            for r, a, c, (combined, combined_w, event) in zip(mine, args, combine_args, calls.combine(combine_args)):
                if async_mode:
                    event.current_stream_wait()
                fanout = in_rank[r].sum(1, keepdim=True).clamp(min=1)
                want = dequantize_rows(a["x"]).float() * (in_rank[r].sum(1, keepdim=True) > 0)
                assert calc_diff(combined.float() / fanout, want) < (5e-4 if isinstance(a["x"], tuple) and rand
                                                                     else 5e-6), f"rank {r}: combine"
                if with_topk:
                    ref_w = a["topk_weights"].masked_fill(inputs[r].topk_idx < 0, 0)
                    got_w = combined_w if rand else combined_w / fanout
                    got_w = got_w.masked_fill(inputs[r].topk_idx < 0, 0)
                    assert calc_diff(got_w, ref_w) < 1e-9, f"rank {r}: combined top-k weights"
                for t in (c["x"], combined):
                    digests[r] = add_hash(digests[r], t)
    recv = calls.dispatch([{"x": inputs[r].x_rand, "num_tokens_per_rank": layout[0],
                            "num_tokens_per_rdma_rank": layout[1], "is_token_in_rank": in_rank[r],
                            "num_tokens_per_expert": layout[2]} for r, layout in zip(mine, layouts)])
    plain = calls.combine([{"x": rec[0], "handle": rec[4]} for rec in recv])
    with_bias = calls.combine([{"x": rec[0], "handle": rec[4], "bias": inputs[r].bias} for r, rec in zip(mine, recv)])
    for r, (p, *_), (b, *_) in zip(mine, plain, with_bias):
        bias = inputs[r].bias
        assert calc_diff(b.float(), p.float() + bias[0].float() + bias[1].float()) < 1e-5, f"rank {r}: bias"
    calls.destroy()
    return [digests[r] for r in mine]


def dequantize_rows(x) -> torch.Tensor:
    """bf16 rows of a payload: as they are, or FP8 rows times float or UE8M0-packed scales."""
    if not isinstance(x, tuple):
        return x
    q, scales = x
    return dequantize_e4m3(q, unpack_ue8m0(scales) if scales.dtype == torch.int32 else scales, torch.bfloat16)


def normal_rank(nvl_peers: int, schedule: Schedule, seed: int) -> int:
    """A pool worker's part: its rank's checks on its own deep_ep.Buffer; the hash of its outputs."""
    with deep_ep_installed(nvl_peers) as deep_ep:
        (digest,) = normal_checks(_process_calls(deep_ep, schedule), dist.get_world_size(), nvl_peers, seed)
    return digest


def normal_group(world: int, nvl_peers: int, run: Run, seed: int) -> list[int]:
    """Every rank's checks on one emulated group; per rank the hash of its outputs."""
    with deep_ep_installed(nvl_peers) as deep_ep:
        return normal_checks(_group_calls(deep_ep, world, run), world, nvl_peers, seed)


# Low-latency kernels (test_low_latency.py).

LL_MODES = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]  # fp8, round, ue8m0


def low_latency_inputs(rank: int, world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's (x, topk_idx, topk_weights), drawn from its own generator in DeepEP's order."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.ones(LL_TOKENS, HIDDEN, dtype=torch.bfloat16) * (rank - RANK_OFFSET)
    x[:, -128:] = torch.arange(LL_TOKENS).bfloat16().view(-1, 1)
    scores = torch.randn(LL_TOKENS, EXPERTS_PER_RANK * world, generator=g).abs() + 1
    topk_idx = scores.topk(TOPK, dim=-1).indices
    for _ in range(3):
        topk_idx[int(torch.randint(LL_TOKENS, (1,), generator=g)), int(torch.randint(TOPK, (1,), generator=g))] = -1
    return x, topk_idx, torch.randn(LL_TOKENS, TOPK, generator=g).abs()


def low_latency_checks(calls: Any, world: int, seed: int) -> list[int]:
    """DeepEP's low-latency checks for the ranks `calls` drives; per rank the hash of its outputs."""
    print(f"ranks {calls.ranks} of {world}: data seed {seed}")
    experts = EXPERTS_PER_RANK * world
    inputs = [low_latency_inputs(r, world, seed) for r in range(world)]
    all_topk_idx = torch.stack([idx for _, idx, _ in inputs])  # DeepEP all-gathers it
    mine = calls.ranks
    stats = {r: torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32) for r in mine}
    wait_stats = {r: torch.zeros(world, dtype=torch.int64) for r in mine}
    digests, times = {r: 0 for r in mine}, 0
    for hook_mode in (False, True):
        for use_fp8, round_scale, use_ue8m0 in LL_MODES:
            dispatched = calls.low_latency_dispatch([
                {"x": inputs[r][0], "topk_idx": inputs[r][1], "num_max_dispatch_tokens_per_rank": LL_MAX_TOKENS,
                 "num_experts": experts, "cumulative_local_expert_recv_stats": stats[r],
                 "dispatch_wait_recv_cost_stats": wait_stats[r], "use_fp8": use_fp8, "round_scale": round_scale,
                 "use_ue8m0": use_ue8m0, "async_finish": not hook_mode, "return_recv_hook": hook_mode}
                for r in mine])
            calls.complete(dispatched, hook_mode)
            times += 1
            received = []
            for r, (recv_x, count, handle, _, _) in zip(mine, dispatched):
                assert isinstance(handle, tuple) and len(handle) == 5
                rows = recv_x if not use_fp8 else packed_dequantize(recv_x, use_ue8m0)
                received.append((rows, handle))
                for i in range(EXPERTS_PER_RANK):
                    expert_id = r * EXPERTS_PER_RANK + i
                    n = int(count[i])
                    assert n == int((all_topk_idx == expert_id).sum()), f"rank {r} expert {i}: count"
                    assert int(stats[r][i]) == n * times, f"rank {r} expert {i}: cumulative stats"
                    digests[r] = add_hash(digests[r], canonical_rows(rows[i], handle[0][i], handle[1][i]))
                    layout_range = handle[1][i]
                    assert n == int((layout_range & 0xFFFFFFFF).sum()), f"rank {r} expert {i}: layout range"
                    got, src = rows[i, :n].float(), (handle[0][i, :n] % LL_TOKENS).float()
                    amin = got[:, :-128].amin(-1)
                    assert torch.equal(amin, got[:, :-128].amax(-1)), f"rank {r} expert {i}: rows not constant"
                    if round_scale:  # power-of-two scales: the encodings survive only approximately
                        assert n == 0 or calc_diff(got[:, -1], src) < 0.007, f"rank {r} expert {i}: token index"
                        continue
                    assert int((got[:, -128:] - src.view(-1, 1)).abs().sum()) == 0, f"rank {r}: token index"
                    for j in range(world):
                        begin, size = int(layout_range[j]) >> 32, int(layout_range[j]) & 0xFFFFFFFF
                        assert int((amin == j - RANK_OFFSET).sum()) == int((all_topk_idx[j] == expert_id).sum())
                        assert int((got[begin:begin + size, :-128] - j + RANK_OFFSET).abs().sum()) == 0
            for zero_copy in (False, True):
                if zero_copy:
                    buffers = calls.get_next_low_latency_combine_buffer([handle for _, handle in received])
                    for buffer, (rows, _) in zip(buffers, received):
                        buffer[:] = rows
                combined = calls.low_latency_combine([
                    {"x": rows, "topk_idx": inputs[r][1], "topk_weights": inputs[r][2], "handle": handle,
                     "zero_copy": zero_copy, "async_finish": not hook_mode, "return_recv_hook": hook_mode,
                     "combine_wait_recv_cost_stats": wait_stats[r]} for r, (rows, handle) in zip(mine, received)])
                calls.complete(combined, hook_mode)
                for r, (out, _, _) in zip(mine, combined):
                    x, topk_idx, topk_weights = inputs[r]
                    want = x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(1, keepdim=True)
                    assert not bool(out.isnan().any())
                    assert calc_diff(want, out) < (9e-4 if use_fp8 else 1e-5), f"rank {r}: combine"
                    digests[r] = add_hash(digests[r], out)
    with pytest.raises(ValueError, match="use_logfmt"):
        calls.low_latency_combine([{"x": rows, "topk_idx": inputs[r][1], "topk_weights": inputs[r][2],
                                    "handle": handle, "use_logfmt": True} for r, (rows, handle) in zip(mine, received)])
    calls.clean_low_latency_buffer(LL_MAX_TOKENS, HIDDEN, experts)
    calls.destroy()
    return [digests[r] for r in mine]


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


def low_latency_rank(schedule: Schedule, seed: int) -> int:
    """A pool worker's part: its rank's checks on its own deep_ep.Buffer; the hash of its outputs."""
    with deep_ep_installed(8) as deep_ep:
        (digest,) = low_latency_checks(_process_calls(deep_ep, schedule, low_latency=True), dist.get_world_size(),
                                       seed)
    return digest


def low_latency_group(world: int, run: Run, seed: int) -> list[int]:
    """Every rank's checks on one emulated group; per rank the hash of its outputs."""
    with deep_ep_installed(8) as deep_ep:
        return low_latency_checks(_group_calls(deep_ep, world, run, low_latency=True), world, seed)


# Parameters: the suite's schedules (tests/kernels/runs.py).

def _process_cases(configs: list, count: int, family: int) -> list:
    """CPU schedules in the sequential memory mode: the relaxed mode needs every rank in one launch (an
    emulated group), and these buffers are one per process (KERNELS_CPU_MEMORY=relaxed is therefore not
    honoured)."""
    return [p for p in cases(configs, count, family, relaxed=0)
            if p.values[1].device == "cpu" and p.values[1].schedule.memory == "sequential"]


def _emulated_cases(configs: list, family: int) -> list:
    """The relaxed-memory runs (one per config; all runs with KERNELS_CPU_MEMORY=relaxed) and the CUDA ones;
    the sequential runs only with KERNELS_CUDA_SOAK=N (N of them): the per-process tests cover that mode."""
    return [p for p in cases(configs, len(configs), family, relaxed=len(configs))
            if p.values[1].device != "cpu" or p.values[1].schedule.memory == "relaxed" or SOAK]


@pytest.fixture(scope="module")
def pools():
    pool_set = PoolSet()
    yield pool_set
    pool_set.close()


NORMAL_LAYOUTS = [(4, 8), (4, 2)]  # (ranks, GPUs per node): one node of 4, 2 simulated nodes of 2


@pytest.mark.parametrize("layout,run", _process_cases(NORMAL_LAYOUTS, 2, family=41))
def test_deepep_normal_checks(pools, layout, run: Run):
    world, nvl_peers = layout
    assert len(pools.get(world).run(normal_rank, nvl_peers, run.schedule, 81, deadline_s=240)) == world


@pytest.mark.parametrize("world,run", _process_cases([4], 2, family=42))
def test_deepep_low_latency_checks(pools, world, run: Run):
    assert len(pools.get(world).run(low_latency_rank, run.schedule, 82, deadline_s=240)) == world


@pytest.mark.parametrize("layout,run", _process_cases([(4, 2)], 1, family=43))
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


# The same checks on emulated groups: every rank in one launch, so the relaxed memory mode runs them.

@pytest.mark.parametrize("layout,run", _emulated_cases(NORMAL_LAYOUTS, family=44))
def test_deepep_normal_checks_on_emulated_groups(layout, run: Run):
    world, nvl_peers = layout
    assert len(normal_group(world, nvl_peers, run, 84)) == world


@pytest.mark.parametrize("world,run", _emulated_cases([4], family=45))
def test_deepep_low_latency_checks_on_emulated_groups(world, run: Run):
    assert len(low_latency_group(world, run, 85)) == world


@pytest.mark.skipif(not SOAK, reason="opt-in with KERNELS_CUDA_SOAK=N (five emulated runs, about 15 s)")
@pytest.mark.parametrize("layout,run", [p for p in _emulated_cases([(4, 2)], family=46) if p.values[1].device == "cpu"])
def test_deepep_pressure_on_emulated_groups_same_seed_same_hash(layout, run: Run):
    """Another schedule (and, relaxed, another draw of the delayed stores) gives the same outputs, and they
    equal the per-rank hashes of the sequential mode."""
    world, nvl_peers = layout
    other = dataclasses.replace(run.schedule, seed=run.schedule.seed + 500_000, policy="random")
    sequential = dataclasses.replace(run.schedule, memory="sequential")
    hashes = [normal_group(world, nvl_peers, Run("cpu", s), 94) for s in (run.schedule, other, sequential)]
    print(f"hashes: {hashes}")
    assert hashes[0] == hashes[1] == hashes[2], "outputs differ between schedules"
    low_latency = [low_latency_group(world, Run("cpu", s), 95) for s in (run.schedule, other)]
    assert low_latency[0] == low_latency[1], "low-latency outputs differ between schedules"
