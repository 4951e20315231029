"""Raw text inputs for data preparation: text files (one document each), folders and JSONL."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from moe_train.data.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson")


def expand_inputs(paths: Sequence[str | os.PathLike], glob: str = "*") -> list[Path]:
    """Files named directly, plus the files under each folder (recursively) whose name matches
    ``glob``; hidden files and folders are skipped. Folder contents are sorted so the document
    order, and hence the dataset, is reproducible."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(
                p for p in path.rglob(glob)
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise DataError(f"{path}: no files matching {glob!r} in this folder")
            files.extend(found)
        else:
            raise DataError(f"input not found: {path}")
    return files


def is_jsonl(path: Path) -> bool:
    return path.name.lower().endswith(JSONL_SUFFIXES)


def iter_documents(files: Sequence[Path], json_key: str = "text") -> Iterator[tuple[str, int]]:
    """Yield ``(document text, input bytes it came from)``; empty documents are skipped."""
    for path in files:
        if is_jsonl(path):
            yield from _jsonl_documents(path, json_key)
        else:
            data = _read(path)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                    "exclude it or choose the files with --glob"
                ) from None
            if text:
                yield text, len(data)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None


def _open(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None


def _jsonl_documents(path: Path, json_key: str) -> Iterator[tuple[str, int]]:
    with _open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(f"{path}:{lineno}: invalid JSON ({exc})") from None
            if not isinstance(record, dict) or json_key not in record:
                raise DataError(f"{path}:{lineno}: no {json_key!r} field (choose the field with --json-key)")
            text = record[json_key]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field {json_key!r} is {type(text).__name__}, not a string")
            if text:
                yield text, len(line)
