"""The one skeleton of the normal kernels' ops, for intranode and internode alike.

`Engine.dispatch` checks the inputs, runs the notify kernel and waits for the receive counts (or, cached,
reuses the handles), allocates the outputs, launches the dispatch kernel and builds the handles;
`Engine.combine` checks, rewrites the handles' heads (cached notify), allocates and launches. Lists take one
entry per launch rank: every rank of an emulated group, or a buffer's own. Kernels launch inside
`op.launching()`, outputs are allocated inside `op.allocating()` (kernels_cuda.streams).

What differs between the two paths is the subclass's: its argument structs (`OpStructs`), the handle fields
each kernel reads, the routing tensors a notify fills, the outputs beyond the payload, the handle type and
the checks (`IntranodeEngine` in kernels_cuda.buffer, `InternodeEngine` in kernels_cuda.internode).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kernels_cuda import constants as C
from kernels_cuda.config import combine_row_shape
from kernels_cuda.inputs import Layout, Payload, check_combine, check_dispatch, scale_words
from kernels_cuda.streams import ON_CURRENT_STREAM, CurrentStreamOp


@dataclass(frozen=True)
class OpStructs:
    """One path's argument structs (classes of the extension): per rank and per op, for each kernel."""

    notify_rank: Any
    notify_op: Any
    cached_notify_rank: Any
    cached_notify_op: Any
    dispatch_rank: Any
    dispatch_op: Any
    combine_rank: Any
    combine_op: Any


@dataclass(frozen=True)
class Received:
    """What one rank receives in a dispatch: rows, records over RDMA (internode), rows per local expert
    (empty when not counted: cached, or num_worst_tokens)."""

    rows: int
    rdma_records: int = 0
    per_expert: list[int] = field(default_factory=list)


def fields_of(handle: Any, names: Sequence[str]) -> dict[str, Any]:
    """The named fields of a handle, as keyword arguments of a struct whose fields share their names."""
    return {name: getattr(handle, name) for name in names}


class Engine(ABC):
    """Per-rank lists of tensors -> kernel launches over `runtime`, in the order every op takes."""

    KIND: str  # "" or "internode ", in messages
    # Names of handle fields (the same as the structs' fields) that each kernel reads.
    ROUTE_FIELDS: tuple[str, ...]            # the dispatch: what the notify filled, and is_token_in_rank
    CACHED_DISPATCH_FIELDS: tuple[str, ...]  # the cached notify before a cached dispatch
    COMBINE_NOTIFY_FIELDS: tuple[str, ...]   # the cached notify before a combine (it rewrites the heads)
    COMBINE_FIELDS: tuple[str, ...]          # the combine

    def __init__(self, runtime: Any, structs: OpStructs, num_ranks: int, config: Any, timeout_cycles: int,
                 timeout_s: float, device: str, sms: int) -> None:
        self.runtime, self.structs, self.num_ranks, self.config = runtime, structs, num_ranks, config
        self.timeout_cycles, self.timeout_s = timeout_cycles, timeout_s
        self.device, self.sms = device, sms

    def dispatch(self, ranks: Sequence[int], xs: Sequence[Payload], topk_idx: Sequence[torch.Tensor | None],
                 topk_weights: Sequence[torch.Tensor | None], layouts: Sequence[Layout | None],
                 handles: Sequence[Any], num_experts: int, expert_alignment: int, num_worst_tokens: int,
                 config: Any, stalled_rank: int = -1, op: CurrentStreamOp = ON_CURRENT_STREAM) -> list[tuple]:
        """Per rank: (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle).
        Fresh with `layouts` (handles None), cached with `handles`. `num_worst_tokens > 0` (fresh only): no
        host wait for the counts; received rows are sized `num_worst_tokens`, rows past the received ones get
        top-k ids -1, the per-expert lists are empty, and a rank receiving more traps with error code 2."""
        cached = handles[0] is not None
        config = self._dispatch_config(config, handles)
        payloads = [x if isinstance(x, tuple) else (x, None) for x in xs]
        for r, (x, x_scales), idx, weights in zip(ranks, payloads, topk_idx, topk_weights):
            check_dispatch(self.device, x, x_scales, idx, weights, expert_alignment, r)
        rows0, scales0 = payloads[0]
        device, hidden_bytes = rows0.device, rows0.shape[1] * rows0.element_size()
        num_topk = topk_idx[0].shape[1] if topk_idx[0] is not None else 1
        self._check(config, hidden_bytes, num_topk, num_experts, len(ranks))
        if cached:
            routes, received = self._reuse(ranks, payloads, handles, config, op)
        else:
            routes, received = self._notify(ranks, payloads, layouts, num_experts, expert_alignment,
                                            num_worst_tokens, config, device, op)

        args, outputs = [], []
        for r, (x, x_scales), idx, w, route, got in zip(ranks, payloads, topk_idx, topk_weights, routes, received):
            with op.allocating():
                out = {
                    "recv_x": torch.empty(got.rows, x.shape[1], dtype=x.dtype, device=device),
                    "recv_x_scales": None if x_scales is None else
                    torch.empty(got.rows, x_scales.shape[1], dtype=torch.float32, device=device),
                    "recv_src_idx": torch.empty(got.rows, dtype=torch.int32, device=device),
                    "recv_topk_idx": None if idx is None else
                    torch.empty(got.rows, num_topk, dtype=torch.int64, device=device),
                    "recv_topk_weights": None if idx is None else
                    torch.empty(got.rows, num_topk, dtype=torch.float32, device=device),
                    **self._new_dispatch_outputs(x.shape[0], got, config, device),
                }
            with op.launching():  # conversions run (and their temporaries live) on the kernels' stream
                args.append(self.structs.dispatch_rank(
                    rank=r, num_tokens=x.shape[0], x=x.contiguous(),
                    x_scales=None if x_scales is None else scale_words(x_scales),
                    scale_token_stride=0 if x_scales is None else x_scales.stride(0),
                    scale_hidden_stride=0 if x_scales is None else x_scales.stride(1),
                    topk_idx=None if idx is None else idx.contiguous(),
                    topk_weights=None if idx is None else w.float().contiguous(), **route, **out))
            outputs.append(out)
        with op.launching():
            self.runtime.dispatch(args, self.structs.dispatch_op(
                **self._ring_settings(config), timeout_cycles=self.timeout_cycles, hidden_bytes=hidden_bytes,
                num_scales=0 if scales0 is None else scales0.shape[1], num_topk=num_topk, num_experts=num_experts,
                num_worst_tokens=0 if cached else num_worst_tokens, stalled_rank=stalled_rank))

        results = []
        for route, (_, x_scales), out, got, old in zip(routes, payloads, outputs, received, handles):
            recv_x = out["recv_x"] if out["recv_x_scales"] is None else (
                out["recv_x"], out["recv_x_scales"].view(x_scales.dtype))  # as sent: float32 or packed UE8M0
            results.append((recv_x, out["recv_topk_idx"], out["recv_topk_weights"], list(got.per_expert),
                            self._handle(route, out, got, old, config)))
        return results

    def _reuse(self, ranks: Sequence[int], payloads: Sequence[tuple], handles: Sequence[Any], config: Any,
               op: CurrentStreamOp) -> tuple[list[dict], list[Received]]:
        """A cached dispatch: the cached notify (barrier, ring metadata zeroed), then the handles' routing."""
        with op.launching():
            self.runtime.cached_notify(
                [self.structs.cached_notify_rank(rank=r, num_tokens=x.shape[0],
                                                 **fields_of(h, self.CACHED_DISPATCH_FIELDS))
                 for r, (x, _), h in zip(ranks, payloads, handles)],
                self.structs.cached_notify_op(**self._launch_settings(config), timeout_cycles=self.timeout_cycles,
                                              rewrite_heads=False))
        return [fields_of(h, self.ROUTE_FIELDS) for h in handles], [self._received_by(h) for h in handles]

    def _notify(self, ranks: Sequence[int], payloads: Sequence[tuple], layouts: Sequence[Layout | None],
                num_experts: int, expert_alignment: int, num_worst_tokens: int, config: Any, device: torch.device,
                op: CurrentStreamOp) -> tuple[list[dict], list[Received]]:
        """A fresh dispatch's notify: the routing tensors it fills, and what every rank receives (the counts
        the kernel publishes, waited for here; without a wait, num_worst_tokens)."""
        if any(layout is None for layout in layouts):
            raise ValueError(f"kernels_cuda: a fresh {self.KIND}dispatch needs the layout of every rank")
        with op.launching():  # the kernels index these densely: int32 counts, contiguous bool [T, R]
            counts = [self._dense_layout(layout) for layout in layouts]
        with op.allocating():
            prefixes = [self._new_prefixes(config, device) for _ in layouts]
        with op.launching():
            self.runtime.notify(
                [self.structs.notify_rank(rank=r, num_tokens=x.shape[0], **count, **prefix,
                                          publish_counts=num_worst_tokens <= 0)
                 for r, (x, _), count, prefix in zip(ranks, payloads, counts, prefixes)],
                self.structs.notify_op(**self._launch_settings(config), timeout_cycles=self.timeout_cycles,
                                       num_experts=num_experts, expert_alignment=expert_alignment))
        routes = [{**prefix, "is_token_in_rank": count["is_token_in_rank"]} for count, prefix in zip(counts, prefixes)]
        if num_worst_tokens > 0:
            return routes, [Received(num_worst_tokens, num_worst_tokens) for _ in ranks]
        counts = self.runtime.wait_recv_counts(len(ranks), num_experts // self.num_ranks, self.timeout_s)
        return routes, [self._received(c) for c in counts]

    def combine(self, ranks: Sequence[int], ys: Sequence[torch.Tensor], handles: Sequence[Any],
                topk_weights: Sequence[torch.Tensor | None], config: Any, stalled_rank: int = -1,
                op: CurrentStreamOp = ON_CURRENT_STREAM) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per rank: (combined_x, combined_topk_weights): unweighted sums over the ranks each token went to."""
        config = config or handles[0].config
        for r, y, h, w in zip(ranks, ys, handles, topk_weights):
            check_combine(self.device, y, h.num_recv_tokens, w, r)
        y0 = ys[0]
        hidden_bytes, num_topk = combine_row_shape(y0, topk_weights[0])
        self._check(config, hidden_bytes, num_topk, self.num_ranks, len(ranks))
        with op.launching():
            self.runtime.cached_notify(
                [self.structs.cached_notify_rank(rank=r, num_tokens=h.is_token_in_rank.shape[0],
                                                 **fields_of(h, self.COMBINE_NOTIFY_FIELDS))
                 for r, h in zip(ranks, handles)],
                self.structs.cached_notify_op(**self._launch_settings(config), timeout_cycles=self.timeout_cycles,
                                              rewrite_heads=True))
        args, results = [], []
        for r, y, h, w in zip(ranks, ys, handles, topk_weights):
            tokens = h.is_token_in_rank.shape[0]
            with op.allocating():
                combined = torch.empty(tokens, y.shape[1], dtype=y.dtype, device=y.device)
                combined_w = None if w is None else torch.empty(tokens, num_topk, dtype=torch.float32, device=y.device)
            with op.launching():
                args.append(self.structs.combine_rank(
                    rank=r, num_tokens=tokens, x=y.contiguous(), topk_weights=None if w is None else w.float().contiguous(),
                    combined_x=combined, combined_topk_weights=combined_w, **fields_of(h, self.COMBINE_FIELDS)))
            results.append((combined, combined_w))
        with op.launching():
            self.runtime.combine(args, self.structs.combine_op(
                **self._ring_settings(config), timeout_cycles=self.timeout_cycles, hidden_bytes=hidden_bytes,
                num_topk=num_topk, stalled_rank=stalled_rank, float32=y0.dtype == torch.float32))
        return results

    def error_record(self) -> dict[str, Any]:
        """The first device error (code 0 = none): role (and its name), rank, channel, peer, head, tail, expected."""
        return C.error_record(self.runtime.error_record())

    # What each path says for itself.

    @abstractmethod
    def _check(self, config: Any, hidden_bytes: int, num_topk: int, num_experts: int, launch_ranks: int) -> None:
        """Refuses a config that does not fit these rows, or launches that cannot all be resident."""

    @abstractmethod
    def _dispatch_config(self, config: Any, handles: Sequence[Any]) -> Any:
        """The config of a dispatch called with `config` (None: a default)."""

    @abstractmethod
    def _launch_settings(self, config: Any) -> dict[str, int]:
        """The notify ops' fields from `config`."""

    @abstractmethod
    def _ring_settings(self, config: Any) -> dict[str, int]:
        """The dispatch and combine ops' fields from `config`."""

    @abstractmethod
    def _dense_layout(self, layout: Layout) -> dict[str, torch.Tensor]:
        """A notify rank's layout fields, as the kernels index them."""

    @abstractmethod
    def _new_prefixes(self, config: Any, device: torch.device) -> dict[str, torch.Tensor]:
        """The routing tensors a notify fills for one rank, allocated."""

    @abstractmethod
    def _received(self, counts: tuple) -> Received:
        """One rank's entry of runtime.wait_recv_counts."""

    @abstractmethod
    def _received_by(self, handle: Any) -> Received:
        """What a cached dispatch with `handle` receives."""

    @abstractmethod
    def _new_dispatch_outputs(self, num_tokens: int, got: Received, config: Any,
                              device: torch.device) -> dict[str, torch.Tensor]:
        """The dispatch kernel's outputs beyond the received payload, allocated."""

    @abstractmethod
    def _handle(self, route: dict[str, torch.Tensor], out: dict[str, torch.Tensor], got: Received, old: Any,
                config: Any) -> Any:
        """The handle a dispatch returns (`old`: the one a cached dispatch was given)."""
