"""DeepEP-style Python API over kernels_cuda's extensions.

`Buffer(group, num_nvl_bytes, num_rdma_bytes=0)`: this process's rank of a torch.distributed group,
with deep_ep.Buffer's API (`get_dispatch_layout`, `dispatch`, `combine`, handles, events, `destroy`).
It takes the intranode path when the group is one node and the two-hop internode path when it spans
nodes (`ranks_per_node`: by default the ranks on this machine; simulated nodes pass a smaller one).
Each rank's regions are mapped by its peers: on a GPU through CUDA IPC (and NVSHMEM for the RDMA hop
between machines), on the CPU emulation through shared memory between the processes of one machine
(the handles travel over torch.distributed either way).

`EmulatedGroup(num_ranks, num_nvl_bytes)`: every rank in this process on one GPU, or on the CPU
emulation (`device="cpu"`, with a `Schedule`), all ranks' buffers in one allocation; the same calls
take and return one entry per rank, and one kernel launch covers all ranks
(`kernels_cuda.internode.EmulatedInternodeGroup` likewise across nodes).

On a GPU a `Buffer` runs its ops on its own communication stream with DeepEP's `previous_event` /
`async_finish` / `allocate_on_comm_stream` semantics (`kernels_cuda.streams`); on the CPU, and in an
emulated group, everything runs on the caller's stream and is finished when the call returns.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from kernels_cuda.extensions import extension, extension_of
from kernels_cuda import constants as C
from kernels_cuda.config import Config, InternodeConfig
from kernels_cuda.emulated_calls import EmulatedCalls
from kernels_cuda.emulation import Schedule, apply_schedule, check_resident, device_sms, resolve_device
from kernels_cuda.engine import Engine, OpStructs, Received
from kernels_cuda.inputs import Layout, Payload, check_layout_input
from kernels_cuda.internode import (InternodeEngine, InternodeHandle, check_rdma_transport, internode_runtime)
from kernels_cuda.low_latency import (EmulatedLowLatency, LowLatencyEngine, LowLatencyHandle, check_hook_args,
                                      size_hint)
from kernels_cuda.region_view import region_view
from kernels_cuda.streams import (ON_CURRENT_STREAM, CommStreamOp, CurrentStreamOp, EventOverlap, capture,
                                  check_stream_args)


@dataclass
class Handle:
    """What combine and cached dispatch reuse (DeepEP's intranode handle)."""

    rank_prefix_matrix: torch.Tensor     # [R, R] int32: tokens from ranks <= i to rank j
    channel_prefix_matrix: torch.Tensor  # [R, C] int32: this rank's tokens to rank j in channels <= c
    recv_channel_offset: torch.Tensor    # [R, C] int32: start of (source, channel) in the source's block
    recv_src_idx: torch.Tensor           # [M] int32: token index at the source rank of each row
    is_token_in_rank: torch.Tensor       # [N, R] bool
    send_head: torch.Tensor              # [N, R] int32: ring slot of token t towards rank r, or negative
    num_recv_tokens: int
    config: Config


class IntranodeEngine(Engine):
    """The intranode path of the op skeleton (kernels_cuda.engine): one ring per (channel, source, destination)
    rank in every rank's buffer. `Buffer` drives it as it drives `InternodeEngine`."""

    KIND = ""
    ROUTE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "is_token_in_rank")
    CACHED_DISPATCH_FIELDS = ("channel_prefix_matrix",)
    COMBINE_NOTIFY_FIELDS = ("send_head", "channel_prefix_matrix")
    COMBINE_FIELDS = ("rank_prefix_matrix", "recv_channel_offset", "send_head")

    def __init__(self, runtime: Any, num_ranks: int, config: Config, timeout_cycles: int, timeout_s: float,
                 device: str, sms: int) -> None:
        ext = extension_of(runtime)
        structs = OpStructs(ext.NotifyRank, ext.NotifyOp, ext.CachedNotifyRank, ext.CachedNotifyOp, ext.DispatchRank,
                            ext.DispatchOp, ext.CombineRank, ext.CombineOp)
        super().__init__(runtime, structs, num_ranks, config, timeout_cycles, timeout_s, device, sms)

    def layout(self, topk_idx: torch.Tensor, num_experts: int, op: CurrentStreamOp = ON_CURRENT_STREAM) -> Layout:
        """(per rank, None (one node: no per-node counts, as DeepEP), per expert, is_token_in_rank)."""
        check_layout_input(topk_idx)
        with op.launching():  # the extension allocates its outputs where it launches
            per_rank, _per_node, per_expert, in_rank = self.runtime.get_dispatch_layout(
                topk_idx.contiguous(), num_experts, self.num_ranks, self.num_ranks)
        return per_rank, None, per_expert, in_rank

    def _check(self, config: Config, hidden_bytes: int, num_topk: int, num_experts: int, launch_ranks: int) -> None:
        problem = config.validate(self.num_ranks, hidden_bytes, num_topk, max(1, num_experts // self.num_ranks))
        if problem is not None:
            raise ValueError(f"kernels_cuda: invalid config {config}: {problem}")
        blocks = launch_ranks * max(config.num_sms, 1 + self.num_ranks)  # dispatch/combine, notify
        check_resident(f"{launch_ranks} rank(s) x num_sms={config.num_sms}", blocks, self.sms,
                       "use fewer SMs per rank (Config(num_sms=...)) or fewer ranks per launch")

    def _dispatch_config(self, config: Config | None, handles: Sequence[Handle | None]) -> Config:
        return config or self.config

    def _launch_settings(self, config: Config) -> dict[str, int]:
        return {"num_channels": config.num_channels}

    def _ring_settings(self, config: Config) -> dict[str, int]:
        return {"num_channels": config.num_channels, "capacity": config.num_max_recv_tokens,
                "chunk": config.num_max_send_tokens}

    def _dense_layout(self, layout: Layout) -> dict[str, torch.Tensor]:
        per_rank, _per_node, per_expert, in_rank = layout
        return {"num_tokens_per_rank": per_rank.int().contiguous(), "num_tokens_per_expert": per_expert.int().contiguous(),
                "is_token_in_rank": in_rank.bool().contiguous()}

    def _new_prefixes(self, config: Config, device: torch.device) -> dict[str, torch.Tensor]:
        R = self.num_ranks
        return {"rank_prefix_matrix": torch.empty(R, R, dtype=torch.int32, device=device),
                "channel_prefix_matrix": torch.empty(R, config.num_channels, dtype=torch.int32, device=device)}

    def _received(self, counts: tuple) -> Received:
        rows, per_expert = counts
        return Received(rows, per_expert=per_expert)

    def _received_by(self, handle: Handle) -> Received:
        return Received(handle.num_recv_tokens)

    def _new_dispatch_outputs(self, num_tokens: int, got: Received, config: Config,
                              device: torch.device) -> dict[str, torch.Tensor]:
        R = self.num_ranks
        return {"recv_channel_offset": torch.empty(R, config.num_channels, dtype=torch.int32, device=device),
                "send_head": torch.empty(num_tokens, R, dtype=torch.int32, device=device)}

    def _handle(self, route: dict[str, torch.Tensor], out: dict[str, torch.Tensor], got: Received,
                old: Handle | None, config: Config) -> Handle:
        """A new handle, cached or not: a cached dispatch rewrites the slots and offsets it records."""
        return Handle(route["rank_prefix_matrix"], route["channel_prefix_matrix"], out["recv_channel_offset"],
                      out["recv_src_idx"], route["is_token_in_rank"], out["send_head"], got.rows, config)


class Buffer:
    """This process's EP rank of `group`, with deep_ep.Buffer's API; construction is collective.

    One node (`ranks_per_node` = the group's size): the intranode kernels over `num_nvl_bytes` per rank
    (`config` a `Config`). Several nodes: the two-hop internode kernels over an RDMA region of
    `num_rdma_bytes` and an NVLink region of `num_nvl_bytes` per rank (`config` an `InternodeConfig`),
    ranks numbered node * ranks_per_node + GPU. The RDMA hop (`rdma_transport`) goes through CUDA IPC
    when every rank runs on one machine ('ipc': simulated nodes, or processes sharing a GPU), or through
    NVSHMEM ('nvshmem': EP rank 0 makes the unique id; a process's first buffer initialises NVSHMEM,
    PE = EP rank, and later buffers reuse that world); 'auto' picks by host names. On the CPU emulation
    (`device="cpu"`, the default without a GPU) the regions are shared memory between the processes of
    one machine and `schedule` sets this rank's fiber scheduler.

    `low_latency_mode=True` adds DeepEP's low-latency ops (`low_latency_dispatch`, `low_latency_combine`,
    `get_next_low_latency_combine_buffer`, `clean_low_latency_buffer`) over a region of `num_rdma_bytes`
    per rank (`get_low_latency_rdma_size_hint`), mapped by every peer as the intranode buffer is. It is
    an allocation of its own (across nodes the normal kernels' RDMA region is another one of the same
    size), so normal ops never dirty it; `clean_low_latency_buffer` is needed only after a failed op.
    Peers on other machines are reached through NVSHMEM (`rdma_transport`, as for the RDMA hop).
    """

    def __init__(self, group: Any, num_nvl_bytes: int, num_rdma_bytes: int = 0, *, ranks_per_node: int | None = None,
                 config: Config | InternodeConfig | None = None, timeout_cycles: int = C.DEFAULT_TIMEOUT_CYCLES,
                 timeout_s: float = 100.0, rdma_transport: str = "auto", device: str | None = None,
                 schedule: Schedule | None = None, low_latency_mode: bool = False) -> None:
        import torch.distributed as dist

        self.device = resolve_device(device)
        ext = extension(self.device)
        self.group, self.rank, self.num_ranks = group, dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.ranks_per_node = ranks_on_this_machine(group) if ranks_per_node is None else ranks_per_node
        if self.ranks_per_node < 1 or self.num_ranks % self.ranks_per_node:
            raise ValueError(f"kernels_cuda Buffer: a group of {self.num_ranks} ranks does not split into nodes of "
                             f"ranks_per_node={self.ranks_per_node}")
        self.num_nodes = self.num_ranks // self.ranks_per_node
        low_latency_transport = None  # checked before any region is made (a refusal then leaves nothing mapped)
        if low_latency_mode:
            if num_rdma_bytes <= 0:
                raise ValueError("kernels_cuda Buffer: low_latency_mode needs num_rdma_bytes > 0 (see "
                                 "Buffer.get_low_latency_rdma_size_hint)")
            low_latency_transport = check_rdma_transport(rdma_transport, group, ext, self.device)
        if self.is_internode:
            if num_rdma_bytes <= 0:
                raise ValueError(f"kernels_cuda Buffer: a group over {self.num_nodes} nodes needs num_rdma_bytes > 0 "
                                 "(see Buffer.get_buffer_size_hints)")
            config = config or InternodeConfig.for_nodes(self.num_nodes)
        else:
            config = config or Config()
        want = InternodeConfig if self.is_internode else Config
        if not isinstance(config, want):
            raise TypeError(f"kernels_cuda Buffer: a group over {self.num_nodes} node(s) takes a {want.__name__}, "
                            f"got {type(config).__name__}")
        if self.is_internode:
            self.rdma_transport = check_rdma_transport(rdma_transport, group, ext, self.device)
            self.runtime = internode_runtime(ext, self.rdma_transport, group, self.rank, self.num_nodes,
                                             self.ranks_per_node, int(num_rdma_bytes), int(num_nvl_bytes))
            handles: list = [None] * self.num_ranks
            dist.all_gather_object(handles, self.runtime.ipc_handles(), group=group)
            self.engine: IntranodeEngine | InternodeEngine = InternodeEngine(
                self.runtime, self.num_nodes, self.ranks_per_node, config, timeout_cycles, timeout_s, self.device,
                device_sms(self.device, schedule))
        else:
            self.rdma_transport = None
            self.runtime = ext.Runtime(self.rank, self.num_ranks, int(num_nvl_bytes), False)
            handles = [None] * self.num_ranks
            dist.all_gather_object(handles, self.runtime.ipc_handle(), group=group)
            self.engine = IntranodeEngine(self.runtime, self.num_ranks, config, timeout_cycles, timeout_s,
                                          self.device, device_sms(self.device, schedule))
        self.runtime.open_ipc_handles(handles)
        self.low_latency: LowLatencyEngine | None = None
        if low_latency_transport is not None:
            runtime = low_latency_runtime(ext, low_latency_transport, group, self.rank, self.num_ranks,
                                          int(num_rdma_bytes))
            apply_schedule(runtime, self.device, schedule)
            self.low_latency = LowLatencyEngine(runtime, self.num_ranks, timeout_cycles, device_sms(self.device, schedule))
        dist.barrier(group=group)  # every peer mapped this rank's regions
        apply_schedule(self.runtime, self.device, schedule)
        self.comm_stream = torch.cuda.Stream() if self.device == "cuda" else None

    @property
    def is_internode(self) -> bool:
        return self.num_nodes > 1

    @staticmethod
    def get_buffer_size_hints(num_nodes: int, gpus_per_node: int, hidden_bytes: int, num_topk: int,
                              config: Config | InternodeConfig | None = None) -> tuple[int, int]:
        """(num_nvl_bytes, num_rdma_bytes) per rank for rows of `hidden_bytes` (0 RDMA bytes on one node)."""
        if num_nodes == 1:
            return (config or Config()).buffer_size_hint(gpus_per_node, hidden_bytes, num_topk), 0
        config = config or InternodeConfig.for_nodes(num_nodes)
        rdma, nvl = config.buffer_size_hints(num_nodes, gpus_per_node, hidden_bytes, num_topk)
        return nvl, rdma

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, to pass as `previous_event` (None on the CPU)."""
        return capture()

    def _op(self, previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool) -> CurrentStreamOp:
        check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        if self.comm_stream is None:
            return ON_CURRENT_STREAM
        return CommStreamOp(self.comm_stream, previous_event, async_finish, allocate_on_comm_stream)

    @contextlib.contextmanager
    def _reporting(self) -> Iterator[None]:
        """A failed launch's error also says, in words, what the device recorded (role, peer, head, tail)."""
        try:
            yield
        except RuntimeError as error:
            record = self.error_record()
            if record["code"] == 0:
                raise
            raise RuntimeError(f"kernels_cuda Buffer (rank {self.rank}): {C.describe_error(record)}\n{error}") from error

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """(num_tokens_per_rank, num_tokens_per_rdma_rank (None on one node), num_tokens_per_expert,
        is_token_in_rank, event)."""
        op = self._op(previous_event, async_finish, allocate_on_comm_stream)
        with self._reporting():
            layout = self.engine.layout(topk_idx, num_experts, op)
        return (*layout, op.finish(topk_idx, layout))

    def dispatch(self, x: Payload, handle: Handle | InternodeHandle | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None, num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | InternodeConfig | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event).
        Fresh with the layout of `get_dispatch_layout`, cached with `handle`."""
        op = self._op(previous_event, async_finish, allocate_on_comm_stream)
        layout = None
        if handle is None:
            layout = (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank)
            needed = {"num_tokens_per_rank": num_tokens_per_rank, "num_tokens_per_expert": num_tokens_per_expert,
                      "is_token_in_rank": is_token_in_rank}
            if self.is_internode:
                needed["num_tokens_per_rdma_rank"] = num_tokens_per_rdma_rank
            missing = [name for name, value in needed.items() if value is None]
            if missing:
                raise ValueError(f"kernels_cuda dispatch (rank {self.rank}): a fresh dispatch needs "
                                 f"{', '.join(missing)} (from get_dispatch_layout), or a handle")
        num_experts = self.num_ranks if num_tokens_per_expert is None else num_tokens_per_expert.numel()
        with self._reporting():
            (result,) = self.engine.dispatch([self.rank], [x], [topk_idx], [topk_weights], [layout], [handle],
                                             num_experts, expert_alignment, num_worst_tokens, config, op=op)
        return (*result, op.finish((x, topk_idx, topk_weights, layout, handle), result))

    def combine(self, x: torch.Tensor, handle: Handle | InternodeHandle, topk_weights: torch.Tensor | None = None,
                config: Config | InternodeConfig | None = None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """(combined_x, combined_topk_weights, event): unweighted sum over the ranks each token went to."""
        op = self._op(previous_event, async_finish, allocate_on_comm_stream)
        with self._reporting():
            ((combined, weights),) = self.engine.combine([self.rank], [x], [handle], [topk_weights], config, op=op)
        return combined, weights, op.finish((x, handle, topk_weights), (combined, weights))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """num_rdma_bytes per rank for low_latency_mode (independent of num_ranks, as in DeepEP)."""
        return size_hint(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def _low_latency_engine(self) -> LowLatencyEngine:
        if self.low_latency is None:
            raise RuntimeError(f"kernels_cuda Buffer (rank {self.rank}): low-latency ops need "
                               "Buffer(..., low_latency_mode=True)")
        return self.low_latency

    @contextlib.contextmanager
    def _reporting_low_latency(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:
            record = self._low_latency_engine().error_record()
            if record["code"] == 0:
                raise
            raise RuntimeError(f"kernels_cuda Buffer (rank {self.rank}): {C.describe_error(record)}\n{error}") from error

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> tuple:
        """(recv_x, packed_recv_count, handle, event, hook), as deep_ep.Buffer.low_latency_dispatch; runs on
        the current stream."""
        check_hook_args(return_recv_hook, async_finish)
        engine = self._low_latency_engine()
        with self._reporting_low_latency():
            ((recv_x, count, handle, _, hook),) = engine.dispatch(
                [self.rank], [x], [topk_idx], num_max_dispatch_tokens_per_rank, num_experts,
                [cumulative_local_expert_recv_stats], use_fp8, round_scale, use_ue8m0, return_recv_hook)
        return recv_x, count, handle, capture() if async_finish else EventOverlap(), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None) -> tuple:
        """(combined_x, event, hook), as deep_ep.Buffer.low_latency_combine; with `zero_copy` the expert
        outputs are read from get_next_low_latency_combine_buffer(handle)."""
        check_hook_args(return_recv_hook, async_finish)
        engine = self._low_latency_engine()
        with self._reporting_low_latency():
            ((combined, _, hook),) = engine.combine([self.rank], [None if zero_copy else x], [topk_idx],
                                                    [topk_weights], [handle], use_logfmt, return_recv_hook, [out])
        return combined, capture() if async_finish else EventOverlap(), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The bfloat16 [E_local, R * T_max, H] view of this rank's region that the next combine reads with
        `zero_copy=True`."""
        return self._low_latency_engine().next_combine_buffer(self.rank, handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0,
                                 num_experts: int = 0) -> None:
        """Zeroes every rank's low-latency region (collective; DeepEP's arguments are accepted and unused:
        the whole region is cleaned)."""
        import torch.distributed as dist

        engine = self._low_latency_engine()
        dist.barrier(group=self.group)
        engine.clean()
        dist.barrier(group=self.group)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Sequence[int] | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """DeepEP's raw view of this rank's buffer: `dtype` elements from byte `offset` (a multiple of their size)
        to the buffer's end, or the first numel(`size`) of them shaped `size` (kernels_cuda.region_view). The
        NVLink buffer (`num_nvl_bytes`: the intranode buffer, or the internode NVLink region), or with
        `use_rdma_buffer` the RDMA buffer (`num_rdma_bytes`): the low-latency region in low_latency_mode, where
        DeepEP's low-latency kernels work, else the internode RDMA region. The memory the kernels use, not a
        copy, laid out as csrc/params/config.h, params/internode_layout.h and params/low_latency.h say (not as
        DeepEP's); valid until destroy()."""
        where = f"kernels_cuda Buffer.get_local_buffer_tensor (rank {self.rank})"
        return region_view(self._local_region(use_rdma_buffer, where), dtype, size, offset, where)

    def _local_region(self, use_rdma_buffer: bool, where: str) -> torch.Tensor:
        """This rank's whole NVLink or RDMA buffer as bytes."""
        if not use_rdma_buffer:
            if self.num_nvl_bytes == 0:
                raise ValueError(f"{where}: this buffer has no NVLink buffer (num_nvl_bytes=0); use_rdma_buffer=True "
                                 "for the RDMA one")
            return self.runtime.nvl_region(self.rank) if self.is_internode else self.runtime.region(self.rank)
        if self.low_latency is not None:
            return self.low_latency.runtime.region(self.rank)
        if self.is_internode:
            return self.runtime.rdma_region(self.rank)
        raise ValueError(f"{where}: use_rdma_buffer=True, but this buffer has no RDMA buffer (one node, not "
                         "low_latency_mode)")

    def error_record(self) -> dict[str, Any]:
        """The first device error (code 0 = none): role (and its name), rank, channel, peer, head, tail, expected."""
        return self.engine.error_record()

    def destroy(self) -> None:
        """Frees this rank's regions and unmaps the peers' now, once no peer uses them (collective over the
        group; otherwise when the buffer is garbage collected). NVSHMEM itself is finalised at process exit."""
        import torch.distributed as dist

        if self.device == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=self.group)
        self.runtime.destroy()
        if self.low_latency is not None:
            self.low_latency.runtime.destroy()


def low_latency_runtime(ext: Any, transport: str, group: Any, rank: int, num_ranks: int, num_bytes: int) -> Any:
    """This rank's low-latency runtime, its peers' regions mapped (collective): CUDA IPC (or shared memory on
    the CPU emulation) inside a machine, NVSHMEM's symmetric heap across machines."""
    import torch.distributed as dist

    if transport == "nvshmem":
        unique_id = [ext.NvshmemLowLatencyRuntime.unique_id(num_bytes) if rank == 0 else None]
        dist.broadcast_object_list(unique_id, group=group, group_src=0)
        return ext.NvshmemLowLatencyRuntime(rank, num_ranks, num_bytes, unique_id[0])
    runtime = ext.LowLatencyRuntime(rank, num_ranks, num_bytes, False)
    handles: list = [None] * num_ranks
    dist.all_gather_object(handles, runtime.ipc_handle(), group=group)
    runtime.open_ipc_handles(handles)
    return runtime


def ranks_on_this_machine(group: Any) -> int:
    """How many ranks of `group` share this rank's host (collective): DeepEP's NVLink domain. The ranks of
    one machine must be consecutive, as a launcher numbers them."""
    import socket

    import torch.distributed as dist

    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    per_host = hosts.count(hosts[0])
    if any(hosts[r] != hosts[r // per_host * per_host] for r in range(len(hosts))) or len(hosts) % per_host:
        raise ValueError(f"kernels_cuda Buffer: the ranks of a machine must be consecutive and the same number on "
                         f"every machine; hosts by rank: {hosts}")
    return per_host


class EmulatedGroup(EmulatedCalls, EmulatedLowLatency):
    """All `num_ranks` ranks in this process, on the current GPU or on the CPU emulation (`device`,
    default kernels_cuda.default_device(); `schedule` for the emulation); calls take and return
    per-rank lists of tensors on that device."""

    def __init__(self, num_ranks: int, num_nvl_bytes: int, config: Config | None = None,
                 timeout_cycles: int = C.DEFAULT_TIMEOUT_CYCLES, timeout_s: float = 100.0, device: str | None = None,
                 schedule: Schedule | None = None, num_rdma_bytes: int = 0, low_latency_blocks: int = 4) -> None:
        self.device = resolve_device(device)
        ext = extension(self.device)
        self.num_ranks = num_ranks
        self.runtime = ext.Runtime(0, num_ranks, int(num_nvl_bytes), True)
        apply_schedule(self.runtime, self.device, schedule)
        self.engine = IntranodeEngine(self.runtime, num_ranks, config or Config(), timeout_cycles, timeout_s,
                                      self.device, device_sms(self.device, schedule))
        if num_rdma_bytes > 0:  # the low-latency region (Buffer.get_low_latency_rdma_size_hint)
            self._init_low_latency(ext, num_rdma_bytes, timeout_cycles, device_sms(self.device, schedule), schedule,
                                   low_latency_blocks)

    def destroy(self) -> None:
        """Frees every rank's regions now; the group is unusable afterwards."""
        self.runtime.destroy()
        self._destroy_low_latency()
