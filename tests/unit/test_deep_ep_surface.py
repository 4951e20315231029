"""`kernels_cuda.deep_ep` has DeepEP's API shape without running a kernel: the alias, the names, every
method's parameters and defaults as DeepEP's `deep_ep.Buffer` (deep_ep/buffers/legacy.py, read for
this table), DeepEP's recommended configs accepted by our kernels' validation after the ring rounding,
the size hints, the handle tuples' order, and the clear refusals (LogFMT, shrink mode, mpi4py)."""
from __future__ import annotations

import inspect
import sys

import pytest
import torch

import kernels_cuda.deep_ep as deep_ep
from kernels_cuda import Config as IntranodeConfig
from kernels_cuda import constants
from kernels_cuda.buffer import Handle
from kernels_cuda.deep_ep.buffer import DISPATCH_CONFIGS, from_tuple, to_tuple
from kernels_cuda.deep_ep.config import nodes_of
from kernels_cuda.internode import InternodeHandle
from kernels_cuda.region_view import region_view

# DeepEP's Buffer: method -> its parameters after self, with their defaults (inspect.Parameter.empty: none).
E = inspect.Parameter.empty
DEEPEP_SIGNATURES = {
    "__init__": [("group", E), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "get_dispatch_layout": [("topk_idx", E), ("num_experts", E), ("previous_event", None), ("async_finish", False),
                            ("allocate_on_comm_stream", False)],
    "dispatch": [("x", E), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                 ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                 ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": [("x", E), ("handle", E), ("topk_weights", None), ("bias", None), ("config", None),
                ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "low_latency_dispatch": [("x", E), ("topk_idx", E), ("num_max_dispatch_tokens_per_rank", E), ("num_experts", E),
                             ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
                             ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                             ("return_recv_hook", False)],
    "low_latency_combine": [("x", E), ("topk_idx", E), ("topk_weights", E), ("handle", E), ("use_logfmt", False),
                            ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False), ("out", None),
                            ("combine_wait_recv_cost_stats", None)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", E), ("hidden", E), ("num_experts", E)],
    "get_next_low_latency_combine_buffer": [("handle", E)],
    "get_local_buffer_tensor": [("dtype", E), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_comm_stream": [], "destroy": [],
}
STATIC = {"set_num_sms": [("new_num_sms", E)], "get_dispatch_config": [("num_ranks", E)],
          "get_combine_config": [("num_ranks", E)], "capture": [], "is_sm90_compiled": [],
          "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", E), ("hidden", E), ("num_ranks", E),
                                             ("num_experts", E)]}


def _params(fn, skip_self: bool) -> list[tuple[str, object]]:
    params = list(inspect.signature(fn).parameters.values())[1 if skip_self else 0:]
    return [(p.name, p.default) for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


@pytest.mark.parametrize("name", sorted(DEEPEP_SIGNATURES))
def test_buffer_methods_take_deepeps_parameters_in_order_with_its_defaults(name):
    assert _params(getattr(deep_ep.Buffer, name), skip_self=True) == DEEPEP_SIGNATURES[name]


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_methods_are_static_with_deepeps_parameters(name):
    assert isinstance(inspect.getattr_static(deep_ep.Buffer, name), staticmethod)
    assert _params(getattr(deep_ep.Buffer, name), skip_self=False) == STATIC[name]


def test_one_line_alias_gives_deep_ep_and_its_utils():
    saved = {k: sys.modules.get(k) for k in ("deep_ep", "deep_ep.utils")}
    try:
        deep_ep.install()
        from deep_ep import Buffer, Config, topk_idx_t  # noqa: F401
        from deep_ep.utils import EventHandle, EventOverlap
        assert Buffer is deep_ep.Buffer and topk_idx_t == torch.int64
        overlap = EventOverlap(EventHandle(), extra_tensors=(torch.ones(1),))
        with overlap:  # waits on exit (nothing to wait for on the CPU)
            pass
        with pytest.raises(ValueError, match="no event"):
            EventOverlap().current_stream_wait()
    finally:
        for k, module in saved.items():
            sys.modules.pop(k) if module is None else sys.modules.__setitem__(k, module)


def test_config_has_deepeps_five_fields_positionally():
    config = deep_ep.Config(24, 6, 256, 6, 128)
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (24, 6, 256, 6, 128)


@pytest.mark.parametrize("num_ranks", sorted(DISPATCH_CONFIGS))
def test_deepeps_recommended_configs_are_accepted_up_to_20_nodes(num_ranks, monkeypatch):
    monkeypatch.setattr(deep_ep.Buffer, "num_sms", 24)
    hidden_bytes, nodes_gpus = 7168 * 2, nodes_of(num_ranks)
    for config in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)):
        ours = config.for_kernels(num_ranks)
        assert ours.num_sms == 24
        nvl, rdma = config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks), config.get_rdma_buffer_size_hint(
            hidden_bytes, num_ranks)
        if isinstance(ours, IntranodeConfig):
            assert num_ranks <= 8 and rdma == 0
            assert ours.validate(num_ranks, hidden_bytes, 8, 32, buffer_size=nvl) is None
            assert nvl == ours.buffer_size_hint(num_ranks, hidden_bytes, constants.MAX_TOPK)
            continue
        nodes, gpus = nodes_gpus
        problem = ours.validate(nodes, gpus, hidden_bytes, 8, 2)
        assert problem is None, f"EP {num_ranks}: {config} -> {ours}: {problem}"
        assert ours.rdma_capacity >= config.num_max_rdma_chunked_recv_tokens
        assert ours.nvl_capacity >= config.num_max_nvl_chunked_recv_tokens
        assert (rdma, nvl) == ours.buffer_size_hints(nodes, gpus, hidden_bytes, constants.MAX_TOPK)


def test_deepeps_node_limit_is_ours():
    """DeepEP's NUM_MAX_RDMA_PEERS is 20: EP 160 over nodes of 8 is its largest group, and ours."""
    assert constants.MAX_RDMA_PEERS == 20 and nodes_of(max(DISPATCH_CONFIGS)) == (20, 8)
    ours = deep_ep.Buffer.get_dispatch_config(160).for_kernels(160)
    assert ours.validate(21, 8, 7168 * 2, 8, 2) == "num_nodes must be in [2, kMaxRdmaPeers]"


def test_ep16_rdma_ring_is_rounded_up_to_a_multiple_of_its_chunk():
    ours = deep_ep.Buffer.get_dispatch_config(16).for_kernels(16)
    assert (ours.rdma_chunk, ours.rdma_capacity, ours.nvl_chunk, ours.nvl_capacity) == (20, 140, 36, 288)


def test_handle_tuples_keep_deepeps_order_and_round_trip():
    t = [torch.full((2,), float(i)) for i in range(10)]
    intranode = Handle(*t[:6], num_recv_tokens=2, config=None)
    as_tuple = to_tuple(intranode)
    assert [int(x[0]) for x in as_tuple] == [0, 1, 2, 3, 4, 5]  # rank prefix, channel prefix, recv channel, src, in rank, head
    assert from_tuple(as_tuple, None) == intranode
    internode = InternodeHandle(*t, num_recv_tokens=2, num_rdma_recv_tokens=2, config=None)
    # DeepEP: (is_token_in_rank, rdma_channel_prefix, gbl_channel_prefix, recv_rdma_channel_prefix,
    #          recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix, recv_gbl_rank_prefix_sum, recv_src_meta,
    #          send_rdma_head, send_nvl_head)
    assert [int(x[0]) for x in to_tuple(internode)] == [7, 0, 1, 3, 2, 5, 4, 6, 8, 9]
    assert from_tuple(to_tuple(internode), None) == internode


def test_unsupported_modes_are_refused_with_the_reason():
    class Group:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 2

    with pytest.raises(NotImplementedError, match="shrink mode"):
        deep_ep.Buffer(Group(), 0, 1 << 20, low_latency_mode=True, enable_shrink=True)
    with pytest.raises(ValueError, match="mpi4py"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(ValueError, match="even"):
        deep_ep.Buffer.set_num_sms(5)
    with pytest.raises(ValueError, match="no recommended config for 6 ranks"):
        deep_ep.Buffer.get_dispatch_config(6)


def test_local_buffer_views_take_a_byte_offset_and_refuse_what_leaves_the_buffer():
    """get_local_buffer_tensor's view logic (kernels_cuda.region_view) on a 256-byte stand-in region: DeepEP's
    byte offset, a view (writes reach the region), and each out-of-bounds argument refused by name."""
    region = torch.zeros(256, dtype=torch.uint8)
    where = "get_local_buffer_tensor"
    whole = region_view(region, torch.int32, None, 0, where)
    assert whole.dtype == torch.int32 and whole.numel() == 64 and whole.data_ptr() == region.data_ptr()
    part = region_view(region, torch.int32, torch.Size([2, 3]), 8, where)  # bytes 8..31: int32 elements 2..7
    assert part.shape == (2, 3) and part.data_ptr() == region.data_ptr() + 8
    part[1, 2] = -1
    assert region[28:32].tolist() == [255] * 4 and int(whole[7]) == -1 and int(region[:28].sum()) == 0
    assert region_view(region, torch.float64, None, 248, where).numel() == 1
    assert region_view(region, torch.bfloat16, None, 256, where).numel() == 0  # the end itself
    assert region_view(region, torch.int32, (62,), 8, where).numel() == 62  # everything after byte 8
    for offset in (-4, 260, 2.0, True):
        with pytest.raises(ValueError, match=r"offset must be a byte offset in \[0, 256\]"):
            region_view(region, torch.int32, None, offset, where)
    with pytest.raises(ValueError, match="offset must be a multiple of the 4-byte size of torch.int32, got 6"):
        region_view(region, torch.int32, None, 6, where)
    with pytest.raises(ValueError, match=r"size \[63\] needs 63 elements of torch.int32, but only 62 follow byte "
                                         "offset 8 of the 256-byte buffer"):
        region_view(region, torch.int32, (63,), 8, where)
    for size in (-1, (2, -1), (2.0,), 7):
        with pytest.raises(ValueError, match="size must be a torch.Size"):
            region_view(region, torch.int32, size, 0, where)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, got 'int32'"):
        region_view(region, "int32", None, 0, where)
