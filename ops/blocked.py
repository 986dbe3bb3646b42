"""Whole-matrix element-wise, transpose and column-sum operations, as parallel nests of TPPs.

Each function runs one compiled nest over a 2-D (M, N) matrix. The row count M is a size of the
nest (tpp.size), given by the arrays at call time, so one nest serves every M: map_rows and
column_sums compile once per (op, N, dtypes), never per M. Rows go in blocks of ROWS rows, and
the rows past the last full block in pieces of PIECE rows and then single rows (`row_blocks`):
three kernels cover any M, the choice among them made at run time. transpose compiles per
(M, N): its output's row stride is M, and a kernel's leading dimensions are compile-time.
Inputs and outputs are C-contiguous numpy arrays or torch CPU tensors, or device arrays (torch
CUDA tensors, cupy, anything with `__cuda_array_interface__`): the nests then run on their
device (all arrays of a call on one device, else an ArgumentError).

    map_rows("gelu", [z], y)                  # y = gelu(z)
    map_rows("gelu_inv", [dy, z], dz)         # unary ops with a second input (backward)
    map_rows("add", [a, b], out)              # binary ops
    transpose(x, out)                         # out (N, M) = x.T
    column_sums(x, out)                       # out (N,) = x.sum(axis=0)
"""
from __future__ import annotations

import functools

import numpy as np

import tpp
from tpp.runtime import arrays
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError
from tpp.runtime.lru import also_clear

from . import _host

ROWS = 64
COLS = 64
PIECE = 8                    # rows of the middle remainder kernel (row_blocks)
_SERIAL_ELEMENTS = 1 << 16   # smaller matrices run on one thread: waking the team costs more


def _threads(m, n):
    return 1 if m * n < _SERIAL_ELEMENTS else None


def split(total, block):
    """How a loop over the blocks of `total` elements (an int), `block` at a time, meets them:
    ([(block size, guard builder)], block count). A guard builder takes the loop variable and
    returns the `when=` conditions selecting that size: the full blocks, then the tail."""
    full, tail = divmod(total, block)
    cases = []
    if full:
        cases.append((block, (lambda v: (v < full,)) if tail else (lambda v: ())))
    if tail:
        cases.append((tail, lambda v: (v == full,)))
    return cases, full + (tail > 0)


def row_blocks(m, bm: int, pieces=(PIECE,)):
    """How a nest meets the rows of a runtime row count m (a tpp.size expression) in blocks of
    bm: (loop, levels, cases). `loop` runs over the rows (Loop(0, m, 1, blocks=...)) and
    appears `levels` times in the order string (the first, bm at a time, is the one to make
    parallel); each case is (rows, guard builder): the guard builder takes the loop's value r,
    a row, and gives the when= conditions under which a kernel of `rows` rows starts at r.
    Full blocks of bm rows, then the rows past them in pieces of each size of `pieces`
    (descending; each used when the size before it is a multiple of it), then single rows:
    every row is covered exactly once, by at most one kernel of each size, whatever m is
    (0 included)."""
    steps = [bm]
    for piece in pieces:
        if 1 < piece < steps[-1] and steps[-1] % piece == 0:
            steps.append(piece)
    if bm > 1:
        steps.append(1)
    loop = tpp.Loop(0, m, steps[-1], blocks=tuple(steps[:-1]))
    cases = []
    for k, rows in enumerate(steps):
        def guard(r, k=k, rows=rows):
            conds = []
            if k + 1 < len(steps):    # an aligned start with the whole piece before m
                conds += [r - r // rows * rows == 0, r + rows <= m]
            if k > 0:                 # past the rows the bigger pieces cover
                conds.append(r >= m // steps[k - 1] * steps[k - 1])
            return tuple(conds)
        cases.append((rows, guard))
    return loop, len(steps), cases


@functools.lru_cache(maxsize=256)
def _map_nest(op, family, n, dtypes_in, dtype_out, params):
    m = tpp.size("M")
    loop, levels, cases = row_blocks(m, ROWS)
    nest = tpp.LoopNest("A" + "a" * (levels - 1), a=loop)
    r, = nest.vars
    ins = [nest.tensor(f"in{k}", (m, n), dt) for k, dt in enumerate(dtypes_in)]
    out = nest.tensor("out", (m, n), dtype_out)
    for rows, guard in cases:
        if family == "binary":
            spec = tpp.make_binary(op, rows, n, dtype_in0=dtypes_in[0], dtype_in1=dtypes_in[1],
                                   dtype_out=dtype_out, **dict(params))
        else:
            spec = tpp.make_unary(op, rows, n, dtype_in=dtypes_in[0], dtype_out=dtype_out,
                                  **dict(params))
        nest.call(spec, *[t[r] for t in ins], out[r], when=guard(r))
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
    if n == 0:
        return out
    dts = tuple(_dtype(x) for x in inputs)
    nest = _map_nest(op, family, n, dts, _dtype(out), tuple(sorted(params.items())))
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
    """out (N, M) = x.T for x (M, N) (compiled per (M, N): see the module docstring)."""
    _host.reject_unknown(transpose, unknown)
    m, n = _shape2(x, "x")
    if _output(out) != (n, m):
        raise ArgumentError(f"out: expected shape {(n, m)}, got {tuple(out.shape)}")
    if m and n:
        _transpose_nest(m, n, _dtype(x))(x, out, threads=_threads(m, n))
    return out


@functools.lru_cache(maxsize=256)
def _colsum_nest(n, dtype, dtype_out):
    """out[j] = sum_i x[i, j] as BRGEMMs of a ones row (1 x 1) by each row of x (1 x cols),
    M of them in one call (count = M, stride_a = 0): f32 sums in registers, any M, one
    rounding to the output dtype."""
    m = tpp.size("M")
    cases, blocks = split(n, COLS)
    nest = tpp.LoopNest("A", a=blocks)
    a, = nest.vars
    ones = nest.tensor("ones", (1,), dtype)
    x = nest.tensor("x", (m, n), dtype)
    out = nest.tensor("out", (n,), dtype_out)
    for cols, cond in cases:
        spec = tpp.make_brgemm(1, cols, 1, lda=1, ldb=n, ldc=n, dtype_a=dtype, dtype_b=dtype,
                               dtype_c=dtype_out)
        nest.call(spec, ones[0], x[0, a * COLS], out[a * COLS], count=m, stride_a=0,
                  stride_b=n, when=cond(a))
    return nest.compile()


also_clear(_colsum_nest.cache_clear)   # tpp.clear_caches() empties it too


@functools.lru_cache(maxsize=None)
def _ones(dtype: _dt.DType):
    ones = np.ones(1, dtype.numpy)
    ones.flags.writeable = False
    return ones


def column_sums(x, out, **unknown):
    """out (N,) = x.sum(axis=0) for x (M, N); out f32 or x's dtype."""
    _host.reject_unknown(column_sums, unknown)
    m, n = _shape2(x, "x")
    arrays.check_output_tensor(out, "out")
    shape = tuple(_host.host(out, "out", device=True).shape)
    if shape != (n,):
        raise ArgumentError(f"out: expected shape {(n,)}, got {shape}")
    if n:
        dt = _dtype(x)
        ones = _host.constant(1.0, dt, x) if _host.on_device(x) else _ones(dt)
        _colsum_nest(n, dt, _dtype(out))(ones, x, out, threads=_threads(m, n))
    return out


def _output(out):
    """out's (M, N) shape; ArgumentError if it is not 2-D or a torch tensor that autograd
    would have to see written."""
    arrays.check_output_tensor(out, "out")
    return _shape2(out, "out")


def _shape2(x, name):
    """x's (M, N) shape; ArgumentError if x is not a 2-D array (host or device)."""
    shape = tuple(_host.host(x, name, device=True).shape)
    if len(shape) != 2:
        raise ArgumentError(f"{name}: expected a 2-D array, got shape {shape}")
    return shape


def _dtype(x):
    return _host.dtype_of(x, "array")
