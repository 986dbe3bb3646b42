"""Argument rules shared by every public entry point: integers and unknown keywords.

- Sizes, lds, counts and thread numbers are any integral value (`int`, `numpy.int64`, anything
  `operator.index` accepts) except `bool`, and come back as a Python int: all bounds arithmetic
  done on them afterwards is exact (no int64 wrap-around).
- An unknown keyword argument is a TPPError naming the entry point, the word and the accepted
  ones: SpecError where a primitive or nest is described, ArgumentError where one is called.
"""
from __future__ import annotations

import operator

from .errors import ArgumentError, SpecError


def integer(value, what: str, *, minimum: int | None = None, maximum: int | None = None,
            error=SpecError) -> int:
    """value as a Python int; `error` if it is not integral (bool is not) or out of range."""
    if isinstance(value, bool):
        raise error(f"{what} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise error(f"{what} must be an int, got {value!r}") from None
    if minimum is not None and value < minimum:
        raise error(f"{what} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{what} must be <= {maximum}, got {value}")
    return value


def reject_unknown(where: str, unknown: dict, accepted, error=SpecError):
    """Raise `error` if `unknown` (the **kwargs a function did not name) is not empty."""
    if unknown:
        words = ", ".join(repr(k) for k in sorted(unknown))
        raise error(f"{where}: unknown keyword argument(s) {words}; accepted: "
                    f"{', '.join(sorted(accepted))}")


def reject_unknown_call(where: str, unknown: dict, accepted):
    """reject_unknown for the call of a built object (an ArgumentError)."""
    reject_unknown(where, unknown, accepted, ArgumentError)
