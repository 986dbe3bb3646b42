"""Whole-matrix element-wise, transpose and column-sum operations, as parallel nests of TPPs.

Each function runs one compiled nest over a 2-D (M, N) matrix cut into blocks of ROWS rows
(and COLS columns where it matters); the last block takes the remainder with a kernel of its
own size. Inputs and outputs are C-contiguous numpy arrays or torch CPU tensors.

    map_rows("gelu", [z], y)                  # y = gelu(z)
    map_rows("gelu_inv", [dy, z], dz)         # unary ops with a second input (backward)
    map_rows("add", [a, b], out)              # binary ops
    transpose(x, out)                         # out (N, M) = x.T
    column_sums(x, out)                       # out (N,) = x.sum(axis=0)
"""
from __future__ import annotations

import functools

import tpp
from tpp import arrays
from tpp.errors import ArgumentError
from tpp.lru import also_clear

from . import _host

ROWS = 64
COLS = 64
_SERIAL_ELEMENTS = 1 << 16   # smaller matrices run on one thread: waking the team costs more


def _threads(m, n):
    return 1 if m * n < _SERIAL_ELEMENTS else None


def split(total, block):
    """How a loop over the blocks of `total` elements, `block` at a time, meets them:
    ([(block size, guard builder)], block count). A guard builder takes the loop variable and
    returns the `when=` conditions selecting that size: the full blocks, then the tail."""
    full, tail = divmod(total, block)
    cases = []
    if full:
        cases.append((block, (lambda v: (v < full,)) if tail else (lambda v: ())))
    if tail:
        cases.append((tail, lambda v: (v == full,)))
    return cases, full + (tail > 0)


@functools.lru_cache(maxsize=256)
def _map_nest(op, family, m, n, dtypes_in, dtype_out, params):
    cases, blocks = split(m, ROWS)
    nest = tpp.LoopNest("A", a=blocks)
    a, = nest.vars
    ins = [nest.tensor(f"in{k}", (m, n), dt) for k, dt in enumerate(dtypes_in)]
    out = nest.tensor("out", (m, n), dtype_out)
    for rows, cond in cases:
        if family == "binary":
            spec = tpp.make_binary(op, rows, n, dtype_in0=dtypes_in[0], dtype_in1=dtypes_in[1],
                                   dtype_out=dtype_out, **dict(params))
        else:
            spec = tpp.make_unary(op, rows, n, dtype_in=dtypes_in[0], dtype_out=dtype_out,
                                  **dict(params))
        nest.call(spec, *[t[a * ROWS] for t in ins], out[a * ROWS], when=cond(a))
    return nest.compile()


also_clear(_map_nest.cache_clear)   # tpp.clear_caches() empties it too


def map_rows(op, inputs, out, **params):
    """out = op(*inputs) over whole matrices (unary ops, their *_inv backward, binary ops);
    inputs a list or tuple of arrays; params the op's parameters (tpp.unary's keywords)."""
    if not isinstance(inputs, (list, tuple)):
        raise ArgumentError(f"inputs: expected a list of arrays, got {type(inputs).__name__}")
    family = "binary" if op in tpp.BINARY_OPS else "unary"
    m, n = _output(out)
    for k, x in enumerate(inputs):
        if _shape2(x, f"input {k}") != (m, n):
            raise ArgumentError(f"input {k}: shape {tuple(x.shape)}, out is {(m, n)}")
    dts = tuple(_dtype(x) for x in inputs)
    nest = _map_nest(op, family, m, n, dts, _dtype(out), tuple(sorted(params.items())))
    nest(*inputs, out, threads=_threads(m, n))
    return out


@functools.lru_cache(maxsize=256)
def _transpose_nest(m, n, dtype):
    rcases, rblocks = split(m, ROWS)
    ccases, cblocks = split(n, COLS)
    nest = tpp.LoopNest("AB", a=rblocks, b=cblocks)
    a, b = nest.vars
    x = nest.tensor("x", (m, n), dtype)
    out = nest.tensor("out", (n, m), dtype)
    for rows, rc in rcases:
        for cols, cc in ccases:
            spec = tpp.make_unary("transpose", rows, cols, ldi=n, ldo=m, dtype_in=dtype)
            nest.call(spec, x[a * ROWS, b * COLS], out[b * COLS, a * ROWS], when=rc(a) + cc(b))
    return nest.compile()


also_clear(_transpose_nest.cache_clear)   # tpp.clear_caches() empties it too


def transpose(x, out, **unknown):
    """out (N, M) = x.T for x (M, N)."""
    _host.reject_unknown(transpose, unknown)
    m, n = _shape2(x, "x")
    if _output(out) != (n, m):
        raise ArgumentError(f"out: expected shape {(n, m)}, got {tuple(out.shape)}")
    _transpose_nest(m, n, _dtype(x))(x, out, threads=_threads(m, n))
    return out


@functools.lru_cache(maxsize=256)
def _colsum_nest(m, n, dtype, dtype_out):
    cases, blocks = split(n, COLS)
    nest = tpp.LoopNest("A", a=blocks)
    a, = nest.vars
    x = nest.tensor("x", (m, n), dtype)
    out = nest.tensor("out", (n,), dtype_out)
    for cols, cond in cases:
        spec = tpp.make_unary("reduce_sum", m, cols, ldi=n, dtype_in=dtype, dtype_out=dtype_out,
                              axis=0)
        nest.call(spec, x[0, a * COLS], out[a * COLS], when=cond(a))
    return nest.compile()


also_clear(_colsum_nest.cache_clear)   # tpp.clear_caches() empties it too


def column_sums(x, out, **unknown):
    """out (N,) = x.sum(axis=0) for x (M, N); out f32 or x's dtype."""
    _host.reject_unknown(column_sums, unknown)
    m, n = _shape2(x, "x")
    arrays.check_output_tensor(out, "out")
    shape = tuple(_host.host(out, "out").shape)
    if shape != (n,):
        raise ArgumentError(f"out: expected shape {(n,)}, got {shape}")
    _colsum_nest(m, n, _dtype(x), _dtype(out))(x, out, threads=_threads(m, n))
    return out


def _output(out):
    """out's (M, N) shape; ArgumentError if it is not 2-D or a torch tensor that autograd
    would have to see written."""
    arrays.check_output_tensor(out, "out")
    return _shape2(out, "out")


def _shape2(x, name):
    """x's (M, N) shape; ArgumentError if x is not a 2-D host array."""
    shape = tuple(_host.host(x, name).shape)
    if len(shape) != 2:
        raise ArgumentError(f"{name}: expected a 2-D array, got shape {shape}")
    return shape


def _dtype(x):
    return _host.dtype_of(x, "array")
