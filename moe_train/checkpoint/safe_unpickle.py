"""Reading a checkpoint's pickled files without running code from them.

A pickle names the functions and classes it calls while it is read; a crafted one can name
`os.system`. Checkpoints travel between clusters and teams, so every pickled file of ours is read
with an allow-list of what it may name, and anything else is refused before it is called:

- DCP's `.metadata` (`load_dcp_metadata`): only the classes DCP's metadata consists of (its metadata,
  chunk, storage-info and storage-meta classes, `torch.Size`, torch dtypes and layouts, paths).
- `extra.pt` and `rng_rank<r>.pt` (`load_plain`): torch's `weights_only` unpickler, which allows
  tensors, numbers, strings and containers; the training state holds nothing else.

A refusal is an `UnsafePickle` naming the refused global. Hugging Face folders are safetensors and
hold no code at all. DCP reads the tensor data files itself with `weights_only=True`.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import IO, Any

import torch

_DCP_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
ALLOWED_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout looked up by its name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),  # Python 3.13's home of the classes
})


class UnsafePickle(ValueError):
    """A pickled file names a global outside its allow-list; `names` lists them as module.name."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"refused global {', '.join(names)}")
        self.names = names


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickle([f"{module}.{name}"])


def load_dcp_metadata(stream: IO[bytes]) -> Any:
    """DCP's metadata object from the stream of a `.metadata` file."""
    return _MetadataUnpickler(stream).load()


def load_plain(file: Path) -> Any:
    """A torch.save'd file of tensors, numbers, strings and containers (torch.load with weights_only)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        refused = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        if refused:
            raise UnsafePickle(refused) from None
        raise
