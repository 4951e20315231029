"""Small real file systems for the write-failure tests: a tmpfs of a given size (a disk that fills
up: ENOSPC) that can be made read-only (EROFS). Mounting needs root or CAP_SYS_ADMIN; where it is
not permitted the test is skipped with the reason."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def tmpfs(path: Path, size: str, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: 64k, 10m) and at most `inodes` files and folders at `path`,
    unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + ("" if inodes is None else f",nr_inodes={inodes}")
    mounted = _mount("-t", "tmpfs", "-o", options, "tmpfs", str(path))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or f'exit {mounted.returncode}'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True, timeout=30)


def make_read_only(path: Path) -> None:
    """Remount the tmpfs at `path` read-only (no file there may be open for writing)."""
    remounted = _mount("-o", "remount,ro", str(path))
    assert remounted.returncode == 0, remounted.stderr
