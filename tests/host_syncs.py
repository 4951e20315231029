"""Counting device-to-host synchronisations: the calls that make the host wait for a GPU.

On a CPU nothing waits, but a run makes the same calls, so a CPU run counts what a CUDA run pays:
- host reads of tensor values: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool` / `int` /
  `float` / `operator.index` of a tensor (seen by a `TorchFunctionMode`);
- ops whose CUDA kernels size their output from the values, so they copy a count to the host:
  `nonzero`, `masked_select`, indexing or assigning through a boolean mask, `bincount` (reads the
  max), `repeat_interleave` without `output_size`, `unique`, and any other read of one value
  (`_local_scalar_dense`, `equal`) (seen by a `TorchDispatchMode`).
Each sync is attributed to the innermost frame of this repository's code that led to it.
Modes are thread-local: the counter sees the thread that entered it (and the autograd engine's
CPU backward, which runs there). The engine does not carry torch-function modes into a custom
Function's backward, so the counter enters its own again around each one run on its thread.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
_THIS_FILE = str(Path(__file__).resolve())

_HOST_READS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "bool", torch.Tensor.__int__: "int", torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
}
_aten = torch.ops.aten
_SIZED_BY_VALUES = {
    _aten.nonzero.default: "nonzero", _aten.masked_select.default: "masked_select",
    _aten.bincount.default: "bincount", _aten._unique.default: "unique", _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique", _aten.unique_consecutive.default: "unique",
    _aten._local_scalar_dense.default: "item", _aten.equal.default: "equal",
}
_MASKABLE = (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default)


@dataclass(frozen=True)
class HostSync:
    kind: str   # "item", "tolist", "nonzero", "boolean mask", ...
    where: str  # "path/in/repo.py:line" of the innermost repository frame


def _where() -> str:
    frame = sys._getframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(str(ROOT)) and name != _THIS_FILE:
            return f"{Path(name).relative_to(ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside the repository"


def _has_mask(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _HOST_READS.get(func)
        if kind is None:
            return func(*args, **(kwargs or {}))
        self.counter.record(kind)
        self.counter.depth += 1  # the _local_scalar_dense below is this same read
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.counter.depth -= 1


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _SIZED_BY_VALUES.get(func)
        if func in _MASKABLE and _has_mask(args[1]):
            kind = "boolean mask"
        elif func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            kind = "repeat_interleave"
        if kind is not None and not (kind == "item" and self.counter.depth):
            self.counter.record(kind)
        return func(*args, **kwargs)


class HostSyncCounter:
    """`with HostSyncCounter() as syncs:` records every host sync of the block in `syncs.syncs`."""

    def __init__(self) -> None:
        self.syncs: list[HostSync] = []
        self.depth = 0
        self._modes = (_FunctionCounter(self), _DispatchCounter(self))

    def record(self, kind: str) -> None:
        self.syncs.append(HostSync(kind, _where()))

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        self._apply_backward = BackwardCFunction.apply
        thread, function_counter, apply_backward = threading.get_ident(), self._modes[0], self._apply_backward

        def counted_backward(ctx: BackwardCFunction, *args: Any) -> Any:
            with function_counter if threading.get_ident() == thread else contextlib.nullcontext():
                return apply_backward(ctx, *args)

        BackwardCFunction.apply = counted_backward
        return self

    def __exit__(self, *exc: Any) -> None:
        BackwardCFunction.apply = self._apply_backward
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def __len__(self) -> int:
        return len(self.syncs)

    def by_place(self) -> collections.Counter[HostSync]:
        return collections.Counter(self.syncs)

    def report(self) -> str:
        """One line per (kind, place), most frequent first."""
        return "\n".join(f"{n:4d} x {s.kind:<17} {s.where}" for s, n in self.by_place().most_common())
