"""Allowed ranges of numeric settings, and the one-line problem of a value outside its range.

Every numeric key of the model section (model.args) and of the training config (moe_train.config)
is declared with an `Interval`, so NaN, infinities, negative counts and out-of-range factors are
refused by one rule instead of by checks written key by key (a plain `value <= 0` lets NaN through).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Interval:
    """A finite number with `low` <= value (< when `low_open`) and value <= `high` (< when `high_open`);
    a bound of None is no bound. `optional`: null (None) is allowed and means the key's default
    behaviour. `unit` names what the number counts, for the message."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    unit: str = ""

    def describe(self, integer: bool) -> str:
        what = ("an integer" if integer else "a finite number") + (f" of {self.unit}" if self.unit else "")
        low, high = _bound_text(self.low), _bound_text(self.high)
        if self.low is not None and self.high is not None:
            return f"{what} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{what} {'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{what} {'<' if self.high_open else '<='} {high}"
        return what

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def problem(self, value: Any) -> Optional[str]:
        """Why `value` is outside, or None when it is allowed."""
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.contains(value):
            return f"must be {self.describe(isinstance(value, int))}{', or null' if self.optional else ''}, got {value}"
        return None


def _bound_text(bound: Optional[float]) -> str:
    if bound is None:
        return ""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


POSITIVE_COUNT = Interval(low=1)
COUNT = Interval(low=0)
POSITIVE = Interval(low=0, low_open=True)
NON_NEGATIVE = Interval(low=0)
PROBABILITY = Interval(low=0, high=1, high_open=True)


def interval_problems(obj: object, intervals: Mapping[str, Interval], prefix: str = "") -> list[tuple[str, str]]:
    """(prefix + key, message) for every attribute of `obj` outside its interval."""
    problems = []
    for key, interval in intervals.items():
        message = interval.problem(getattr(obj, key))
        if message is not None:
            problems.append((prefix + key, message))
    return problems
