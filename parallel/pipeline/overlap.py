"""Overlapped forward/backward pair (DualPipe's FB, Megatron's "combined 1F1B"): each all-to-all of
one chunk is in flight while the other chunk computes.

Sub-steps. A chunk's sub-steps are the spans between its collectives: for an MoE layer's forward
attention + router | dispatch | experts | combine | shared expert + next attention, and for its
backward combine-backward | experts B | dispatch-backward | attention B (weight gradients queued
in the W store where the backward is a B). Every collective is launched asynchronously and
returns a handle (`parallel.dispatch.handles`); `switch.complete(handle)` ends the sub-step, where
`switch` is the `OverlapSwitch` the pair's scheduler shares with the communicators and dispatchers
of its chunks (whoever runs the pairs creates it and hands it to both).

Scheduling. Each chunk runs the model's ordinary forward or backward (so results are bitwise those
of the sequential run, and a chunk may pair with one whose forward ran outside a pair) on its
own thread, but the two never run at once: a baton passes between them at every `complete`. The
forward chunk starts; at a collective it hands over its handle and the backward chunk runs until
its own collective; then the forward chunk waits on its handle (in flight meanwhile) and goes on,
and so on. Once one chunk has finished, the other waits on each handle at once. The order of
collectives is thus a function of the two chunks' collective sequences only, identical on every
EP peer, as the rendezvous of collectives requires.

On CUDA the threads only enqueue work: collectives go to a communication stream (with events
ordering the compute stream after them), so the GPU runs one chunk's kernels under the other's
communication.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from parallel.dispatch.handles import CommHandle, OverlapSwitch

Chunk = Callable[[], None]


class OverlapAborted(RuntimeError):
    """Raised inside a paused chunk when its partner failed, so its thread can end."""


class _Chunk:
    """One side of a pair: a thread that runs only while it holds the baton."""

    def __init__(self, name: str, fn: Chunk, grad_enabled: bool, paused: threading.Event) -> None:
        self.name, self.fn, self.grad_enabled, self.paused = name, fn, grad_enabled, paused
        self.turn = threading.Event()
        self.done = False
        self.aborted = False
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._main, name=f"overlap-{name}", daemon=True)

    def _main(self) -> None:
        self.turn.wait()
        self.turn.clear()
        try:
            if self.aborted:
                raise OverlapAborted(f"{self.name} chunk aborted before it started")
            with torch.set_grad_enabled(self.grad_enabled):
                self.fn()
        except BaseException as err:  # noqa: BLE001 - handed to the scheduler, which re-raises it
            self.error = err
        self.done = True
        self.paused.set()


@dataclass
class OverlapStats:
    pairs: int = 0
    collectives: int = 0  # collectives launched inside pairs
    hidden: int = 0  # of those, the ones the other chunk computed under


class FBOverlap:
    """The runtime's FB hook: `hook(forward, backward)` runs the two chunks interleaved, passing the
    baton at every collective completed through `switch`."""

    def __init__(self, switch: OverlapSwitch) -> None:
        self.switch = switch
        self.stats = OverlapStats()
        self._chunks: list[_Chunk] = []
        self._running: Optional[_Chunk] = None
        self._back = threading.Event()

    def __call__(self, forward: Chunk, backward: Chunk) -> None:
        grad = torch.is_grad_enabled()
        self._chunks = [_Chunk("forward", forward, grad, self._back), _Chunk("backward", backward, grad, self._back)]
        self.stats.pairs += 1
        for chunk in self._chunks:
            chunk.thread.start()
        try:
            with self.switch.switching(self._switch, comm_streams=torch.cuda.is_available()):
                self._schedule()
        finally:
            for chunk in self._chunks:
                if chunk.done:
                    chunk.thread.join()
            self._chunks, self._running = [], None

    def _schedule(self) -> None:
        current = 0
        while not all(chunk.done for chunk in self._chunks):
            chunk = self._chunks[current]
            if not chunk.done:
                self._resume(chunk)
                if chunk.error is not None:
                    self._abort_others(chunk)
                    raise chunk.error
            current = 1 - current

    def _resume(self, chunk: _Chunk) -> None:
        """Hand `chunk` the baton and block until it reaches a collective or ends."""
        self._running = chunk
        self._back.clear()
        chunk.turn.set()
        while not self._back.wait(timeout=1.0):
            if not chunk.thread.is_alive():
                break

    def _abort_others(self, failed: _Chunk) -> None:
        for chunk in self._chunks:
            if chunk is not failed and not chunk.done:
                chunk.aborted = True
                self._resume(chunk)

    def _switch(self, handle: CommHandle) -> None:
        """Called by the running chunk's thread (or the autograd engine's) at `switch.complete(handle)`."""
        chunk = self._running
        assert chunk is not None
        self.stats.collectives += 1
        if all(other.done for other in self._chunks if other is not chunk):
            self.switch.wait(handle)
            return
        self.stats.hidden += 1
        chunk.turn.clear()
        self._back.set()
        chunk.turn.wait()
        chunk.turn.clear()
        if chunk.aborted:
            raise OverlapAborted(f"the other chunk of this {chunk.name} chunk's pair failed")
        self.switch.wait(handle)
