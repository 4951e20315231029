"""Weighted blends of datasets, written as Megatron's ``--data-path``: one prefix, "W1 P1 W2 P2 ...", or
several prefixes without weights ("P1 P2 ...": each dataset weighted by its size in samples, the
proportions of Megatron's unweighted blend, which concatenates them).

Weights are normalised to sum to 1 (Megatron's ``normalize``), so "3 A 7 B" is "0.3 A 0.7 B". A
prefix may be named by its ``.bin`` or ``.idx`` file as well.

The blended stream repeats a fixed pattern of ``PERIOD`` slots: dataset ``d`` owns ``c_d`` of them
(its weight times ``PERIOD``, rounded by largest remainder so they sum to ``PERIOD``), spread evenly
over the period (slot keys ``(k + 0.5) / c_d``, merged). Global sample ``g`` is therefore sample
``(g // PERIOD) * c_d + k`` of dataset ``d``'s own seeded stream: any sample is found in O(1), the
first ``n`` samples hold each dataset ``weight * n`` times (within 1 + datasets / 2 + n / PERIOD), and the order depends
on the seed, the data and the weights only, not on the run's length or layout.
"""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from moe_train.data.errors import DataError
from moe_train.data.packing import PackedSamples, SampleStream

PERIOD = 1 << 16
DATA_SUFFIXES = (".bin", ".idx")
Blend = list[tuple[float | None, str]]  # weight None: by the dataset's size


def dataset_prefix(path: str) -> str:
    """The dataset prefix of ``path``: itself, or without a ``.bin``/``.idx`` suffix."""
    root, suffix = os.path.splitext(path)
    return root if suffix in DATA_SUFFIXES else path


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(spec: str | os.PathLike | Sequence[Any]) -> Blend:
    """(normalised weight, prefix) pairs of one prefix or a "W1 P1 W2 P2 ..." blend; (None, prefix) for
    each of several prefixes without weights (weighted by size once the datasets are read).

    ``spec`` is a string (split on whitespace), a path (one prefix, never split) or a list of words
    (YAML). Raises ValueError saying what is wrong.
    """
    if isinstance(spec, os.PathLike):
        words = [os.fspath(spec)]
    elif isinstance(spec, str):
        words = spec.split()
    else:
        words = [str(word).strip() for word in spec]
    if not words or not all(words):
        raise ValueError("is empty; give a dataset prefix or a blend 'W1 PREFIX1 W2 PREFIX2 ...'")
    if len(words) == 1:
        return [(1.0, dataset_prefix(words[0]))]
    if all(_weight(w) is None for w in words):
        return [(None, dataset_prefix(w)) for w in words]
    weights = [_weight(w) for w in words[::2]]
    if len(words) % 2 or None in weights:
        raise ValueError(f"{' '.join(words)!r} is neither one prefix nor a blend of weight-prefix pairs "
                         "'W1 PREFIX1 W2 PREFIX2 ...'")
    bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise ValueError(f"blend weights must be finite numbers > 0, got {bad[0]}")
    total = sum(weights)
    return [(w / total, dataset_prefix(p)) for w, p in zip(weights, words[1::2])]


def period_slots(weights: Sequence[float]) -> np.ndarray:
    """Slots of each dataset in one period: ``weight * PERIOD`` rounded by largest remainder."""
    exact = np.asarray(weights, dtype=np.float64) * PERIOD
    slots = np.floor(exact).astype(np.int64)
    short = PERIOD - int(slots.sum())
    slots[np.argsort(-(exact - slots), kind="stable")[:short]] += 1
    return slots


class BlendedSamples(SampleStream):
    """An endless blend of several datasets' packed streams (see the module docstring)."""

    def __init__(self, parts: Sequence[PackedSamples], weights: Sequence[float], stream: str) -> None:
        self.parts = list(parts)
        self.weights = [float(w) for w in weights]
        self.slots = period_slots(self.weights)
        for part, weight, slots in zip(self.parts, self.weights, self.slots):
            if slots == 0:
                raise DataError(f"{part.dataset.prefix}: blend weight {weight:.3g} is below 1/{2 * PERIOD}, "
                                 "so it would never be drawn")
        keys = np.concatenate([(np.arange(c) + 0.5) / c for c in self.slots])
        owners = np.repeat(np.arange(len(self.parts)), self.slots)
        ranks = np.concatenate([np.arange(c) for c in self.slots])
        order = np.lexsort((owners, keys))
        self._owner, self._rank = owners[order], ranks[order]
        self.seed, self.seq_length, self.stream = self.parts[0].seed, self.parts[0].seq_length, stream

    def source(self, index: int) -> tuple[int, int]:
        """(dataset, sample of that dataset's stream) of global sample ``index``."""
        period, slot = divmod(index, PERIOD)
        owner = int(self._owner[slot])
        return owner, period * int(self.slots[owner]) + int(self._rank[slot])

    def draws(self, count: int) -> list[int]:
        periods, rest = divmod(count, PERIOD)
        return (periods * self.slots + np.bincount(self._owner[:rest], minlength=len(self.parts))).tolist()

    def row(self, index: int) -> np.ndarray:
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        owner, local = self.source(index)
        return self.parts[owner].row(local)

    def fingerprint(self) -> dict[str, Any]:
        return {"seed": self.seed, "seq_length": self.seq_length, "stream": self.stream,
                "num_tokens": [p.num_tokens for p in self.parts], "weights": self.weights}
