"""What every communicating backend shares: hops, byte counters, autograd, FP8 payload, the contract.

A backend turns (tokens, layout) into a `Plan`: a list of all-to-all `Hop`s plus an optional final
reordering of the received rows. Dispatch runs the hops forwards, moving one record per row;
combine runs them backwards, summing the rows that came from the same source row at each hop (in
fp32, cast back to the payload dtype on the wire, as DeepEP's partial sums are). Autograd: the
backward of dispatch is that reduction applied to the gradients of `recv_x` and of the received
weights; the backward of combine moves the gradient forwards along the cached plan. With `fp8` the
dispatch's payload, and the gradient combine's backward sends, travel as E4M3 with a power-of-two
scale per token and 128 channels (DeepSeek-V3 §3.3.3); the combine and dispatch's backward stay in
the payload's dtype. The received FP8 rows wait on the plan for `take_fp8_rows`.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from model.dispatcher import Layout
from model.fp8 import Fp8Tensor
from parallel.dispatch.comm import Comm, exchange_counts
from parallel.dispatch.fp8 import ReceivedFp8Rows, dequantize_e4m3, quantize_e4m3
from parallel.dispatch.layout import compute_layout, to_local_expert_ids
from parallel.dispatch.records import pack_rows, specs_of, unpack_rows

INTRA_NODE, INTER_NODE = "intra_node", "inter_node"
DISPATCH, COMBINE = "dispatch", "combine"


class Traffic:
    """Rows and bytes this rank sent to other ranks, by direction and link.

    Direction is DISPATCH (towards the experts) or COMBINE (back to the tokens), whether the move
    happens in the forward or the backward pass; link is INTRA_NODE or INTER_NODE. Sends to
    itself cross no link and are not counted. Bytes are whole records (payload, FP8 scales, top-k
    ids and weights); the small per-call count exchange is not included. Rows may be added as
    device tensors (the `native` backend reads them off its handles): they are summed on the
    device and read back to the host once `rows` or `bytes` is read.
    """

    def __init__(self) -> None:
        self._rows: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._bytes: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._on_device: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, direction: str, link: str, rows: int | torch.Tensor, row_bytes: int) -> None:
        key = direction, link
        if isinstance(rows, torch.Tensor):
            rows_so_far, bytes_so_far = self._on_device.get(key, (0, 0))
            self._on_device[key] = (rows_so_far + rows.long(), bytes_so_far + rows.long() * row_bytes)
        else:
            self._rows[key] += rows
            self._bytes[key] += rows * row_bytes

    def _read_back(self) -> None:
        if not self._on_device:
            return
        values = torch.stack([t for pair in self._on_device.values() for t in pair]).tolist()
        for i, key in enumerate(self._on_device):
            self._rows[key] += values[2 * i]
            self._bytes[key] += values[2 * i + 1]
        self._on_device = {}

    @property
    def rows(self) -> defaultdict[tuple[str, str], int]:
        self._read_back()
        return self._rows

    @property
    def bytes(self) -> defaultdict[tuple[str, str], int]:
        self._read_back()
        return self._bytes

    def reset(self) -> None:
        self._rows.clear()
        self._bytes.clear()
        self._on_device = {}


@dataclass
class Hop:
    """One all-to-all: input rows `send_index` grouped by destination peer, and the splits."""

    comm: Comm
    send_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    links: list[str | None]  # link to each peer of `comm`, None for this rank itself
    num_inputs: int

    def forward(self, fields: Sequence[torch.Tensor], traffic: Traffic, direction: str) -> list[torch.Tensor]:
        specs = specs_of(fields)
        packed = pack_rows([f[self.send_index] for f in fields])
        self._count(traffic, direction, self.send_splits, packed.shape[1])
        return unpack_rows(self.comm.all_to_all(packed, self.send_splits, self.recv_splits), specs)

    def reverse(self, fields: Sequence[torch.Tensor], traffic: Traffic, direction: str) -> list[torch.Tensor]:
        """Send rows back along this hop and sum those that came from the same input row."""
        specs = specs_of(fields)
        packed = pack_rows(fields)
        self._count(traffic, direction, self.recv_splits, packed.shape[1])
        back = unpack_rows(self.comm.all_to_all(packed, self.recv_splits, self.send_splits), specs)
        return [torch.zeros(self.num_inputs, spec.width, dtype=torch.float32, device=rows.device)
                .index_add_(0, self.send_index, rows.float()).to(spec.dtype)
                for rows, spec in zip(back, specs)]

    def _count(self, traffic: Traffic, direction: str, splits: list[int], row_bytes: int) -> None:
        for link, rows in zip(self.links, splits):
            if link is not None:
                traffic.add(direction, link, rows, row_bytes)


def make_hop(comm: Comm, dest: torch.Tensor, links: list[str | None],
             extra: torch.Tensor | None = None) -> tuple[Hop, torch.Tensor, list[list[int]]]:
    """Hop sending row i to every peer p with dest[i, p], rows to a peer in input order.

    The count exchange sends peer p the rows for it followed by `extra[p]` when given ([P, k]
    counts the receiver needs, e.g. per expert); returns the hop and what was received, [P, 1 + k],
    on the device and on the host. Reading the split sizes is the hop's one host sync.
    """
    counts = dest.sum(0)
    sent = counts.view(-1, 1) if extra is None else torch.cat([counts.view(-1, 1), extra.to(counts.dtype)], 1)
    received = exchange_counts(comm, sent)
    host = torch.cat([counts, received.reshape(-1)]).tolist()
    send_splits, width = host[:comm.size], sent.shape[1]
    from_peers = [host[comm.size + p * width:comm.size + (p + 1) * width] for p in range(comm.size)]
    # the rows for each peer in input order: nonzero with a known size does not read a count back
    row = torch.nonzero_static(dest.t(), size=sum(send_splits))[:, 1]
    hop = Hop(comm, row, send_splits, [peer[0] for peer in from_peers], links, dest.shape[0])
    return hop, received, from_peers


@dataclass
class Plan(ReceivedFp8Rows):
    """The route of one dispatch; it is also the handle that combine and the backward passes reuse."""

    hops: list[Hop]
    order: torch.Tensor | None = None  # final reordering of the rows received by the last hop

    def forward(self, fields: Sequence[torch.Tensor], traffic: Traffic) -> list[torch.Tensor]:
        for hop in self.hops:
            fields = hop.forward(fields, traffic, DISPATCH)
        return [f[self.order] for f in fields] if self.order is not None else list(fields)

    def reverse(self, fields: Sequence[torch.Tensor], traffic: Traffic) -> list[torch.Tensor]:
        if self.order is not None:
            fields = [torch.empty_like(f).index_copy_(0, self.order, f) for f in fields]
        for hop in reversed(self.hops):
            fields = hop.reverse(fields, traffic, COMBINE)
        return list(fields)


def save_local_ids(ctx: Any, local: torch.Tensor) -> None:
    """A dispatch's forward keeps the received slots' local expert ids (-1: no expert on this rank)
    for ``local_weight_grad``; they take no gradient."""
    ctx.save_for_backward(local)
    ctx.mark_non_differentiable(local)


def local_weight_grad(ctx: Any, grad_weights: torch.Tensor) -> torch.Tensor:
    """The received routing weights' gradient, zero on the slots of no local expert. Unused outputs
    get zero gradients (materialised by autograd), so both gradients always travel back and every
    rank sends records of the same size."""
    (local,) = ctx.saved_tensors
    return grad_weights.masked_fill(local < 0, 0)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: ExchangeDispatcher, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_idx: torch.Tensor, layout: Layout):
        payload = list(quantize_e4m3(x, round_scale=True)) if backend.fp8 else [x]
        fields = [*payload, topk_idx.to(torch.int32), topk_weights]
        received, plan, counts = backend.route(fields, layout)
        if backend.fp8:
            plan.fp8_rows = Fp8Tensor(received[0], received[1], 1)
            recv_x = dequantize_e4m3(received[0], received[1], x.dtype)
        else:
            recv_x = received[0]
        local = to_local_expert_ids(received[-2].to(topk_idx.dtype), backend.rank, backend.experts_per_rank)
        recv_weights = received[-1].masked_fill(local < 0, 0)
        ctx.backend, ctx.plan = backend, plan
        save_local_ids(ctx, local)
        return recv_x, local, recv_weights, counts, plan

    @staticmethod
    def backward(ctx, grad_x, _idx, grad_weights, _counts, _handle):
        grad_weights = local_weight_grad(ctx, grad_weights)
        grad_x, grad_weights = ctx.plan.reverse([grad_x, grad_weights], ctx.backend.traffic)
        return None, grad_x, grad_weights, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend: ExchangeDispatcher, y: torch.Tensor, plan: Plan):
        ctx.backend, ctx.plan = backend, plan
        return plan.reverse([y], backend.traffic)[0]

    @staticmethod
    def backward(ctx, grad):
        """The gradient goes back along the dispatch's route: in FP8 with the FP8 dispatch (DeepSeek-V3
        sends the gradient before the experts' down projection in FP8; the combine itself stays bf16)."""
        if not ctx.backend.fp8:
            return None, ctx.plan.forward([grad], ctx.backend.traffic)[0], None
        q, scales = ctx.plan.forward(list(quantize_e4m3(grad, round_scale=True)), ctx.backend.traffic)
        return None, dequantize_e4m3(q, scales, grad.dtype), None


class ExchangeDispatcher:
    """The dispatcher contract of `model.dispatcher` over `Comm`s; subclasses only plan routes."""

    def __init__(self, num_experts: int, num_ranks: int, rank: int, ranks_per_node: int, fp8: bool = False) -> None:
        if num_experts % num_ranks:
            raise ValueError(f"{num_experts} experts cannot be split over {num_ranks} EP ranks")
        self.num_experts, self.num_ranks, self.rank = num_experts, num_ranks, rank
        self.ranks_per_node = ranks_per_node
        self.experts_per_rank = num_experts // num_ranks
        self.fp8 = fp8
        self.traffic = Traffic()

    def local_experts(self, num_experts: int) -> range:
        self._check_experts(num_experts)
        return range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)

    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        self._check_experts(num_experts)
        return compute_layout(topk_idx, num_experts, self.num_ranks, self.ranks_per_node)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
        """Each token once per destination rank; rows by source rank, then source token order."""
        if not x.shape[0] == topk_idx.shape[0] == topk_weights.shape[0] == layout.is_token_in_rank.shape[0]:
            raise ValueError("x, topk_idx, topk_weights and the layout must have one row per token")
        return _Dispatch.apply(self, x, topk_weights, topk_idx, layout)

    def take_fp8_rows(self, handle: Plan) -> Fp8Tensor | None:
        return handle.take_fp8_rows()

    def combine(self, y: torch.Tensor, handle: Plan) -> torch.Tensor:
        """Unweighted sum, per source token, of its rows on every rank it went to."""
        handle.take_fp8_rows()  # dropped if nobody took them: the combine keeps the handle for its backward
        return _Combine.apply(self, y, handle)

    def route(self, fields: list[torch.Tensor], layout: Layout) -> tuple[list[torch.Tensor], Plan, list[int]]:
        """Plan the hops for these tokens and move `fields` (one row per token) along them; also
        the top-k slots received per local expert (learnt in the count exchange, on the host).

        `fields` ends with the global top-k ids (int32) and the top-k weights; the payload precedes.
        """
        raise NotImplementedError

    def _check_experts(self, num_experts: int) -> None:
        if num_experts != self.num_experts:
            raise ValueError(f"this dispatcher was built for {self.num_experts} experts, got {num_experts}")
