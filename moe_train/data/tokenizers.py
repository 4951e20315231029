"""Tokenizers with one small interface: a file-free byte-level one and a Hugging Face wrapper.

Both expose ``vocab_size``, ``eod_id``, ``encode(str) -> list[int]`` and ``decode(ids) -> str``.
``load_tokenizer("byte")`` gives the byte tokenizer; any other spec is a ``tokenizer.json`` path.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterable, Protocol, Sequence

import tokenizers as hf

from moe_train.data.errors import DataError

EOD_TEXT = "<|endoftext|>"
# Names that common tokenizer.json files use for the end-of-document token, tried in order.
EOD_CANDIDATES = (
    EOD_TEXT,
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "</s>",
    "<eos>",
    "<|eos|>",
)


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then the special ids (EOD is 256)."""

    name = "byte"
    eod_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes are decoded as UTF-8 (invalid sequences replaced); EOD is shown as its text."""
        out: list[str] = []
        chunk = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                chunk.append(i)
                continue
            if i != self.eod_id:
                raise DataError(f"byte tokenizer: id {i} is outside its vocabulary of {self.vocab_size}")
            out.append(chunk.decode("utf-8", errors="replace"))
            out.append(EOD_TEXT)
            chunk = bytearray()
        out.append(chunk.decode("utf-8", errors="replace"))
        return "".join(out)

    def fingerprint(self) -> str:
        return "byte-v1"


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json`` file."""

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise DataError(f"tokenizer file not found: {self.path}")
        try:
            self._tok = hf.Tokenizer.from_file(self.path)
        except Exception as exc:  # the Rust side raises a bare Exception for malformed files
            raise DataError(f"cannot load tokenizer {self.path}: {exc}") from exc
        self.name = self.path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = self._find_eod(eod_token)

    def _find_eod(self, eod_token: str | None) -> int:
        names: Iterable[str] = (eod_token,) if eod_token is not None else EOD_CANDIDATES
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        wanted = eod_token if eod_token is not None else ", ".join(EOD_CANDIDATES)
        raise DataError(f"tokenizer {self.path} has no end-of-document token (looked for: {wanted})")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        """A content hash, so caches keyed by it follow edits of the file, not its name."""
        with open(self.path, "rb") as f:
            return "hf-" + hashlib.sha256(f.read()).hexdigest()[:16]


def load_tokenizer(spec: str | os.PathLike, eod_token: str | None = None) -> Tokenizer:
    """``"byte"`` for the built-in byte tokenizer, otherwise a path to a ``tokenizer.json``."""
    if os.fspath(spec) == "byte":
        if eod_token is not None:
            raise DataError("the byte tokenizer has a fixed EOD id; eod_token applies to tokenizer.json only")
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token=eod_token)
