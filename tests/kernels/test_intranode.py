"""Intranode kernels (an EmulatedGroup: every rank in one launch) against the pure-torch reference,
bit-exact: layout, dispatch and combine with float32, bfloat16 and FP8 payloads (scales strided as
DeepEP's callers pass them), cached dispatch, num_worst_tokens and its overflow trap, tiny rings and
chunk 1, skewed routings (every token to one rank, a rank that receives nothing, tokens with no
expert), and a stalled rank's timeout diagnostics. Each case runs on the CPU emulation under several
scheduler seeds and once on CUDA when present (tests/kernels/runs.py)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from kernels_cuda import Config, EmulatedGroup
from tests.kernels.cases import payload, quantize, routing, weights
from tests.kernels.reference import layouts_of, reference_combine, reference_dispatch
from tests.kernels.runs import Run, cases
from tests.kernels.traps import intranode_stall, intranode_worst_tokens_overflow, run_trap

HIDDEN, TOKENS, TOPK = 256, 48, 4
SMALL = Config(num_sms=4, num_max_send_tokens=4, num_max_recv_tokens=16)
TIMEOUT_CYCLES = 4_000_000_000  # a hang ends in diagnostics (the emulator finds deadlocks sooner)


def _group(num_ranks: int, run: Run, config: Config = SMALL) -> EmulatedGroup:
    bytes_per_rank = config.buffer_size_hint(num_ranks, 4 * HIDDEN, TOPK)  # float32 rows fit too
    return EmulatedGroup(num_ranks, bytes_per_rank, config, timeout_cycles=TIMEOUT_CYCLES, timeout_s=20.0,
                         **run.group_kwargs())


def _experts(num_ranks: int) -> int:
    return 4 * num_ranks


def _inputs(kind: str, data: str, dtype: torch.dtype, num_ranks: int, seed: int, device: str):
    print(f"data seed {seed}: routing {kind}, payload {data} {dtype}, {num_ranks} ranks")
    topk = routing(kind, num_ranks, TOKENS, _experts(num_ranks), TOPK, seed=seed, device=device)
    if data == "integers":  # exact under any summation order
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randint(-8, 8, (TOKENS, HIDDEN), generator=g).to(dtype).to(device) for _ in range(num_ranks)]
    else:
        xs = payload(data, num_ranks, TOKENS, HIDDEN, dtype, seed=seed, device=device)
    return topk, xs, weights(num_ranks, TOKENS, TOPK, seed=seed, device=device)


def _assert_dispatch_matches(results, ref, fp8: bool = False) -> None:
    for rank, ((recv_x, idx, w, per_expert, handle), want) in enumerate(zip(results, ref)):
        rows = recv_x[0] if fp8 else recv_x
        got = rows.view(torch.uint8) if fp8 else rows
        expect = want.x.view(torch.uint8) if fp8 else want.x
        assert torch.equal(got, expect), f"rank {rank}: recv_x differs"
        assert torch.equal(handle.recv_src_idx.long(), want.src_idx), f"rank {rank}: source indices differ"
        assert torch.equal(idx, want.topk_idx), f"rank {rank}: recv_topk_idx differs"
        assert torch.equal(w, want.topk_weights), f"rank {rank}: recv_topk_weights differ"
        assert per_expert == want.per_expert, f"rank {rank}: per-expert counts differ"


def _assert_combine_matches(combined, ys, ref, topk, ws) -> None:
    want = reference_combine(ys, ref, [TOKENS] * len(ys))
    for rank, ((x, w), expect) in enumerate(zip(combined, want)):
        assert torch.equal(x, expect), f"rank {rank}: combine differs from the fp32 rank-order sum"
        if w is not None:  # each top-k slot is non-zero on exactly one rank: the sum is the original
            valid = topk[rank] >= 0
            assert torch.equal(w[valid], ws[rank][valid]) and bool((w[~valid] == 0).all()), f"rank {rank}: weights"


@pytest.mark.parametrize("num_ranks,run", cases([2, 4, 8], 6, family=1))
def test_layout_matches_reference(num_ranks, run):
    topk = routing("random", num_ranks, TOKENS, _experts(num_ranks), TOPK, seed=num_ranks, device=run.device)
    group = _group(num_ranks, run)
    for (per_rank, per_expert, in_rank), want in zip(group.get_dispatch_layout(topk, _experts(num_ranks)),
                                                    layouts_of(topk, _experts(num_ranks))):
        assert torch.equal(per_rank.long(), want.num_tokens_per_rank.long())
        assert torch.equal(per_expert.long(), want.num_tokens_per_expert.long())
        assert torch.equal(in_rank, want.is_token_in_rank)


DISPATCH_CASES = [(r, kind, data, dtype) for r in (2, 4, 8)
                  for kind in ("random", "all_to_one_rank", "rank_receives_nothing")
                  for data, dtype in (("random", torch.bfloat16), ("rank", torch.bfloat16), ("integers", torch.float32))]


@pytest.mark.parametrize("case,run", cases(DISPATCH_CASES, 27, family=2))
def test_dispatch_and_combine_match_reference(case, run):
    num_ranks, kind, data, dtype = case
    E = _experts(num_ranks)
    topk, xs, ws = _inputs(kind, data, dtype, num_ranks, seed=7 * num_ranks + len(kind), device=run.device)
    group = _group(num_ranks, run)
    results = group.dispatch(xs, topk, ws, E)
    ref = reference_dispatch(xs, topk, ws, E)
    _assert_dispatch_matches(results, ref)
    ys = [r[0] for r in results]
    combined = group.combine(ys, [r[4] for r in results], [r[2] for r in results])
    _assert_combine_matches(combined, ys, ref, topk, ws)


@pytest.mark.parametrize("num_ranks,run", cases([4, 8], 20, family=3))
def test_fp8_payload_and_strided_scales_travel_bit_exactly(num_ranks, run):
    E = _experts(num_ranks)
    topk, xs, ws = _inputs("random", "random", torch.bfloat16, num_ranks, seed=5, device=run.device)
    quantized = [quantize(x) for x in xs]
    results = _group(num_ranks, run).dispatch(quantized, topk, ws, E)
    _assert_dispatch_matches(results, reference_dispatch([q for q, _ in quantized], topk, ws, E), fp8=True)
    for (recv, *_), want in zip(results, reference_dispatch([s.contiguous() for _, s in quantized], topk, ws, E)):
        assert torch.equal(recv[1], want.x)


@pytest.mark.parametrize("num_ranks,run", cases([4], 20, family=4))
def test_cached_dispatch_reproduces_the_data(num_ranks, run):
    E = _experts(num_ranks)
    topk, xs, ws = _inputs("random", "random", torch.bfloat16, num_ranks, seed=11, device=run.device)
    group = _group(num_ranks, run)
    first = group.dispatch(xs, topk, ws, E)
    group.combine([r[0] for r in first], [r[4] for r in first])  # rewrites the head tables in place
    again = group.dispatch(xs, handles=[r[4] for r in first])
    for a, b in zip(first, again):
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[4].recv_src_idx, b[4].recv_src_idx)


@pytest.mark.parametrize("num_ranks,run", cases([4], 20, family=5))
def test_num_worst_tokens_pads_without_host_sync(num_ranks, run):
    E = _experts(num_ranks)
    topk, xs, ws = _inputs("random", "random", torch.bfloat16, num_ranks, seed=9, device=run.device)
    group = _group(num_ranks, run)
    exact = group.dispatch(xs, topk, ws, E)
    worst = TOKENS * num_ranks
    padded = group.dispatch(xs, topk, ws, E, num_worst_tokens=worst)
    for a, b in zip(exact, padded):
        rows = a[0].shape[0]
        assert b[0].shape[0] == worst and b[3] == []
        assert torch.equal(a[0], b[0][:rows]) and torch.equal(a[1], b[1][:rows]) and torch.equal(a[2], b[2][:rows])
        assert bool((b[1][rows:] == -1).all()) and bool((b[2][rows:] == 0).all())
    want = group.combine([r[0] for r in exact], [r[4] for r in exact], [r[2] for r in exact])
    got = group.combine([r[0] for r in padded], [r[4] for r in padded], [r[2] for r in padded])
    for (x, w), (x_want, w_want) in zip(got, want):
        assert torch.equal(x, x_want) and torch.equal(w, w_want)


TINY = [(Config(2, 1, 1), kind) for kind in ("random", "all_to_one_rank", "rank_receives_nothing")] + [
    (Config(2, 1, 2), "random"), (Config(6, 2, 3), "all_to_one_rank"), (Config(4, 3, 3), "rank_receives_nothing")]


@pytest.mark.parametrize("case,run", cases(TINY, 24, family=6))
def test_tiny_rings_and_chunk_one(case, run):
    config, kind = case
    num_ranks, E = 4, _experts(4)
    topk, xs, ws = _inputs(kind, "random", torch.bfloat16, num_ranks, seed=13, device=run.device)
    group = _group(num_ranks, run, config)
    results = group.dispatch(xs, topk, ws, E)
    ref = reference_dispatch(xs, topk, ws, E)
    _assert_dispatch_matches(results, ref)
    ys = [r[0] for r in results]
    _assert_combine_matches(group.combine(ys, [r[4] for r in results], [r[2] for r in results]), ys, ref, topk, ws)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("num_ranks,run", cases([8], 2, family=7))
def test_results_do_not_depend_on_the_interleaving(num_ranks, run):
    """Ten ops in a row (each launch interleaved differently on the CPU) give one digest."""
    E = _experts(num_ranks)
    topk, xs, ws = _inputs("random", "random", torch.bfloat16, num_ranks, seed=21, device=run.device)
    group = _group(num_ranks, run)
    digests = set()
    for _ in range(10):
        results = group.dispatch(xs, topk, ws, E)
        combined = group.combine([r[0] for r in results], [r[4] for r in results], [r[2] for r in results])
        digests.add(_digest([t for r in results for t in (r[0], r[1], r[2])] + [c[0] for c in combined]))
    assert len(digests) == 1


@pytest.mark.parametrize("config,run", cases([None], 4, family=8))
def test_stalled_rank_ends_in_timeout_diagnostics(config, run):
    record, output = run_trap(intranode_stall, run)
    assert record["code"] == 1, output
    assert record["role_name"] in ("DispatchSender", "DispatchReceiver") and record["rank"] != 1, record
    assert "kernels_cuda timeout: role=" in output, output


@pytest.mark.parametrize("config,run", cases([None], 4, family=9))
def test_num_worst_tokens_too_small_traps_with_a_record(config, run):
    record, output = run_trap(intranode_worst_tokens_overflow, run)
    assert record["code"] == 2 and record["rank"] == 3, (record, output)  # all tokens go to the last rank
    assert record["expected"] == 32 and "num_worst_tokens is 32" in output, output
