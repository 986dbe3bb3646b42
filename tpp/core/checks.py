"""Argument rules shared by every public entry point: integers and unknown keywords.

- Sizes, lds, counts and thread numbers are any integral value (`int`, `numpy.int64`, anything
  `operator.index` accepts) except `bool`, and come back as a Python int: all bounds arithmetic
  done on them afterwards is exact (no int64 wrap-around).
- An unknown keyword argument is a TPPError naming the entry point, the word and the accepted
  ones: SpecError where a primitive or nest is described, ArgumentError where one is called.
- Memory a description can address is bounded: a block, a tensor or a loop value spans at most
  ADDRESS_LIMIT bytes (the x86-64 user address space), so a spec that passes never makes the
  generated int64 address arithmetic wrap around.
- Thread counts are 1..MAX_THREADS (the OpenMP runtime aborts the process on absurd counts).
"""
from __future__ import annotations

import functools
import inspect
import operator

from .errors import ArgumentError, SpecError

ADDRESS_LIMIT = 2 ** 47          # bytes: the x86-64 user address space (47-bit addresses)
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
MAX_THREADS = 1024               # the most threads a parallel loop nest runs on


def as_int(value) -> int | None:
    """value as a Python int if it is integral (anything operator.index accepts, bool is not),
    else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def positive_ints(values) -> tuple | None:
    """values (a tuple, list or other iterable of integral values, each >= 1) as a tuple of
    Python ints, or None if it is not one."""
    try:
        ints = tuple(as_int(v) for v in values)
    except TypeError:
        return None
    return None if any(v is None or v < 1 for v in ints) else ints


def integer(value, what: str, *, minimum: int | None = None, maximum: int | None = None,
            error=SpecError) -> int:
    """value as a Python int; `error` if it is not integral (bool is not) or out of range."""
    converted = as_int(value)
    if converted is None:
        raise error(f"{what} must be an int, got {value!r}")
    value = converted
    if minimum is not None and value < minimum:
        raise error(f"{what} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{what} must be <= {maximum}, got {value}")
    return value


def addressable(nbytes: int, what: str, error=SpecError) -> int:
    """nbytes (an exact int) if a span of that many bytes fits in ADDRESS_LIMIT, else `error`
    naming `what` (the block, tensor or range that spans it)."""
    if nbytes > ADDRESS_LIMIT:
        raise error(f"{what} spans {nbytes} bytes, more than the {ADDRESS_LIMIT} (2**47) bytes "
                    f"a process can address")
    return nbytes


def fits_int64(lo: int, hi: int) -> bool:
    """Whether every integer in [lo, hi] is an int64."""
    return INT64_MIN <= lo and hi <= INT64_MAX


def thread_count(value, what: str) -> int:
    """value as a Python int in 1..MAX_THREADS, else an ArgumentError naming `what`."""
    n = as_int(value)
    if n is None or not 1 <= n <= MAX_THREADS:
        raise ArgumentError(f"{what} must be a positive int of at most {MAX_THREADS} "
                            f"(tpp.core.checks.MAX_THREADS), got {value!r}")
    return n


@functools.lru_cache(maxsize=None)
def keywords_of(fn) -> tuple:
    """The names of fn's keyword-only parameters (what reject_unknown lists as accepted)."""
    return tuple(p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY)


def reject_unknown(where: str, unknown: dict, accepted, error=SpecError):
    """Raise `error` if `unknown` (the **kwargs a function did not name) is not empty."""
    if unknown:
        words = ", ".join(repr(k) for k in sorted(unknown))
        raise error(f"{where}: unknown keyword argument(s) {words}; accepted: "
                    f"{', '.join(sorted(accepted))}")


def reject_unknown_call(where: str, unknown: dict, accepted):
    """reject_unknown for the call of a built object (an ArgumentError)."""
    reject_unknown(where, unknown, accepted, ArgumentError)
