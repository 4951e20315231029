"""Progress display for long data jobs: tqdm when installed, else a periodic line on stderr."""
from __future__ import annotations

import sys
import time

_LINE_INTERVAL_S = 2.0


class Progress:
    """Counts documents, tokens and input bytes; shows docs, tokens and MB/s as they grow."""

    def __init__(self, total_bytes: int | None, desc: str, enabled: bool = True) -> None:
        self.docs = self.tokens = self.bytes = 0
        self.desc = desc
        self.enabled = enabled
        self._start = self._last_line = time.monotonic()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, file=sys.stderr)

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(nbytes)
            self._bar.set_postfix(docs=self.docs, tokens=self.tokens, refresh=False)
            return
        now = time.monotonic()
        if now - self._last_line >= _LINE_INTERVAL_S:
            self._last_line = now
            print(self.summary(), file=sys.stderr, flush=True)

    def summary(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        return (
            f"{self.desc}: {self.docs} docs, {self.tokens} tokens, "
            f"{self.bytes / 1e6:.1f} MB in {elapsed:.1f} s ({self.bytes / 1e6 / elapsed:.2f} MB/s)"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
