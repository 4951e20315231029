"""Internode (node-limited, two-hop) dispatch/combine: `num_nodes x gpus_per_node` ranks numbered
rank = node * gpus_per_node + gpu, each with an RDMA region and an NVLink region (DeepEP's
num_rdma_bytes / num_nvl_bytes).

- `InternodeEngine`: per-rank lists of tensors -> the internode kernels' per-rank argument structs; `Buffer`
  (kernels_cuda.buffer) drives it for a group over several nodes, with its own rank.
- `EmulatedInternodeGroup`: every rank in this process on one GPU or on the CPU emulation, one kernel
  launch for all ranks; the list API of `EmulatedGroup` (so `kernels_cuda.rank_views` and the `native`
  dispatcher run on it).
- The per-process runtimes: the NVLink hop through CUDA IPC (shared memory on the CPU emulation); the
  RDMA hop the same way when all ranks share one machine (simulated nodes), or through NVSHMEM across
  machines (PE = EP rank, one NVSHMEM world per process; kernels_cuda built with NVSHMEM, see
  kernels_cuda/build.py). The NVSHMEM path is compiled and linked here (`python -m
  kernels_cuda.compile_check`) but has never run: that needs two or more GPU machines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

import kernels_cuda
from kernels_cuda import constants as C
from kernels_cuda.config import InternodeConfig, combine_row_shape
from kernels_cuda.emulated_calls import EmulatedCalls
from kernels_cuda.emulation import Schedule, apply_schedule, check_resident, device_sms, resolve_device
from kernels_cuda.inputs import Layout, Payload, check_combine, check_dispatch, check_layout_input, scale_words
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


_PREFIX_KEYS = ("rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
                "recv_gbl_rank_prefix_sum", "is_token_in_rank")


class InternodeEngine:
    """Per-rank lists of tensors -> internode kernel launches (the emulated group launches all ranks, a
    buffer its own). Kernels launch inside `op.launching()`, outputs are allocated inside `op.allocating()`.
    The same methods as `kernels_cuda.buffer.IntranodeEngine`."""

    def __init__(self, runtime: Any, num_nodes: int, gpus_per_node: int, config: InternodeConfig,
                 timeout_cycles: int, timeout_s: float, device: str, sms: int) -> None:
        self.runtime, self.config = runtime, config
        self.num_nodes, self.gpus_per_node, self.num_ranks = num_nodes, gpus_per_node, num_nodes * gpus_per_node
        self.timeout_cycles, self.timeout_s = timeout_cycles, timeout_s
        self.device, self.sms = device, sms
        self.args = kernels_cuda.extension_of(runtime)  # the ops' argument structs

    def layout(self, topk_idx: torch.Tensor, num_experts: int, op: CurrentStreamOp = ON_CURRENT_STREAM) -> Layout:
        """(per rank, per node, per expert, is_token_in_rank) from the layout kernel."""
        check_layout_input(topk_idx)
        with op.launching():  # the extension allocates its outputs where it launches
            per_rank, per_node, per_expert, in_rank = self.runtime.get_dispatch_layout(topk_idx.contiguous(), num_experts)
        return per_rank, per_node, per_expert, in_rank

    def _op(self, op_class: Any, config: InternodeConfig, **settings: Any) -> Any:
        """An op struct of `op_class` with `config`'s channels and rings and this engine's timeout."""
        return op_class(num_channels=config.num_channels, nvl_chunk=config.nvl_chunk, nvl_capacity=config.nvl_capacity,
                        rdma_chunk=config.rdma_chunk, rdma_capacity=config.rdma_capacity,
                        timeout_cycles=self.timeout_cycles, **settings)

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

    def dispatch(self, ranks: Sequence[int], xs: Sequence[Payload], topk_idx: Sequence[torch.Tensor | None],
                 topk_weights: Sequence[torch.Tensor | None], layouts: Sequence[Layout | None],
                 handles: Sequence[InternodeHandle | None], num_experts: int, expert_alignment: int,
                 num_worst_tokens: int, config: InternodeConfig | None, stalled_rank: int = -1,
                 op: CurrentStreamOp = ON_CURRENT_STREAM) -> list[tuple]:
        """Per rank: (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle).
        Fresh with `layouts` (handles None), cached with `handles` (the handle comes back unchanged).
        `num_worst_tokens > 0` (fresh only): no host wait for the counts; received rows and RDMA records
        are sized `num_worst_tokens`, rows past the received ones get top-k ids -1, the per-expert
        lists are empty, and a rank receiving more traps with error code 2."""
        R, N, G = self.num_ranks, self.num_nodes, self.gpus_per_node
        cached = handles[0] is not None
        config = config or (handles[0].config if cached else self.config)
        payloads = [x if isinstance(x, tuple) else (x, None) for x in xs]
        for r, (x, x_scales), idx, weights in zip(ranks, payloads, topk_idx, topk_weights):
            check_dispatch(self.device, x, x_scales, idx, weights, expert_alignment, r)
        rows0, scales0 = payloads[0]
        device, hidden_bytes = rows0.device, rows0.shape[1] * rows0.element_size()
        num_topk = topk_idx[0].shape[1] if topk_idx[0] is not None else 1
        self._check(config, hidden_bytes, num_topk, num_experts, len(ranks))
        channels = config.num_channels
        ints = dict(dtype=torch.int32, device=device)

        if cached:
            with op.launching():
                self.runtime.cached_notify([self.args.InternodeCachedNotifyRank(rank=r, num_tokens=x.shape[0])
                                            for r, (x, _) in zip(ranks, payloads)],
                                           self._op(self.args.InternodeCachedNotifyOp, config, rewrite_heads=False))
            prefixes = [{k: getattr(h, k) for k in _PREFIX_KEYS} for h in handles]
            received = [(h.num_recv_tokens, h.num_rdma_recv_tokens, []) for h in handles]
        else:
            if any(layout is None for layout in layouts):
                raise ValueError("kernels_cuda: a fresh internode dispatch needs the layout of every rank")
            with op.launching():  # the kernels index these densely: int32 counts, contiguous bool [T, R]
                layouts = [(per_rank.int().contiguous(), per_node.int().contiguous(), per_expert.int().contiguous(),
                            in_rank.bool().contiguous()) for per_rank, per_node, per_expert, in_rank in layouts]
            with op.allocating():
                prefixes = [{"rdma_channel_prefix_matrix": torch.empty(N, channels, **ints),
                             "gbl_channel_prefix_matrix": torch.empty(R, channels, **ints),
                             "recv_rdma_rank_prefix_sum": torch.empty(N, **ints),
                             "recv_gbl_rank_prefix_sum": torch.empty(R, **ints), "is_token_in_rank": lay[3]}
                            for lay in layouts]
            with op.launching():
                self.runtime.notify([self.args.InternodeNotifyRank(
                    rank=r, num_tokens=x.shape[0], num_tokens_per_rank=lay[0], num_tokens_per_node=lay[1],
                    num_tokens_per_expert=lay[2], **prefix, publish_counts=num_worst_tokens <= 0)
                    for r, (x, _), lay, prefix in zip(ranks, payloads, layouts, prefixes)],
                    self._op(self.args.InternodeNotifyOp, config, num_experts=num_experts,
                             expert_alignment=expert_alignment))
            if num_worst_tokens > 0:
                received = [(num_worst_tokens, num_worst_tokens, []) for _ in ranks]
            else:
                received = self.runtime.wait_recv_counts(len(ranks), num_experts // R, self.timeout_s)

        args, outputs = [], []
        for r, (x, x_scales), idx, w, prefix, (num_recv, num_rdma, _) in zip(
                ranks, payloads, topk_idx, topk_weights, prefixes, received):
            with op.allocating():
                out = {
                    "recv_x": torch.empty(num_recv, x.shape[1], dtype=x.dtype, device=device),
                    "recv_x_scales": None if x_scales is None else
                    torch.empty(num_recv, x_scales.shape[1], dtype=torch.float32, device=device),
                    "recv_src_idx": torch.empty(num_recv, **ints),
                    "recv_topk_idx": None if idx is None else
                    torch.empty(num_recv, num_topk, dtype=torch.int64, device=device),
                    "recv_topk_weights": None if idx is None else
                    torch.empty(num_recv, num_topk, dtype=torch.float32, device=device),
                    "recv_rdma_channel_offset": torch.empty(N, channels, **ints),
                    "recv_gbl_channel_offset": torch.empty(R, channels, **ints),
                    "send_rdma_head": torch.empty(x.shape[0], N, **ints),
                    "send_nvl_head": torch.empty(num_rdma, G, **ints),
                }
            with op.launching():  # conversions run (and their temporaries live) on the kernels' stream
                args.append(self.args.InternodeDispatchRank(
                    rank=r, num_tokens=x.shape[0], x=x.contiguous(),
                    x_scales=None if x_scales is None else scale_words(x_scales),
                    scale_token_stride=0 if x_scales is None else x_scales.stride(0),
                    scale_hidden_stride=0 if x_scales is None else x_scales.stride(1),
                    topk_idx=None if idx is None else idx.contiguous(),
                    topk_weights=None if idx is None else w.float().contiguous(), **prefix, **out))
            outputs.append(out)
        with op.launching():
            self.runtime.dispatch(args, self._op(
                self.args.InternodeDispatchOp, config, hidden_bytes=hidden_bytes,
                num_scales=0 if scales0 is None else scales0.shape[1], num_topk=num_topk, num_experts=num_experts,
                num_worst_tokens=0 if cached else num_worst_tokens, stalled_rank=stalled_rank))

        results = []
        for a, (_, x_scales), out, (num_recv, num_rdma, per_expert), old in zip(
                args, payloads, outputs, received, handles):
            handle = old or InternodeHandle(
                a.rdma_channel_prefix_matrix, a.gbl_channel_prefix_matrix, a.recv_rdma_rank_prefix_sum,
                out["recv_rdma_channel_offset"], a.recv_gbl_rank_prefix_sum, out["recv_gbl_channel_offset"],
                out["recv_src_idx"], a.is_token_in_rank, out["send_rdma_head"], out["send_nvl_head"], num_recv,
                num_rdma, config)
            recv_x = out["recv_x"] if out["recv_x_scales"] is None else (
                out["recv_x"], out["recv_x_scales"].view(x_scales.dtype))  # as sent: float32 or packed UE8M0
            results.append((recv_x, out["recv_topk_idx"], out["recv_topk_weights"], list(per_expert), handle))
        return results

    def combine(self, ranks: Sequence[int], ys: Sequence[torch.Tensor], handles: Sequence[InternodeHandle],
                topk_weights: Sequence[torch.Tensor | None], config: InternodeConfig | None, stalled_rank: int = -1,
                op: CurrentStreamOp = ON_CURRENT_STREAM) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per rank: (combined_x, combined_topk_weights): unweighted sums over the ranks each token went to."""
        config = config or handles[0].config
        for r, y, h, w in zip(ranks, ys, handles, topk_weights):
            check_combine(self.device, y, h.num_recv_tokens, w, r)
        y0 = ys[0]
        hidden_bytes, num_topk = combine_row_shape(y0, topk_weights[0])
        self._check(config, hidden_bytes, num_topk, self.num_ranks, len(ranks))
        with op.launching():
            self.runtime.cached_notify([self.args.InternodeCachedNotifyRank(
                rank=r, num_tokens=h.is_token_in_rank.shape[0], send_rdma_head=h.send_rdma_head,
                rdma_channel_prefix_matrix=h.rdma_channel_prefix_matrix, send_nvl_head=h.send_nvl_head,
                recv_rdma_rank_prefix_sum=h.recv_rdma_rank_prefix_sum,
                recv_rdma_channel_offset=h.recv_rdma_channel_offset) for r, h in zip(ranks, handles)],
                self._op(self.args.InternodeCachedNotifyOp, config, rewrite_heads=True))
        args, results = [], []
        for r, y, h, w in zip(ranks, ys, handles, topk_weights):
            tokens = h.is_token_in_rank.shape[0]
            with op.allocating():
                combined = torch.empty(tokens, y.shape[1], dtype=y.dtype, device=y.device)
                combined_w = None if w is None else torch.empty(tokens, num_topk, dtype=torch.float32, device=y.device)
            with op.launching():
                args.append(self.args.InternodeCombineRank(
                    rank=r, num_tokens=tokens, x=y.contiguous(), topk_weights=None if w is None else w.float().contiguous(),
                    recv_gbl_rank_prefix_sum=h.recv_gbl_rank_prefix_sum,
                    recv_gbl_channel_offset=h.recv_gbl_channel_offset,
                    recv_rdma_rank_prefix_sum=h.recv_rdma_rank_prefix_sum,
                    recv_rdma_channel_offset=h.recv_rdma_channel_offset, send_nvl_head=h.send_nvl_head,
                    send_rdma_head=h.send_rdma_head, combined_x=combined, combined_topk_weights=combined_w))
            results.append((combined, combined_w))
        with op.launching():
            self.runtime.combine(args, self._op(self.args.InternodeCombineOp, config, hidden_bytes=hidden_bytes,
                                                num_topk=num_topk, stalled_rank=stalled_rank,
                                                float32=y0.dtype == torch.float32))
        return results

    def error_record(self) -> dict[str, Any]:
        """The first device timeout (code 0 = none): role (and its name), rank, channel, peer, head, tail, expected."""
        return C.error_record(self.runtime.error_record())


class EmulatedInternodeGroup(EmulatedCalls, EmulatedLowLatency):
    """All ranks of `num_nodes` x `gpus_per_node` in this process, on the current GPU or on the CPU
    emulation (`device` and `schedule` as EmulatedGroup). `low_latency_mode` adds the low-latency calls
    over a region of `num_rdma_bytes` per rank of their own, as Buffer does."""

    def __init__(self, num_nodes: int, gpus_per_node: int, num_rdma_bytes: int, num_nvl_bytes: int,
                 config: InternodeConfig | None = None, timeout_cycles: int = C.DEFAULT_TIMEOUT_CYCLES,
                 timeout_s: float = 100.0, device: str | None = None, schedule: Schedule | None = None,
                 low_latency_mode: bool = False, low_latency_blocks: int = 4) -> None:
        self.device = resolve_device(device)
        ext = kernels_cuda.extension(self.device)
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
        from kernels_cuda.build import NVSHMEM_HOW  # (not at import: `python -m kernels_cuda.build` runs it)

        raise kernels_cuda.KernelsNotBuilt(
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
