"""Pack several per-row tensors into one byte row per token, so each hop is a single all-to-all.

Every hop moves one record per (token, destination): payload, FP8 scales, top-k ids and weights
side by side, as DeepEP's single record format does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class FieldSpec:
    dtype: torch.dtype
    width: int  # elements per row

    @property
    def nbytes(self) -> int:
        return self.width * self.dtype.itemsize


def specs_of(fields: Sequence[torch.Tensor]) -> list[FieldSpec]:
    return [FieldSpec(f.dtype, math.prod(f.shape[1:])) for f in fields]


def pack_rows(fields: Sequence[torch.Tensor]) -> torch.Tensor:
    """[n, ...] tensors -> uint8 [n, total bytes per row]."""
    rows = fields[0].shape[0]
    flat = [f.reshape(rows, math.prod(f.shape[1:])).contiguous() for f in fields]
    return torch.cat([f.view(torch.uint8) for f in flat], dim=1)


def unpack_rows(packed: torch.Tensor, specs: Sequence[FieldSpec]) -> list[torch.Tensor]:
    """Inverse of `pack_rows`: uint8 [n, B] -> [n, width] tensors of the given dtypes."""
    out, start = [], 0
    for spec in specs:
        chunk = packed[:, start:start + spec.nbytes].contiguous()
        out.append(chunk.view(spec.dtype).view(packed.shape[0], spec.width))
        start += spec.nbytes
    return out
