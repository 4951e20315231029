"""A range of a tensor's elements as torch.distributed.checkpoint saves and loads it.

ZeRO-1 cuts a bucket of parameters at any element (parallel.grad_buffers), so a rank owns, of one
parameter, the elements [start, stop) of its row-major flattening: its fp32 main values, Adam
moments and EMA. `FlatRange` stands for the whole tensor in a DCP state dict while holding only
that range: DCP asks it for its chunks (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`, the protocol DTensor implements), and it answers with the boxes the range
covers: a partial row, whole rows and a partial row, recursively in each dimension. The checkpoint
therefore holds each tensor in its own shape, written by the ranks that own its pieces, and any
layout reads any box of it back: a checkpoint of one ZeRO-1 layout loads into another, and into
plain tensors.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The boxes (offsets, sizes, first flat index) that elements [start, stop) of a row-major tensor
    of `shape` cover, in order; each is contiguous in the flattening."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first_whole, end_whole = -(-start // inner), stop // inner  # the whole rows inside the range

    def within_row(row: int, low: int, high: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [((row,) + offsets, (1,) + sizes, row * inner + flat)
                for offsets, sizes, flat in boxes(tuple(shape[1:]), low - row * inner, high - row * inner)]

    if first_whole > end_whole:  # start and stop inside one row
        return within_row(start // inner, start, stop)
    out = within_row(start // inner, start, first_whole * inner) if start < first_whole * inner else []
    if first_whole < end_whole:
        out.append(((first_whole,) + (0,) * (len(shape) - 1), (end_whole - first_whole,) + tuple(shape[1:]),
                    first_whole * inner))
    if end_whole * inner < stop:
        out += within_row(end_whole, end_whole * inner, stop)
    return out


class FlatRange(torch.Tensor):
    """Elements [start, start + values.numel()) of a tensor of `shape` (row-major), held in the 1-D
    tensor `values` (DCP loads into it in place). Only DCP's checkpoint protocol is supported."""

    @staticmethod
    def __new__(cls, shape: torch.Size | tuple[int, ...], start: int, values: torch.Tensor) -> "FlatRange":
        out = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=values.dtype, device=values.device)
        out.start, out.values = start, values
        out.boxes = [(offsets, sizes, values[flat - start:flat - start + math.prod(sizes)].view(sizes))
                     for offsets, sizes, flat in boxes(tuple(shape), start, start + values.numel())]
        return out

    def __init__(self, shape: torch.Size | tuple[int, ...], start: int, values: torch.Tensor) -> None:
        super().__init__()

    @property
    def stop(self) -> int:
        return self.start + self.values.numel()

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FlatRange(shape={list(self.shape)}, elements {self.start}:{self.stop}, {self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(f"FlatRange only takes part in torch.distributed.checkpoint, not in {func}")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.shape))
                for offsets, sizes, view in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, _, view in self.boxes:
            if index.offset is None or tuple(index.offset) == offsets:
                return view
        raise ValueError(f"{index.fqn}: no chunk at {index.offset} in {self!r}")

    def rows(self) -> list[tuple[int, "FlatRange"]]:
        """The range cut along the first dimension: (row, the part of the range inside that row) for
        each row it touches (routed experts are saved one key per expert)."""
        inner = math.prod(self.shape[1:])
        out = []
        for row in range(self.start // inner, -(-self.stop // inner)):
            low, high = max(self.start, row * inner), min(self.stop, (row + 1) * inner)
            out.append((row, FlatRange(self.shape[1:], low - row * inner, self.values[low - self.start:high - self.start])))
        return out
