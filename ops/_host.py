"""Array bookkeeping the operators share: numpy or torch CPU in, the same kind out.

Operators take numpy arrays or torch CPU tensors and return the kind they were given; these
helpers allocate, view and validate without copying where the layout allows.
"""
from __future__ import annotations

import inspect
import math
import sys

import numpy as np

from tpp.runtime import arrays

from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError


def host(x, name: str):
    """x as a numpy array or CPU torch tensor (UnsupportedError for other devices). numpy
    arrays and CPU tensors of a type seen before return at once (a tensor's .device costs
    ~0.8 us; .is_cpu ~0.1)."""
    t = type(x)
    if t is np.ndarray or (t in _CPU_TENSOR_TYPES and x.is_cpu):
        return x
    arr = arrays.as_host_array(x, name, "the ops operators (CPU loop nests)")
    if arr is x and arrays.is_torch(x) and t.__module__.startswith("torch"):
        _CPU_TENSOR_TYPES.add(t)     # torch.Tensor, torch.nn.Parameter
    return arr


_CPU_TENSOR_TYPES: set = set()


def reject_unknown(fn, unknown: dict):
    """ArgumentError if `unknown` (the **unknown a public entry point `fn` collected) is not
    empty, naming fn as users call it (ops.matmul, ops.blocked.transpose) and the keywords it
    accepts. The rule every ops entry point follows: a misspelt keyword is never a TypeError."""
    if unknown:
        checks.reject_unknown_call(_public_name(fn), unknown, _parameters(fn))


def _public_name(fn) -> str:
    package = sys.modules.get("ops")
    if package is not None and getattr(package, fn.__name__, None) is fn:
        return f"ops.{fn.__name__}"
    return f"{fn.__module__}.{fn.__qualname__}"


def _parameters(fn) -> tuple:
    """fn's named parameters (positional or keyword), without *args and **kwargs."""
    return tuple(p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def dtype_of(x, name: str) -> _dt.DType:
    try:
        dt = _dt.lookup(x.dtype)
    except Exception:
        dt = None
    if dt not in _dt.FLOAT_DTYPES:
        raise ArgumentError(f"{name}: expected f32, bf16 or f16 data, got {getattr(x, 'dtype', x)}")
    return dt


def empty(shape, dtype: _dt.DType, like):
    """An uninitialised array of the same kind as `like` (numpy array or torch tensor)."""
    if arrays.is_torch(like):
        import torch
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype.torch_name))
    return np.empty(tuple(shape), dtype.numpy)


def zeros(shape, dtype: _dt.DType, like):
    if arrays.is_torch(like):
        import torch
        return torch.zeros(tuple(shape), dtype=getattr(torch, dtype.torch_name))
    return np.zeros(tuple(shape), dtype.numpy)


def contiguous(x):
    """x itself when C-contiguous, else a C-contiguous copy (the nests take dense tensors)."""
    if arrays.is_torch(x):
        return x if x.is_contiguous() else x.contiguous()
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def rows(x, k: int, name: str):
    """x (..., k) as a C-contiguous (M, k) view and the leading shape."""
    shape = tuple(x.shape)
    if len(shape) < 1 or shape[-1] != k:
        raise ArgumentError(f"{name}: expected shape (..., {k}), got {shape}")
    lead = shape[:-1]
    m = 1
    for d in lead:
        m *= d
    x = contiguous(x)
    return x.reshape(m, k), lead


def weight_key(w) -> tuple:
    """What identifies a torch weight's values to a packed copy of it: storage address, version
    counter (in-place writes bump it), dtype, shape and strides. An inference tensor (made
    under torch.inference_mode) has no version counter: its key is new at every call, so its
    packed copy is rebuilt each time rather than trusted after a write it cannot see."""
    if w.is_inference():
        return (w.data_ptr(), object(), w.dtype, w.shape, w.stride())
    return (w.data_ptr(), w._version, w.dtype, w.shape, w.stride())


def finite_number(value, name: str) -> float:
    """A finite real number (not a bool) as a float; ArgumentError otherwise."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ArgumentError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ArgumentError(f"{name} must be finite, got {value!r}")
    return v
