"""EMA of the parameters in CPU memory (DeepSeek-V3 §3.2.3), updated in the background after each step.

`update`, called after every optimizer step, copies the fp32 master value of each piece it covers
(`DistributedOptimizer.master_weights`: one range of a parameter per entry) into a host buffer: on
CUDA without waiting for the device (non_blocking into pinned memory, then an event), on a CPU as a
plain snapshot. One background thread then folds it in, ema = decay * ema + (1 - decay) * param, in
fp32. One update is in flight at most: the next update, a save (`wait`) and the end of the run
(`close`) wait for it, and an exception of the thread is raised at that wait as an EMAError. No EMA
tensor is ever on the device.

Memory: each rank keeps the EMA of the elements its optimizer owns, i.e. of its ZeRO-1 ranges with
`parallel.zero1` (the dp ranks hold one copy between them, so host memory per rank divides by dp),
or of every parameter it holds without ZeRO-1. That is 8 bytes per covered element: the fp32
average and the fp32 buffer the copy lands in. In a checkpoint the owners write their ranges of
`ema.<parameter name>` (routed experts split per expert, as the model; parallel.sharded_state), so a
resume into another layout works as for the optimizer state: each rank loads the ranges it owns there.

A skipped step (non-finite gradient norm; the optimizer skips on the device) leaves the parameters
as they were, and its update folds in those unchanged values: the EMA is always the recurrence over
the parameters after each step, skipped steps included, and no host read of the skip flag is needed.
Buffers (router correction biases) are not parameters and have no EMA.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class EMAError(RuntimeError):
    """The background EMA update failed; raised in the training thread at the next wait."""


class ParameterEMA:
    """The EMA of `params` ({name: tensor}, read in place at each update), started from their current values."""

    def __init__(self, params: dict[str, torch.Tensor], decay: float) -> None:
        self.decay = decay
        self._params = params
        self._on_cuda = any(t.is_cuda for t in params.values())
        self.average = {name: self._host_buffer(t) for name, t in params.items()}
        self._copies = {name: self._host_buffer(t) for name, t in params.items()}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ema")
        self._pending: Future[None] | None = None
        self.restart()

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=torch.float32, pin_memory=self._on_cuda)

    def restart(self) -> None:
        """Start the average from the parameters' current values."""
        self.wait()
        for name, param in self._params.items():
            self.average[name].copy_(param)

    def update(self) -> None:
        """Fold in the parameters as they are now: copied to the host here, added on the background thread."""
        self.wait()
        for name, param in self._params.items():
            self._copies[name].copy_(param, non_blocking=True)
        copied = None
        if self._on_cuda:
            copied = torch.cuda.Event()
            copied.record()
        self._pending = self._thread.submit(self._fold, copied)

    def _fold(self, copied: torch.cuda.Event | None) -> None:
        if copied is not None:
            copied.synchronize()
        for name, average in self.average.items():
            average.mul_(self.decay).add_(self._copies[name], alpha=1.0 - self.decay)

    def wait(self) -> None:
        """Return once the update in flight is done; EMAError if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as err:  # any failure of the thread, raised where the training thread can act
            raise EMAError(f"optim.ema_decay: the background EMA update failed: {type(err).__name__}: {err}") from err

    def finite(self) -> torch.Tensor:
        """Whether every average is finite, after the update in flight: a host bool tensor."""
        self.wait()
        checks = [t.isfinite().all() for t in self.average.values()]
        return torch.stack(checks).all() if checks else torch.tensor(True)

    def close(self) -> None:
        """Wait for the update in flight and end the thread. An error of that update is not raised: close
        runs while the run ends, possibly on another error; saves `wait`, so a good run has seen it."""
        self._pending = None
        self._thread.shutdown(wait=True)
