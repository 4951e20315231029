"""Asynchronous collectives and the point where a chunk needs their result.

Every all-to-all of the communicating backends is launched asynchronously and gives a handle;
`OverlapSwitch.complete(handle)` is where the caller needs the result. Outside an overlapped
forward/backward pair it simply waits. Inside one (`parallel.pipeline.overlap.FBOverlap` installs
itself with `switching`), the handle goes to the scheduler, which runs the other chunk's compute
while the collective is in flight and waits on it before this chunk resumes. The switch is an
object: whoever runs the pairs creates it and gives it to the pair's scheduler and to the
communicators and dispatchers whose collectives the chunks complete.

On CUDA, collectives launched inside `switching(..., comm_streams=True)` run on a separate
communication stream per device; their handle records an event there and `wait` makes the
current (compute) stream wait on it, so no host synchronisation is needed.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist


class CommHandle(Protocol):
    def wait(self) -> None:
        """Return once the result may be used (on CUDA: once the current stream is ordered after it)."""
        ...


class WorkHandle:
    """A torch.distributed `Work`, keeping the tensors it reads and writes alive until waited on."""

    def __init__(self, work: Optional[dist.Work], *tensors: torch.Tensor) -> None:
        self.work, self.tensors = work, tensors

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.tensors = ()


class StreamHandle(WorkHandle):
    """A collective launched on a communication stream; waiting orders the current stream after it."""

    def __init__(self, work: Optional[dist.Work], event: Any, *tensors: torch.Tensor) -> None:
        super().__init__(work, *tensors)
        self.event = event

    def wait(self) -> None:
        super().wait()
        torch.cuda.current_stream().wait_event(self.event)


class OverlapSwitch:
    """Where the two chunks of an overlapped pair pass the baton; outside a pair, `complete` waits.

    `waited_s` adds up the host time blocked in `wait` (the straggler report's compute time leaves it out,
    moe_train.straggler); on CUDA a wait only orders the streams, so it is about 0 there."""

    def __init__(self) -> None:
        self._to: Optional[Callable[[CommHandle], None]] = None
        self._streams: Optional[dict[torch.device, Any]] = None
        self.waited_s = 0.0

    def complete(self, handle: CommHandle) -> None:
        """The caller needs `handle`'s result now: wait, or let an overlapped chunk compute meanwhile."""
        if self._to is None:
            self.wait(handle)
        else:
            self._to(handle)

    def wait(self, handle: CommHandle) -> None:
        """Wait on `handle`, counting the time in `waited_s`."""
        start = time.perf_counter()
        handle.wait()
        self.waited_s += time.perf_counter() - start

    @contextlib.contextmanager
    def switching(self, to: Callable[[CommHandle], None], comm_streams: bool = False) -> Iterator[None]:
        """Within the block, `complete` calls `to` (and CUDA collectives use a comm stream if asked)."""
        if self._to is not None:
            raise RuntimeError("an overlapped pair is already running")
        self._to, self._streams = to, ({} if comm_streams else None)
        try:
            yield
        finally:
            self._to, self._streams = None, None

    def comm_stream(self, device: torch.device) -> Any:
        """The communication stream of `device` inside an overlapped pair on CUDA, else None."""
        if self._streams is None or device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


def all_to_all_async(group: dist.ProcessGroup, send: torch.Tensor, send_splits: list[int],
                     recv_splits: list[int], switch: OverlapSwitch) -> tuple[torch.Tensor, CommHandle]:
    """Launch `all_to_all_single` of rows (on `switch`'s comm stream if it has one); returns the (not
    yet valid) output and its handle."""
    send = send.contiguous()
    out = send.new_empty((sum(recv_splits), *send.shape[1:]))
    stream = switch.comm_stream(send.device)
    if stream is None:
        work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=group, async_op=True)
        return out, WorkHandle(work, send, out)
    stream.wait_stream(torch.cuda.current_stream(send.device))
    with torch.cuda.stream(stream):
        work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=group, async_op=True)
        event = torch.cuda.Event()
        event.record(stream)
    send.record_stream(stream)
    out.record_stream(stream)
    return out, StreamHandle(work, event, send, out)
