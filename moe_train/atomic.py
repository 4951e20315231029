"""Write-then-rename publication: a reader sees a file's old content or its new one, never a part."""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def temp_path_for(final_path: str) -> str:
    """A fresh hidden name in ``final_path``'s folder (same filesystem, so ``os.replace`` is
    atomic). Files created there get the usual umask-based permissions."""
    directory, base = os.path.split(os.path.abspath(final_path))
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f".{base}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def fsync_dir(path: str | os.PathLike) -> None:
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


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def publish_written(path: Path, write: Callable[[Path], None], temp: Path | None = None,
                    durable: bool = False) -> None:
    """Replace ``path`` by what ``write`` writes to the temporary path it is given (default: a fresh hidden
    name beside ``path``), in one rename; a failed write leaves ``path`` as it was and no temporary file
    behind. ``durable``: the file and the rename are fsynced."""
    tmp = temp if temp is not None else Path(temp_path_for(str(path)))
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as file:
                os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def publish_bytes(path: Path, data: bytes, temp: Path | None = None, durable: bool = False) -> None:
    """``publish_written`` of ``data``."""
    publish_written(path, lambda tmp: tmp.write_bytes(data), temp, durable)
