"""The executable semantics of every primitive, in numpy.

`run(spec, *inputs)` is the definition a backend is tested against. Inputs are the spec's
input operands (role "in" or "inout") in `spec.operands()` order, as arrays of their logical
shape (any strides). It returns the outputs (role "out" or "inout") in the same order: one
array, or a tuple when there are several.

Values are computed in float64 from the exactly widened inputs, rounded once to f32 (the
computation dtype) and then to the output dtype with round-to-nearest-even, so the reference is
the correctly rounded f32 result of the exact math.
"""
from __future__ import annotations

import math

import numpy as np

from . import dtypes as _dt
from .errors import ArgumentError

_erfc = np.frompyfunc(math.erfc, 1, 1)
_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def erfc(x):
    return _erfc(np.asarray(x, np.float64)).astype(np.float64)


def _phi_cdf(x):
    return 0.5 * erfc(-x * _SQRT_HALF)


def _gelu(x, approximate):
    with np.errstate(all="ignore"):
        if approximate == "tanh":
            # 0.5*x*(1 + tanh(u)) = x*sigmoid(2u), free of cancellation for negative x
            u = _SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)
            return np.where(x == -np.inf, -0.0, x * _sigmoid(2.0 * u))
        y = x * _phi_cdf(x)
        return np.where(x == -np.inf, -0.0, y)


def _gelu_grad(x, approximate):
    with np.errstate(all="ignore"):
        if approximate == "tanh":
            u = _SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)
            du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
            s = _sigmoid(2.0 * u)
            e = np.exp(-2.0 * np.abs(u))
            ds = e / (1.0 + e) ** 2          # s*(1-s) without cancellation
            return s + np.where(np.isinf(x), 0.0, 2.0 * x * ds * du)
        pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        g = _phi_cdf(x) + np.where(np.isinf(x), 0.0, x * pdf)
        return g


def _sigmoid(x):
    with np.errstate(all="ignore"):
        e = np.exp(-np.abs(x))
        return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _expm1(x):
    with np.errstate(all="ignore"):
        return np.expm1(x)


def _div(a, b):
    with np.errstate(all="ignore"):
        return a / b


_MAP = {
    "identity": lambda x, p: x,
    "replicate_col": lambda x, p: x,
    "square": lambda x, p: x * x,
    "sqrt": lambda x, p: _nowarn(np.sqrt, x),
    "rsqrt": lambda x, p: _div(1.0, _nowarn(np.sqrt, x)),
    "reciprocal": lambda x, p: _div(1.0, x),
    "exp": lambda x, p: _nowarn(np.exp, x),
    "negate": lambda x, p: -x,
    "abs": lambda x, p: np.abs(x),
    "increment": lambda x, p: x + 1.0,
    "relu": lambda x, p: np.where(x <= 0, 0.0, x),
    "leaky_relu": lambda x, p: np.where(x > 0, x, p["alpha"] * x),
    "elu": lambda x, p: np.where(x > 0, x, p["alpha"] * _expm1(x)),
    "gelu": lambda x, p: _gelu(x, p["approximate"]),
    "tanh": lambda x, p: np.tanh(x),
    "sigmoid": lambda x, p: _sigmoid(x),
}

_MAP_INV = {
    "relu_inv": lambda g, s, p: np.where(s > 0, g, 0.0),
    "leaky_relu_inv": lambda g, s, p: np.where(s > 0, g, p["alpha"] * g),
    "elu_inv": lambda g, s, p: np.where(s > 0, g, g * (s + p["alpha"])),
    "gelu_inv": lambda g, s, p: g * _gelu_grad(s, p["approximate"]),
    "tanh_inv": lambda g, s, p: g * (1.0 - s * s),
    "sigmoid_inv": lambda g, s, p: g * s * (1.0 - s),
}

_BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": _div,
    "max": np.maximum,
    "min": np.minimum,
}

_COMPARE = {"gt": np.greater, "ge": np.greater_equal, "lt": np.less, "le": np.less_equal,
            "eq": np.equal, "ne": np.not_equal}

_REDUCE = {
    "reduce_sum": lambda x, axis: np.sum(x, axis=axis),
    "reduce_sumsq": lambda x, axis: np.sum(x * x, axis=axis),
    "reduce_max": lambda x, axis: np.max(x, axis=axis),
    "reduce_min": lambda x, axis: np.min(x, axis=axis),
    "reduce_absmax": lambda x, axis: np.max(np.abs(x), axis=axis),
}


def _nowarn(fn, x):
    with np.errstate(all="ignore"):
        return fn(x)


# ---------------------------------------------------------------- the dropout RNG
def _fmix32(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def dropout_bits(seed: int, m: int, n: int) -> np.ndarray:
    """The counter-based random stream of dropout: one uint32 per element (i, j) of an (m, n)
    block, a function of (seed, i*n + j) only (murmur3's finalizer applied twice, the seed's
    low and high words mixed in). Give each block its own seed."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    lo, hi = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
    idx = np.arange(m * n, dtype=np.uint32).reshape(m, n)
    with np.errstate(over="ignore"):
        h = _fmix32((idx * np.uint32(0x9E3779B9)) ^ lo)
        return _fmix32(h ^ hi)


def dropout_threshold(p: float) -> int:
    """An element is kept when its uint32 draw is >= this threshold (probability 1 - p)."""
    return min(int(round(p * 2.0 ** 32)), 2 ** 32 - 1)


def dropout_scale(p: float) -> np.float32:
    return np.float32(1.0 / (1.0 - p))


# ---------------------------------------------------------------- helpers
def pack_mask(bits: np.ndarray) -> np.ndarray:
    """A boolean (m, n) array as the library's bitmask layout (m, ceil(n/8)) uint8."""
    return np.packbits(np.asarray(bits, bool), axis=1, bitorder="little")


def unpack_mask(mask: np.ndarray, n: int) -> np.ndarray:
    """The library's bitmask of an n-column block as a boolean (m, n) array."""
    return np.unpackbits(np.asarray(mask, np.uint8), axis=1, count=n, bitorder="little").astype(bool)


def _widen(arr, operand, m, n):
    """The operand's values as a float64 array broadcastable to (m, n)."""
    a = np.asarray(arr)
    if operand.layout == "row":
        a = a.reshape(1, n)
    elif operand.layout == "col":
        a = a.reshape(m, 1)
    elif operand.layout == "scalar":
        a = a.reshape(1, 1)
    return a.astype(np.float64)


def _round(values, dtype: _dt.DType):
    """Round float64 values to f32 (the computation dtype), then to the output dtype."""
    with np.errstate(all="ignore"):
        return np.asarray(values, np.float64).astype(np.float32).astype(dtype.numpy)


def _check_inputs(spec, inputs):
    names = [o.name for o in spec.operands() if o.role in ("in", "inout")]
    if len(inputs) != len(names):
        raise ArgumentError(f"reference.run({spec.op}) takes {len(names)} inputs "
                            f"({', '.join(names)}), got {len(inputs)}")


def run(spec, *inputs, seed: int | None = None):
    """Compute the outputs of `spec` on `inputs` (see the module docstring). For a BRGEMM the
    inputs are the sequence of stored A blocks, the sequence of stored B blocks (equal length,
    possibly 0; a 3-D array is a sequence), then C when beta=1, then the bias row."""
    _check_inputs(spec, inputs)
    if spec.family == "binary":
        return _run_binary(spec, *inputs)
    if spec.family == "brgemm":
        return _run_brgemm(spec, *inputs)
    info, m, n = spec.info, spec.m, spec.n
    p = dict(spec.params)
    ops = spec.operands()
    out_dt = spec.dtype_out
    if info.kind == "map":
        if spec.op == "zero":
            return np.zeros((m, n), out_dt.numpy)
        x = np.broadcast_to(_widen(inputs[0], ops[0], m, n), (m, n))
        if spec.op == "dropout":
            if seed is None:
                raise ArgumentError("dropout needs a seed")
            keep = dropout_bits(seed, m, n) >= np.uint32(dropout_threshold(p["p"]))
            x32 = x.astype(np.float32)
            y = np.where(keep, x32 * dropout_scale(p["p"]), np.float32(0))
            return _round(y, out_dt), pack_mask(keep)
        y = _round(_MAP[spec.op](x, p), out_dt)
        if spec.op == "relu" and p["bitmask"]:
            return y, pack_mask(x > 0)
        return y
    if info.kind == "map_inv":
        g = np.asarray(inputs[0]).astype(np.float64)
        second = inputs[1]
        if ops[1].layout == "mask":
            keep = unpack_mask(second, n)
            if spec.op == "dropout_inv":
                g32 = g.astype(np.float32)
                return _round(np.where(keep, g32 * dropout_scale(p["p"]), np.float32(0)), out_dt)
            return _round(np.where(keep, g, 0.0), out_dt)
        s = np.asarray(second).astype(np.float64)
        return _round(_MAP_INV[spec.op](g, s, p), out_dt)
    if info.kind == "reduce":
        x = np.asarray(inputs[0]).astype(np.float64)
        with np.errstate(all="ignore"):   # inf - inf in a sum is nan, as in the kernel
            return _round(_REDUCE[spec.op](x, 0 if p["axis"] == 0 else 1), out_dt)
    if info.kind == "transpose":
        return np.ascontiguousarray(np.asarray(inputs[0]).T).astype(out_dt.numpy)
    if info.kind == "vnni2":
        x = np.asarray(inputs[0])
        if m % 2:
            x = np.concatenate([x, np.zeros((1, n), x.dtype)])
        return x.reshape((m + 1) // 2, 2, n).transpose(0, 2, 1).reshape((m + 1) // 2, 2 * n).copy()
    if info.kind == "vnni2_inv":
        x = np.asarray(inputs[0]).reshape((m + 1) // 2, n, 2).transpose(0, 2, 1)
        return x.reshape(-1, n)[:m].copy()
    if info.kind == "gather":
        src, idx = np.asarray(inputs[0]), np.asarray(inputs[1])
        return src[idx].copy()
    if info.kind == "scatter":
        src, idx, dst = (np.asarray(a) for a in inputs)
        out = dst.copy()
        out[idx] = src
        return out
    raise AssertionError(info.kind)


def _run_binary(spec, a, b, *rest):
    m, n = spec.m, spec.n
    ops = spec.operands()
    x = np.broadcast_to(_widen(a, ops[0], m, n), (m, n))
    y = np.broadcast_to(_widen(b, ops[1], m, n), (m, n))
    info = spec.info
    if info.kind == "compare":
        with np.errstate(all="ignore"):
            return pack_mask(_COMPARE[spec.op[4:]](x, y))
    if spec.op == "muladd":
        c = np.asarray(rest[0]).astype(np.float64)
        return _round(c + x * y, spec.dtype_out)
    with np.errstate(all="ignore"):
        return _round(_BINARY[spec.op](x, y), spec.dtype_out)


def _logical_b(spec, blk):
    """One stored B block as the logical (k, n) float64 matrix."""
    blk = np.asarray(blk)
    if spec.vnni_b:
        pairs = blk.reshape(-1, spec.n, 2).transpose(0, 2, 1).reshape(-1, spec.n)
        return pairs[:spec.k].astype(np.float64)
    return (blk.T if spec.trans_b else blk).astype(np.float64)


def _run_brgemm(spec, a_blocks, b_blocks, *rest):
    """act(beta*C + sum_i A_i @ B_i + bias), summed exactly in float64, rounded once to f32 before
    the activation; returns C, or (C, bitmask) for relu with bitmask."""
    if len(a_blocks) != len(b_blocks):
        raise ArgumentError(f"brgemm: {len(a_blocks)} A blocks but {len(b_blocks)} B blocks")
    m, n = spec.m, spec.n
    acc = np.zeros((m, n), np.float64)
    for a, b in zip(a_blocks, b_blocks):
        a = np.asarray(a).astype(np.float64)
        acc += (a.T if spec.trans_a else a) @ _logical_b(spec, b)
    rest = list(rest)
    if spec.beta:
        acc += np.asarray(rest.pop(0)).astype(np.float64)
    if spec.bias:
        acc += np.asarray(rest.pop(0)).astype(np.float64).reshape(1, n)
    x = acc.astype(np.float32).astype(np.float64)
    if spec.activation is None:
        return _round(x, spec.dtype_c)
    params = {"bitmask": spec.bitmask, "approximate": "none"}
    y = _round(_MAP[spec.activation](x, params), spec.dtype_c)
    return (y, pack_mask(x > 0)) if spec.bitmask else y
