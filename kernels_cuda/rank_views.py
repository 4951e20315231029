"""Per-rank `Buffer`-shaped views of an `EmulatedGroup` or `EmulatedInternodeGroup`, for one thread per
emulated rank.

The emulated groups take and return one entry per rank and launch once for all of them; code written
for one rank per process (the `native` dispatcher) calls `Buffer.dispatch(x, ...)` with its own rank's
tensors. `rank_views(group, R)[r]` bridges the two:
every rank's thread calls its view, the calls meet at a barrier, the last thread to arrive runs the
group call for everybody, and each thread takes its own result. All ranks must make the same
sequence of collective calls (dispatch, cached dispatch, combine), as they must with real buffers.
`group` only needs the list API the two emulated groups share (`get_dispatch_layout`, `dispatch`,
`combine`), so a recording wrapper works too; the handles are the group's own (`Handle` or
`InternodeHandle`).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch


class _Meeting:
    """Collects one argument per rank, runs `fn(args by rank)` once, hands out results by rank."""

    def __init__(self, num_ranks: int, timeout_s: float) -> None:
        self.args: list[Any] = [None] * num_ranks
        self.results: list[Any] = [None] * num_ranks
        self.fn: Callable[[list[Any]], list[Any]] | None = None
        self.error: BaseException | None = None
        self.barrier = threading.Barrier(num_ranks, action=self._run, timeout=timeout_s)
        self.done = threading.Barrier(num_ranks, timeout=timeout_s)

    def _run(self) -> None:
        try:
            assert self.fn is not None
            self.results = list(self.fn(self.args))
            self.error = None
        except BaseException as err:  # noqa: BLE001 - handed to every rank below
            self.error = err

    def call(self, rank: int, fn: Callable[[list[Any]], list[Any]], arg: Any) -> Any:
        self.args[rank] = arg
        self.fn = fn  # every rank passes an equivalent closure; the last one set runs
        self.barrier.wait()
        error, result = self.error, self.results[rank]
        self.done.wait()  # nobody starts the next call before every rank took its result
        if error is not None:
            raise RuntimeError(f"emulated collective failed on rank {rank}: {error!r}") from error
        return result


class RankView:
    """`kernels_cuda.Buffer`'s API for rank `rank` of an emulated group (events are
    always None; no per-node counts from the layout, as the groups' list API returns none)."""

    def __init__(self, group: Any, meeting: _Meeting, rank: int, num_ranks: int) -> None:
        self.group, self.meeting, self.rank, self.num_ranks = group, meeting, rank, num_ranks

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, **_: Any) -> tuple:
        ((per_rank, per_expert, in_rank),) = self.group.get_dispatch_layout([topk_idx], num_experts)
        return per_rank, None, per_expert, in_rank, None

    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, **_: Any) -> tuple:
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, None)."""
        if handle is None:
            num_experts = int(num_tokens_per_expert.numel())

            def run(args: list) -> list:
                return self.group.dispatch([a[0] for a in args], [a[1] for a in args], [a[2] for a in args],
                                           num_experts)

            result = self.meeting.call(self.rank, run, (x, topk_idx, topk_weights))
        else:
            def run(args: list) -> list:
                return self.group.dispatch([a[0] for a in args], handles=[a[1] for a in args])

            result = self.meeting.call(self.rank, run, (x, handle))
        return (*result, None)

    def combine(self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None = None, **_: Any) -> tuple:
        """(combined_x, combined_topk_weights, None)."""
        def run(args: list) -> list:
            weights = [a[2] for a in args]
            return self.group.combine([a[0] for a in args], [a[1] for a in args],
                                      None if all(w is None for w in weights) else weights)

        combined, weights = self.meeting.call(self.rank, run, (x, handle, topk_weights))
        return combined, weights, None


def rank_views(group: Any, num_ranks: int, timeout_s: float = 120.0) -> list[RankView]:
    """One view per rank of `group`; use each from its own thread."""
    meeting = _Meeting(num_ranks, timeout_s)
    return [RankView(group, meeting, r, num_ranks) for r in range(num_ranks)]
