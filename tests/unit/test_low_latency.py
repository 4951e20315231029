"""The low-latency reference (`parallel.dispatch.low_latency`) on simulated EP ranks (threads), against an
oracle written here as plain loops over every rank's inputs (DeepEP's test_low_latency.py checks):
per local expert, count == cumulative stats == the sum of layout_range counts; each (expert, source)
group holds exactly the source's tokens for that expert, rows equal to the source's row (or its FP8
bytes and scale, computed here from amax / 448); combine equals sum_k w_k * f_e(x) in fp32. Then hook
mode, the double-buffer rule over three consecutive ops, zero-copy, `out=` and the errors. The same
calls over gloo processes: tests/distributed/test_low_latency.py."""
from __future__ import annotations

import math

import pytest
import torch

from parallel.dispatch.low_latency import LowLatencyExchange
from parallel.dispatch.simulated import SimulatedEPGroup

R, E, H, K, T_MAX = 4, 8, 512, 3, 12


def routing(seed: int, rank: int, tokens: int, kind: str = "random") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x bf16 [tokens, H], topk_idx [tokens, K], weights) of `rank`; kind: random, one_expert, avoid_rank_1."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = (torch.randn(tokens, H, generator=g) * torch.rand(tokens, 1, generator=g) * 4).bfloat16()
    scores = torch.rand(tokens, E, generator=g)
    if kind == "avoid_rank_1":
        scores[:, E // R: 2 * E // R] = -1
    idx = scores.topk(K, dim=1).indices
    idx[torch.rand(tokens, K, generator=g) < 0.15] = -1
    if kind == "one_expert":
        idx[:, 0], idx[:, 1:] = 5, -1
    return x, idx, torch.rand(tokens, K, generator=g)


def expert_output(x: torch.Tensor, expert: int) -> torch.Tensor:
    """A stand-in for expert `expert`'s FFN: a distinct, exactly representable scaling per expert."""
    return (x.float() * (expert + 1) / 8).bfloat16()


def fp8_oracle(row: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scales = []
    out = torch.empty(H, dtype=torch.float8_e4m3fn)
    for b in range(H // 128):
        block = row[b * 128:(b + 1) * 128].float()
        scale = max(block.abs().max().item(), 1e-4) / 448.0
        if round_scale:
            scale = 2.0 ** math.ceil(math.log2(scale))
        out[b * 128:(b + 1) * 128] = (block / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales.append(scale)
    return out, torch.tensor(scales, dtype=torch.float32)


def check_dispatch(rank: int, inputs, recv_x, count, handle, stats, use_fp8: bool, round_scale: bool,
                   use_ue8m0: bool) -> None:
    local = E // R
    src_info, layout_range = handle.src_info, handle.layout_range
    assert count.dtype == torch.int32 and layout_range.dtype == torch.int64
    for e in range(local):
        expert = rank * local + e
        ranges = [(int(v) >> 32, int(v) & 0xFFFFFFFF) for v in layout_range[e]]
        assert int(count[e]) == sum(n for _, n in ranges) == int(stats[e])
        covered = sorted(i for begin, n in ranges for i in range(begin, begin + n))
        assert covered == list(range(int(count[e])))  # the groups tile the valid rows
        for src, (begin, n) in enumerate(ranges):
            x, idx, _ = inputs[src]
            want = sorted(t for t in range(idx.shape[0]) if expert in idx[t].tolist())
            got = src_info[e, begin:begin + n].tolist()
            assert sorted(got) == want, (rank, e, src)
            for row, t in zip(range(begin, begin + n), got):
                if not use_fp8:
                    assert torch.equal(recv_x[e, row], x[t]), (rank, e, src, t)
                    continue
                q, scales = fp8_oracle(x[t], round_scale or use_ue8m0)
                assert torch.equal(recv_x[0][e, row].view(torch.uint8), q.view(torch.uint8)), (rank, e, src, t)
                got_scales = recv_x[1][e, row]
                if use_ue8m0:
                    exponents = [(int(got_scales[j // 4]) >> (8 * (j % 4))) & 0xFF for j in range(H // 128)]
                    assert exponents == [int(math.log2(s)) + 127 for s in scales.tolist()], (rank, e, t)
                else:
                    assert torch.equal(got_scales, scales), (rank, e, t)


def combined_oracle(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(K):
            if idx[t, k] >= 0:
                out[t] += w[t, k] * expert_output(x[t:t + 1], int(idx[t, k]))[0].float()
    return out.bfloat16()


def expert_outputs(recv_x, handle, rank: int, use_fp8: bool) -> torch.Tensor:
    """The packed layout's expert outputs from the received rows (FP8 rows dequantised first)."""
    rows = recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=2) if use_fp8 else recv_x.float()
    local = E // R
    return torch.stack([expert_output(rows[e], rank * local + e) for e in range(local)])


def round_trip(seed: int, tokens: list[int], kind: str, use_fp8: bool, round_scale: bool, use_ue8m0: bool):
    print(f"seed {seed}, tokens per rank {tokens}, routing {kind}")
    inputs = [routing(seed, r, tokens[r], kind) for r in range(R)]

    def body(rank: int, comms) -> None:
        ll = LowLatencyExchange(comms.ep)
        x, idx, w = inputs[rank]
        stats = torch.zeros(E // R, dtype=torch.int32)
        recv_x, count, handle, event, hook = ll.low_latency_dispatch(
            x, idx, T_MAX, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0)
        assert hook is None and event.event is None
        check_dispatch(rank, inputs, recv_x, count, handle, stats, use_fp8, round_scale, use_ue8m0)
        if use_ue8m0:
            return  # (the expert outputs would need the unpacked scales; the FP8 case covers combine)
        ys = expert_outputs(recv_x, handle, rank, use_fp8)
        combined, _, hook = ll.low_latency_combine(ys, idx, w, handle)
        assert hook is None
        want = combined_oracle(inputs[rank][0] if not use_fp8 else dequantised(inputs[rank][0], round_scale), idx, w)
        torch.testing.assert_close(combined.float(), want.float(), rtol=1e-2, atol=1e-2)

    SimulatedEPGroup(R, 2, timeout_s=60).run(body)


def dequantised(x: torch.Tensor, round_scale: bool) -> torch.Tensor:
    rows = []
    for row in x:
        q, scales = fp8_oracle(row, round_scale)
        rows.append((q.float().view(-1, 128) * scales.unsqueeze(1)).flatten())
    return torch.stack(rows).bfloat16() if rows else x


@pytest.mark.parametrize("use_fp8, round_scale, use_ue8m0", [(False, False, False), (True, False, False),
                                                             (True, True, False), (True, True, True)],
                         ids=["bf16", "fp8", "fp8-round-scale", "fp8-ue8m0"])
def test_dispatch_and_combine_match_the_oracle(use_fp8, round_scale, use_ue8m0):
    round_trip(7, [10, 12, 3, 9], "random", use_fp8, round_scale, use_ue8m0)


@pytest.mark.parametrize("kind, tokens", [("one_expert", [12, 12, 12, 12]), ("avoid_rank_1", [5, 12, 0, 7])],
                         ids=["all-tokens-to-one-expert-T_max-full", "a-rank-receives-nothing"])
def test_edge_routings(kind, tokens):
    round_trip(11, tokens, kind, True, False, False)


def test_scales_are_column_major_in_the_last_two_dims():
    inputs = [routing(3, r, 6) for r in range(R)]

    def body(rank, comms):
        (rows, scales), *_ = LowLatencyExchange(comms.ep).low_latency_dispatch(*inputs[rank][:2], T_MAX, E)
        assert scales.shape == (E // R, R * T_MAX, H // 128) and scales.stride() == (R * T_MAX * H // 128, 1, R * T_MAX)
        assert rows.dtype == torch.float8_e4m3fn and rows.shape == (E // R, R * T_MAX, H)

    SimulatedEPGroup(R, 2).run(body)


def test_hook_mode_three_consecutive_ops_and_the_double_buffer_rule():
    inputs = [routing(5, r, 8) for r in range(R)]

    def body(rank, comms):
        ll = LowLatencyExchange(comms.ep)
        x, idx, w = inputs[rank]
        sync_x, sync_count, sync_handle, _, _ = ll.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        # three consecutive hooked ops: dispatch, dispatch, combine of the first, each hook called before the
        # next op, as the one-way signals require
        first = ll.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False, return_recv_hook=True)
        with pytest.raises(RuntimeError, match="receive is pending: call its hook first"):
            ll.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        first[4]()
        second = ll.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False, return_recv_hook=True)
        second[4]()
        ys = expert_outputs(first[0], first[2], rank, False)
        third = ll.low_latency_combine(ys, idx, w, first[2], return_recv_hook=True)
        third[2]()
        with pytest.raises(RuntimeError, match="already called"):
            third[2]()
        for recv_x, count, handle, _, _ in (first, second):  # a hooked op receives what a synchronous one does
            assert torch.equal(count, sync_count) and torch.equal(handle.layout_range, sync_handle.layout_range)
            for e, n in enumerate(count.tolist()):
                assert torch.equal(recv_x[e, :n], sync_x[e, :n]) and torch.equal(handle.src_info[e, :n],
                                                                                 sync_handle.src_info[e, :n])
        torch.testing.assert_close(third[0].float(), combined_oracle(x, idx, w).float(), rtol=1e-2, atol=1e-2)
        with pytest.raises(ValueError, match="cannot both be set"):
            ll.low_latency_dispatch(x, idx, T_MAX, E, async_finish=True, return_recv_hook=True)

    SimulatedEPGroup(R, 2, timeout_s=60).run(body)


def test_zero_copy_and_out():
    inputs = [routing(9, r, 7) for r in range(R)]

    def body(rank, comms):
        ll = LowLatencyExchange(comms.ep)
        x, idx, w = inputs[rank]
        recv_x, _, handle, _, _ = ll.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        ys = expert_outputs(recv_x, handle, rank, False)
        buffer = ll.get_next_low_latency_combine_buffer(handle)
        buffer.copy_(ys)  # the experts write straight into the buffer
        out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
        combined, _, _ = ll.low_latency_combine(torch.zeros_like(ys), idx, w, handle, zero_copy=True, out=out)
        assert combined is out
        torch.testing.assert_close(out.float(), combined_oracle(x, idx, w).float(), rtol=1e-2, atol=1e-2)

    SimulatedEPGroup(R, 2).run(body)


def test_bad_inputs_are_refused_before_anything_is_sent():
    x, idx, w = routing(1, 0, 6)

    def body(rank, comms):
        ll = LowLatencyExchange(comms.ep)
        bad = [
            (lambda: ll.low_latency_dispatch(torch.zeros(T_MAX + 1, H, dtype=torch.bfloat16),
                                             torch.zeros(T_MAX + 1, K, dtype=torch.int64), T_MAX, E),
             "exceed num_max_dispatch_tokens_per_rank=12"),
            (lambda: ll.low_latency_dispatch(x.float(), idx, T_MAX, E), "x must be bfloat16"),
            (lambda: ll.low_latency_dispatch(x, idx.int(), T_MAX, E), "topk_idx must be int64"),
            (lambda: ll.low_latency_dispatch(x, torch.full_like(idx, E), T_MAX, E), "outside"),
            (lambda: ll.low_latency_dispatch(x, torch.zeros_like(idx), T_MAX, E), "same expert twice"),
            (lambda: ll.low_latency_dispatch(x[:, :200], idx, T_MAX, E), "multiple of 128"),
            (lambda: ll.low_latency_dispatch(x, idx, T_MAX, E, use_ue8m0=True), "needs use_fp8 and round_scale"),
            (lambda: ll.low_latency_dispatch(x, idx, T_MAX, 6), "do not split"),
            (lambda: ll.low_latency_dispatch(x, idx, T_MAX, E, cumulative_local_expert_recv_stats=torch.zeros(2)),
             "must be int32"),
        ]
        messages = []
        for call, match in bad:
            with pytest.raises(ValueError, match=match):
                call()
            messages.append(match)
        recv_x, _, handle, _, _ = ll.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)  # still in step
        with pytest.raises(ValueError, match="packed layout"):
            ll.low_latency_combine(recv_x[:, :5], idx, w, handle)
        with pytest.raises(ValueError, match="use_logfmt"):
            ll.low_latency_combine(recv_x, idx, w, handle, use_logfmt=True)
        return messages

    SimulatedEPGroup(R, 2).run(body)


def test_round_scale_is_the_exact_power_of_two_ceiling():
    # float log2 rounds 2^k * (1 + 2^-23) down to k; DeepEP's kernels read the exponent bits instead
    from model.fp8 import power_of_two_ceil
    k = torch.arange(-30, 10, dtype=torch.float32)
    exact = torch.exp2(k)
    just_above = exact * (1 + 2.0 ** -23)
    assert torch.equal(power_of_two_ceil(exact), exact)
    assert torch.equal(power_of_two_ceil(just_above), exact * 2)
    assert torch.equal(power_of_two_ceil(exact * 1.5), exact * 2)


def test_float32_rows_travel_bit_exact_and_combine_in_float32():
    """The reference's extension for exact fp32 decoding (DeepEP takes bfloat16 only)."""
    seed = 29
    print(f"seed {seed}")
    inputs = [(x.float() * 1.001, idx, w) for x, idx, w in (routing(seed, r, 6) for r in range(R))]

    def body(rank: int, comms) -> None:
        ll = LowLatencyExchange(comms.ep)
        x, idx, w = inputs[rank]
        with pytest.raises(ValueError, match="float32 without use_fp8"):
            ll.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=True)
        recv_x, count, handle, _, _ = ll.low_latency_dispatch(x, idx, T_MAX, E, use_fp8=False)
        assert recv_x.dtype == torch.float32
        for e in range(E // R):
            for src in range(R):
                begin, n = int(handle.layout_range[e, src]) >> 32, int(handle.layout_range[e, src]) & 0xFFFFFFFF
                tokens = handle.src_info[e, begin:begin + n].long()
                assert torch.equal(recv_x[e, begin:begin + n], inputs[src][0][tokens])
        local = E // R
        scale = (torch.arange(rank * local, (rank + 1) * local) + 1).float().view(-1, 1, 1) / 8  # expert e: x (e+1)/8
        combined, _, _ = ll.low_latency_combine(recv_x * scale, idx, w, handle)
        want = torch.zeros(x.shape[0], H)
        for t in range(x.shape[0]):
            for k in range(K):
                if idx[t, k] >= 0:
                    want[t] += w[t, k] * x[t] * (int(idx[t, k]) + 1) / 8
        assert combined.dtype == torch.float32
        torch.testing.assert_close(combined, want, rtol=1e-6, atol=1e-6)

    SimulatedEPGroup(R, 2, timeout_s=60).run(body)
