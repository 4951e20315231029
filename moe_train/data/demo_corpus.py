"""A demo corpus that needs no download: the ``.py`` files of the running Python's standard library.

Built once per (tokenizer, Python, limits) into a cache directory and reused after that. Builds
are serialized by a lock file, so ranks launched together may all call ``build_demo_corpus``.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

from moe_train.data.indexed_dataset import dataset_exists
from moe_train.data.inputs import iter_documents
from moe_train.data.prepare import write_dataset
from moe_train.data.progress import Progress
from moe_train.data.tokenizers import Tokenizer

_FORMAT = 1
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(max_files: int | None = None, max_bytes: int | None = None) -> list[Path]:
    """The standard library's UTF-8 ``.py`` files (no third-party packages) in a fixed walk
    order, at most ``max_files`` files and ``max_bytes`` bytes (files that would overflow are
    skipped)."""
    files: list[Path] = []
    total = 0
    for folder, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in sorted(n for n in names if n.endswith(".py")):
            if max_files is not None and len(files) >= max_files:
                return files
            path = Path(folder, name)
            size = path.stat().st_size
            if (max_bytes is not None and total + size > max_bytes) or not _is_utf8(path):
                continue
            files.append(path)
            total += size
    return files


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    return True


def demo_corpus_prefix(cache_dir: str | os.PathLike, tokenizer: Tokenizer,
                       max_files: int | None = None, max_bytes: int | None = None) -> str:
    """Where the corpus for these settings lives; the name changes whenever its content would."""
    key = json.dumps(
        [_FORMAT, tokenizer.fingerprint(), sys.version, sysconfig.get_paths()["stdlib"], max_files, max_bytes]
    )
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return os.path.join(os.fspath(cache_dir), f"stdlib-py-{digest}")


def build_demo_corpus(cache_dir: str | os.PathLike, tokenizer: Tokenizer, max_files: int | None = None,
                      max_bytes: int | None = None, show_progress: bool = False) -> str:
    """Return the prefix of the cached demo dataset, building it first if needed."""
    prefix = demo_corpus_prefix(cache_dir, tokenizer, max_files, max_bytes)
    if dataset_exists(prefix):
        return prefix
    os.makedirs(os.fspath(cache_dir), exist_ok=True)
    with open(prefix + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not dataset_exists(prefix):
            files = stdlib_sources(max_files, max_bytes)
            total = sum(f.stat().st_size for f in files)
            progress = Progress(total, "building the demo corpus", enabled=show_progress)
            try:
                write_dataset(iter_documents(files), tokenizer, prefix, progress)
            finally:
                progress.close()
    return prefix
