"""Low-latency kernels (an EmulatedGroup with a low-latency region: every rank in one launch) against the
pure-torch reference `parallel.dispatch.low_latency` on simulated ranks, bit-exact.

Dispatch is compared per (local expert, source rank) group, rows in source-token order: the kernels
place the groups in arrival order and the rows of a group in slot order, so positions differ, but
count, the groups' counts, source indices, rows (bfloat16, or e4m3 bytes), scales (float, or UE8M0
exponent bytes, column-major) and the cumulative stats must be identical. Combine is fed the same
per-token expert outputs on both sides and must be identical bit for bit (fp32 sum in top-k order).
Cases: random routing, a rank receiving nothing, every token to one expert with T_max exactly full,
tokens with no expert; FP8 with float, rounded and UE8M0 scales; hook mode over three consecutive ops
(the double buffer); zero-copy and `out=`; the refusals. Each case runs on the CPU emulation under
several scheduler seeds (tests/kernels/runs.py)."""
from __future__ import annotations

import pytest
import torch

from kernels_cuda import Buffer, EmulatedGroup
from parallel.dispatch.low_latency import LowLatencyExchange
from parallel.dispatch.simulated import SimulatedEPGroup
from tests.kernels.runs import Run, cases

E_PER_RANK, H, K, T_MAX = 2, 512, 3, 12
TIMEOUT_CYCLES = 4_000_000_000


def _group(num_ranks: int, run: Run) -> EmulatedGroup:
    num_bytes = Buffer.get_low_latency_rdma_size_hint(T_MAX, H, num_ranks, E_PER_RANK * num_ranks)
    return EmulatedGroup(num_ranks, 1 << 20, timeout_cycles=TIMEOUT_CYCLES, num_rdma_bytes=num_bytes,
                         **run.group_kwargs())


def inputs_for(kind: str, num_ranks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per rank (x bf16 [T, H], topk_idx [T, K], weights [T, K])."""
    print(f"data seed {seed}: routing {kind}, {num_ranks} ranks")
    E = E_PER_RANK * num_ranks
    out = []
    for rank in range(num_ranks):
        g = torch.Generator().manual_seed(seed * 131 + rank)
        tokens = T_MAX if kind == "one_expert_full" else int(torch.randint(0, T_MAX + 1, (1,), generator=g))
        x = (torch.randn(tokens, H, generator=g) * torch.rand(tokens, 1, generator=g) * 4).bfloat16()
        x[:, :128][torch.rand(tokens, 128, generator=g) < 0.3] = 0  # small and zero values: e4m3 subnormals
        scores = torch.rand(tokens, E, generator=g)
        if kind == "rank_1_receives_nothing":
            scores[:, E_PER_RANK:2 * E_PER_RANK] = -1
        idx = scores.topk(K, dim=1).indices
        idx[torch.rand(tokens, K, generator=g) < 0.15] = -1
        if kind == "one_expert_full":
            idx[:, 0], idx[:, 1:] = E - 1, -1
        out.append((x, idx, torch.rand(tokens, K, generator=g)))
    return out


def _reference(inputs, fp8: tuple[bool, bool, bool], hook: bool = False) -> list[tuple]:
    """Per rank (dispatch result, combine output of _expert_outputs), from the reference."""
    num_ranks = len(inputs)

    def body(rank: int, comms) -> tuple:
        ll = LowLatencyExchange(comms.ep)
        x, idx, w = inputs[rank]
        stats = torch.zeros(E_PER_RANK, dtype=torch.int32)
        result = ll.low_latency_dispatch(x, idx, T_MAX, E_PER_RANK * num_ranks, stats, *fp8)
        combined, _, _ = ll.low_latency_combine(expert_outputs(result[0], rank, fp8), idx, w, result[2])
        return result, stats, combined

    return SimulatedEPGroup(num_ranks, num_ranks, timeout_s=60).run(body)


def expert_outputs(recv_x, rank: int, fp8: tuple[bool, bool, bool]) -> torch.Tensor:
    """Expert e's stand-in output: its (dequantised) rows times (e + 1) / 8, bfloat16; a function of
    each row alone, so it does not depend on where the row was packed."""
    use_fp8, _, use_ue8m0 = fp8
    if not use_fp8:
        rows = recv_x.float()
    else:
        scales = recv_x[1]
        if use_ue8m0:
            from parallel.dispatch.fp8 import unpack_ue8m0
            scales = unpack_ue8m0(scales)
        rows = recv_x[0].float() * scales.repeat_interleave(128, dim=2)
    factors = torch.arange(E_PER_RANK, dtype=torch.float32).add(rank * E_PER_RANK + 1).div(8).view(-1, 1, 1)
    return (rows * factors).bfloat16()


def groups_of(recv_x, count, handle, num_ranks: int) -> list:
    """Per local expert: count, per-source counts, and source indices, rows and scales in (source, token) order."""
    rows, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    out = []
    for e in range(E_PER_RANK):
        ranges = [(int(v) >> 32, int(v) & 0xFFFFFFFF) for v in handle.layout_range[e]]
        covered = sorted(i for begin, n in ranges for i in range(begin, begin + n))
        assert covered == list(range(int(count[e]))), f"expert {e}: layout_range does not tile the valid rows"
        order = torch.cat([begin + handle.src_info[e, begin:begin + n].argsort() for begin, n in ranges]).long()
        got_rows = rows[e, order]
        out.append((int(count[e]), [n for _, n in ranges], handle.src_info[e, order],
                    got_rows.view(torch.uint8) if got_rows.dtype == torch.float8_e4m3fn else got_rows,
                    None if scales is None else scales[e, order]))
    return out


def assert_same(results, stats, want, num_ranks: int) -> None:
    for rank, ((recv_x, count, handle, _, _), (ref, ref_stats, _)) in enumerate(zip(results, want)):
        assert torch.equal(count, ref[1]), f"rank {rank}: packed_recv_count {count} != {ref[1]}"
        assert torch.equal(stats[rank], ref_stats), f"rank {rank}: cumulative stats"
        for e, (got, expect) in enumerate(zip(groups_of(recv_x, count, handle, num_ranks),
                                              groups_of(ref[0], ref[1], ref[2], num_ranks))):
            assert got[:2] == expect[:2], f"rank {rank} expert {e}: counts per source {got[1]} != {expect[1]}"
            for name, a, b in zip(("src_info", "rows", "scales"), got[2:], expect[2:]):
                assert (a is None and b is None) or torch.equal(a, b), f"rank {rank} expert {e}: {name} differ"
        if isinstance(recv_x, tuple):
            scales = recv_x[1]
            assert scales.stride()[1:] == (1, num_ranks * T_MAX), "scales are column-major in the last two dims"


FP8_MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8_round": (True, True, False),
             "ue8m0": (True, True, True)}
CASES = [(r, kind, mode) for r in (2, 4) for kind in ("random", "rank_1_receives_nothing", "one_expert_full")
         for mode in FP8_MODES]


@pytest.mark.parametrize("case,run", cases(CASES, 24, family=31))
def test_dispatch_and_combine_match_the_reference(case, run):
    num_ranks, kind, mode = case
    fp8 = FP8_MODES[mode]
    inputs = inputs_for(kind, num_ranks, seed=3 * num_ranks + len(kind) + len(mode))
    want = _reference(inputs, fp8)
    group = _group(num_ranks, run)
    stats = [torch.zeros(E_PER_RANK, dtype=torch.int32) for _ in range(num_ranks)]
    results = group.low_latency_dispatch([x for x, _, _ in inputs], [i for _, i, _ in inputs], T_MAX,
                                         E_PER_RANK * num_ranks, stats, *fp8)
    assert_same(results, stats, want, num_ranks)
    ys = [expert_outputs(r[0], rank, fp8) for rank, r in enumerate(results)]
    combined = group.low_latency_combine(ys, [i for _, i, _ in inputs], [w for _, _, w in inputs],
                                         [r[2] for r in results])
    for rank, ((out, _, hook), (_, _, expect)) in enumerate(zip(combined, want)):
        assert hook is None
        assert torch.equal(out, expect), f"rank {rank}: combine differs from the reference"


@pytest.mark.parametrize("num_ranks,run", cases([2, 4], 8, family=32))
def test_hook_mode_zero_copy_and_consecutive_ops_over_both_halves(num_ranks, run):
    """Six ops, so that each half carries a dispatch and a combine of different data in turn: dispatch A
    (hook), dispatch B, combine A (zero-copy, hook), combine B (out=), dispatch C, combine C. Each is what
    the reference gives (stale signals of an earlier op in the same half would show); stats accumulate;
    a new op while a hook is pending is refused."""
    E = E_PER_RANK * num_ranks
    bf16 = FP8_MODES["bf16"]
    group = _group(num_ranks, run)
    stats = [torch.zeros(E_PER_RANK, dtype=torch.int32) for _ in range(num_ranks)]
    batches = [inputs_for("random", num_ranks, seed=40 + num_ranks + b) for b in range(3)]
    wants = [_reference(inputs, bf16) for inputs in batches]
    columns = [([x for x, _, _ in inputs], [i for _, i, _ in inputs], [w for _, _, w in inputs]) for inputs in batches]

    (xa, ia, wa), (xb, ib, wb), (xc, ic, wc) = columns
    a = group.low_latency_dispatch(xa, ia, T_MAX, E, stats, use_fp8=False, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="receive is pending: call its hook first"):
        group.low_latency_dispatch(xb, ib, T_MAX, E, use_fp8=False)
    a[0][4]()
    b = group.low_latency_dispatch(xb, ib, T_MAX, E, stats, use_fp8=False)
    handles_a = [r[2] for r in a]
    for rank, (buffer, r) in enumerate(zip(group.get_next_low_latency_combine_buffer(handles_a), a)):
        buffer.copy_(expert_outputs(r[0], rank, bf16))
    combine_a = group.low_latency_combine(None, ia, wa, handles_a, zero_copy=True, return_recv_hook=True)
    combine_a[0][2]()
    with pytest.raises(RuntimeError, match="already called"):
        combine_a[0][2]()
    outs = [torch.empty(x.shape[0], H, dtype=torch.bfloat16) for x in xb]
    combine_b = group.low_latency_combine([expert_outputs(r[0], rank, bf16) for rank, r in enumerate(b)], ib, wb,
                                          [r[2] for r in b], out=outs)
    c = group.low_latency_dispatch(xc, ic, T_MAX, E, use_fp8=False)
    combine_c = group.low_latency_combine([expert_outputs(r[0], rank, bf16) for rank, r in enumerate(c)], ic, wc,
                                          [r[2] for r in c])

    total = [sum(want[rank][1] for want in wants[:2]) for rank in range(num_ranks)]
    assert all(torch.equal(s, t) for s, t in zip(stats, total)), "cumulative stats over dispatches A and B"
    for results, want in ((a, wants[0]), (b, wants[1]), (c, wants[2])):
        assert_same(results, [w[1] for w in want], want, num_ranks)
    for rank in range(num_ranks):
        assert torch.equal(combine_a[rank][0], wants[0][rank][2]), f"rank {rank}: zero-copy hooked combine A"
        assert combine_b[rank][0] is outs[rank] and torch.equal(outs[rank], wants[1][rank][2]), f"rank {rank}: B"
        assert torch.equal(combine_c[rank][0], wants[2][rank][2]), f"rank {rank}: combine C"


def test_bad_inputs_are_refused_before_anything_is_launched():
    run = Run("cpu")
    group = _group(2, run)
    x, idx, _ = inputs_for("random", 2, seed=1)[0]
    too_many = torch.zeros(T_MAX + 1, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"rank 0\): 13 tokens exceed num_max_dispatch_tokens_per_rank=12"):
        group.low_latency_dispatch([too_many, too_many], [torch.zeros(T_MAX + 1, K, dtype=torch.long)] * 2, T_MAX, 4)
    with pytest.raises(ValueError, match="use_ue8m0 needs use_fp8 and round_scale"):
        group.low_latency_dispatch([x, x], [idx, idx], T_MAX, 4, use_ue8m0=True)
    with pytest.raises(RuntimeError, match="low-latency ops need num_rdma_bytes > 0"):
        EmulatedGroup(2, 1 << 20, device="cpu").low_latency_dispatch([x, x], [idx, idx], T_MAX, 4)
    # nothing was launched: the next op works
    results = group.low_latency_dispatch([x, x], [idx, idx], T_MAX, 4, use_fp8=False)
    assert int(sum(r[1].sum() for r in results)) == int((idx >= 0).sum()) * 2
