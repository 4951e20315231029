"""DeepEP's calls for the ranks one test process drives, so that the ported DeepEP checks
(tests/kernels/test_deep_ep_port.py) run unchanged on both set-ups:

- `ProcessCalls`: this process's `deep_ep.Buffer` (`kernels_cuda.deep_ep`), one rank, per-process
  buffers as DeepEP's tests run;
- `GroupCalls`: an emulated group (`EmulatedGroup`, `EmulatedInternodeGroup`), every rank in one
  launch, so the relaxed memory mode can run them. DeepEP's keyword arguments and return tuples are
  translated to the group's list calls with `kernels_cuda.deep_ep`'s own config mapping, tuple handles,
  events and bias add; the group runs on the caller's stream, so `previous_event` and
  `allocate_on_comm_stream` have nothing to order and `*_wait_recv_cost_stats` nothing to record.

Each call takes one dict of DeepEP keyword arguments per driven rank (`ranks`, in order) and returns
one DeepEP result tuple per rank.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import torch

from kernels_cuda import streams
from kernels_cuda.deep_ep.buffer import add_bias, bias_terms, from_tuple, to_tuple
from kernels_cuda.deep_ep.utils import EventOverlap, from_kernels


class ProcessCalls:
    """This process's rank of a `deep_ep.Buffer`."""

    def __init__(self, buffer: Any) -> None:
        self.buffer, self.ranks = buffer, [buffer.rank]

    def capture(self) -> EventOverlap:
        return self.buffer.capture()

    def get_dispatch_layout(self, topk_idx: list[torch.Tensor], num_experts: int) -> list[tuple]:
        return [self.buffer.get_dispatch_layout(topk_idx[0], num_experts)]

    def dispatch(self, kwargs: list[dict]) -> list[tuple]:
        return [self.buffer.dispatch(**kwargs[0])]

    def combine(self, kwargs: list[dict]) -> list[tuple]:
        return [self.buffer.combine(**kwargs[0])]

    def low_latency_dispatch(self, kwargs: list[dict]) -> list[tuple]:
        return [self.buffer.low_latency_dispatch(**kwargs[0])]

    def low_latency_combine(self, kwargs: list[dict]) -> list[tuple]:
        return [self.buffer.low_latency_combine(**kwargs[0])]

    def get_next_low_latency_combine_buffer(self, handles: list[tuple]) -> list[torch.Tensor]:
        return [self.buffer.get_next_low_latency_combine_buffer(handles[0])]

    def complete(self, results: list[tuple], hook_mode: bool) -> None:
        """Each rank's receive: its hook in hook mode, else a wait on its event (the last two fields)."""
        for *_, event, hook in results:
            hook() if hook_mode else event.current_stream_wait()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.buffer.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def destroy(self) -> None:
        self.buffer.destroy()


def _event(kwargs: dict) -> EventOverlap:
    """What deep_ep.Buffer returns for an op that finished on the caller's stream."""
    return from_kernels(streams.EventOverlap(), kwargs.get("async_finish", False))


def _column(kwargs: list[dict], key: str) -> list | None:
    values = [k.get(key) for k in kwargs]
    return None if values[0] is None else values


class GroupCalls:
    """Every rank of an emulated group, with DeepEP's configs from `deep_ep` (kernels_cuda.deep_ep, whose
    `Buffer.num_sms` and node size the caller has set)."""

    def __init__(self, deep_ep: ModuleType, group: Any) -> None:
        self.deep_ep, self.group = deep_ep, group
        self.ranks = list(range(group.num_ranks))

    def _config(self, config: Any, recommended: Callable[[int], Any]) -> Any:
        return (config or recommended(self.group.num_ranks)).for_kernels(self.group.num_ranks)

    def capture(self) -> EventOverlap:
        return self.deep_ep.Buffer.capture()

    def get_dispatch_layout(self, topk_idx: list[torch.Tensor], num_experts: int) -> list[tuple]:
        return [(*layout, EventOverlap()) for layout in self.group.get_dispatch_layouts(topk_idx, num_experts)]

    def dispatch(self, kwargs: list[dict]) -> list[tuple]:
        first = kwargs[0]
        ours = self._config(first.get("config"), self.deep_ep.Buffer.get_dispatch_config)
        xs = [k["x"] for k in kwargs]
        if first.get("handle") is not None:
            results = self.group.dispatch(xs, handles=[from_tuple(k["handle"], ours) for k in kwargs], config=ours)
            return [(recv_x, None, None, None, None, _event(k)) for (recv_x, *_), k in zip(results, kwargs)]
        layouts = [(k["num_tokens_per_rank"], k.get("num_tokens_per_rdma_rank"), k["num_tokens_per_expert"],
                    k["is_token_in_rank"]) for k in kwargs]
        results = self.group.dispatch(xs, _column(kwargs, "topk_idx"), _column(kwargs, "topk_weights"),
                                      layouts=layouts, expert_alignment=first.get("expert_alignment", 1),
                                      num_worst_tokens=first.get("num_worst_tokens", 0), config=ours)
        return [(recv_x, idx, w, counts, to_tuple(handle), _event(k))
                for (recv_x, idx, w, counts, handle), k in zip(results, kwargs)]

    def combine(self, kwargs: list[dict]) -> list[tuple]:
        ours = self._config(kwargs[0].get("config"), self.deep_ep.Buffer.get_combine_config)
        biases = [bias_terms(k.get("bias")) for k in kwargs]
        results = self.group.combine([k["x"] for k in kwargs], [from_tuple(k["handle"], ours) for k in kwargs],
                                     _column(kwargs, "topk_weights"), config=ours)
        return [(add_bias(combined, b) if b else combined, weights, _event(k))
                for (combined, weights), b, k in zip(results, biases, kwargs)]

    def low_latency_dispatch(self, kwargs: list[dict]) -> list[tuple]:
        first = kwargs[0]
        results = self.group.low_latency_dispatch(
            [k["x"] for k in kwargs], [k["topk_idx"] for k in kwargs], first["num_max_dispatch_tokens_per_rank"],
            first["num_experts"], [k.get("cumulative_local_expert_recv_stats") for k in kwargs],
            first.get("use_fp8", True), first.get("round_scale", False), first.get("use_ue8m0", False),
            first.get("return_recv_hook", False))
        return [(recv_x, count, handle, _event(k), hook) for (recv_x, count, handle, _, hook), k in zip(results, kwargs)]

    def low_latency_combine(self, kwargs: list[dict]) -> list[tuple]:
        first = kwargs[0]
        results = self.group.low_latency_combine(
            [k["x"] for k in kwargs], [k["topk_idx"] for k in kwargs], [k["topk_weights"] for k in kwargs],
            [k["handle"] for k in kwargs], zero_copy=first.get("zero_copy", False),
            return_recv_hook=first.get("return_recv_hook", False), out=_column(kwargs, "out"),
            use_logfmt=first.get("use_logfmt", False))
        return [(combined, _event(k), hook) for (combined, _, hook), k in zip(results, kwargs)]

    def get_next_low_latency_combine_buffer(self, handles: list[tuple]) -> list[torch.Tensor]:
        return self.group.get_next_low_latency_combine_buffer(handles)

    def complete(self, results: list[tuple], hook_mode: bool) -> None:
        """Every rank's receive: in hook mode the one hook of the launch (it completes every rank), else a wait
        on each rank's event."""
        if hook_mode:
            results[0][-1]()
            return
        for *_, event, _ in results:
            event.current_stream_wait()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.group.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def destroy(self) -> None:
        self.group.destroy()
