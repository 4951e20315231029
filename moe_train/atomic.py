"""Temporary names beside a final path, for write-then-rename publication."""
from __future__ import annotations

import os
import secrets


def temp_path_for(final_path: str) -> str:
    """A fresh hidden name in ``final_path``'s folder (same filesystem, so ``os.replace`` is
    atomic). Files created there get the usual umask-based permissions."""
    directory, base = os.path.split(os.path.abspath(final_path))
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f".{base}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def fsync_dir(path: str) -> None:
    """Make renames inside ``path`` durable; a no-op where directories cannot be fsynced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
