"""Telling a failed collective (a peer process died, the network broke, a collective timed out) from
any other error, so the application can name it in one line instead of a traceback.

torch.distributed raises `DistError` subclasses for most of these, but gloo's transport errors reach
Python as a plain RuntimeError whose text starts with the gloo source location; both are recognised.
"""
from __future__ import annotations

import re

import torch.distributed as dist

GLOO_TRANSPORT = "gloo/transport/"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def collective_failure(err: BaseException) -> str | None:
    """What failed, in a few words, when `err` is a failed collective, else None: the error's first
    line without the source location in brackets and the generic advice gloo appends."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    if not (isinstance(err, dist.DistError) or isinstance(err, RuntimeError) and (
            GLOO_TRANSPORT in first or any(p in first for p in PEER_GONE))):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)
    return first.split(". This is typically", 1)[0].rstrip(".")
