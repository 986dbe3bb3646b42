"""The arguments of the ops.norms operators: rows of an (..., n) array, dtypes, parameter
vectors, eps and scale as f32 scalars, saved statistics and `need` tuples, each checked with a
clear ArgumentError (shared by ops.norms and ops.residual_norm)."""
from __future__ import annotations

import numpy as np

from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError

from . import _host

DTYPES = (_dt.F32, _dt.BF16)
MAX_GRAD_COLS = 1 << 16         # an axis-0 reduction keeps n f32 per block (equations' limit)
_SCALARS: dict = {}             # value -> its read-only (1,) f32 array (eps, scale)


def _rows(x, name):
    """(x as a C-contiguous (M, n) array, leading shape, dtype)."""
    x = _host.host(x, name, device=True)
    shape = tuple(x.shape)
    if len(shape) < 1:
        raise ArgumentError(f"{name}: expected an array of shape (..., n), got a 0-d one")
    if shape[-1] < 1:
        raise ArgumentError(f"{name}: the last axis (n) is empty: shape {shape}")
    dt = _dtype(x, name)
    x2, lead = _host.rows(x, shape[-1], name)
    return x2, lead, dt


def _dtype(x, name):
    """x's dtype, f32 or bf16 (tpp.core.dtypes.lookup remembers the dtypes it has seen)."""
    try:
        dt = _dt.lookup(getattr(x, "dtype", None))
    except Exception:   # noqa: BLE001 - any dtype tpp does not know
        dt = None
    if dt not in DTYPES:
        raise ArgumentError(f"{name}: expected f32 or bf16 data, got {x.dtype}")
    return dt


def _vector(v, n, name):
    """v, an (n,) f32 or bf16 array, contiguous; None stays None."""
    if v is None:
        return None
    v = _host.host(v, name, device=True)
    if tuple(v.shape) != (n,):
        raise ArgumentError(f"{name}: expected shape ({n},) (the last axis of x), got "
                            f"{tuple(v.shape)}")
    _dtype(v, name)
    return _host.contiguous(v)


def _param_dtype(weight, bias, dt):
    dts = {_dtype(v, "weight") for v in (weight, bias) if v is not None}
    if len(dts) > 1:
        raise ArgumentError(f"weight and bias must have one dtype, got {sorted(map(str, dts))}")
    return dts.pop() if dts else dt


def _eps(eps, name="eps"):
    value = _host.finite_number(eps, name)      # no bools (numpy's too), no strings
    if value < 0:
        raise ArgumentError(f"{name} must be >= 0, got {eps!r}")
    return value


def _scalar(value):
    got = _SCALARS.get(value)
    if got is None:
        if len(_SCALARS) >= 64:
            _SCALARS.clear()
        got = _SCALARS[value] = np.full(1, value, np.float32)
        got.flags.writeable = False
    return got


def _grad_cols(n, what):
    if n > MAX_GRAD_COLS:
        raise ArgumentError(f"{what}: the parameter gradients are equation reductions over the "
                            f"rows, limited to n <= {MAX_GRAD_COLS} columns; got n = {n}")


def _same_rows(a, like, m, n, name, dt=None):
    """a as (m, n) rows of like's leading shape (it must have x's shape)."""
    a = _host.host(a, name, device=True)
    if tuple(a.shape) != tuple(like.shape):
        raise ArgumentError(f"{name}: expected shape {tuple(like.shape)}, got "
                            f"{tuple(a.shape)}")
    got = _dtype(a, name)
    if dt is not None and got != dt:
        raise ArgumentError(f"{name}: expected {dt} (the dtype of the forward's data), got "
                            f"{got}")
    return _host.contiguous(a).reshape(m, n)


def _stats(s, lead, m, name):
    s = _host.host(s, name, device=True)
    if tuple(s.shape) not in (tuple(lead), (m,)):
        raise ArgumentError(f"{name}: expected shape {tuple(lead)} (x's leading shape), got "
                            f"{tuple(s.shape)}")
    if _host.dtype_of(s, name) != _dt.F32:
        raise ArgumentError(f"{name}: expected f32 statistics, got {s.dtype}")
    return _host.contiguous(s).reshape(m)


def _need(need, count):
    if not isinstance(need, (tuple, list)) or len(need) != count:
        raise ArgumentError(f"need must be a tuple of {count} bools, got {need!r}")
    return tuple(bool(v) for v in need)


ALIGNED_BYTES = 1 << 20     # outputs this big start at a 64-byte boundary (_np_empty)


def _np_empty(shape, dtype, like):
    """np.empty, but at a 64-byte boundary from ALIGNED_BYTES up (_host.np_empty): tpp_cpu's
    equations then stream their block outputs with one non-temporal store per vector instead
    of four 16-byte pieces (numpy promises 16-byte alignment only)."""
    return _host.np_empty(shape, dtype.numpy, ALIGNED_BYTES)
