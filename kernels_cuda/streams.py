"""Where a buffer op runs and when its results may be used (DeepEP's stream and event semantics).

A per-process buffer owns a communication stream. Each op:
- makes that stream wait on `previous_event` if given, else on the whole current (compute) stream;
- launches its kernels there; its output tensors are allocated on the compute stream, or on the
  communication stream with `allocate_on_comm_stream=True` (which needs `previous_event` and
  `async_finish`, as in DeepEP: the caller then owns the ordering);
- with `async_finish=False` makes the compute stream wait before returning (event None);
  with `async_finish=True` returns an `EventOverlap` recorded on the communication stream and
  marks the inputs with `record_stream` for the communication stream;
- either way marks the outputs for both streams (the layout kernel's, for one, are allocated where
  it launches), so the caching allocator cannot hand their memory to other work before the op, or
  the compute stream's use of the outputs, has ended.

Without `previous_event`, outputs allocated on the compute stream are ordered before the kernels
(a deterministic-mode fill of a new tensor runs on the compute stream). With `previous_event` the
communication stream waits on that event only, as in DeepEP, and the caller should allocate on the
communication stream: memory the compute stream frees after the event may otherwise be reused for
the outputs while that work still runs (DeepEP issue #589).

`CurrentStreamOp` is the same interface on the caller's stream (the CPU, emulated groups, tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager, Iterator

import torch


class EventOverlap:
    """A CUDA event marking the end of an op (None when the op was synchronous)."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()


def capture() -> EventOverlap:
    """An event recorded on the current stream now: pass it as a later op's `previous_event` (None
    without CUDA: on the CPU every op has finished when it returns)."""
    if not torch.cuda.is_available():
        return EventOverlap()
    event = torch.cuda.Event()
    event.record()
    return EventOverlap(event)


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested tuples, lists, dicts and dataclasses (handles)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_in(getattr(value, f.name))


def check_stream_args(previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    """DeepEP's rule, on every device: outputs on the communication stream need an event and an async finish."""
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True "
                         "(the caller must order the compute stream's use of the outputs)")


class CurrentStreamOp:
    """Everything on the caller's current stream; no events."""

    def allocating(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def launching(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def finish(self, inputs: Any, outputs: Any) -> EventOverlap:
        return EventOverlap()


ON_CURRENT_STREAM = CurrentStreamOp()  # stateless: one instance serves every call


class CommStreamOp(CurrentStreamOp):
    """One op on `comm`, ordered after `previous_event` or the current stream (see the module doc)."""

    def __init__(self, comm: torch.cuda.Stream, previous_event: EventOverlap | None, async_finish: bool,
                 allocate_on_comm_stream: bool) -> None:
        check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        self.comm, self.compute = comm, torch.cuda.current_stream()
        self.async_finish, self.allocate_on_comm = async_finish, allocate_on_comm_stream
        self.after_compute = previous_event is None or previous_event.event is None
        if self.after_compute:
            comm.wait_stream(self.compute)
        else:
            comm.wait_event(previous_event.event)

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        if self.allocate_on_comm:
            with torch.cuda.stream(self.comm):
                yield
            return
        yield
        if self.after_compute:  # whatever the allocation queued on the compute stream comes first
            self.comm.wait_stream(self.compute)

    def launching(self) -> ContextManager[None]:
        return torch.cuda.stream(self.comm)

    def finish(self, inputs: Any, outputs: Any) -> EventOverlap:
        for tensor in tensors_in(outputs):
            tensor.record_stream(self.comm)
            tensor.record_stream(self.compute)
        if not self.async_finish:
            self.compute.wait_stream(self.comm)
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(self.comm)
        for tensor in tensors_in(inputs):
            tensor.record_stream(self.comm)
        return EventOverlap(event)
