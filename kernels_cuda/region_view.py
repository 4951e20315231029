"""DeepEP's `get_local_buffer_tensor` over one of our regions: typed views of the region's bytes.

DeepEP returns `torch::from_blob(base + offset, (num_bytes / element_size,), dtype)`: the offset is in
bytes, and the view is a window onto the memory its kernels use (no copy). The same here, with the
bounds DeepEP leaves unchecked refused: the offset is a multiple of the element size inside the region,
the view ends at the region's end, and `size` fits in it.
"""
from __future__ import annotations

from typing import Sequence

import torch


def region_view(region: torch.Tensor, dtype: torch.dtype, size: Sequence[int] | None, offset: int,
                where: str) -> torch.Tensor:
    """`dtype` elements of `region` (a uint8 tensor: the whole region) from byte `offset` to the region's
    end, or the first numel(`size`) of them shaped `size`. Errors name `where` and the argument."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: dtype must be a torch.dtype, got {dtype!r}")
    num_bytes, element = region.numel(), dtype.itemsize
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= num_bytes:
        raise ValueError(f"{where}: offset must be a byte offset in [0, {num_bytes}] (the buffer's bytes), "
                         f"got {offset!r}")
    if offset % element:
        raise ValueError(f"{where}: offset must be a multiple of the {element}-byte size of {dtype}, got {offset}")
    count = (num_bytes - offset) // element
    elements = region[offset:offset + count * element].view(dtype)
    if size is None:
        return elements
    if isinstance(size, int) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in size):
        raise ValueError(f"{where}: size must be a torch.Size (or sequence) of non-negative ints, got {size!r}")
    shape = torch.Size(size)
    if shape.numel() > count:
        raise ValueError(f"{where}: size {list(shape)} needs {shape.numel()} elements of {dtype}, but only {count} "
                         f"follow byte offset {offset} of the {num_bytes}-byte buffer")
    return elements[:shape.numel()].view(shape)
