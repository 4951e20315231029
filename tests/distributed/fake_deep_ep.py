"""A `deep_ep` module for the wiring test of the `deepep` dispatcher on CPU: deep_ep.Buffer's constructor,
static configs and size hints, and DeepEP's tuple handles, over our `kernels_cuda.Buffer` on the CPU
emulation (whose API is DeepEP's). The real package needs GPUs and NVSHMEM; this checks that the
dispatcher drives a DeepEP-shaped buffer, not DeepEP itself."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

import kernels_cuda
from kernels_cuda import Config
from kernels_cuda.buffer import Handle

NUM_MAX_NVL_PEERS = 8


class _Config:
    """DeepEP's Config: size hints for (hidden bytes, ranks)."""

    def __init__(self, config: Config, num_topk: int) -> None:
        self.config, self.num_topk = config, num_topk

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return self.config.buffer_size_hint(num_ranks, hidden_bytes, self.num_topk)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise AssertionError("intranode only: no RDMA buffer is sized")


def _as_tuple(handle: Handle) -> tuple:
    return (handle.rank_prefix_matrix, handle.channel_prefix_matrix, handle.recv_channel_offset, handle.recv_src_idx,
            handle.is_token_in_rank, handle.send_head)


class Buffer:
    num_sms = 20
    made: list[tuple[int, int]] = []  # (num_nvl_bytes, num_rdma_bytes) of every buffer, for the test

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 **_: Any) -> None:
        assert not low_latency_mode and dist.get_world_size(group) <= NUM_MAX_NVL_PEERS
        Buffer.made.append((num_nvl_bytes, num_rdma_bytes))
        self.inner = kernels_cuda.Buffer(group, num_nvl_bytes, num_rdma_bytes, config=Config(num_sms=Buffer.num_sms),
                                         device="cpu")
        self.handles: dict[int, Handle] = {}  # id of a returned tuple -> our handle

    @staticmethod
    def set_num_sms(num_sms: int) -> None:
        assert num_sms % 2 == 0
        Buffer.num_sms = num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _Config:
        return _Config(Config(num_sms=Buffer.num_sms), num_topk=8)

    @staticmethod
    def get_combine_config(num_ranks: int) -> _Config:
        return _Config(Config(num_sms=Buffer.num_sms), num_topk=8)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        return self.inner.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                              allocate_on_comm_stream)

    def dispatch(self, x, handle=None, **kwargs):
        result = self.inner.dispatch(x, handle=None if handle is None else self.handles[id(handle)], **kwargs)
        as_tuple = _as_tuple(result[4]) if handle is None else handle
        self.handles[id(as_tuple)] = result[4]
        return (*result[:4], as_tuple, result[5])

    def combine(self, x, handle, topk_weights=None, bias=None, **kwargs):
        assert bias is None
        return self.inner.combine(x, self.handles[id(handle)], topk_weights=topk_weights, **kwargs)

    def destroy(self) -> None:
        self.inner.destroy()
