"""numpy renderings of the expression IR: the exact reference, and an f32 emulator.

`evaluate(outputs, m, n, inputs=..., params=..., masks=..., seed=..., mode=...)` returns one
numpy array per output, of the output's shape class as a 2-D array ((m, n) block, (1, n) row,
(m, 1) col, (1, 1) scalar).

mode="exact" (the reference): f32 nodes are computed in float64 from exactly widened inputs,
named transcendentals by their exact float64 meaning (`tpp.core.mathlib`), with no rounding except
at `round_f32` nodes; callers round the results once to f32. mode="f32": every f32 node rounds
to float32 as the compiled code does, and transcendentals run their expansion (an emulator of
what the backends render: the same bits as the CPU code except where double rounding of an fma
differs, which is rare).
"""
from __future__ import annotations

import numpy as np

from . import expr as X
from . import mathlib
from .errors import ArgumentError

_U32 = np.uint32


def _shape2(shape, m, n):
    return {"block": (m, n), "row": (1, n), "col": (m, 1), "scalar": (1, 1)}[shape]


def evaluate(outputs, m: int, n: int, *, inputs=None, params=None, masks=None, seed=None,
             mode: str = "exact") -> list:
    if mode not in ("exact", "f32"):
        raise ArgumentError(f"mode must be 'exact' or 'f32', got {mode!r}")
    inputs, params, masks = inputs or {}, params or {}, masks or {}
    ftype = np.float64 if mode == "exact" else np.float32
    values: dict = {}
    outputs = list(outputs)
    if mode == "f32":
        outputs = expand_prims(outputs)
    for nd in X.topological(outputs):
        values[nd] = _eval(nd, values, m, n, inputs, params, masks, seed, ftype, mode)
    return [np.broadcast_to(values[o], _shape2(o.shape, m, n)) for o in outputs]


def expand_prims(outputs) -> list:
    """The outputs with every transcendental replaced by its expansion (where it has one)."""
    mapping = {}
    for nd in X.topological(outputs):
        if nd.op == "prim":
            p = mathlib.PRIMS[nd.attr[0]]
            if p.expand is not None:
                mapping[nd] = expand_prims([p.expand(*nd.args)])[0]
    return X.substitute(outputs, mapping) if mapping else outputs


def _to_f(values, ftype):
    return np.asarray(values).astype(ftype)


def _eval(nd, v, m, n, inputs, params, masks, seed, ftype, mode):
    op, a = nd.op, [v[x] for x in nd.args]
    with np.errstate(all="ignore"):
        if op == "input":
            name = nd.attr[0]
            if name not in inputs:
                raise ArgumentError(f"missing input {name!r}")
            arr = np.asarray(inputs[name])
            try:
                arr = arr.reshape(_shape2(nd.shape, m, n)) if nd.shape != "block" else arr
                arr = np.broadcast_to(arr, _shape2(nd.shape, m, n))
            except ValueError:
                raise ArgumentError(f"input {name!r} of shape {np.shape(inputs[name])} does not "
                                    f"fit a {nd.shape} of an ({m}, {n}) block") from None
            return _to_f(arr.astype(np.float32) if mode == "f32" else arr, ftype)
        if op == "param":
            name = nd.attr[0]
            if name not in params:
                raise ArgumentError(f"missing scalar parameter {name!r}")
            return np.full((1, 1), np.float32(params[name]), ftype)
        if op == "const":
            return np.full((1, 1), X.const_value(nd), ftype)
        if op == "extent":
            return np.full((1, 1), (m, n)[nd.attr[0]], ftype)
        if op == "iconst":
            return np.full((1, 1), nd.attr[0] & 0xFFFFFFFF, _U32)
        if op == "index":
            which = nd.attr[0]
            if which == "flat":
                return (np.arange(m * n, dtype=np.uint64).reshape(m, n) & 0xFFFFFFFF).astype(_U32)
            if which == "row":
                return np.arange(m, dtype=_U32).reshape(m, 1)
            return np.arange(n, dtype=_U32).reshape(1, n)
        if op == "seed":
            if seed is None:
                raise ArgumentError("this expression needs a seed")
            s = int(seed) & 0xFFFFFFFFFFFFFFFF
            return np.full((1, 1), (s >> (32 * nd.attr[0])) & 0xFFFFFFFF, _U32)
        if op == "maskbit":
            name = nd.attr[0]
            if name not in masks:
                raise ArgumentError(f"missing bitmask {name!r}")
            return np.broadcast_to(np.asarray(masks[name], bool), _shape2(nd.shape, m, n))
        if op in ("add", "sub", "mul", "div"):
            x, y = a
            r = {"add": np.add, "sub": np.subtract, "mul": np.multiply,
                 "div": np.divide}[op](x, y)
            return r.astype(ftype)
        if op == "fma":
            x, y, z = a
            if mode == "exact":
                return x * y + z
            return (x.astype(np.float64) * y + z).astype(np.float32)
        if op == "min":
            return np.minimum(*a)
        if op == "max":
            return np.maximum(*a)
        if op == "neg":
            return -a[0]
        if op == "abs":
            return np.abs(a[0])
        if op == "sqrt":
            return np.sqrt(a[0])
        if op == "round_f32":
            return a[0].astype(np.float32).astype(ftype)
        if op in X.COMPARES:
            x, y = a
            return {"lt": np.less, "le": np.less_equal, "gt": np.greater,
                    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}[op](x, y)
        if op == "select":
            return np.where(*a)
        if op == "and":
            return np.logical_and(*a)
        if op == "or":
            return np.logical_or(*a)
        if op == "not":
            return np.logical_not(a[0])
        if op == "bits":
            return np.asarray(a[0]).astype(np.float32).view(_U32)
        if op == "fbits":
            return np.ascontiguousarray(a[0], _U32).view(np.float32).astype(ftype)
        if op in ("iadd", "isub", "imul", "iand", "ior", "ixor"):
            x, y = (np.asarray(t, np.uint64) for t in a)
            r = {"iadd": x + y, "isub": x - y, "imul": x * y, "iand": x & y, "ior": x | y,
                 "ixor": x ^ y}[op]
            return (r & 0xFFFFFFFF).astype(_U32)
        if op in ("shl", "lshr"):
            x, k = np.asarray(a[0], np.uint64), np.asarray(a[1], np.uint64) & 31
            r = (x << k) if op == "shl" else (x >> k)
            return (r & 0xFFFFFFFF).astype(_U32)
        if op == "inot":
            return ~a[0]
        if op == "islt":
            return a[0].view(np.int32) < a[1].view(np.int32)
        if op == "iuge":
            return a[0] >= a[1]
        if op == "prim":
            p = mathlib.PRIMS[nd.attr[0]]
            if mode == "exact":
                return p.exact(*a)
            return p.exact(*(t.astype(np.float64) for t in a)).astype(np.float32)
        if op in X.REDUCTIONS:
            axis = nd.attr[0]
            x = np.broadcast_to(a[0], _shape2(nd.args[0].shape, m, n))
            fn = {"rsum": np.sum, "rmax": np.max, "rmin": np.min}[op]
            if x.shape[axis] == 0:
                ident = {"rsum": 0.0, "rmax": -np.inf, "rmin": np.inf}[op]
                return np.full(_shape2(nd.shape, m, n), ident, ftype)
            return fn(x, axis=axis, keepdims=True).astype(ftype)
    raise AssertionError(f"no numpy rendering of {op!r}")
