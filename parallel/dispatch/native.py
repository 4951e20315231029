"""The `native` dispatcher: our CUDA kernels (`kernels_cuda.Buffer`, on a GPU or the CPU emulation) behind the
DeepEP-shaped contract.

The buffer does the moving; this module adds what the contract asks beyond DeepEP's API:
- autograd, as in `parallel.dispatch.base`: dispatch's backward is a combine of the gradients of
  `recv_x` and of the received weights (DeepEP's combine sums the weights it carries); combine's
  backward is a cached dispatch with the handle of the forward dispatch (no count exchange);
- an FP8 payload (per-128-channel e4m3 + scales, dequantised on arrival), as the other backends;
- the byte counters (`Traffic`) with the same logical record sizes the pure-torch backends count
  (payload, FP8 scales, top-k ids as int32, top-k weights), so benchmarks compare like with like;
  the kernels' rings add a 4-byte source index and 16-byte alignment, which is not counted. Rows
  are counted on the links they cross: intranode, one row per (token, destination rank), as
  `alltoall`; internode, as `hierarchical` (one RDMA record per token and other node, then the
  forwarder's NVLink copies), read from the handle of each fresh dispatch;
- the buffer is created on first dispatch, sized for the rows it meets, and re-created larger if a
  later call needs it (e.g. float32 gradients after bfloat16 tokens; handles are plain tensors, so
  they outlive a buffer). Creation is collective, which is safe because every EP rank runs the
  same layers in the same order.

The kind of buffer follows the config: a `kernels_cuda.Config` means an intranode buffer (one
NVLink region), an `InternodeConfig` an internode one (RDMA and NVLink regions).
`buffer_factory(sizes)` gets the `BufferSizes` the next calls need and returns an object with the
buffer API (a real `Buffer` on a process group, a
`kernels_cuda.rank_views.RankView` of an emulated group, or a test double).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from kernels_cuda.config import Config, InternodeConfig
from model.dispatcher import Layout
from model.fp8 import Fp8Tensor
from parallel.dispatch.base import (COMBINE, DISPATCH, INTER_NODE, INTRA_NODE, Traffic, local_weight_grad,
                                     save_local_ids)
from parallel.dispatch.fp8 import ReceivedFp8Rows, dequantize_e4m3, quantize_e4m3
from parallel.dispatch.handles import OverlapSwitch, StreamHandle, WorkHandle
from parallel.dispatch.layout import compute_layout

PAYLOAD_DTYPES = (torch.bfloat16, torch.float32)  # what the kernels' combine can sum


@dataclass(frozen=True)
class BufferSizes:
    """Bytes per rank of a buffer's regions: NVLink, and RDMA for internode buffers (0 intranode)."""

    nvl_bytes: int
    rdma_bytes: int = 0

    def covers(self, other: BufferSizes) -> bool:
        return self.nvl_bytes >= other.nvl_bytes and self.rdma_bytes >= other.rdma_bytes


BufferFactory = Callable[[BufferSizes], Any]
BufferSizer = Callable[[int, int], BufferSizes]  # (hidden bytes of a row, top-k) -> what a buffer needs


def buffer_sizes(config: Config | InternodeConfig, num_ranks: int, ranks_per_node: int, hidden_bytes: int,
                 num_topk: int) -> BufferSizes:
    """What a buffer of `config`'s kind needs for rows of up to `hidden_bytes` (FP8 rows sized as BF16):
    `Config.buffer_size_hint` intranode, `InternodeConfig.buffer_size_hints` across nodes."""
    if isinstance(config, InternodeConfig):
        rdma, nvl = config.buffer_size_hints(num_ranks // ranks_per_node, ranks_per_node, hidden_bytes, num_topk)
        return BufferSizes(nvl, rdma)
    return BufferSizes(config.buffer_size_hint(num_ranks, hidden_bytes, num_topk))


# DeepEP's handles are tuples (reference brief §1.6); the positions of the fields the counters read.
DEEPEP_HANDLE_FIELDS = {
    6: {"rank_prefix_matrix": 0, "is_token_in_rank": 4},
    10: {"is_token_in_rank": 0, "recv_rdma_rank_prefix_sum": 4, "recv_gbl_rank_prefix_sum": 6, "send_nvl_head": 9},
}


def handle_fields(handle: Any) -> Any:
    """The handle's fields by name: our handles as they are, DeepEP's tuples by position."""
    if not isinstance(handle, tuple):
        return handle
    positions = DEEPEP_HANDLE_FIELDS.get(len(handle))
    if positions is None:
        raise TypeError(f"a buffer handle of {len(handle)} fields is neither DeepEP's intranode (6) nor internode (10)")
    return SimpleNamespace(**{name: handle[i] for name, i in positions.items()})


@dataclass
class NativeHandle(ReceivedFp8Rows):
    """What combine and both backward passes reuse: the buffer's handle and this rank's rows per link
    (and, until `take_fp8_rows`, the received FP8 rows)."""

    handle: Any                    # Handle or InternodeHandle: plain tensors, any buffer of the group can use it
    num_topk: int
    dispatch_rows: dict[str, torch.Tensor]  # rows this rank sends over each link when rows move towards the experts
    combine_rows: dict[str, torch.Tensor]   # ... and when they move back towards their tokens


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def on_comm_stream(fn: Callable[[], Any], inputs: tuple[torch.Tensor, ...], switch: OverlapSwitch) -> Any:
    """Run the buffer call `fn`; inside an overlapped pair (`switch` installed) on CUDA its kernels go to the pair's
    communication stream (whose SMs are the buffer's `num_sms` budget) and the other chunk computes
    until they finish, as the all-to-alls of the pure-torch backends do. Elsewhere (the CPU emulation,
    or outside a pair) the call has finished when it returns; a pair still passes the baton here, so
    the chunks interleave at the same points on every device."""
    device = inputs[0].device
    stream = switch.comm_stream(device)
    if stream is None:
        out = fn()
        switch.complete(WorkHandle(None))
        return out
    compute = torch.cuda.current_stream(device)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        out = fn()
        event = torch.cuda.Event()
        event.record(stream)
    for tensor in inputs:
        tensor.record_stream(stream)
    switch.complete(StreamHandle(None, event))
    for tensor in _tensors(out):
        tensor.record_stream(compute)
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: NativeDispatcher, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_idx: torch.Tensor, layout: Layout):
        buffer = backend.buffer_for(x, topk_idx.shape[1])
        payload = quantize_e4m3(x, round_scale=True) if backend.fp8 else x.contiguous()
        idx, weights = topk_idx.long().contiguous(), topk_weights.float().contiguous()
        layout_args = backend.layout_args(layout)
        recv, local, recv_w, per_expert, handle, _ = on_comm_stream(lambda: buffer.dispatch(
            payload, **layout_args, topk_idx=idx, topk_weights=weights), (idx, weights, *_tensors(payload)),
            backend.switch)
        recv_x = dequantize_e4m3(recv[0], recv[1], x.dtype) if backend.fp8 else recv
        local = local.to(topk_idx.dtype)
        recv_w = recv_w.to(topk_weights.dtype)
        counts = list(per_expert)  # the buffer's host list (DeepEP's num_recv_tokens_per_expert_list)
        native = NativeHandle(handle, topk_idx.shape[1], *backend.link_rows(handle),
                              fp8_rows=Fp8Tensor(recv[0], recv[1], 1) if backend.fp8 else None)
        backend.count(DISPATCH, native.dispatch_rows, backend.dispatch_row_bytes(x, topk_idx, topk_weights))
        ctx.backend, ctx.native, ctx.weights_dtype = backend, native, topk_weights.dtype
        save_local_ids(ctx, local)
        return recv_x, local, recv_w, counts, native

    @staticmethod
    def backward(ctx, grad_x, _idx, grad_weights, _counts, _handle):
        backend, native = ctx.backend, ctx.native
        grad_weights = local_weight_grad(ctx, grad_weights)
        grad_x = grad_x.contiguous()
        backend.check_payload(grad_x)
        buffer = backend.buffer_for(grad_x, native.num_topk)
        grad_w32 = grad_weights.float()
        combined, combined_w, _ = on_comm_stream(
            lambda: buffer.combine(grad_x, native.handle, topk_weights=grad_w32), (grad_x, grad_w32), backend.switch)
        backend.count(COMBINE, native.combine_rows,
                      grad_x.shape[1] * grad_x.element_size() + grad_weights.shape[1] * grad_weights.element_size())
        return None, combined, combined_w.to(ctx.weights_dtype), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: NativeDispatcher, y: torch.Tensor, native: NativeHandle):
        backend.check_payload(y)
        buffer, y = backend.buffer_for(y, native.num_topk), y.contiguous()
        combined, _, _ = on_comm_stream(lambda: buffer.combine(y, native.handle), (y,), backend.switch)
        backend.count(COMBINE, native.combine_rows, y.shape[1] * y.element_size())
        ctx.backend, ctx.native = backend, native
        return combined

    @staticmethod
    def backward(ctx, grad):
        """The gradient dispatched along the cached handle: in FP8 with the FP8 dispatch (base.py)."""
        backend, native = ctx.backend, ctx.native
        grad = grad.contiguous()
        buffer = backend.buffer_for(grad, native.num_topk)
        payload = quantize_e4m3(grad, round_scale=True) if backend.fp8 else grad
        recv, *_ = on_comm_stream(lambda: buffer.dispatch(payload, handle=native.handle), (grad, *_tensors(payload)),
                                  backend.switch)
        backend.count(DISPATCH, native.dispatch_rows, backend.payload_row_bytes(grad))
        return None, dequantize_e4m3(recv[0], recv[1], grad.dtype) if backend.fp8 else recv, None


class NativeDispatcher:
    """The dispatcher contract of `model.dispatcher` over a `kernels_cuda` buffer (one EP rank).

    `config` says the kind of buffer `buffer_factory` makes: intranode (`Config`, the default) or
    internode (`InternodeConfig`, ranks numbered node * ranks_per_node + GPU), and by default its size
    (`sizes` overrides it: `deepep` sizes by DeepEP's configs). `payload_dtypes` are the row dtypes the
    buffer moves and sums; `name` is the dispatcher's name in errors; its buffer calls complete through
    `switch` (None: one of its own, which only waits).
    """

    def __init__(self, buffer_factory: BufferFactory, num_experts: int, num_ranks: int, rank: int,
                 ranks_per_node: int, fp8: bool = False, config: Config | InternodeConfig | None = None,
                 sizes: BufferSizer | None = None, payload_dtypes: tuple[torch.dtype, ...] = PAYLOAD_DTYPES,
                 name: str = "native", switch: OverlapSwitch | None = None) -> None:
        if num_experts % num_ranks:
            raise ValueError(f"{num_experts} experts cannot be split over {num_ranks} EP ranks")
        self.buffer_factory, self.config = buffer_factory, config or Config()
        self.sizes = sizes or (lambda hidden_bytes, num_topk: buffer_sizes(
            self.config, self.num_ranks, self.ranks_per_node, hidden_bytes, num_topk))
        self.payload_dtypes, self.name = payload_dtypes, name
        self.switch = switch if switch is not None else OverlapSwitch()
        self.num_experts, self.num_ranks, self.rank = num_experts, num_ranks, rank
        self.ranks_per_node, self.experts_per_rank = ranks_per_node, num_experts // num_ranks
        self.fp8 = fp8
        self.traffic = Traffic()
        node = rank // ranks_per_node
        self.links = [None if peer == rank else INTRA_NODE if peer // ranks_per_node == node else INTER_NODE
                      for peer in range(num_ranks)]
        self._buffer: Any = None
        self._buffer_sizes = BufferSizes(0)

    @property
    def internode(self) -> bool:
        return isinstance(self.config, InternodeConfig)

    def local_experts(self, num_experts: int) -> range:
        self._check_experts(num_experts)
        return range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        """The layout kernel's counts (as int64, like the other backends) and `is_token_in_rank`.

        Before the first dispatch there is no buffer yet (its size depends on the rows), so the
        pure-torch layout gives the same numbers.
        """
        self._check_experts(num_experts)
        if self._buffer is None:
            return compute_layout(topk_idx, num_experts, self.num_ranks, self.ranks_per_node)
        per_rank, per_node, per_expert, in_rank, _ = self._buffer.get_dispatch_layout(topk_idx.long().contiguous(),
                                                                                       num_experts)
        if per_node is None:  # intranode buffers (and emulated rank views) report no per-node counts
            per_node = self._tokens_per_node(in_rank)
        return Layout(per_rank.long(), per_expert.long(), in_rank, per_node.long())

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], NativeHandle]:
        """Each token once per destination rank; rows by source rank, then source token order."""
        if not x.shape[0] == topk_idx.shape[0] == topk_weights.shape[0] == layout.is_token_in_rank.shape[0]:
            raise ValueError("x, topk_idx, topk_weights and the layout must have one row per token")
        self.check_payload(x)
        return _Dispatch.apply(self, x, topk_weights, topk_idx, layout)

    def take_fp8_rows(self, handle: NativeHandle) -> Fp8Tensor | None:
        return handle.take_fp8_rows()

    def combine(self, y: torch.Tensor, handle: NativeHandle) -> torch.Tensor:
        """Unweighted sum, per source token, of its rows on every rank it went to."""
        if not isinstance(handle, NativeHandle):
            raise TypeError(f"dispatcher '{self.name}' combines with its own dispatch handle, got {type(handle).__name__}")
        handle.take_fp8_rows()  # dropped if nobody took them: the combine keeps the handle for its backward
        return _Combine.apply(self, y, handle)

    # ------------------------------------------------------------------ helpers for the autograd functions

    def buffer_for(self, x: torch.Tensor, num_topk: int) -> Any:
        """The buffer, (re-)created if it is missing or too small for rows like `x`."""
        hidden_bytes = x.shape[1] * max(x.element_size(), 2)  # FP8 rows (+ scales) fit where BF16 rows do
        needed = self.sizes(hidden_bytes, num_topk)
        if self._buffer is None or not self._buffer_sizes.covers(needed):
            destroy = getattr(self._buffer, "destroy", None)
            if destroy is not None:  # collective: peers finish with its regions before they are freed
                destroy()
            self._buffer = None  # release the old buffer before allocating the new one
            self._buffer = self.buffer_factory(needed)
            self._buffer_sizes = needed
        return self._buffer

    def layout_args(self, layout: Layout) -> dict[str, torch.Tensor]:
        """The layout arguments of a fresh `dispatch`, as the buffers' layout returns them (int32 counts);
        internode buffers also take the tokens per node."""
        args = {"num_tokens_per_rank": layout.num_tokens_per_rank.int(),
                "is_token_in_rank": layout.is_token_in_rank.bool().contiguous(),
                "num_tokens_per_expert": layout.num_tokens_per_expert.int()}
        if self.internode:
            per_node = layout.num_tokens_per_node
            args["num_tokens_per_rdma_rank"] = (self._tokens_per_node(layout.is_token_in_rank) if per_node is None
                                                else per_node).int()
        return args

    def link_rows(self, handle: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Rows this rank sends over each link (dispatch direction, combine direction), read from the
        handle of a fresh dispatch (before any combine rewrites its heads), as device tensors: the
        traffic counters read them back only when they are read."""
        handle = handle_fields(handle)
        if self.internode:
            return self._internode_link_rows(handle)
        column = handle.rank_prefix_matrix[:, self.rank].long()  # [R, R] prefix over sources, column = receiver
        received = torch.diff(column, prepend=column.new_zeros(1))
        return self._by_link(handle.is_token_in_rank.sum(0)), self._by_link(received)

    def _internode_link_rows(self, handle: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """As `hierarchical` counts its two hops. Dispatch: one RDMA record per token and other node,
        then the NVLink copies this rank makes as forwarder of its rail (`send_nvl_head` >= 0) to the
        other GPUs of its node. Combine: the same records back, i.e. the RDMA records received from
        other nodes and the rows received through other forwarders (source ranks of another GPU index)."""
        gpus = self.ranks_per_node
        node, gpu = divmod(self.rank, gpus)
        to_node = handle.is_token_in_rank.view(-1, self.num_ranks // gpus, gpus).any(-1)
        forwarded = handle.send_nvl_head >= 0
        rdma = handle.recv_rdma_rank_prefix_sum.long()
        records_in = torch.diff(rdma, prepend=rdma.new_zeros(1))
        rows = handle.recv_gbl_rank_prefix_sum.long()
        rows_in = torch.diff(rows, prepend=rows.new_zeros(1)).view(-1, gpus)
        inter_out, intra_out = to_node.sum() - to_node[:, node].sum(), forwarded.sum() - forwarded[:, gpu].sum()
        inter_in, intra_in = records_in.sum() - records_in[node], rows_in.sum() - rows_in[:, gpu].sum()
        if gpus == 1:
            return {INTER_NODE: inter_out}, {INTER_NODE: inter_in}
        return {INTER_NODE: inter_out, INTRA_NODE: intra_out}, {INTER_NODE: inter_in, INTRA_NODE: intra_in}

    def payload_row_bytes(self, x: torch.Tensor) -> int:
        """Bytes of one dispatched row of `x`: E4M3 and a 4-byte scale per 128 channels with `fp8`."""
        hidden = x.shape[1]
        return hidden + hidden // 128 * 4 if self.fp8 else hidden * x.element_size()

    def dispatch_row_bytes(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> int:
        k = topk_idx.shape[1]
        return self.payload_row_bytes(x) + k * 4 + k * topk_weights.element_size()

    def count(self, direction: str, rows_per_link: dict[str, torch.Tensor], row_bytes: int) -> None:
        for link, rows in rows_per_link.items():
            self.traffic.add(direction, link, rows, row_bytes)

    def _by_link(self, rows_per_rank: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows per peer [R] -> rows per link (every link this rank has, even with no rows, as `Hop` counts)."""
        first = self.rank // self.ranks_per_node * self.ranks_per_node
        in_node = rows_per_rank[first:first + self.ranks_per_node].sum()
        out = {}
        if self.ranks_per_node > 1:
            out[INTRA_NODE] = in_node - rows_per_rank[self.rank]
        if self.num_ranks > self.ranks_per_node:
            out[INTER_NODE] = rows_per_rank.sum() - in_node
        return out

    def _tokens_per_node(self, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        nodes = self.num_ranks // self.ranks_per_node
        return is_token_in_rank.view(-1, nodes, self.ranks_per_node).any(-1).sum(0)

    def check_payload(self, x: torch.Tensor) -> None:
        if x.dtype not in self.payload_dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.payload_dtypes)
            raise TypeError(f"dispatcher '{self.name}' moves {names} rows, got {x.dtype}")
        if x.shape[1] * x.element_size() % 16:
            raise ValueError(f"dispatcher '{self.name}' needs rows of a multiple of 16 bytes, got {x.shape[1]} x {x.dtype}")

    def _check_experts(self, num_experts: int) -> None:
        if num_experts != self.num_experts:
            raise ValueError(f"this dispatcher was built for {self.num_experts} experts, got {num_experts}")


def process_group_buffer_factory(group: Any, ranks_per_node: int, config: Config | InternodeConfig,
                                 device: str) -> BufferFactory:
    """Per-process `kernels_cuda.Buffer`s on a torch.distributed process group: intranode for a `Config`,
    internode (nodes of `ranks_per_node` ranks) for an `InternodeConfig`; on a GPU or the CPU emulation."""
    from kernels_cuda import Buffer

    def make(sizes: BufferSizes) -> Any:
        return Buffer(group, sizes.nvl_bytes, sizes.rdma_bytes, ranks_per_node=ranks_per_node, config=config,
                      device=device)

    return make
