"""`deep_ep.Buffer`: DeepEP's signatures, defaults and return shapes over one `kernels_cuda.Buffer`.

The adapter only translates: DeepEP's one `Config` into our intranode or internode config
(`kernels_cuda.deep_ep.config`), its tuple handles into our handle dataclasses and back (the tuples
hold our kernels' tensors at DeepEP's positions), its `EventOverlap(EventHandle)` into our events,
and `combine(bias=...)` into an add after our combine. Every op runs in `self.runtime`, the
`kernels_cuda.Buffer` underneath.

Where it differs from DeepEP (each refused with the reason, or documented as accepted and unused):
LogFMT combine (`use_logfmt=True`) and shrink mode (`enable_shrink`, the mask-buffer calls) are
refused; `allow_mnnvl`, `use_fabric`, `num_qps_per_rank` and `allow_nvlink_for_low_latency_mode`
are accepted and have no effect (peers inside a machine are reached through CUDA IPC, across
machines through NVSHMEM); `*_wait_recv_cost_stats` are checked and left unchanged (the kernels do
not time their waits); `get_local_buffer_tensor` views our regions, whose layout is not DeepEP's.
"""
from __future__ import annotations

from typing import Any

import torch

import kernels_cuda
from kernels_cuda.buffer import Handle
from kernels_cuda.deep_ep import config as deep_ep_config
from kernels_cuda.deep_ep.config import Config
from kernels_cuda.deep_ep.utils import EventHandle, EventOverlap, from_kernels, to_kernels
from kernels_cuda.internode import InternodeHandle
from kernels_cuda.low_latency import LowLatencyHandle
from kernels_cuda.streams import capture

# DeepEP's recommended configs by EP size: (num_max_nvl_chunked_send_tokens, ..._recv_tokens,
# num_max_rdma_chunked_send_tokens, ..._recv_tokens); num_sms is Buffer.num_sms at the call.
DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
                    160: (28, 720, 12, 128)}
COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                   24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                   96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}

SHRINK = "shrink mode (enable_shrink, the low-latency mask buffer) is not implemented by kernels_cuda"


def _recommended(table: dict[int, tuple[int, int, int, int]], num_ranks: int, what: str) -> Config:
    if num_ranks not in table:
        raise ValueError(f"deep_ep Buffer.get_{what}_config: no recommended config for {num_ranks} ranks "
                         f"(DeepEP has them for {sorted(table)}); pass a Config")
    return Config(Buffer.num_sms, *table[num_ranks])


def to_tuple(handle: Handle | InternodeHandle) -> tuple:
    """DeepEP's handle tuple: intranode (6 fields) or internode (10), in DeepEP's order."""
    if isinstance(handle, Handle):
        return (handle.rank_prefix_matrix, handle.channel_prefix_matrix, handle.recv_channel_offset,
                handle.recv_src_idx, handle.is_token_in_rank, handle.send_head)
    return (handle.is_token_in_rank, handle.rdma_channel_prefix_matrix, handle.gbl_channel_prefix_matrix,
            handle.recv_rdma_channel_offset, handle.recv_rdma_rank_prefix_sum, handle.recv_gbl_channel_offset,
            handle.recv_gbl_rank_prefix_sum, handle.recv_src_idx, handle.send_rdma_head, handle.send_nvl_head)


def from_tuple(handle: tuple | list, config: Any) -> Handle | InternodeHandle:
    """Our handle from DeepEP's tuple (row counts from the tensors' sizes, as DeepEP reads them)."""
    if len(handle) == 6:
        rank_prefix, channel_prefix, recv_offset, src_idx, in_rank, send_head = handle
        return Handle(rank_prefix, channel_prefix, recv_offset, src_idx, in_rank, send_head, src_idx.size(0), config)
    if len(handle) == 10:
        (in_rank, rdma_prefix, gbl_prefix, recv_rdma_offset, recv_rdma_sum, recv_gbl_offset, recv_gbl_sum, src_idx,
         send_rdma_head, send_nvl_head) = handle
        return InternodeHandle(rdma_prefix, gbl_prefix, recv_rdma_sum, recv_rdma_offset, recv_gbl_sum, recv_gbl_offset,
                               src_idx, in_rank, send_rdma_head, send_nvl_head, src_idx.size(0), send_nvl_head.size(0),
                               config)
    raise TypeError(f"deep_ep Buffer: a handle is DeepEP's intranode (6) or internode (10) tuple, got {len(handle)} "
                    "fields")


def bias_terms(bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    """DeepEP's `combine(bias=...)`: none, one tensor or a pair."""
    biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
    if len(biases) > 2:
        raise ValueError(f"deep_ep Buffer.combine: bias is one tensor or a pair, got {len(biases)}")
    return biases


def add_bias(combined: torch.Tensor, biases: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`combined` plus each bias [num_tokens, hidden], summed in float32 and rounded once more."""
    for b in biases:
        if tuple(b.shape) != tuple(combined.shape):
            raise ValueError(f"deep_ep Buffer.combine: bias must be {list(combined.shape)}, got {list(b.shape)}")
    return sum((b.float() for b in biases), combined.float()).to(combined.dtype)


def _check_cost_stats(name: str, stats: torch.Tensor | None, num_ranks: int) -> None:
    if stats is not None and (stats.dtype != torch.int64 or tuple(stats.shape) != (num_ranks,)):
        raise ValueError(f"deep_ep: {name} must be int64 [num_ranks={num_ranks}], got {stats.dtype} "
                         f"{list(stats.shape)}")


class Buffer:
    """DeepEP's `Buffer` (construction is collective over `group`). `options` go to `kernels_cuda.Buffer`
    (ours, not DeepEP's: `device`, `schedule`, `timeout_cycles`, `timeout_s`, `rdma_transport`,
    `ranks_per_node`; by default nodes of `NUM_MAX_NVL_PEERS` GPUs, as DeepEP)."""

    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None, **options: Any) -> None:
        if group is None:
            raise ValueError("deep_ep Buffer: pass a torch.distributed group (mpi4py communicators, `comm`, are not "
                             "supported by kernels_cuda)")
        if enable_shrink:
            raise NotImplementedError(f"deep_ep Buffer: {SHRINK}")
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = low_latency_mode, explicitly_destroy, False
        ranks_per_node = options.pop("ranks_per_node", deep_ep_config.nodes_of(self.group_size)[1])
        self.runtime = kernels_cuda.Buffer(group, num_nvl_bytes, num_rdma_bytes, ranks_per_node=ranks_per_node,
                                           low_latency_mode=low_latency_mode, **options)

    # Static settings and sizes.

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether kernels_cuda's CUDA extension (built for sm_90) loads here."""
        return kernels_cuda.is_built("cuda")

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SMs of the normal kernels (a sender and a receiver per channel: even), for later configs."""
        if new_num_sms % 2:
            raise ValueError(f"deep_ep Buffer.set_num_sms: the SM count must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return kernels_cuda.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                                  num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return _recommended(DISPATCH_CONFIGS, num_ranks, "dispatch")

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return _recommended(COMBINE_CONFIGS, num_ranks, "combine")

    def get_comm_stream(self) -> torch.cuda.Stream:
        if self.runtime.comm_stream is None:
            raise RuntimeError("deep_ep Buffer.get_comm_stream: on the CPU emulation every op runs on the caller's "
                               "thread and has finished when it returns; there is no communication stream")
        return self.runtime.comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view (no copy) of this rank's NVLink buffer, or RDMA buffer (the low-latency region in
        low_latency_mode): `dtype` elements from byte `offset`, the first numel(`size`) shaped `size` if given;
        see kernels_cuda.Buffer.get_local_buffer_tensor."""
        return self.runtime.get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    def _kernels_config(self, config: Config | None, default: Config) -> Any:
        return (config or default).for_kernels(self.group_size)

    # Normal (training and prefill) kernels.

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """(num_tokens_per_rank, num_tokens_per_rdma_rank (None on one node), num_tokens_per_expert,
        is_token_in_rank, event)."""
        *layout, event = self.runtime.get_dispatch_layout(topk_idx, num_experts, to_kernels(previous_event),
                                                          async_finish, allocate_on_comm_stream)
        return (*layout, from_kernels(event, async_finish))

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: tuple | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None, num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event); a cached
        dispatch (`handle` given) returns (recv_x, None, None, None, None, event), as DeepEP."""
        ours = self._kernels_config(config, self.get_dispatch_config(self.group_size))
        cached = handle is not None
        if cached and (topk_idx is not None or topk_weights is not None):
            raise ValueError("deep_ep Buffer.dispatch: a cached dispatch (handle given) takes no topk_idx/topk_weights")
        recv_x, recv_idx, recv_w, per_expert, new_handle, event = self.runtime.dispatch(
            x, None if handle is None else from_tuple(handle, ours), num_tokens_per_rank, num_tokens_per_rdma_rank,
            is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, ours,
            to_kernels(previous_event), async_finish, allocate_on_comm_stream)
        event = from_kernels(event, async_finish)
        if cached:
            return recv_x, None, None, None, None, event
        return recv_x, recv_idx, recv_w, per_expert, to_tuple(new_handle), event

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        """(combined_x, combined_topk_weights, event): the unweighted sum over the ranks each token went to,
        plus up to two `bias` tensors [num_tokens, hidden] (added in float32, rounded once more)."""
        ours = self._kernels_config(config, self.get_combine_config(self.group_size))
        biases = bias_terms(bias)
        combined, weights, event = self.runtime.combine(x, from_tuple(handle, ours), topk_weights, ours,
                                                        to_kernels(previous_event), async_finish,
                                                        allocate_on_comm_stream)
        if biases:
            event.current_stream_wait()  # the add runs on the current stream, after the combine
            combined = add_bias(combined, biases)
            event = capture() if async_finish else event
        return combined, weights, from_kernels(event, async_finish)

    # Low-latency (decoding) kernels.

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.runtime.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple:
        """(recv_x, recv_count, handle, event, hook); the handle is DeepEP's 5-tuple."""
        _check_cost_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, self.group_size)
        recv_x, count, handle, event, hook = self.runtime.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats, use_fp8,
            round_scale, use_ue8m0, async_finish, return_recv_hook)
        return recv_x, count, handle, from_kernels(event, async_finish), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None) -> tuple:
        """(combined_x, event, hook). `use_logfmt=True` is refused (DeepEP's 10-bit LogFMT is not implemented)."""
        _check_cost_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, self.group_size)
        combined, event, hook = self.runtime.low_latency_combine(
            x, topk_idx, topk_weights, LowLatencyHandle(*handle), use_logfmt, zero_copy, async_finish,
            return_recv_hook, out)
        return combined, from_kernels(event, async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        return self.runtime.get_next_low_latency_combine_buffer(LowLatencyHandle(*handle))

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        raise NotImplementedError(f"deep_ep Buffer: {SHRINK}")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        raise NotImplementedError(f"deep_ep Buffer: {SHRINK}")

    def low_latency_clean_mask_buffer(self) -> None:
        raise NotImplementedError(f"deep_ep Buffer: {SHRINK}")

    def destroy(self) -> None:
        """Frees the regions now (collective); DeepEP allows it only with `explicitly_destroy=True`."""
        if not self.explicitly_destroy:
            raise RuntimeError("deep_ep Buffer.destroy: construct the buffer with explicitly_destroy=True (otherwise "
                               "its regions go when it is garbage collected)")
        self.runtime.destroy()
