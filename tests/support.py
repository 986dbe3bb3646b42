"""Shared helpers of the test suite: inputs per op, strided views, the tolerance table.

Both come from the op table (tpp.core.optable), the single place an element-wise op is defined:
inputs are drawn from the op's `domain` with its `specials` mixed in, and the tolerance of an
element-wise op against tpp.core.reference is its `tol` plus one f32 ulp (the table bounds the
kernel's error against the exact math within half an ulp, and the reference is the exact
value rounded once to f32: another half ulp). TOLERANCE holds every op; `_OVERRIDES` the few
whose tests need another value, each with its reason.
"""
from __future__ import annotations

import numpy as np

import tpp

RNG = np.random.default_rng(1234)

_ULP = 2.0 ** -23           # one f32 ulp, relative
_ELEMENTWISE = {info.name: info for info in list(tpp.UNARY_OPS.values()) +
                list(tpp.BINARY_OPS.values()) if info.expr is not None}

# op -> (rtol, atol) of f32 outputs against tpp.core.reference
_OVERRIDES = {
    # the ops without a definition: exact (data movement, max / min) unless listed
    "default": (2 * _ULP, 0.0),
    # the kernel sums in a blocked f32 order, the reference in float64 (then rounds once)
    "reduce_sum": (1e-6, 1e-4),
    "reduce_sumsq": (1e-6, 1e-3),
}
TOLERANCE = {**{name: (info.tol[0] + _ULP, info.tol[1]) for name, info in _ELEMENTWISE.items()},
             **_OVERRIDES}
# extra relative error of rounding the f32 result to a 16-bit output (double rounding: 1 ulp)
_OUT_ROUNDING = {"f32": 0.0, "bf16": 2.0 ** -7, "f16": 2.0 ** -10}


def values(op: str, shape, dtype, *, specials: bool = True, reverse: bool = False) -> np.ndarray:
    """Test inputs of `op` (a gradient: op="grad"): uniform over the op table's `domain` with
    the op's `specials` (reversed for a second operand: other pairs) in the first elements of
    an array big enough to keep most of it ordinary; standard normal * 3 for a gradient and the
    ops without a definition (reductions, data movement)."""
    info = _ELEMENTWISE.get(op)
    if info is None:
        data = RNG.standard_normal(shape) * 3.0
    else:
        data = RNG.uniform(*info.domain, shape)
        flat = data.reshape(-1)
        extra = np.array(info.specials[::-1] if reverse else info.specials, np.float64)
        if specials and flat.size >= 4 * extra.size:
            flat[:extra.size] = extra
    with np.errstate(over="ignore"):            # 3e38 in a 16-bit dtype: inf
        return data.astype(np.float32).astype(tpp.core.dtypes.lookup(dtype).numpy)


def strided(arr: np.ndarray, pad: int) -> np.ndarray:
    """A copy of a 2D array as a view into a wider buffer (ld = cols + pad), margins poisoned."""
    rows, cols = arr.shape
    fill = np.array(np.nan, np.float32).astype(arr.dtype) if arr.dtype.kind == "f" or \
        arr.dtype.name == "bfloat16" else 0
    big = np.full((rows, cols + pad), fill, dtype=arr.dtype)
    big[:, :cols] = arr
    return big[:, :cols]


def out_buffer(shape, dtype, pad: int, sentinel=7.0):
    """An output view (ld = cols + pad) into a buffer filled with a sentinel, and the buffer."""
    rows, cols = shape
    dt = tpp.core.dtypes.lookup(dtype).numpy
    big = np.full((rows + 1, cols + pad), sentinel, dtype=np.float32).astype(dt)
    return big[:rows, :cols], big


def check_margins(big, rows, cols, sentinel=7.0):
    """Nothing outside the [:rows, :cols] window of big was written."""
    s = np.array(sentinel, np.float32).astype(big.dtype)
    assert (big[rows:] == s).all(), "the kernel wrote past the last row"
    assert (big[:rows, cols:] == s).all(), "the kernel wrote past the end of a row"


def assert_matches(got, want, op: str, dtype_out: str):
    rtol, atol = TOLERANCE.get(op, TOLERANCE["default"])
    rtol += _OUT_ROUNDING[tpp.core.dtypes.lookup(dtype_out).name]
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    assert (nan_g == nan_w).all(), f"{op}: nan mismatch at {np.argwhere(nan_g != nan_w)[:5]}"
    finite = ~nan_w
    g, w = g[finite], w[finite]
    inf = np.isinf(w)
    assert (g[inf] == w[inf]).all(), f"{op}: infinities differ"
    g, w = g[~inf], w[~inf]
    if w.size == 0:
        return
    err = np.abs(g - w)
    bound = atol + rtol * np.abs(w)
    bad = err > bound
    assert not bad.any(), (f"{op}: {bad.sum()} of {w.size} elements off; worst got "
                           f"{g[bad][:3]} want {w[bad][:3]} (rtol {rtol:g}, atol {atol:g})")
    norm = np.linalg.norm(w)
    if norm > 0:
        assert np.linalg.norm(g - w) / norm <= max(rtol, 1e-7)


def make_inputs(spec, pad: int = 0):
    """Arrays for the spec's inputs (operand order), blocks as views with ld = cols + pad."""
    arrays = []
    for op in spec.operands():
        if op.role != "in":
            continue
        if op.layout == "mask":
            arrays.append(RNG.integers(0, 256, (op.rows, op.cols), dtype=np.uint8))
            continue
        if op.layout == "index":
            arrays.append(RNG.integers(0, spec.m + 3, op.cols).astype(np.int64))
            continue
        value_op = "grad" if op.name == "grad" else spec.op   # x, y: the op's own range
        rows = spec.m + 3 if op.rows == -1 else op.rows    # gather's source has spare rows
        shape = {"block": (rows, op.cols), "row": (op.cols,), "col": (op.rows,),
                 "scalar": ()}[op.layout]
        data = values(value_op, shape, op.dtype.name, reverse=op.name == "in1")
        if op.layout == "block" and pad:
            data = strided(data, pad)
        arrays.append(data)
    return arrays


def run_checked(kernel, pad_out: int = 0, pad_in: int = 0, seed=None):
    """Call kernel on generated inputs with a sentinel-bordered out; check against the reference."""
    spec = kernel.spec
    inputs = make_inputs(spec, pad_in)
    outs = [o for o in spec.operands() if o.role != "in"]
    kwargs = {}
    bigs = {}
    for o in outs:
        if o.layout == "block":
            view, big = out_buffer((o.rows, o.cols), o.dtype.name, pad_out)
            if o.role == "inout":
                view[...] = values(spec.op, view.shape, o.dtype.name)
                inputs.append(view.copy())
            kwargs[o.name], bigs[o.name] = view, big
    if seed is not None:
        kwargs["seed"] = seed
    got = kernel(*inputs[:len(kernel.input_names)], **kwargs)
    want = tpp.core.reference.run(spec, *inputs, **({"seed": seed} if seed is not None else {}))
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for o, g, w in zip(outs, got, want):
        if o.layout == "mask":
            np.testing.assert_array_equal(g, w, err_msg=f"{spec.op}: bitmask differs")
        else:
            assert_matches(g, w, spec.op, o.dtype.name)
        if o.name in bigs:
            check_margins(bigs[o.name], o.rows, o.cols)
    return got


def sixteen_lane_code(monkeypatch):
    """Make the CPU backend generate 16-lane (AVX-512 width) code for the rest of a test: the
    host's own target where it has AVX-512, else 16-lane IR compiled for the host (LLVM
    splits each vector in two). Returns the target."""
    from tpp_cpu import backend, target
    host = target.current()       # as TPP_CPU_ISA chooses
    if host.lanes == 16:
        return host
    wide = target.Target("w16-on-" + host.isa, 16, True, host.host, features=host.features)
    monkeypatch.setattr(backend, "current", lambda: wide)
    return wide
