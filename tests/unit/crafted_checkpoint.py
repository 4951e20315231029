"""Crafted checkpoints for the trust tests: a payload that, if a reader unpickled it, would run a
command creating a marker file (as a hostile checkpoint would run anything), planted in each
pickled file of a real checkpoint so that an unrestricted reader would then load it normally."""
from __future__ import annotations

import os
import pickle
import shlex
from pathlib import Path

import torch

PLANTED_FILES = (".metadata", "extra.pt", "rng_rank0.pt")


class MarkerPayload:
    """Unpickled, it calls os.system (pickled as the global posix.system) to create `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(folder: Path, name: str, marker: Path) -> Path:
    """Put a MarkerPayload into `folder`/`name` (one of PLANTED_FILES), keeping what the file holds; returns it."""
    file = folder / name
    if name == ".metadata":
        with open(file, "rb") as stream:
            metadata = pickle.load(stream)  # our own file, written by the test: trusted here
        metadata.storage_meta.modules = [MarkerPayload(marker)]
        file.write_bytes(pickle.dumps(metadata))
    else:
        content = torch.load(file, weights_only=True)
        torch.save({**content, "note": MarkerPayload(marker)}, file)
    return file
