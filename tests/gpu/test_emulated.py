"""Single-GPU emulation of 2, 4 and 8 ranks (one launch covers all ranks) against the torch reference."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels_cuda import Config, EmulatedGroup
from tests.gpu.cases import payload, quantize, routing, weights
from tests.gpu.reference import layouts_of, reference_combine, reference_dispatch

HIDDEN, TOKENS, TOPK = 512, 96, 4
SMALL = Config(num_sms=4, num_max_send_tokens=4, num_max_recv_tokens=16)
BUFFER = 64 << 20
TIMEOUT_CYCLES = 4_000_000_000  # ~2 s: a hang fails fast with diagnostics


def _group(num_ranks: int, config: Config = SMALL) -> EmulatedGroup:
    return EmulatedGroup(num_ranks, BUFFER, config, timeout_cycles=TIMEOUT_CYCLES, timeout_s=20.0)


def _experts(num_ranks: int) -> int:
    return 4 * num_ranks


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


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_layout_matches_reference(num_ranks):
    topk = routing("random", num_ranks, TOKENS, _experts(num_ranks), TOPK, seed=num_ranks)
    group = _group(num_ranks)
    for (per_rank, per_expert, in_rank), want in zip(group.get_dispatch_layout(topk, _experts(num_ranks)),
                                                    layouts_of(topk, _experts(num_ranks))):
        assert torch.equal(per_rank.long(), want.num_tokens_per_rank.long())
        assert torch.equal(per_expert.long(), want.num_tokens_per_expert.long())
        assert torch.equal(in_rank, want.is_token_in_rank)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("data", ["rank", "random"])
@pytest.mark.parametrize("kind", ["random", "all_to_one_rank", "rank_receives_nothing"])
def test_dispatch_and_combine_match_reference(num_ranks, data, kind):
    E = _experts(num_ranks)
    topk = routing(kind, num_ranks, TOKENS, E, TOPK, seed=7 * num_ranks)
    xs = payload(data, num_ranks, TOKENS, HIDDEN, torch.bfloat16, seed=num_ranks)
    ws = weights(num_ranks, TOKENS, TOPK, seed=num_ranks)
    group = _group(num_ranks)
    results = group.dispatch(xs, topk, ws, E)
    ref = reference_dispatch(xs, topk, ws, E)
    _assert_dispatch_matches(results, ref)

    ys = [r[0] for r in results]
    combined = group.combine(ys, [r[4] for r in results], [r[2] for r in results])
    want = reference_combine(ys, ref, [TOKENS] * num_ranks)
    for rank, ((x, w), expect) in enumerate(zip(combined, want)):
        torch.testing.assert_close(x.float(), expect.float(), rtol=1e-2, atol=1e-2, msg=f"rank {rank}: combine")
        if data == "rank":
            assert torch.equal(x, expect), f"rank {rank}: rank-encoded combine must be exact"
        # each top-k slot is non-zero on exactly one rank, so the summed weights are the originals
        slot_valid = topk[rank] >= 0
        torch.testing.assert_close(w[slot_valid], ws[rank][slot_valid])


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_float32_combine_is_exact_for_integers(num_ranks):
    E = _experts(num_ranks)
    topk = routing("random", num_ranks, TOKENS, E, TOPK, seed=3)
    xs = [torch.randint(-8, 8, (TOKENS, HIDDEN), device="cuda").float() for _ in range(num_ranks)]
    group = _group(num_ranks)
    results = group.dispatch(xs, topk, weights(num_ranks, TOKENS, TOPK, 3), E)
    ref = reference_dispatch(xs, topk, weights(num_ranks, TOKENS, TOPK, 3), E)
    combined = group.combine([r[0] for r in results], [r[4] for r in results])
    for (x, _), expect in zip(combined, reference_combine([r[0] for r in results], ref, [TOKENS] * num_ranks)):
        assert torch.equal(x, expect)


def test_cached_dispatch_reproduces_the_data():
    num_ranks, E = 4, _experts(4)
    topk = routing("random", num_ranks, TOKENS, E, TOPK, seed=11)
    xs = payload("random", num_ranks, TOKENS, HIDDEN, torch.bfloat16, seed=11)
    group = _group(num_ranks)
    first = group.dispatch(xs, topk, weights(num_ranks, TOKENS, TOPK, 11), E)
    again = group.dispatch(xs, handles=[r[4] for r in first])
    for a, b in zip(first, again):
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[4].recv_src_idx, b[4].recv_src_idx)


def test_fp8_payload_and_strided_scales_travel_bit_exactly():
    num_ranks, E = 4, _experts(4)
    topk = routing("random", num_ranks, TOKENS, E, TOPK, seed=5)
    xs = payload("random", num_ranks, TOKENS, HIDDEN, torch.bfloat16, seed=5)
    quantized = [quantize(x) for x in xs]
    ws = weights(num_ranks, TOKENS, TOPK, 5)
    group = _group(num_ranks)
    results = group.dispatch(quantized, topk, ws, E)
    ref_rows = reference_dispatch([q for q, _ in quantized], topk, ws, E)
    ref_scales = reference_dispatch([s.contiguous() for _, s in quantized], topk, ws, E)
    _assert_dispatch_matches(results, ref_rows, fp8=True)
    for (recv, *_), want in zip(results, ref_scales):
        assert torch.equal(recv[1], want.x)


def test_num_worst_tokens_pads_without_host_sync():
    num_ranks, E = 4, _experts(4)
    topk = routing("random", num_ranks, TOKENS, E, TOPK, seed=9)
    xs = payload("random", num_ranks, TOKENS, HIDDEN, torch.bfloat16, seed=9)
    ws = weights(num_ranks, TOKENS, TOPK, 9)
    group = _group(num_ranks)
    exact = group.dispatch(xs, topk, ws, E)
    worst = TOKENS * num_ranks
    padded = group.dispatch(xs, topk, ws, E, num_worst_tokens=worst)
    for a, b in zip(exact, padded):
        rows = a[0].shape[0]
        assert b[0].shape[0] == worst and b[3] == []
        assert torch.equal(a[0], b[0][:rows]) and torch.equal(a[1], b[1][:rows])
        assert bool((b[1][rows:] == -1).all())


@pytest.mark.parametrize("config", [Config(2, 1, 1), Config(2, 1, 2), Config(6, 2, 3), Config(4, 3, 3)])
def test_tiny_rings_and_chunk_one(config):
    num_ranks, E = 4, _experts(4)
    for kind in ("random", "all_to_one_rank", "rank_receives_nothing"):
        topk = routing(kind, num_ranks, TOKENS, E, TOPK, seed=13)
        xs = payload("random", num_ranks, TOKENS, HIDDEN, torch.bfloat16, seed=13)
        ws = weights(num_ranks, TOKENS, TOPK, 13)
        group = _group(num_ranks, config)
        results = group.dispatch(xs, topk, ws, E)
        ref = reference_dispatch(xs, topk, ws, E)
        _assert_dispatch_matches(results, ref)
        combined = group.combine([r[0] for r in results], [r[4] for r in results])
        for (x, _), expect in zip(combined, reference_combine([r[0] for r in results], ref, [TOKENS] * num_ranks)):
            torch.testing.assert_close(x.float(), expect.float(), rtol=1e-2, atol=1e-2)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def test_determinism_loop():
    num_ranks, E = 8, _experts(8)
    topk = routing("random", num_ranks, TOKENS, E, TOPK, seed=21)
    xs = payload("random", num_ranks, TOKENS, HIDDEN, torch.bfloat16, seed=21)
    ws = weights(num_ranks, TOKENS, TOPK, 21)
    group = _group(num_ranks)
    digests = set()
    for _ in range(10):
        results = group.dispatch(xs, topk, ws, E)
        combined = group.combine([r[0] for r in results], [r[4] for r in results], [r[2] for r in results])
        digests.add(_digest([t for r in results for t in (r[0], r[1], r[2])] + [c[0] for c in combined]))
    assert len(digests) == 1


def test_stalled_rank_ends_in_timeout_diagnostics():
    script = Path(__file__).with_name("stalled_rank.py")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    output = proc.stdout + proc.stderr
    print(output[-4000:])
    assert proc.returncode != 0, output
    assert "kernels_cuda timeout" in output or "device timeout: role=" in output or "error_record" in output, output
    assert "ERROR_RECORD code=1" in output, output


def test_num_worst_tokens_too_small_traps_with_a_record():
    script = Path(__file__).with_name("worst_tokens_overflow.py")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "ERROR_RECORD code=2" in output and "rank=3" in output, output  # the rank all tokens go to
    assert "num_worst_tokens is 32" in output, output
