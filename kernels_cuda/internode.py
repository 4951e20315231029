"""Internode (node-limited, two-hop) dispatch/combine: `num_nodes x gpus_per_node` ranks numbered
rank = node * gpus_per_node + gpu, each with an RDMA region and an NVLink region (DeepEP's
num_rdma_bytes / num_nvl_bytes).

- `EmulatedInternodeGroup`: every rank in this process on one GPU or on the CPU emulation, one kernel
  launch for all ranks; the list API of `EmulatedGroup` (so `kernels_cuda.rank_views` and the `native`
  dispatcher run on it).
- `InternodeBuffer`: this process's rank of a torch.distributed group spanning nodes, with DeepEP's
  Buffer API. The NVLink hop goes through CUDA IPC; the RDMA hop through CUDA IPC as well when all
  ranks share one machine (simulated nodes; tests/gpu runs 2 x 2 ranks as processes on one GPU), or
  through NVSHMEM across machines (PE = EP rank, one NVSHMEM world per process; kernels_cuda built
  with NVSHMEM, see kernels_cuda/build.py). The NVSHMEM path is compiled and linked here
  (`python -m kernels_cuda.compile_check`) but has never run: that needs two or more GPU machines.
Both turn per-rank lists of tensors into the kernels' per-rank dicts with one `_InternodeEngine`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kernels_cuda import constants as C
from kernels_cuda.config import InternodeConfig, combine_row_shape
from kernels_cuda.emulation import Schedule, apply_schedule, check_resident, device_sms, resolve_device
from kernels_cuda.inputs import check_combine, check_dispatch
from kernels_cuda.streams import ON_CURRENT_STREAM, CommStreamOp, CurrentStreamOp, EventOverlap, capture

Payload = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# (num_tokens_per_rank, num_tokens_per_rdma_rank (per node), num_tokens_per_expert, is_token_in_rank)
Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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


class _InternodeEngine:
    """Per-rank lists of tensors -> internode kernel launches (the emulated group launches all ranks, a
    buffer its own). Kernels launch inside `op.launching()`, outputs are allocated inside `op.allocating()`."""

    def __init__(self, runtime: Any, num_nodes: int, gpus_per_node: int, config: InternodeConfig,
                 timeout_cycles: int, timeout_s: float, device: str, sms: int) -> None:
        self.runtime, self.config = runtime, config
        self.num_nodes, self.gpus_per_node, self.num_ranks = num_nodes, gpus_per_node, num_nodes * gpus_per_node
        self.timeout_cycles, self.timeout_s = timeout_cycles, timeout_s
        self.device, self.sms = device, sms

    def layout(self, topk_idx: torch.Tensor, num_experts: int, op: CurrentStreamOp = ON_CURRENT_STREAM) -> Layout:
        """(per rank, per node, per expert, is_token_in_rank) from the layout kernel."""
        if topk_idx.dtype != torch.int64:
            raise ValueError(f"kernels_cuda get_dispatch_layout: topk_idx must be int64, got {topk_idx.dtype}")
        with op.launching():  # the extension allocates its outputs where it launches
            per_rank, per_node, per_expert, in_rank = self.runtime.get_dispatch_layout(topk_idx.contiguous(), num_experts)
        return per_rank, per_node, per_expert, in_rank

    def _settings(self, config: InternodeConfig, **extra: Any) -> dict:
        return {"num_channels": config.num_channels, "nvl_chunk": config.nvl_chunk,
                "nvl_capacity": config.nvl_capacity, "rdma_chunk": config.rdma_chunk,
                "rdma_capacity": config.rdma_capacity, "timeout_cycles": self.timeout_cycles, **extra}

    def _check(self, config: InternodeConfig, hidden_bytes: int, num_topk: int, num_experts: int,
               launch_ranks: int) -> None:
        problem = config.validate(self.num_nodes, self.gpus_per_node, hidden_bytes, num_topk,
                                  max(1, num_experts // self.num_ranks))
        if problem is not None:
            raise ValueError(f"kernels_cuda: invalid internode config {config}: {problem}")
        check_resident(f"{launch_ranks} rank(s) x {config.num_channels} channels", launch_ranks * 2 * config.num_channels,
                       self.sms, "use fewer channels (InternodeConfig(num_channels=...)) or fewer ranks per launch")

    def dispatch(self, ranks: Sequence[int], xs: Sequence[Payload], topk_idx: Sequence[torch.Tensor | None],
                 topk_weights: Sequence[torch.Tensor | None], layouts: Sequence[Layout | None],
                 handles: Sequence[InternodeHandle | None], num_experts: int, expert_alignment: int,
                 config: InternodeConfig | None, num_worst_tokens: int = 0, stalled_rank: int = -1,
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
                self.runtime.cached_notify([{"rank": r, "num_tokens": x.shape[0]}
                                            for r, (x, _) in zip(ranks, payloads)],
                                           self._settings(config, rewrite_heads=False))
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
                self.runtime.notify([{"rank": r, "num_tokens": x.shape[0], "num_tokens_per_rank": lay[0],
                                      "num_tokens_per_node": lay[1], "num_tokens_per_expert": lay[2], **prefix,
                                      "publish_counts": num_worst_tokens <= 0}
                                     for r, (x, _), lay, prefix in zip(ranks, payloads, layouts, prefixes)],
                                    self._settings(config, num_experts=num_experts, expert_alignment=expert_alignment))
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
                args.append({"rank": r, "num_tokens": x.shape[0], "x": x.contiguous(), "x_scales": x_scales,
                             "scale_token_stride": 0 if x_scales is None else x_scales.stride(0),
                             "scale_hidden_stride": 0 if x_scales is None else x_scales.stride(1),
                             "topk_idx": None if idx is None else idx.contiguous(),
                             "topk_weights": None if idx is None else w.float().contiguous(), **prefix, **out})
            outputs.append(out)
        with op.launching():
            self.runtime.dispatch(args, self._settings(
                config, hidden_bytes=hidden_bytes, num_scales=0 if scales0 is None else scales0.shape[1],
                num_topk=num_topk, num_experts=num_experts, num_worst_tokens=0 if cached else num_worst_tokens,
                stalled_rank=stalled_rank))

        results = []
        for a, out, (num_recv, num_rdma, per_expert), old in zip(args, outputs, received, handles):
            handle = old or InternodeHandle(
                a["rdma_channel_prefix_matrix"], a["gbl_channel_prefix_matrix"], a["recv_rdma_rank_prefix_sum"],
                out["recv_rdma_channel_offset"], a["recv_gbl_rank_prefix_sum"], out["recv_gbl_channel_offset"],
                out["recv_src_idx"], a["is_token_in_rank"], out["send_rdma_head"], out["send_nvl_head"], num_recv,
                num_rdma, config)
            recv_x = out["recv_x"] if out["recv_x_scales"] is None else (out["recv_x"], out["recv_x_scales"])
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
            self.runtime.cached_notify([
                {"rank": r, "num_tokens": h.is_token_in_rank.shape[0], "send_rdma_head": h.send_rdma_head,
                 "rdma_channel_prefix_matrix": h.rdma_channel_prefix_matrix, "send_nvl_head": h.send_nvl_head,
                 "recv_rdma_rank_prefix_sum": h.recv_rdma_rank_prefix_sum,
                 "recv_rdma_channel_offset": h.recv_rdma_channel_offset} for r, h in zip(ranks, handles)],
                self._settings(config, rewrite_heads=True))
        args, results = [], []
        for r, y, h, w in zip(ranks, ys, handles, topk_weights):
            tokens = h.is_token_in_rank.shape[0]
            with op.allocating():
                combined = torch.empty(tokens, y.shape[1], dtype=y.dtype, device=y.device)
                combined_w = None if w is None else torch.empty(tokens, num_topk, dtype=torch.float32, device=y.device)
            with op.launching():
                args.append({"rank": r, "num_tokens": tokens, "x": y.contiguous(),
                             "topk_weights": None if w is None else w.float().contiguous(),
                             "recv_gbl_rank_prefix_sum": h.recv_gbl_rank_prefix_sum,
                             "recv_gbl_channel_offset": h.recv_gbl_channel_offset,
                             "recv_rdma_rank_prefix_sum": h.recv_rdma_rank_prefix_sum,
                             "recv_rdma_channel_offset": h.recv_rdma_channel_offset, "send_nvl_head": h.send_nvl_head,
                             "send_rdma_head": h.send_rdma_head, "combined_x": combined,
                             "combined_topk_weights": combined_w})
            results.append((combined, combined_w))
        with op.launching():
            self.runtime.combine(args, self._settings(config, hidden_bytes=hidden_bytes, num_topk=num_topk,
                                                      stalled_rank=stalled_rank, float32=y0.dtype == torch.float32))
        return results

    def error_record(self) -> dict[str, Any]:
        """The first device timeout (code 0 = none): role (and its name), rank, channel, peer, head, tail, expected."""
        return C.error_record(self.runtime.error_record())


class EmulatedInternodeGroup:
    """All ranks of `num_nodes` x `gpus_per_node` in this process, on the current GPU or on the CPU
    emulation (`device` and `schedule` as EmulatedGroup)."""

    def __init__(self, num_nodes: int, gpus_per_node: int, num_rdma_bytes: int, num_nvl_bytes: int,
                 config: InternodeConfig | None = None, timeout_cycles: int = C.DEFAULT_TIMEOUT_CYCLES,
                 timeout_s: float = 100.0, device: str | None = None, schedule: Schedule | None = None) -> None:
        import kernels_cuda

        self.device = resolve_device(device)
        ext = kernels_cuda.extension(self.device)
        self.num_nodes, self.gpus_per_node, self.num_ranks = num_nodes, gpus_per_node, num_nodes * gpus_per_node
        self.runtime = ext.EmulatedInternodeRuntime(num_nodes, gpus_per_node, int(num_rdma_bytes), int(num_nvl_bytes))
        apply_schedule(self.runtime, self.device, schedule)
        self.engine = _InternodeEngine(self.runtime, num_nodes, gpus_per_node,
                                       config or InternodeConfig.for_nodes(num_nodes), timeout_cycles, timeout_s,
                                       self.device, device_sms(self.device, schedule))

    def get_dispatch_layout(self, topk_idx: Sequence[torch.Tensor], num_experts: int) -> list[tuple[torch.Tensor, ...]]:
        """Per rank: (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank), as EmulatedGroup."""
        layouts = [self.engine.layout(idx, num_experts) for idx in topk_idx]
        return [(per_rank, per_expert, in_rank) for per_rank, _per_node, per_expert, in_rank in layouts]

    def dispatch(self, xs: Sequence[Payload], topk_idx: Sequence[torch.Tensor] | None = None,
                 topk_weights: Sequence[torch.Tensor] | None = None, num_experts: int | None = None,
                 handles: Sequence[InternodeHandle] | None = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: InternodeConfig | None = None,
                 stalled_rank: int = -1) -> list[tuple]:
        """Per rank: (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)."""
        R = self.num_ranks
        if handles is None:
            if topk_idx is None or num_experts is None:
                raise ValueError("dispatch without handles needs topk_idx and num_experts")
            layouts = [self.engine.layout(idx, num_experts) for idx in topk_idx]
        else:
            layouts = [None] * R
        return self.engine.dispatch(range(R), xs, topk_idx or [None] * R, topk_weights or [None] * R, layouts,
                                    handles or [None] * R, num_experts or R, expert_alignment, config,
                                    num_worst_tokens=num_worst_tokens, stalled_rank=stalled_rank)

    def combine(self, ys: Sequence[torch.Tensor], handles: Sequence[InternodeHandle],
                topk_weights: Sequence[torch.Tensor] | None = None, config: InternodeConfig | None = None,
                stalled_rank: int = -1) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per rank: (combined_x, combined_topk_weights): unweighted sums over the ranks each token went to."""
        return self.engine.combine(range(self.num_ranks), ys, handles, topk_weights or [None] * self.num_ranks,
                                   config, stalled_rank)

    def error_record(self) -> dict[str, Any]:
        return self.engine.error_record()


RDMA_TRANSPORTS = ("auto", "ipc", "nvshmem")


def _rdma_transport(requested: str, group: Any, ext: Any) -> str:
    """'ipc' or 'nvshmem': 'auto' takes IPC when every rank of `group` runs on this machine (nodes are
    simulated, or share one box), else NVSHMEM. The decision is collective and the same on every rank."""
    import socket

    import torch.distributed as dist

    if requested not in RDMA_TRANSPORTS:
        raise ValueError(f"kernels_cuda: rdma_transport must be one of {', '.join(RDMA_TRANSPORTS)}, got {requested!r}")
    if requested == "auto":
        hosts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        requested = "ipc" if len(set(hosts)) == 1 else "nvshmem"
    if requested == "nvshmem" and not getattr(ext, "with_nvshmem", False):
        import kernels_cuda

        from kernels_cuda.build import NVSHMEM_HOW  # (not at import: `python -m kernels_cuda.build` runs it)

        raise kernels_cuda.KernelsNotBuilt(
            f"kernels_cuda was built without NVSHMEM; {NVSHMEM_HOW}; or use dispatcher 'hierarchical'")
    return requested


class InternodeBuffer:
    """This process's EP rank of `group` (ranks node * ranks_per_node + GPU) with DeepEP's Buffer API.

    Construction is collective over `group`. The NVLink regions are shared inside each node through
    CUDA IPC. The RDMA hop (`rdma_transport`) goes through CUDA IPC too when every rank runs on one
    machine ('ipc': simulated nodes, or processes sharing a GPU in tests), or through NVSHMEM
    ('nvshmem': EP rank 0 makes the unique id; a process's first buffer initialises NVSHMEM with it,
    PE = EP rank; later buffers reuse that world, and its symmetric heap keeps the size the first one
    gave NVSHMEM_SYMMETRIC_SIZE unless it was set). 'auto' picks by host names. Streams and events as
    `kernels_cuda.Buffer`.
    """

    def __init__(self, group: Any, ranks_per_node: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 config: InternodeConfig | None = None, timeout_cycles: int = C.DEFAULT_TIMEOUT_CYCLES,
                 timeout_s: float = 100.0, rdma_transport: str = "auto") -> None:
        import kernels_cuda
        import torch.distributed as dist

        ext = kernels_cuda.require_built()
        self.rdma_transport = _rdma_transport(rdma_transport, group, ext)
        self.group, self.rank, self.num_ranks = group, dist.get_rank(group), dist.get_world_size(group)
        if ranks_per_node < 1 or self.num_ranks % ranks_per_node or self.num_ranks // ranks_per_node < 2:
            raise ValueError(f"kernels_cuda: InternodeBuffer needs 2 or more nodes of ranks_per_node={ranks_per_node} "
                             f"ranks, got a group of {self.num_ranks}")
        self.num_nodes, self.ranks_per_node = self.num_ranks // ranks_per_node, ranks_per_node
        sizes = (self.num_nodes, ranks_per_node, int(num_rdma_bytes), int(num_nvl_bytes))
        if self.rdma_transport == "ipc":
            self.runtime = ext.IpcInternodeRuntime(self.rank, *sizes)
        else:
            unique_id = [ext.NvshmemInternodeRuntime.unique_id(int(num_rdma_bytes)) if self.rank == 0 else None]
            dist.broadcast_object_list(unique_id, group=group, group_src=0)
            self.runtime = ext.NvshmemInternodeRuntime(self.rank, *sizes, unique_id[0])
        handles: list = [None] * self.num_ranks
        dist.all_gather_object(handles, self.runtime.ipc_handles(), group=group)
        self.runtime.open_ipc_handles(handles)
        dist.barrier(group=group)
        self.engine = _InternodeEngine(self.runtime, self.num_nodes, ranks_per_node,
                                       config or InternodeConfig.for_nodes(self.num_nodes), timeout_cycles, timeout_s,
                                       "cuda", device_sms("cuda", None))
        self.comm_stream = torch.cuda.Stream()

    @staticmethod
    def get_buffer_size_hints(num_nodes: int, gpus_per_node: int, hidden_bytes: int, num_topk: int,
                              config: InternodeConfig | None = None) -> tuple[int, int]:
        """(num_rdma_bytes, num_nvl_bytes) per rank (`InternodeConfig.buffer_size_hints`)."""
        config = config or InternodeConfig.for_nodes(num_nodes)
        return config.buffer_size_hints(num_nodes, gpus_per_node, hidden_bytes, num_topk)

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, to pass as `previous_event`."""
        return capture()

    def _op(self, previous_event: EventOverlap | None, async_finish: bool,
            allocate_on_comm_stream: bool) -> CommStreamOp:
        return CommStreamOp(self.comm_stream, previous_event, async_finish, allocate_on_comm_stream)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event)."""
        op = self._op(previous_event, async_finish, allocate_on_comm_stream)
        layout = self.engine.layout(topk_idx, num_experts, op)
        return (*layout, op.finish(topk_idx, layout))

    def dispatch(self, x: Payload, handle: InternodeHandle | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None, num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: InternodeConfig | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple:
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event).
        Fresh with the layout of `get_dispatch_layout`, cached with `handle`."""
        op = self._op(previous_event, async_finish, allocate_on_comm_stream)
        layout = None if handle is not None else (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                                                  is_token_in_rank)
        if layout is not None and any(t is None for t in layout):
            raise ValueError("kernels_cuda: a fresh dispatch needs num_tokens_per_rank, num_tokens_per_rdma_rank, "
                             "num_tokens_per_expert and is_token_in_rank (from get_dispatch_layout)")
        num_experts = self.num_ranks if num_tokens_per_expert is None else num_tokens_per_expert.numel()
        (result,) = self.engine.dispatch([self.rank], [x], [topk_idx], [topk_weights], [layout], [handle], num_experts,
                                         expert_alignment, config, num_worst_tokens=num_worst_tokens, op=op)
        return (*result, op.finish((x, topk_idx, topk_weights, layout, handle), result))

    def combine(self, x: torch.Tensor, handle: InternodeHandle, topk_weights: torch.Tensor | None = None,
                config: InternodeConfig | None = None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """(combined_x, combined_topk_weights, event): unweighted sum over the ranks each token went to."""
        op = self._op(previous_event, async_finish, allocate_on_comm_stream)
        ((combined, weights),) = self.engine.combine([self.rank], [x], [handle], [topk_weights], config, op=op)
        return combined, weights, op.finish((x, handle, topk_weights), (combined, weights))

    def error_record(self) -> dict[str, Any]:
        return self.engine.error_record()

    def destroy(self) -> None:
        """Frees this rank's regions now, once no peer uses them (collective over the group; otherwise
        when the buffer is garbage collected). NVSHMEM itself is finalised at process exit."""
        import torch.distributed as dist

        torch.cuda.synchronize()
        dist.barrier(group=self.group)
        self.runtime.destroy()
