"""DeepEP's low-latency dispatch/combine (the decoding kernels; shared/reference/deepep.md §1.8 and §5) as
pure-torch reference semantics over any `Comm`: torch.distributed (gloo on CPU) or the simulated EP group.

Tokens move by point-to-point messages into fixed slots, with no rings and no forwarding: rank s
writes its t-th token's copy for expert e into rank r's receive buffer at `[local expert][s][slot]`,
slot < `num_max_dispatch_tokens_per_rank` (T_max). The receiver packs them per local expert:

- `packed_recv_x [E_local, R * T_max, H]`: bfloat16 (or float32, an extension of this reference for
  exact fp32 decoding: DeepEP takes bfloat16 only), or with `use_fp8` e4m3 rows plus
  `packed_recv_x_scales`, float32 `[E_local, R * T_max, H / 128]` (per 128 channels, amax / 448 with
  DeepEP's 1e-4 floor; `round_scale` rounds each up to a power of two), or with `use_ue8m0` the
  exponent bytes of those power-of-two scales packed 4 per int32 `[E_local, R * T_max, H / 512]`.
  Scales are column-major in the last two dims (strides (R * T_max * S, 1, R * T_max)), as DeepEP
  allocates them for TMA loads.
- `packed_recv_count [E_local]` int32: only the first `count[e]` rows of expert e are valid.
- `packed_recv_src_info [E_local, R * T_max]` int32: each row's token index at its source rank.
- `packed_recv_layout_range [E_local, R]` int64: `(begin << 32) | count` of the rows from source s.

Order of rows inside an expert. DeepEP's kernels group an expert's rows by source rank, but the
groups land in arrival order (`begin` is an atomicAdd on `packed_recv_count`), and inside a group
the rows follow the sender's per-expert slot counter (an atomic across warps, not token order). So
positions mean nothing by themselves: `layout_range` says where each source's rows are and
`src_info` which token each row is. This reference puts the groups in source-rank order and the rows
of a group in token order, which is one of the orders the kernels may produce; compare through
`layout_range` and `src_info`, never by position.

Double buffering. DeepEP's buffer has two halves used in turn by consecutive low-latency ops
(dispatch or combine), because signalling is one-way (data, then a count or flag, never an
acknowledgement), and each op zeroes the next half's signals as it starts. An op's sends into a
peer's half are safe once that peer has started the previous op (which zeroed the half, after
finishing the op before that, its last user). Completing an op's receive proves every peer started
it; a pending hook proves nothing, so a rank whose hook is pending could be overwritten or have its
unread signals zeroed by a peer that runs ahead. Hence the rule here and in the kernels
(`kernels_cuda.Buffer`): call an op's hook before the next low-latency op, which raises otherwise.
With it, any three consecutive ops are safe, and at most 2 results live in the buffer at once (the
op whose receive is pending, and the zero-copy combine input written into the next half).
The zero-copy combine buffer (`get_next_low_latency_combine_buffer`) is the next op's half.

`return_recv_hook=True` issues the send now and returns `hook`, which completes the receive (the
outputs are valid after it); otherwise the op completes before it returns and `hook` is None. Events
are always None here (the reference is synchronous on the caller's stream).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from kernels_cuda.low_latency import (PENDING_HOOK, LowLatencyHandle, check_combine, check_dispatch,
                                      check_hook_args, column_major)
from kernels_cuda.streams import EventOverlap
from parallel.dispatch.comm import Comm
from parallel.dispatch.fp8 import BLOCK, pack_ue8m0, quantize_e4m3

ROW_DTYPES = (torch.bfloat16, torch.float32)  # float32 rows: this reference's extension for exact fp32 decoding


@dataclass
class _Half:
    """One half of the double buffer: whether a result received into it is still waiting for its hook."""

    pending: bool = False
    combine_buffer: torch.Tensor | None = None  # the zero-copy combine input, [E_local, R * T_max, H] bf16


def _exchange(comm: Comm, send: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Equal blocks of `send` [R, ...] to every peer; returns the wait for the received [R, ...] (by source)."""
    splits = [1] * comm.size
    launch = getattr(comm, "all_to_all_async", None)
    if launch is None:  # a synchronous transport (threads): the data has arrived when the call returns
        received = comm.all_to_all(send, splits, splits)
        return lambda: received
    received, handle = launch(send, splits, splits)

    def wait() -> torch.Tensor:
        handle.wait()
        return received

    return wait


class LowLatencyExchange:
    """One EP rank's low-latency dispatch and combine with DeepEP's signatures and return values.

    Every rank of `comm` must make the same sequence of calls (each is collective), with the same
    `num_max_dispatch_tokens_per_rank` and `num_experts`, as with DeepEP's buffer.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._halves = [_Half(), _Half()]
        self._next = 0

    # ------------------------------------------------------------------ the double buffer

    def _take_half(self, op: str) -> _Half:
        if any(h.pending for h in self._halves):
            raise RuntimeError(f"low_latency_{op}: {PENDING_HOOK} (the one-way signals of the double buffer are safe "
                               "only then)")
        half = self._halves[self._next]
        self._next ^= 1
        return half

    def _complete(self, half: _Half, receive: Callable[[], Any], return_recv_hook: bool,
                  async_finish: bool) -> tuple[Any, Callable[[], None] | None]:
        """Run `receive` now, or return it as the hook; `receive` fills the outputs in place."""
        check_hook_args(return_recv_hook, async_finish)
        if not return_recv_hook:
            receive()
            return None
        half.pending = True

        def hook() -> None:
            if not half.pending:
                raise RuntimeError("this low-latency hook was already called")
            receive()
            half.pending = False

        return hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The bfloat16 [E_local, R * T_max, H] buffer the next combine reads with `zero_copy=True`: write
        the expert outputs there instead of passing them."""
        local = handle.num_experts // self.comm.size
        shape = (local, self.comm.size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        half = self._halves[self._next]
        if half.combine_buffer is None or tuple(half.combine_buffer.shape) != shape:
            half.combine_buffer = torch.zeros(shape, dtype=torch.bfloat16, device=handle.src_info.device)
        return half.combine_buffer

    # ------------------------------------------------------------------ dispatch

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> tuple:
        """(recv_x, packed_recv_count, handle, event, hook); recv_x is packed_recv_x, or with `use_fp8`
        (packed_recv_x, packed_recv_x_scales)."""
        R, T_max = self.comm.size, num_max_dispatch_tokens_per_rank
        check_dispatch(f"low_latency_dispatch (rank {self.comm.rank})", R, x, topk_idx, T_max, num_experts, use_fp8,
                       round_scale, use_ue8m0, cumulative_local_expert_recv_stats, ROW_DTYPES)
        half = self._take_half("dispatch")
        tokens, hidden = x.shape
        local = num_experts // R
        device = x.device
        stats = cumulative_local_expert_recv_stats

        # Send: the token's copy for each of its experts into [destination][local expert][slot], the slot
        # from a per-expert counter (here: the token's rank among this rank's tokens for that expert).
        if use_fp8:
            rows, scales = quantize_e4m3(x, round_scale or use_ue8m0)
            payload = torch.cat([rows.view(torch.uint8), scales.view(torch.uint8)], dim=1)
        else:
            payload = x.contiguous().view(torch.uint8)
        message = payload.shape[1]
        send = torch.zeros(R, local, T_max, message, dtype=torch.uint8, device=device)
        send_src = torch.full((R, local, T_max), -1, dtype=torch.int32, device=device)
        counts = torch.zeros(R, local, dtype=torch.int32, device=device)
        for expert in range(num_experts):
            chosen = (topk_idx == expert).any(dim=1).nonzero().flatten()
            if chosen.numel() == 0:
                continue
            dst, e = divmod(expert, local)
            send[dst, e, :chosen.numel()] = payload[chosen]
            send_src[dst, e, :chosen.numel()] = chosen.int()
            counts[dst, e] = chosen.numel()
        wait_payload = _exchange(self.comm, send)
        wait_src = _exchange(self.comm, send_src)
        wait_counts = _exchange(self.comm, counts)

        packed_x = torch.empty(local, R * T_max, hidden, device=device,
                               dtype=torch.float8_e4m3fn if use_fp8 else x.dtype)
        scale_cols = hidden // BLOCK // (4 if use_ue8m0 else 1)
        packed_scales = None if not use_fp8 else column_major(
            local, scale_cols, R * T_max, torch.int32 if use_ue8m0 else torch.float32, device)
        src_info = torch.full((local, R * T_max), -1, dtype=torch.int32, device=device)
        layout_range = torch.zeros(local, R, dtype=torch.int64, device=device)
        packed_count = torch.zeros(local, dtype=torch.int32, device=device)

        def receive() -> None:
            received, received_src, received_counts = wait_payload(), wait_src(), wait_counts()  # [R(src), local, ...]
            for e in range(local):
                begin = 0
                for src in range(R):
                    n = int(received_counts[src, e])
                    rows = received[src, e, :n]
                    if use_fp8:
                        packed_x[e, begin:begin + n] = rows[:, :hidden].view(torch.float8_e4m3fn)
                        row_scales = rows[:, hidden:].contiguous().view(torch.float32)
                        packed_scales[e, begin:begin + n] = pack_ue8m0(row_scales) if use_ue8m0 else row_scales
                    else:
                        packed_x[e, begin:begin + n] = rows.contiguous().view(packed_x.dtype)
                    src_info[e, begin:begin + n] = received_src[src, e, :n]
                    layout_range[e, src] = (begin << 32) | n
                    begin += n
                packed_count[e] = begin
            if stats is not None:
                stats.add_(packed_count)

        hook = self._complete(half, receive, return_recv_hook, async_finish)
        recv_x = (packed_x, packed_scales) if use_fp8 else packed_x
        handle = LowLatencyHandle(src_info, layout_range, T_max, hidden, num_experts)
        return recv_x, packed_count, handle, EventOverlap(), hook

    # ------------------------------------------------------------------ combine

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None) -> tuple:
        """(combined_x, event, hook): combined_x[t] = sum_k topk_weights[t, k] * (the expert output of
        token t's k-th expert), summed in fp32 in k order, in x's dtype. `x` [E_local, R * T_max, H]
        bfloat16 (or float32, this reference's extension) holds the expert outputs in the dispatch's packed
        layout (with `zero_copy`, the buffer of `get_next_low_latency_combine_buffer` holds them instead)."""
        R, me = self.comm.size, self.comm.rank
        src_info, layout_range, T_max, hidden, num_experts = handle
        local = num_experts // R
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        check_combine(f"low_latency_combine (rank {me})", R, x, topk_idx, topk_weights, handle, use_logfmt, out,
                      ROW_DTYPES)
        half = self._take_half("combine")
        device = x.device

        # Send: per (local expert, source rank), the rows [begin, begin + count) back to their source,
        # into its [global expert][source token] slots, with a flag per expert.
        send = torch.zeros(R, local, T_max, hidden, dtype=x.dtype, device=device)
        flags = torch.zeros(R, local, T_max, dtype=torch.int32, device=device)
        for e in range(local):
            for src in range(R):
                begin, n = int(layout_range[e, src]) >> 32, int(layout_range[e, src]) & 0xFFFFFFFF
                tokens = src_info[e, begin:begin + n].long()
                send[src, e, tokens] = x[e, begin:begin + n]
                flags[src, e, tokens] = 1
        wait_rows = _exchange(self.comm, send)
        wait_flags = _exchange(self.comm, flags)
        tokens = topk_idx.shape[0]
        combined = out if out is not None else torch.empty(tokens, hidden, dtype=x.dtype, device=device)

        def receive() -> None:
            rows = wait_rows().view(num_experts, T_max, hidden)  # [global expert, source token slot, H]
            arrived = wait_flags().view(num_experts, T_max)
            valid = topk_idx >= 0
            expert = topk_idx.clamp(min=0)
            slot = torch.arange(tokens, device=device).unsqueeze(1).expand_as(topk_idx)
            if not bool(arrived[expert, slot][valid].all()):
                raise RuntimeError(f"low_latency_combine (rank {me}): an expert output for one of this rank's tokens "
                                   "did not arrive: topk_idx or the handle is not the dispatch's")
            acc = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
            for k in range(topk_idx.shape[1]):
                weight = torch.where(valid[:, k], topk_weights[:, k].float(), 0.0).unsqueeze(1)
                acc += weight * rows[expert[:, k], slot[:, k]].float()
            combined.copy_(acc.to(x.dtype))

        hook = self._complete(half, receive, return_recv_hook, async_finish)
        return combined, EventOverlap(), hook
