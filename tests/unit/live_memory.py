"""Bytes of tensor storage alive while CPU code runs, and their peak: what a GPU allocator's
statistics would show, measured deterministically on a CPU.

A `TorchDispatchMode` sees every op: an output whose storage none of the op's inputs shares is a new
allocation; each storage is followed by a weak reference, so it counts until it is freed. The live
total is taken after every op, so frees between two ops are seen before the next allocation.
Allocations inside kernels (scratch buffers) and tensors made before the mode are not counted.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class LiveStorage(TorchDispatchMode):
    """`with LiveStorage() as mem:` ... `mem.live()` bytes alive now, `mem.peak` the most so far."""

    def __init__(self) -> None:
        super().__init__()
        self._alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self._bytes = 0
        self.peak = 0

    def live(self) -> int:
        for key in [k for k, (ref, _) in self._alive.items() if ref.expired()]:
            self._bytes -= self._alive.pop(key)[1]
        return self._bytes

    def reset_peak(self) -> None:
        self.peak = self.live()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.live()
        inputs = {StorageWeakRef(s).cdata for s in _storages((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        for storage in _storages(out):
            ref = StorageWeakRef(storage)
            if ref.cdata not in inputs and ref.cdata not in self._alive:
                self._alive[ref.cdata] = (ref, storage.nbytes())
                self._bytes += storage.nbytes()
        self.peak = max(self.peak, self._bytes)
        return out
