"""Dispatch pieces without processes: records, FP8, and the backends on thread-simulated ranks.

The simulated EP group drives the same backend code as gloo (only the transport differs); here it
covers the degenerate layouts the gloo suite skips (one node; one rank per node).
"""
import pytest
import torch

from parallel.dispatch import DISPATCH, INTER_NODE, INTRA_NODE, make_dispatcher
from parallel.dispatch.fp8 import dequantize_e4m3, quantize_e4m3
from parallel.dispatch.records import pack_rows, specs_of, unpack_rows
from parallel.dispatch.simulated import SimulatedEPGroup


def test_records_round_trip_mixed_dtypes_and_empty():
    for rows in (5, 0):
        fields = [torch.randn(rows, 3), torch.randint(-1, 9, (rows, 2), dtype=torch.int32),
                  torch.randn(rows, 4).to(torch.bfloat16), torch.randn(rows, 128).to(torch.float8_e4m3fn)]
        packed = pack_rows(fields)
        assert packed.dtype == torch.uint8 and packed.shape == (rows, 12 + 8 + 8 + 128)
        back = unpack_rows(packed, specs_of(fields))
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fields, back))


def test_fp8_error_is_within_half_a_step_of_the_block_scale():
    x = torch.randn(6, 256) * torch.logspace(-3, 2, 6).unsqueeze(1)
    x[0, :128] = 0  # an all-zero block must not divide by zero
    q, scales = quantize_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (6, 2)
    blocks = x.view(6, 2, 128)
    bound = blocks.abs() / 16 + blocks.abs().amax(-1, keepdim=True) / 448 / 1024 + 1e-12
    assert ((dequantize_e4m3(q, scales, torch.float32) - x).view(6, 2, 128).abs() <= bound).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_e4m3(torch.randn(2, 100))


@pytest.mark.parametrize("ep,per_node", [(4, 4), (4, 1), (8, 4)], ids=["one-node", "rank-per-node", "2x4"])
def test_backends_on_simulated_ranks(ep, per_node):
    experts, tokens, hidden = 2 * ep, 10, 16
    gen = torch.Generator().manual_seed(ep * 10 + per_node)
    inputs = [(torch.randn(tokens, hidden, generator=gen),
               torch.stack([torch.randperm(experts, generator=gen)[:3] for _ in range(tokens)]),
               torch.rand(tokens, 3, generator=gen)) for _ in range(ep)]

    def step(name):
        def one_rank(rank, comms):
            x, topk_idx, weights = inputs[rank]
            dispatcher = make_dispatcher(name, comms, experts)
            recv_x, recv_idx, recv_w, _, handle = dispatcher.dispatch(
                x, topk_idx, weights, dispatcher.layout(topk_idx, experts))
            return recv_x, recv_idx, recv_w, dispatcher.combine(recv_x, handle), dispatcher.traffic
        return SimulatedEPGroup(ep, per_node).run(one_rank)

    flat, hierarchical = step("alltoall"), step("hierarchical")
    for rank in range(ep):
        x, topk_idx, _ = inputs[rank]
        assert all(torch.equal(a, b) for a, b in zip(flat[rank][:3], hierarchical[rank][:3]))
        destinations = torch.tensor([float(len(set((row // 2).tolist()))) for row in topk_idx])
        for result in (flat[rank], hierarchical[rank]):
            assert torch.allclose(result[3], x * destinations.unsqueeze(1), rtol=1e-6, atol=0)
            traffic = result[4]
            if per_node == ep:
                assert traffic.rows[DISPATCH, INTER_NODE] == 0 and traffic.rows[DISPATCH, INTRA_NODE] > 0
            if per_node == 1:
                assert traffic.rows[DISPATCH, INTRA_NODE] == 0 and traffic.rows[DISPATCH, INTER_NODE] > 0
