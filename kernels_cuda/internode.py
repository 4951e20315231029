"""Internode (node-limited, two-hop) dispatch/combine: `num_nodes x gpus_per_node` ranks numbered
rank = node * gpus_per_node + gpu, each with an RDMA region and an NVLink region (DeepEP's
num_rdma_bytes / num_nvl_bytes).

- `InternodeEngine`: the internode path of the op skeleton (kernels_cuda.engine); `Buffer`
  (kernels_cuda.buffer) drives it for a group over several nodes, with its own rank.
- `EmulatedInternodeGroup`: every rank in this process on one GPU or on the CPU emulation, one kernel
  launch for all ranks; the list API of `EmulatedGroup` (so `kernels_cuda.rank_views` and the `native`
  dispatcher run on it).
- The per-process runtimes: the NVLink hop through CUDA IPC (shared memory on the CPU emulation); the
  RDMA hop the same way when all ranks share one machine (simulated nodes), or through NVSHMEM across
  machines (PE = EP rank, one NVSHMEM world per process; kernels_cuda built with NVSHMEM, see
  kernels_cuda/build_cuda.py). The NVSHMEM path is compiled and linked here (`python -m
  kernels_cuda.compile_check`) but has never run: that needs two or more GPU machines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kernels_cuda.extensions import KernelsNotBuilt, extension, extension_of
from kernels_cuda import constants as C
from kernels_cuda.build_cuda import NVSHMEM_HOW
from kernels_cuda.config import InternodeConfig
from kernels_cuda.emulated_calls import EmulatedCalls
from kernels_cuda.emulation import Schedule, apply_schedule, check_resident, device_sms, resolve_device
from kernels_cuda.engine import Engine, OpStructs, Received
from kernels_cuda.inputs import Layout, check_layout_input
from kernels_cuda.low_latency import EmulatedLowLatency
from kernels_cuda.streams import ON_CURRENT_STREAM, CurrentStreamOp


@dataclass
class InternodeHandle:
    """What combine and cached dispatch reuse (DeepEP's internode handle; int32 tensors)."""

    rdma_channel_prefix_matrix: torch.Tensor  # [N, C]: this rank's tokens to node m in channels <= c
    gbl_channel_prefix_matrix: torch.Tensor   # [R, C]: this rank's tokens to rank r in channels <= c
    recv_rdma_rank_prefix_sum: torch.Tensor   # [N]: records received over RDMA (as rail proxy) from nodes <= n
    recv_rdma_channel_offset: torch.Tensor    # [N, C]: start of (source node, channel) among its records
    recv_gbl_rank_prefix_sum: torch.Tensor    # [R]: rows received from ranks <= s
    recv_gbl_channel_offset: torch.Tensor     # [R, C]: start of (source rank, channel) among its rows
    recv_src_idx: torch.Tensor                # [M]: token index at the source rank of each row
    is_token_in_rank: torch.Tensor            # [T, R] bool
    send_rdma_head: torch.Tensor              # [T, N]: slot of token t in node m's RDMA ring, or negative
    send_nvl_head: torch.Tensor               # [M_rdma, G]: slot of record i in its (node -> GPU j) stream, or negative
    num_recv_tokens: int
    num_rdma_recv_tokens: int
    config: InternodeConfig


class InternodeEngine(Engine):
    """The internode path of the op skeleton (kernels_cuda.engine): RDMA rings between rail peers, NVLink rings
    inside a node. `Buffer` (kernels_cuda.buffer) drives it for a group over several nodes, with its own rank."""

    KIND = "internode "
    ROUTE_FIELDS = ("rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
                    "recv_gbl_rank_prefix_sum", "is_token_in_rank")
    CACHED_DISPATCH_FIELDS = ()
    COMBINE_NOTIFY_FIELDS = ("send_rdma_head", "rdma_channel_prefix_matrix", "send_nvl_head",
                             "recv_rdma_rank_prefix_sum", "recv_rdma_channel_offset")
    COMBINE_FIELDS = ("recv_gbl_rank_prefix_sum", "recv_gbl_channel_offset", "recv_rdma_rank_prefix_sum",
                      "recv_rdma_channel_offset", "send_nvl_head", "send_rdma_head")

    def __init__(self, runtime: Any, num_nodes: int, gpus_per_node: int, config: InternodeConfig,
                 timeout_cycles: int, timeout_s: float, device: str, sms: int) -> None:
        ext = extension_of(runtime)
        structs = OpStructs(ext.InternodeNotifyRank, ext.InternodeNotifyOp, ext.InternodeCachedNotifyRank,
                            ext.InternodeCachedNotifyOp, ext.InternodeDispatchRank, ext.InternodeDispatchOp,
                            ext.InternodeCombineRank, ext.InternodeCombineOp)
        super().__init__(runtime, structs, num_nodes * gpus_per_node, config, timeout_cycles, timeout_s, device, sms)
        self.num_nodes, self.gpus_per_node = num_nodes, gpus_per_node

    def layout(self, topk_idx: torch.Tensor, num_experts: int, op: CurrentStreamOp = ON_CURRENT_STREAM) -> Layout:
        """(per rank, per node, per expert, is_token_in_rank) from the layout kernel."""
        check_layout_input(topk_idx)
        with op.launching():  # the extension allocates its outputs where it launches
            per_rank, per_node, per_expert, in_rank = self.runtime.get_dispatch_layout(topk_idx.contiguous(), num_experts)
        return per_rank, per_node, per_expert, in_rank

    def _check(self, config: InternodeConfig, hidden_bytes: int, num_topk: int, num_experts: int,
               launch_ranks: int) -> None:
        problem = config.validate(self.num_nodes, self.gpus_per_node, hidden_bytes, num_topk,
                                  max(1, num_experts // self.num_ranks))
        if problem is not None:
            raise ValueError(f"kernels_cuda: invalid internode config {config}: {problem}")
        blocks = launch_ranks * max(2 * config.num_channels, 1 + self.num_nodes)  # dispatch/combine, notify
        check_resident(f"{launch_ranks} rank(s) x {config.num_channels} channels over {self.num_nodes} nodes", blocks,
                       self.sms, "use fewer channels (InternodeConfig(num_channels=...)) or fewer ranks per launch "
                       "(on the CPU emulation: Schedule(sm_count=...))")

    def _dispatch_config(self, config: InternodeConfig | None,
                         handles: Sequence[InternodeHandle | None]) -> InternodeConfig:
        return config or (handles[0].config if handles[0] is not None else self.config)

    def _launch_settings(self, config: InternodeConfig) -> dict[str, int]:
        return {"num_channels": config.num_channels, "nvl_chunk": config.nvl_chunk, "nvl_capacity": config.nvl_capacity,
                "rdma_chunk": config.rdma_chunk, "rdma_capacity": config.rdma_capacity}

    def _ring_settings(self, config: InternodeConfig) -> dict[str, int]:
        return self._launch_settings(config)  # the notify kernels lay out both regions as the data kernels do

    def _dense_layout(self, layout: Layout) -> dict[str, torch.Tensor]:
        per_rank, per_node, per_expert, in_rank = layout
        return {"num_tokens_per_rank": per_rank.int().contiguous(), "num_tokens_per_node": per_node.int().contiguous(),
                "num_tokens_per_expert": per_expert.int().contiguous(), "is_token_in_rank": in_rank.bool().contiguous()}

    def _new_prefixes(self, config: InternodeConfig, device: torch.device) -> dict[str, torch.Tensor]:
        ints = dict(dtype=torch.int32, device=device)
        N, R, channels = self.num_nodes, self.num_ranks, config.num_channels
        return {"rdma_channel_prefix_matrix": torch.empty(N, channels, **ints),
                "gbl_channel_prefix_matrix": torch.empty(R, channels, **ints),
                "recv_rdma_rank_prefix_sum": torch.empty(N, **ints), "recv_gbl_rank_prefix_sum": torch.empty(R, **ints)}

    def _received(self, counts: tuple) -> Received:
        rows, rdma_records, per_expert = counts
        return Received(rows, rdma_records, per_expert)

    def _received_by(self, handle: InternodeHandle) -> Received:
        return Received(handle.num_recv_tokens, handle.num_rdma_recv_tokens)

    def _new_dispatch_outputs(self, num_tokens: int, got: Received, config: InternodeConfig,
                              device: torch.device) -> dict[str, torch.Tensor]:
        ints = dict(dtype=torch.int32, device=device)
        N, R, channels = self.num_nodes, self.num_ranks, config.num_channels
        return {"recv_rdma_channel_offset": torch.empty(N, channels, **ints),
                "recv_gbl_channel_offset": torch.empty(R, channels, **ints),
                "send_rdma_head": torch.empty(num_tokens, N, **ints),
                "send_nvl_head": torch.empty(got.rdma_records, self.gpus_per_node, **ints)}

    def _handle(self, route: dict[str, torch.Tensor], out: dict[str, torch.Tensor], got: Received,
                old: InternodeHandle | None, config: InternodeConfig) -> InternodeHandle:
        """A cached dispatch returns the handle it was given."""
        return old or InternodeHandle(
            route["rdma_channel_prefix_matrix"], route["gbl_channel_prefix_matrix"], route["recv_rdma_rank_prefix_sum"],
            out["recv_rdma_channel_offset"], route["recv_gbl_rank_prefix_sum"], out["recv_gbl_channel_offset"],
            out["recv_src_idx"], route["is_token_in_rank"], out["send_rdma_head"], out["send_nvl_head"], got.rows,
            got.rdma_records, config)


class EmulatedInternodeGroup(EmulatedCalls, EmulatedLowLatency):
    """All ranks of `num_nodes` x `gpus_per_node` in this process, on the current GPU or on the CPU
    emulation (`device` and `schedule` as EmulatedGroup). `low_latency_mode` adds the low-latency calls
    over a region of `num_rdma_bytes` per rank of their own, as Buffer does."""

    def __init__(self, num_nodes: int, gpus_per_node: int, num_rdma_bytes: int, num_nvl_bytes: int,
                 config: InternodeConfig | None = None, timeout_cycles: int = C.DEFAULT_TIMEOUT_CYCLES,
                 timeout_s: float = 100.0, device: str | None = None, schedule: Schedule | None = None,
                 low_latency_mode: bool = False, low_latency_blocks: int = 4) -> None:
        self.device = resolve_device(device)
        ext = extension(self.device)
        self.num_nodes, self.gpus_per_node, self.num_ranks = num_nodes, gpus_per_node, num_nodes * gpus_per_node
        self.runtime = ext.EmulatedInternodeRuntime(num_nodes, gpus_per_node, int(num_rdma_bytes), int(num_nvl_bytes))
        apply_schedule(self.runtime, self.device, schedule)
        self.engine = InternodeEngine(self.runtime, num_nodes, gpus_per_node,
                                       config or InternodeConfig.for_nodes(num_nodes), timeout_cycles, timeout_s,
                                       self.device, device_sms(self.device, schedule))
        if low_latency_mode:
            self._init_low_latency(ext, num_rdma_bytes, timeout_cycles, device_sms(self.device, schedule), schedule,
                                   low_latency_blocks)

    def destroy(self) -> None:
        """Frees every rank's regions now (the emulated internode regions go with the last reference to
        them); the group is unusable afterwards."""
        del self.engine, self.runtime
        self._destroy_low_latency()


RDMA_TRANSPORTS = ("auto", "ipc", "nvshmem")


def check_rdma_transport(requested: str, group: Any, ext: Any, device: str) -> str:
    """'ipc' or 'nvshmem': 'auto' takes IPC when every rank of `group` runs on this machine (nodes are
    simulated, or share one box), else NVSHMEM. The decision is collective and the same on every rank.
    The CPU emulation shares memory between the processes of one machine only."""
    import socket

    import torch.distributed as dist

    if requested not in RDMA_TRANSPORTS:
        raise ValueError(f"kernels_cuda: rdma_transport must be one of {', '.join(RDMA_TRANSPORTS)}, got {requested!r}")
    if requested == "auto":
        hosts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        requested = "ipc" if len(set(hosts)) == 1 else "nvshmem"
    if requested == "nvshmem" and device == "cpu":
        raise ValueError("kernels_cuda on the CPU emulation: per-process buffers share memory between the processes "
                         "of one machine, but this group spans machines (or rdma_transport='nvshmem' was asked); "
                         "use dispatcher 'hierarchical'")
    if requested == "nvshmem" and not getattr(ext, "with_nvshmem", False):
        raise KernelsNotBuilt(
            f"kernels_cuda was built without NVSHMEM; {NVSHMEM_HOW}; or use dispatcher 'hierarchical'")
    return requested


def internode_runtime(ext: Any, transport: str, group: Any, rank: int, num_nodes: int, gpus_per_node: int,
                      rdma_bytes: int, nvl_bytes: int) -> Any:
    """This rank's per-process internode runtime (collective for NVSHMEM: rank 0's unique id is broadcast)."""
    import torch.distributed as dist

    sizes = (num_nodes, gpus_per_node, rdma_bytes, nvl_bytes)
    if transport == "ipc":
        return ext.IpcInternodeRuntime(rank, *sizes)
    unique_id = [ext.NvshmemInternodeRuntime.unique_id(rdma_bytes) if rank == 0 else None]
    dist.broadcast_object_list(unique_id, group=group, group_src=0)
    return ext.NvshmemInternodeRuntime(rank, *sizes, unique_id[0])
