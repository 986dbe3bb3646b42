"""The dtype table: the element types a primitive's operands may have.

Inputs and outputs are f32, bf16 (round-to-nearest-even, through ml_dtypes in numpy and
torch.bfloat16 in torch) or f16; computation is f32. Index operands are i64 and bitmasks
are bytes, but those are fixed by the op, not chosen by the user.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import SpecError


@dataclass(frozen=True)
class DType:
    name: str          # canonical short name used in specs: "f32", "bf16", ...
    numpy: np.dtype    # numpy dtype holding the values
    itemsize: int
    torch_name: str    # attribute of the torch module, e.g. "bfloat16"

    def __repr__(self) -> str:
        return self.name


F32 = DType("f32", np.dtype(np.float32), 4, "float32")
BF16 = DType("bf16", np.dtype(ml_dtypes.bfloat16), 2, "bfloat16")
F16 = DType("f16", np.dtype(np.float16), 2, "float16")
I64 = DType("i64", np.dtype(np.int64), 8, "int64")
U8 = DType("u8", np.dtype(np.uint8), 1, "uint8")

FLOAT_DTYPES = (F32, BF16, F16)
# the smallest magnitude that rounds to an f32 infinity (to nearest even: halfway between the
# largest finite f32, (2 - 2**-23) * 2**127, and 2**128)
F32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103


def overflows_f32(value: float) -> bool:
    """Whether a finite number becomes an infinity in f32 (a parameter that would silently
    turn into inf: callers refuse it; inf and nan themselves are values f32 holds)."""
    return math.isfinite(value) and abs(value) >= F32_OVERFLOW
"""The dtypes a user may choose for data operands."""

_BY_KEY: dict = {}
for _d in (F32, BF16, F16, I64, U8):
    _BY_KEY[_d.name] = _d
    _BY_KEY[_d.numpy] = _d
    _BY_KEY[_d.torch_name] = _d
_ALIASES = {"float32": F32, "float": F32, "bfloat16": BF16, "float16": F16, "half": F16,
            "int64": I64, "uint8": U8}
_BY_KEY.update(_ALIASES)


_SEEN: dict = {}            # numpy / torch dtype -> its DType, for those looked up before
_SEEN_TYPES: set = set()    # the types of the values in _SEEN


def lookup(value) -> DType:
    """Return the DType named by a string, a numpy dtype/type or a torch dtype."""
    if isinstance(value, DType):
        return value
    seen = _SEEN.get(value) if type(value) in _SEEN_TYPES else None
    if seen is not None:        # an operator's every call asks: ~0.2 us instead of ~2
        return seen
    key = value
    if isinstance(value, str):
        key = value.lower()
    elif not isinstance(value, np.dtype):
        mod = type(value).__module__
        if mod.startswith("torch"):
            key = str(value).split(".")[-1]
        else:
            try:
                key = np.dtype(value)
            except TypeError:
                key = value
    try:
        found = _BY_KEY[key]
    except (KeyError, TypeError):
        raise SpecError(f"unknown dtype {value!r}: expected one of f32, bf16, f16") from None
    if _remembers(value) and len(_SEEN) < 64:
        _SEEN[value] = found
    return found


def _remembers(value) -> bool:
    """Whether lookup may remember value: a numpy dtype or a torch dtype (hashable, and
    equal only to the same dtype), not a string or a Python type."""
    t = type(value)
    if t.__module__.startswith("torch") or isinstance(value, np.dtype):
        _SEEN_TYPES.add(t)
        return True
    return False


def float_dtype(value, what: str) -> DType:
    """Like lookup, but only the data dtypes f32/bf16/f16 are accepted."""
    dt = lookup(value)
    if dt not in FLOAT_DTYPES:
        raise SpecError(f"{what}: expected one of f32, bf16, f16, got {value!r}")
    return dt
