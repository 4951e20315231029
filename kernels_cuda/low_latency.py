"""The low-latency (decoding) dispatch and combine kernels behind DeepEP's API.

`LowLatencyEngine` drives `LowLatencyRuntime` (csrc/host/low_latency_runtime.cpp) with per-rank lists:
a `Buffer(..., low_latency_mode=True)` launches its own rank, an `EmulatedGroup` every rank at once.
The semantics, return values and the hook rule are those of the pure-torch reference,
`parallel.dispatch.low_latency` (its docstring explains the packed layout, the order of rows inside an
expert and the double buffer); the input checks and the handle type live here and serve both.

How an op maps onto the kernels: op number `seq` (1, 2, ...) uses half (seq - 1) % 2 of every rank's
region and zeroes the other half's signals as it starts. `return_recv_hook=True` launches the send
phase only and returns a hook that launches the receive phase; the next low-latency op is refused
until the hook ran.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from kernels_cuda.extensions import default_device, extension, extension_of
from kernels_cuda import constants as C
from kernels_cuda.emulation import check_resident
from kernels_cuda.streams import EventOverlap

MAX_TOPK = 11  # DeepEP's low-latency kernels take top-k <= 11
BLOCK = 128    # channels per FP8 scale
SEND_PHASE, RECV_PHASE = 1, 2
DEFAULT_BLOCKS = 4  # blocks per rank


class LowLatencyHandle(NamedTuple):
    """DeepEP's low-latency handle `(src_info, layout_range, T_max, H, E)`."""

    src_info: torch.Tensor      # [E_local, R * T_max] int32
    layout_range: torch.Tensor  # [E_local, R] int64: (begin << 32) | count
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


def check_dispatch(where: str, num_ranks: int, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int,
                   num_experts: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                   stats: torch.Tensor | None, row_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> None:
    """Refuses, naming `where`, what low_latency_dispatch cannot take (rows of `row_dtypes` without FP8:
    the kernels take bfloat16 as DeepEP's, the reference float32 too)."""
    if x.dim() != 2 or x.dtype not in row_dtypes or (use_fp8 and x.dtype != torch.bfloat16):
        also = " (or float32 without use_fp8)" if torch.float32 in row_dtypes else ""
        raise ValueError(f"{where}: x must be bfloat16 [num_tokens, hidden]{also}, got {x.dtype} {list(x.shape)}")
    if x.shape[0] > max_tokens:
        raise ValueError(f"{where}: {x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank={max_tokens}")
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: topk_idx must be int64 [num_tokens={x.shape[0]}, num_topk], got "
                         f"{topk_idx.dtype} {list(topk_idx.shape)}")
    if not 1 <= topk_idx.shape[1] <= MAX_TOPK:
        raise ValueError(f"{where}: num_topk must be in [1, {MAX_TOPK}], got {topk_idx.shape[1]}")
    if num_experts % num_ranks:
        raise ValueError(f"{where}: {num_experts} experts do not split over {num_ranks} ranks")
    if topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
        raise ValueError(f"{where}: topk_idx holds ids outside [-1, {num_experts})")
    ordered = topk_idx.sort(dim=1).values
    if bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()):
        raise ValueError(f"{where}: a token lists the same expert twice in topk_idx")
    if x.shape[1] % 8:
        raise ValueError(f"{where}: the hidden size must be a multiple of 8 (rows of 16-byte vectors), got {x.shape[1]}")
    if use_fp8 and x.shape[1] % BLOCK:
        raise ValueError(f"{where}: use_fp8 needs the hidden size to be a multiple of {BLOCK}, got {x.shape[1]}")
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError(f"{where}: use_ue8m0 needs use_fp8 and round_scale (UE8M0 scales are powers of two)")
    if use_ue8m0 and x.shape[1] % (4 * BLOCK):
        raise ValueError(f"{where}: use_ue8m0 packs 4 scales per int32: the hidden size must be a multiple of "
                         f"{4 * BLOCK}, got {x.shape[1]}")
    if stats is not None and (stats.dtype != torch.int32 or tuple(stats.shape) != (num_experts // num_ranks,)):
        raise ValueError(f"{where}: cumulative_local_expert_recv_stats must be int32 "
                         f"[{num_experts // num_ranks}], got {stats.dtype} {list(stats.shape)}")


def check_combine(where: str, num_ranks: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  handle: LowLatencyHandle, use_logfmt: bool, out: torch.Tensor | None,
                  row_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> None:
    """Refuses, naming `where`, what low_latency_combine cannot take (x of `row_dtypes`, out of x's)."""
    local, slots = handle.num_experts // num_ranks, num_ranks * handle.num_max_dispatch_tokens_per_rank
    want = (local, slots, handle.hidden)
    if x.dtype not in row_dtypes or tuple(x.shape) != want:
        also = " (or float32)" if torch.float32 in row_dtypes else ""
        raise ValueError(f"{where}: x must be bfloat16{also} {list(want)} (the dispatch's packed layout), got "
                         f"{x.dtype} {list(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] > handle.num_max_dispatch_tokens_per_rank:
        raise ValueError(f"{where}: topk_idx must be the dispatch's [num_tokens, num_topk], got {list(topk_idx.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise ValueError(f"{where}: topk_weights must have topk_idx's shape {list(topk_idx.shape)}, got "
                         f"{list(topk_weights.shape)}")
    if use_logfmt:
        raise ValueError(f"{where}: use_logfmt (DeepEP's 10-bit log format) is not implemented; combine in bfloat16")
    if out is not None and (out.dtype != x.dtype or tuple(out.shape) != (topk_idx.shape[0], handle.hidden)):
        raise ValueError(f"{where}: out must be {x.dtype} [{topk_idx.shape[0]}, {handle.hidden}], got "
                         f"{out.dtype} {list(out.shape)}")


def check_hook_args(return_recv_hook: bool, async_finish: bool) -> None:
    if return_recv_hook and async_finish:
        raise ValueError("return_recv_hook and async_finish cannot both be set (hook mode runs on the compute stream)")


PENDING_HOOK = "the previous low-latency op's receive is pending: call its hook first"


def column_major(rows: int, cols: int, slots: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[rows, slots, cols] with strides (slots * cols, 1, slots): DeepEP's scale layout."""
    return torch.zeros(rows, cols, slots, dtype=dtype, device=device).transpose(1, 2)


class LowLatencyEngine:
    """Per-rank lists of tensors -> low-latency kernel launches over `runtime` (all ranks when it emulates
    them, else this process's). Keeps the op number, hence the half, and the pending hook."""

    def __init__(self, runtime: Any, num_ranks: int, timeout_cycles: int, sms: int,
                 num_blocks: int = DEFAULT_BLOCKS) -> None:
        self.runtime, self.num_ranks, self.timeout_cycles = runtime, num_ranks, timeout_cycles
        self.args = extension_of(runtime)  # the ops' argument structs
        self.sms, self.num_blocks = sms, num_blocks
        self.seq = 0
        self.pending = False

    def _start(self, op: str, launch_ranks: int) -> tuple[int, int]:
        """(half, seq) of a new op."""
        if self.pending:
            raise RuntimeError(f"low_latency_{op}: {PENDING_HOOK} (the one-way signals of the double buffer are "
                               "safe only then)")
        check_resident(f"{launch_ranks} rank(s) x {self.num_blocks} low-latency blocks", launch_ranks * self.num_blocks,
                       self.sms, "use fewer blocks per rank or fewer ranks per launch")
        self.seq += 1
        return (self.seq - 1) % 2, self.seq

    def _run(self, launch: Callable[[int], None], return_recv_hook: bool) -> Callable[[], None] | None:
        """Both phases now, or the send phase now and the receive phase as the returned hook."""
        if not return_recv_hook:
            launch(SEND_PHASE | RECV_PHASE)
            return None
        launch(SEND_PHASE)
        self.pending = True
        called = []

        def hook() -> None:
            if called:
                raise RuntimeError("this low-latency hook was already called")
            called.append(True)
            launch(RECV_PHASE)
            self.pending = False

        return hook

    def next_combine_buffer(self, rank: int, handle: LowLatencyHandle) -> torch.Tensor:
        """The zero-copy combine input of `rank` for the next op: a view of its region's next half."""
        return self.runtime.combine_buffer(rank, self.seq % 2, handle.num_max_dispatch_tokens_per_rank,
                                           handle.hidden, handle.num_experts)

    def dispatch(self, ranks: Sequence[int], xs: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                 max_tokens: int, num_experts: int, stats: Sequence[torch.Tensor | None], use_fp8: bool,
                 round_scale: bool, use_ue8m0: bool, return_recv_hook: bool) -> list[tuple]:
        """Per rank: (recv_x, packed_recv_count, handle, event, hook), as low_latency_dispatch."""
        R, local = self.num_ranks, num_experts // self.num_ranks
        for r, x, idx, st in zip(ranks, xs, topk_idx, stats):
            check_dispatch(f"low_latency_dispatch (rank {r})", R, x, idx, max_tokens, num_experts, use_fp8,
                           round_scale, use_ue8m0, st)
        num_topk = {idx.shape[1] for idx in topk_idx}
        hidden = {x.shape[1] for x in xs}
        if len(num_topk) != 1 or len(hidden) != 1:
            raise ValueError("low_latency_dispatch: every rank needs the same hidden size and num_topk")
        (num_topk,), (hidden,) = num_topk, hidden
        half, seq = self._start("dispatch", len(ranks))
        slots = R * max_tokens
        args, results = [], []
        for r, x, idx, st in zip(ranks, xs, topk_idx, stats):
            device = x.device
            packed_x = torch.empty(local, slots, hidden, device=device,
                                   dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
            scales = None if not use_fp8 else column_major(
                local, hidden // BLOCK // (4 if use_ue8m0 else 1), slots, torch.int32 if use_ue8m0 else torch.float32,
                device)
            src_info = torch.full((local, slots), -1, dtype=torch.int32, device=device)
            layout_range = torch.zeros(local, R, dtype=torch.int64, device=device)
            count = torch.zeros(local, dtype=torch.int32, device=device)
            args.append(self.args.LowLatencyDispatchRank(
                rank=r, num_tokens=x.shape[0], x=x.contiguous(), topk_idx=idx.contiguous(), src_info=src_info,
                layout_range=layout_range, packed_x=packed_x, packed_scales=scales, packed_count=count, stats=st))
            handle = LowLatencyHandle(src_info, layout_range, max_tokens, hidden, num_experts)
            results.append([(packed_x, scales) if use_fp8 else packed_x, count, handle, EventOverlap()])
        op = self._op(self.args.LowLatencyDispatchOp, num_experts, num_topk, hidden, max_tokens, half, seq,
                      use_fp8=use_fp8, round_scale=round_scale or use_ue8m0, use_ue8m0=use_ue8m0)
        hook = self._run(lambda phases: self.runtime.dispatch(args, op, phases), return_recv_hook)
        return [(*result, hook) for result in results]

    def combine(self, ranks: Sequence[int], xs: Sequence[torch.Tensor | None], topk_idx: Sequence[torch.Tensor],
                topk_weights: Sequence[torch.Tensor], handles: Sequence[LowLatencyHandle], use_logfmt: bool,
                return_recv_hook: bool, outs: Sequence[torch.Tensor | None]) -> list[tuple]:
        """Per rank: (combined_x, event, hook), as low_latency_combine; an x of None is the zero-copy buffer."""
        R = self.num_ranks
        buffers = [self.next_combine_buffer(r, h) for r, h in zip(ranks, handles)]
        if self.runtime.symmetric_sources:  # NVSHMEM puts read from the region: the input goes there first
            for buffer, x in zip(buffers, xs):
                if x is not None:
                    buffer.copy_(x)
            xs = [None] * len(buffers)
        xs = [buffer if x is None else x for buffer, x in zip(buffers, xs)]
        for r, x, idx, w, h, out in zip(ranks, xs, topk_idx, topk_weights, handles, outs):
            check_combine(f"low_latency_combine (rank {r})", R, x, idx, w, h, use_logfmt, out)
        h0 = handles[0]
        num_topk = topk_idx[0].shape[1]
        half, seq = self._start("combine", len(ranks))
        args, results = [], []
        for r, x, idx, w, h, out in zip(ranks, xs, topk_idx, topk_weights, handles, outs):
            combined = out if out is not None else torch.empty(idx.shape[0], h.hidden, dtype=torch.bfloat16,
                                                               device=x.device)
            args.append(self.args.LowLatencyCombineRank(
                rank=r, num_tokens=idx.shape[0], x=x.contiguous(), topk_idx=idx.contiguous(),
                topk_weights=w.float().contiguous(), src_info=h.src_info, layout_range=h.layout_range,
                combined_x=combined))
            results.append((combined, EventOverlap()))
        op = self._op(self.args.LowLatencyOp, h0.num_experts, num_topk, h0.hidden, h0.num_max_dispatch_tokens_per_rank,
                      half, seq)
        hook = self._run(lambda phases: self.runtime.combine(args, op, phases), return_recv_hook)
        return [(*result, hook) for result in results]

    def _op(self, op_class: Any, num_experts: int, num_topk: int, hidden: int, max_tokens: int, half: int, seq: int,
            **flags: bool) -> Any:
        """An op struct of `op_class` for these sizes, this op's half and number, and this engine's launch."""
        return op_class(num_experts=num_experts, num_topk=num_topk, hidden=hidden, max_tokens=max_tokens, half=half,
                        seq=seq, num_blocks=self.num_blocks, timeout_cycles=self.timeout_cycles, **flags)

    def clean(self) -> None:
        """Zeroes this process's regions (after a failed op); the next op starts from a clean buffer."""
        self.runtime.clean()
        self.pending = False

    def error_record(self) -> dict[str, Any]:
        return C.error_record(self.runtime.error_record())


class EmulatedLowLatency:
    """The low-latency calls of an emulated group (`EmulatedGroup`, `EmulatedInternodeGroup`): per-rank lists,
    one launch for all ranks, over a region of `num_bytes` per rank (Buffer.get_low_latency_rdma_size_hint)."""

    num_ranks: int
    device: str
    low_latency: LowLatencyEngine | None = None

    def _init_low_latency(self, ext: Any, num_bytes: int, timeout_cycles: int, sms: int, schedule: Any,
                          num_blocks: int) -> None:
        from kernels_cuda.emulation import apply_schedule

        runtime = ext.LowLatencyRuntime(0, self.num_ranks, int(num_bytes), True)
        apply_schedule(runtime, self.device, schedule)
        self.low_latency = LowLatencyEngine(runtime, self.num_ranks, timeout_cycles, sms, num_blocks)

    def _low_latency_engine(self) -> LowLatencyEngine:
        if self.low_latency is None:
            raise RuntimeError(f"{type(self).__name__}: low-latency ops need num_rdma_bytes > 0 (the low-latency "
                               "region; EmulatedInternodeGroup also low_latency_mode=True)")
        return self.low_latency

    def low_latency_dispatch(self, xs: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Sequence[torch.Tensor | None] | None = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             return_recv_hook: bool = False) -> list[tuple]:
        """Per rank: (recv_x, packed_recv_count, handle, event, hook); one hook completes every rank."""
        R = self.num_ranks
        return self._low_latency_engine().dispatch(
            range(R), xs, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats or [None] * R, use_fp8, round_scale, use_ue8m0, return_recv_hook)

    def low_latency_combine(self, xs: Sequence[torch.Tensor] | None, topk_idx: Sequence[torch.Tensor],
                            topk_weights: Sequence[torch.Tensor], handles: Sequence[LowLatencyHandle],
                            zero_copy: bool = False, return_recv_hook: bool = False,
                            out: Sequence[torch.Tensor | None] | None = None, use_logfmt: bool = False) -> list[tuple]:
        """Per rank: (combined_x, event, hook); with `zero_copy` (xs None) each rank's input is its
        get_next_low_latency_combine_buffer. `use_logfmt=True` is refused, as Buffer's."""
        R = self.num_ranks
        inputs = [None] * R if zero_copy else xs
        return self._low_latency_engine().combine(range(R), inputs, topk_idx, topk_weights, handles, use_logfmt,
                                                  return_recv_hook, out or [None] * R)

    def get_next_low_latency_combine_buffer(self, handles: Sequence[LowLatencyHandle]) -> list[torch.Tensor]:
        return [self._low_latency_engine().next_combine_buffer(r, h) for r, h in enumerate(handles)]

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0,
                                 num_experts: int = 0) -> None:
        """Zeroes every rank's low-latency region (DeepEP's arguments accepted and unused, as Buffer's)."""
        self._low_latency_engine().clean()

    def low_latency_error_record(self) -> dict[str, Any]:
        return self._low_latency_engine().error_record()

    def _destroy_low_latency(self) -> None:
        if self.low_latency is not None:
            self.low_latency.runtime.destroy()
            self.low_latency = None


def size_hint(max_tokens: int, hidden: int, num_experts: int) -> int:
    """Bytes of one rank's low-latency region (independent of the number of ranks, as in DeepEP)."""
    return int(extension(default_device()).LowLatencyRuntime.size_hint(
        max_tokens, hidden, num_experts))
