"""The numbers a layout rule's fix proposes: a count's divisors and the multiples near a value."""

from __future__ import annotations

from typing import List


def nearby_multiples(value: int, step: int, count: int = 2) -> List[int]:
    """The ``count`` multiples of ``step`` just below and above ``value`` (positive only)."""
    below = [(value // step - i) * step for i in range(count)]
    above = [(value // step + 1 + i) * step for i in range(count)]
    return sorted({v for v in below + above if v > 0})


def divisors(n: int) -> List[int]:
    """The divisors of ``n`` (positive), ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_multiple(value: int, step: int) -> int:
    """The positive multiple of ``step`` nearest ``value`` (the larger on a tie): a fix's one concrete value."""
    return max(step, min(nearby_multiples(value, step, 1), key=lambda v: (abs(v - value), -v)))


def nearest_divisor(n: int, target: int) -> int:
    """The divisor of ``n`` nearest ``target`` (the smaller on a tie): a fix's one concrete value."""
    return min(divisors(n), key=lambda d: (abs(d - target), d))
