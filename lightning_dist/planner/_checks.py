"""Argument checks shared by the planner's formulas: each names the value and what it must be."""

from __future__ import annotations

import math
from typing import Any


def check_count(name: str, value: Any, *, minimum: float = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"`{name}={value!r}` must be a number >= {minimum}.")


def check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}={value!r}` must be an integer >= 1.")


def check_zero_stage(zero_stage: Any) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"`zero_stage={zero_stage!r}` must be 0 (replicate), 1, 2 or 3.")


def check_divides(what: str, part: int, whole: int, whole_name: str = "world_size") -> None:
    if whole % part:
        divisors = [d for d in range(1, whole + 1) if whole % d == 0]
        raise ValueError(f"`{what}={part}` does not divide {whole_name}={whole}; pick one of {divisors}.")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
