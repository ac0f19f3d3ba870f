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
