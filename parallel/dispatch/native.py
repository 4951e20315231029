"""The `native` dispatcher: our CUDA kernels (`kernels_cuda.Buffer`) behind the DeepEP-shaped contract.

The buffer does the moving; this module adds what the contract asks beyond DeepEP's API:
- autograd, as in `parallel.dispatch.base`: dispatch's backward is a combine of the gradients of
  `recv_x` and of the received weights (DeepEP's combine sums the weights it carries); combine's
  backward is a cached dispatch with the handle of the forward dispatch (no count exchange);
- an FP8 payload (per-128-channel e4m3 + scales, dequantised on arrival), as the other backends;
- the byte counters (`Traffic`) with the same logical record sizes the pure-torch backends count
  (payload, FP8 scales, top-k ids as int32, top-k weights), so benchmarks compare like with like;
  the kernels' rings add a 4-byte source index and 16-byte alignment, which is not counted;
- the buffer is created on first dispatch, sized for the rows it meets, and re-created larger if a
  later call needs it (e.g. float32 gradients after bfloat16 tokens; handles are plain tensors, so
  they outlive a buffer). Creation is collective, which is safe because every EP rank runs the
  same layers in the same order.

`buffer_factory(num_bytes)` returns a `kernels_cuda.Buffer`-like object (a real `Buffer` on a
process group, a `kernels_cuda.rank_views.RankView` of an emulated group, or a test double).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kernels_cuda.config import Config
from model.dispatcher import Layout
from parallel.dispatch.base import COMBINE, DISPATCH, INTER_NODE, INTRA_NODE, Traffic
from parallel.dispatch.fp8 import dequantize_e4m3, quantize_e4m3
from parallel.dispatch.handles import StreamHandle, comm_stream, complete
from parallel.dispatch.layout import compute_layout

PAYLOAD_DTYPES = (torch.bfloat16, torch.float32)  # what the kernels' combine can sum


@dataclass
class NativeHandle:
    """What combine and both backward passes reuse: the buffer's handle and this rank's row counts."""

    handle: Any              # kernels_cuda.Handle (plain tensors: any buffer of the same group can use it)
    num_topk: int
    sent: list[int]          # rows this rank sent to each rank in dispatch
    received: list[int]      # rows this rank received from each rank in dispatch


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def on_comm_stream(fn: Callable[[], Any], inputs: tuple[torch.Tensor, ...]) -> Any:
    """Run the buffer call `fn`; inside an overlapped pair on CUDA its kernels go to the pair's
    communication stream (whose SMs are the buffer's `num_sms` budget) and the other chunk computes
    until they finish, as the all-to-alls of the pure-torch backends do."""
    device = inputs[0].device
    stream = comm_stream(device)
    if stream is None:
        return fn()
    compute = torch.cuda.current_stream(device)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        out = fn()
        event = torch.cuda.Event()
        event.record(stream)
    for tensor in inputs:
        tensor.record_stream(stream)
    complete(StreamHandle(None, event))
    for tensor in _tensors(out):
        tensor.record_stream(compute)
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: NativeDispatcher, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_idx: torch.Tensor, layout: Layout):
        buffer = backend.buffer_for(x, topk_idx.shape[1])
        payload = quantize_e4m3(x) if backend.fp8 else x.contiguous()
        idx, weights = topk_idx.long().contiguous(), topk_weights.float().contiguous()
        recv, local, recv_w, per_expert, handle, _ = on_comm_stream(lambda: buffer.dispatch(
            payload, num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
            num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=idx, topk_weights=weights),
            (idx, weights, *_tensors(payload)))
        recv_x = dequantize_e4m3(recv[0], recv[1], x.dtype) if backend.fp8 else recv
        local = local.to(topk_idx.dtype)
        recv_w = recv_w.to(topk_weights.dtype)
        counts = torch.tensor(per_expert, dtype=torch.long, device=x.device)
        sent = layout.is_token_in_rank.sum(0).tolist()
        native = NativeHandle(handle, topk_idx.shape[1], sent, backend.received_counts(handle))
        backend.count(DISPATCH, sent, backend.dispatch_row_bytes(x, topk_idx, topk_weights))
        ctx.backend, ctx.native, ctx.weights_dtype = backend, native, topk_weights.dtype
        ctx.save_for_backward(local)
        ctx.mark_non_differentiable(local, counts)
        return recv_x, local, recv_w, counts, native

    @staticmethod
    def backward(ctx, grad_x, _idx, grad_weights, _counts, _handle):
        (local,) = ctx.saved_tensors
        backend, native = ctx.backend, ctx.native
        # Both gradients always travel (autograd materialises unused ones as zeros), as in base.py.
        grad_weights = grad_weights.masked_fill(local < 0, 0)
        grad_x = grad_x.contiguous()
        backend.check_payload(grad_x)
        buffer = backend.buffer_for(grad_x, native.num_topk)
        grad_w32 = grad_weights.float()
        combined, combined_w, _ = on_comm_stream(
            lambda: buffer.combine(grad_x, native.handle, topk_weights=grad_w32), (grad_x, grad_w32))
        backend.count(COMBINE, native.received,
                      grad_x.shape[1] * grad_x.element_size() + grad_weights.shape[1] * grad_weights.element_size())
        return None, combined, combined_w.to(ctx.weights_dtype), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: NativeDispatcher, y: torch.Tensor, native: NativeHandle):
        backend.check_payload(y)
        buffer, y = backend.buffer_for(y, native.num_topk), y.contiguous()
        combined, _, _ = on_comm_stream(lambda: buffer.combine(y, native.handle), (y,))
        backend.count(COMBINE, native.received, y.shape[1] * y.element_size())
        ctx.backend, ctx.native = backend, native
        return combined

    @staticmethod
    def backward(ctx, grad):
        backend, native = ctx.backend, ctx.native
        grad = grad.contiguous()
        buffer = backend.buffer_for(grad, native.num_topk)
        recv, *_ = on_comm_stream(lambda: buffer.dispatch(grad, handle=native.handle), (grad,))
        backend.count(DISPATCH, native.sent, grad.shape[1] * grad.element_size())
        return None, recv, None


class NativeDispatcher:
    """The dispatcher contract of `model.dispatcher` over a `kernels_cuda.Buffer` (one EP rank)."""

    def __init__(self, buffer_factory: Callable[[int], Any], num_experts: int, num_ranks: int, rank: int,
                 ranks_per_node: int, fp8: bool = False, config: Config | None = None) -> None:
        if num_experts % num_ranks:
            raise ValueError(f"{num_experts} experts cannot be split over {num_ranks} EP ranks")
        self.buffer_factory, self.config = buffer_factory, config or Config()
        self.num_experts, self.num_ranks, self.rank = num_experts, num_ranks, rank
        self.ranks_per_node, self.experts_per_rank = ranks_per_node, num_experts // num_ranks
        self.fp8 = fp8
        self.traffic = Traffic()
        node = rank // ranks_per_node
        self.links = [None if peer == rank else INTRA_NODE if peer // ranks_per_node == node else INTER_NODE
                      for peer in range(num_ranks)]
        self._buffer: Any = None
        self._buffer_bytes = 0

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
        if per_node is None:  # intranode buffers report no per-node counts
            nodes = self.num_ranks // self.ranks_per_node
            per_node = in_rank.view(-1, nodes, self.ranks_per_node).any(-1).sum(0)
        return Layout(per_rank.long(), per_expert.long(), in_rank, per_node.long())

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, NativeHandle]:
        """Each token once per destination rank; rows by source rank, then source token order."""
        if not x.shape[0] == topk_idx.shape[0] == topk_weights.shape[0] == layout.is_token_in_rank.shape[0]:
            raise ValueError("x, topk_idx, topk_weights and the layout must have one row per token")
        self.check_payload(x)
        return _Dispatch.apply(self, x, topk_weights, topk_idx, layout)

    def combine(self, y: torch.Tensor, handle: NativeHandle) -> torch.Tensor:
        """Unweighted sum, per source token, of its rows on every rank it went to."""
        if not isinstance(handle, NativeHandle):
            raise TypeError(f"dispatcher 'native' combines with its own dispatch handle, got {type(handle).__name__}")
        return _Combine.apply(self, y, handle)

    # ------------------------------------------------------------------ helpers for the autograd functions

    def buffer_for(self, x: torch.Tensor, num_topk: int) -> Any:
        """The buffer, (re-)created if it is missing or too small for rows like `x`."""
        hidden_bytes = x.shape[1] * max(x.element_size(), 2)  # FP8 rows (+ scales) fit where BF16 rows do
        needed = self.config.buffer_size_hint(self.num_ranks, hidden_bytes, num_topk)
        if self._buffer is None or needed > self._buffer_bytes:
            self._buffer = None  # release the old buffer before allocating the new one
            self._buffer = self.buffer_factory(needed)
            self._buffer_bytes = needed
        return self._buffer

    def received_counts(self, handle: Any) -> list[int]:
        """Rows received from each rank, from the handle's rank_prefix_matrix [R, R] (column = receiver)."""
        column = handle.rank_prefix_matrix[:, self.rank].long()
        return torch.diff(column, prepend=column.new_zeros(1)).tolist()

    def dispatch_row_bytes(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> int:
        hidden, k = x.shape[1], topk_idx.shape[1]
        payload = hidden + hidden // 128 * 4 if self.fp8 else hidden * x.element_size()
        return payload + k * 4 + k * topk_weights.element_size()

    def count(self, direction: str, rows_per_rank: list[int], row_bytes: int) -> None:
        for link, rows in zip(self.links, rows_per_rank):
            if link is not None:
                self.traffic.add(direction, link, rows, rows * row_bytes)

    def check_payload(self, x: torch.Tensor) -> None:
        if x.dtype not in PAYLOAD_DTYPES:
            raise TypeError(f"dispatcher 'native' moves bfloat16 or float32 rows, got {x.dtype}")
        if x.shape[1] * x.element_size() % 16:
            raise ValueError(f"dispatcher 'native' needs rows of a multiple of 16 bytes, got {x.shape[1]} x {x.dtype}")

    def _check_experts(self, num_experts: int) -> None:
        if num_experts != self.num_experts:
            raise ValueError(f"this dispatcher was built for {self.num_experts} experts, got {num_experts}")


def process_group_buffer_factory(group: Any, config: Config | None = None) -> Callable[[int], Any]:
    """Buffers on a torch.distributed process group (CUDA IPC between the ranks of one node)."""
    from kernels_cuda import Buffer

    def make(num_bytes: int) -> Any:
        return Buffer(group, num_bytes, config)

    return make
