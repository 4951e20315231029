"""`deep_ep.utils`: DeepEP's event types over torch's CUDA events.

`EventHandle()` records an event on the current stream, as DeepEP's C++ `EventHandle` does; without
CUDA (the CPU emulation, where every op has finished when it returns) it holds no event and waiting
on it does nothing. `EventOverlap(event, extra_tensors)` is DeepEP's wrapper: `current_stream_wait()`
and the `with` form; `extra_tensors` are kept alive until the event is released, as DeepEP's
substitute for `record_stream` under CUDA graphs.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kernels_cuda import streams


class EventHandle:
    """An event recorded on the current CUDA stream at construction (none on the CPU)."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        if event is None and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's `EventOverlap`: an optional `EventHandle` plus tensors to keep alive until it is waited on."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], None] | None = None
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Makes the current stream wait for the event (DeepEP requires an event here, as this does)."""
        if self.event is None:
            raise ValueError("EventOverlap.current_stream_wait: no event (the op was not run with async_finish=True)")
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event, self.extra_tensors = None, None

    def register_hook_after_wait(self, hook: Callable[[], None]) -> None:
        if self.hook_after_wait is not None:
            raise ValueError("EventOverlap: a hook is already registered")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """`with event(release_handle=True):` releases the event (and extra tensors) on exit."""
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_on_exit)
        self._release_on_exit = False


def to_kernels(event: EventOverlap | None) -> streams.EventOverlap | None:
    """A `previous_event` for `kernels_cuda.Buffer` (which takes torch's event itself)."""
    if event is None:
        return None
    return streams.EventOverlap(None if event.event is None else event.event.event)


def from_kernels(event: streams.EventOverlap, async_finish: bool,
                 extra_tensors: tuple[torch.Tensor, ...] | None = None) -> EventOverlap:
    """The `EventOverlap` DeepEP returns: an event with `async_finish` (a finished one on the CPU), else none."""
    if not async_finish:
        return EventOverlap()
    return EventOverlap(EventHandle(event.event) if event.event is not None else _FINISHED, extra_tensors)


class _FinishedEvent(EventHandle):
    """The event of an op that finished before it returned (the CPU emulation): nothing to wait for."""

    def __init__(self) -> None:
        self.event = None


_FINISHED = _FinishedEvent()
