"""LayerNorm, RMSNorm, softmax and bias + activation + dropout from TPP equations, forward and
backward, in compiled loop nests over row blocks.

    y = ops.layer_norm(x, weight, bias, eps=1e-5)              # over the last axis
    y, mean, rstd = ops.layer_norm_forward(x, weight, bias)   # keeps what the backward needs
    dx, dweight, dbias = ops.layer_norm_backward(dy, x, mean, rstd, weight)
    y = ops.rms_norm(x, weight, eps=1e-6);  y, rstd = ops.rms_norm_forward(x, weight)
    dx, dweight = ops.rms_norm_backward(dy, x, rstd, weight)
    y = ops.softmax(x, mask=None, scale=None)                 # softmax(x * scale + mask)
    dx = ops.softmax_backward(dy, y, scale=None)
    y, keep = ops.bias_act_dropout(x, bias, "gelu", p=0.1, seed=7)
    dx, dbias = ops.bias_act_dropout_backward(dy, x, bias, keep, "gelu", p=0.1)

Data: numpy arrays or torch CPU tensors (the result is of the kind given) of any leading shape
(..., n), viewed as (rows, n); f32, or bf16 (bf16 in and out, f32 arithmetic and statistics:
mean and rstd are f32 arrays of the leading shape). weight and bias: (n,) of f32 or bf16 (their
gradients come back in their dtype). Non-contiguous inputs are copied to a contiguous array
first (no error). Bad input raises tpp.core.errors.ArgumentError: a wrong shape, a dtype other
than f32/bf16, a negative or non-finite eps, an unknown keyword.

On a GPU: the same calls take device arrays (torch CUDA tensors, cupy, anything with
`__cuda_array_interface__`) and return device arrays of the input's kind on its device
(ops._host.empty: the device backend allocates them); every array of a call on one device,
else an ArgumentError naming them. The same nests run there (tpp.runtime.loops.CompiledNest
dispatches by the arrays' device: tpp_cuda lowers a nest to one kernel, each equation a
block-cooperative device function), in their device form (`_nest(..., device=True)`): the
CUDA equations reduce along axis 1 only, so a parameter gradient's equation writes its per-row
terms (the argument of its sum over the rows: norm_graphs.per_row_terms) to an (M, n) f32
scratch tensor instead of one partial row per block, and the same column-sum nest adds them
up (on the device: scratch of M rows instead of M / bm). eps and scale go to the device once
per value (ops._host.constant). Not on the device: a softmax mask that needs broadcasting
(other than one row (n,) or x's shape): UnsupportedError.

How. Each operator is an equation (tpp.equation) over a block of `bm` rows by all n columns:
the compiler fuses a row's reductions and element-wise work into a few passes over the row
while it is in L1. One loop nest runs it over the rows, whose count M is a size of the nest
(tpp.size): blocks of bm rows in parallel (the upper-case loop), then the rows past the last
full block one at a time by the same equation built for 1 row. A nest is compiled once per
(operator, n, dtypes, options) and cached; a new row count compiles nothing.

Weight and bias gradients (sums over all rows) are equation outputs reduced along axis 0: each
block (and each remainder row) writes its partial row to an f32 scratch tensor of
M // bm + M % bm rows, which a column-sum nest (ops.blocked.column_sums, a BRGEMM of a ones row)
adds up in f32 and rounds once to the parameter's dtype. A backward step calls one equation on
its block: dx and the partial rows, which the equation compiler's rowwise schedule folds into
dx's last pass over each row (tpp_cpu.equation: per-row reductions in registers, each row in
L1 across its passes, the column sums in stack rows). Parameter gradients need n <=
MAX_GRAD_COLS (65536, the equations' stack limit for an axis-0 result): ArgumentError beyond.

The backward equations are not written by hand: they are tpp.core.autodiff.grad of the forward
equations (the vector-Jacobian product over the IR), with the saved per-row statistics put in
place of their recomputation (`_saved`): mean and rstd for the norms; for softmax the saved
output y in place of exp(z - max) and 1 in place of the row sum (the gradient is invariant to
scaling both, so this is exact algebra). A last rewrite (`_lean`) turns block divisions by
per-row (or per-column) values into multiplications by reciprocals computed once per row.

Performance (one thread, 4096 x 1024 f32; bench/suites/norm.py, `tpp-bench norm`): a call
writing STREAM_BYTES or more of blocks runs the nest variant with non-temporal stores, whole
vectors where the outputs are 64-byte aligned (_np_empty aligns large numpy outputs; torch
aligns its own). Thread CPU time on the shared 2-core Zen 4, glibc malloc pinned as in the
bench: LayerNorm forward ~0.8 ms (~40 GB/s, RMSNorm ~0.7), LayerNorm fwd+bwd ~2.75 ms (torch
~5.3), softmax forward ~1.0-1.2 ms (exp-bound, its rows software-pipelined by the equation
compiler: tpp_cpu.equation's "Pipelined rows"; torch ~2.5), 32768 x 128 softmax ~1.35 ms.

LayerNorm forward:  mu = mean(x), var = mean((x - mu)^2) (two passes: no cancellation),
rstd = 1 / sqrt(var + eps), y = fma(x, rstd, -mu * rstd) * w + b ((x - mu) * rstd over one column).
RMSNorm forward:    rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w.
softmax forward:    z = x * scale + mask, y = exp(z - max(z)) * (1 / sum(exp(z - max(z)))).

Dropout uses the op table's `dropout` definition (tpp.core.optable: a counter-based stream, a
function of (seed, element)); each row block draws with its own seed, (seed mod 2**32) in the
low word and (seed // 2**32 mod 2**16 + the block's first row) in the high word, so results
depend on the seed, M and n only (not on the threads). The keep bitmask is (rows,
ceil(n / 8)) uint8, tpp.core.spec's layout, bit j % 8 of byte j // 8 for column j.
"""
from __future__ import annotations

import functools
import math

import numpy as np

import tpp
from tpp.runtime import arrays as _arrays
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError, UnsupportedError
from tpp.runtime.lru import also_clear
from tpp.core.spec import mask_bytes

from . import _host
from . import norm_plans as _plans
from .blocked import column_sums
from .norm_graphs import _BUILDERS, _grad, _lean, _saved  # noqa: F401  (ops.residual_norm uses them)
from .norm_graphs import per_row_terms
from .norm_args import (MAX_GRAD_COLS, _dtype, _eps, _grad_cols, _need,  # noqa: F401
                        _np_empty, _param_dtype, _rows, _same_rows, _scalar, _stats, _vector)

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "sigmoid", "tanh", "silu")
_SERIAL_ELEMENTS = 1 << 16      # smaller problems run on one thread (waking the team costs more)


def block_rows(n: int) -> int:
    """Rows per step: 64 for rows under 256 columns, else 32 down to 8 so that a block of two
    f32 arrays stays within 256 KiB (the second equation of a step reads it from L2). The
    weight gradients' scratch costs 1/bm of the data."""
    if n < 256:
        return 64
    return max(8, min(32, 32768 // n))


# ---------------------------------------------------------------- the nests
_ALIASES = {"e": "y"}     # equation operand -> the nest tensor it reads (softmax's e is y)


class _Nest:
    """A compiled nest of one operator for one n (any M): `run(arrays by tensor name, m)`.
    Its tensors are the operands of its equations, by name: block and bitmask operands
    (M, cols), per-row ones (M,), rows (n,), params (1,) and partial rows (M // bm + M % bm,
    n) f32. Each step calls the equations in order on one block of bm rows (or one row)."""

    def __init__(self, kind, n, options, stream=False, device=False):
        bm = block_rows(n)
        self.bm, self.n, self.device = bm, n, device
        build = _BUILDERS[kind]
        specs = {bm: build(bm, n, *options), 1: build(1, n, *options)}
        if stream:      # outputs bigger than the caches: non-temporal stores
            specs = {k: tuple(sp.replace(stream=True) for sp in v) for k, v in specs.items()}
        if device:      # no axis-0 reductions: per-row terms (m, n) f32, summed by column_sums
            specs = {k: tuple(per_row_terms(sp) for sp in v) for k, v in specs.items()}
            host = {op.name for sp in build(1, n, *options) for op in sp.operands()
                    if op.layout == "vector"}
        m = tpp.size("M")
        full = m // bm
        partial_rows = full + m - full * bm
        nest = tpp.LoopNest("Aa", a=tpp.Loop(0, m, 1, blocks=(bm,)))
        r, = nest.vars
        tensors, self.names, self.layouts, self.dtypes = {}, [], {}, {}
        self.seeded = any(spec.scalars for spec in specs[bm])
        for spec in specs[bm]:
            for op in spec.operands():
                name = _ALIASES.get(op.name, op.name)
                if name in tensors:
                    continue
                if op.layout in ("block", "mask"):
                    shape = (m, op.cols)
                elif op.layout == "col":
                    shape = (m,)
                elif op.layout == "row":
                    shape = (n,)
                elif op.layout == "scalar":
                    shape = (1,)
                else:                       # "vector": a partial row per block
                    shape = (partial_rows, n)
                tensors[name] = nest.tensor(name, shape, op.dtype)
                self.names.append(name)
                layout = "vector" if device and name in host else op.layout
                self.layouts[name], self.dtypes[name] = layout, op.dtype
        seed = None
        for rows, guard, part in ((bm, (r - r // bm * bm == 0, r + bm <= m), r // bm),
                                  (1, (r >= full * bm,), full + r - full * bm)):
            if self.seeded:
                seed = tpp.size("SEEDLO") + (tpp.size("SEEDHI") + r) * (1 << 32)
            for spec in specs[rows]:
                args = []
                for op in spec.operands():
                    t = tensors[_ALIASES.get(op.name, op.name)]
                    if op.layout in ("block", "mask", "col"):
                        args.append(t[r])     # (a device nest's per-row terms too)
                    elif op.layout in ("row", "scalar"):
                        args.append(t[0])
                    else:
                        args.append(t[part])
                nest.call(spec, *args, when=guard, seed=seed if spec.scalars else None)
        self.nest = nest.compile()
        self.specs = specs
        written = {_ALIASES.get(op.name, op.name) for spec in specs[bm] for op in spec.operands()
                   if op.role == "out"}
        # the tensors a call allocates: (name, layout, dtype) of those the nest writes
        self.outputs = tuple((name, self.layouts[name], self.dtypes[name])
                             for name in self.names if name in written)

    def partial_rows(self, m):
        """Rows of a partial-sums tensor: one per block and remainder row; on a device, one per
        row (the per-row terms)."""
        return m if self.device else m // self.bm + m % self.bm

    def run(self, arrays: dict, m: int, seed=None):
        threads = 1 if m * self.n < _SERIAL_ELEMENTS or self.device else None
        args = [arrays[name] for name in self.names]
        if self.seeded:
            self.nest(*args, threads=threads, SEEDLO=seed & 0xFFFFFFFF,
                      SEEDHI=(seed >> 32) & 0xFFFF)
        else:
            self.nest.call(tuple(args), threads)


@functools.lru_cache(maxsize=256)
def _nest(kind, n, options, stream=False, device=False) -> _Nest:
    """The nest of (kind, n, options); device=True: its form for device backends (the
    CompiledNest dispatches by the arrays' device), the equations' axis-0 outputs written as
    per-row terms (norm_graphs.per_row_terms)."""
    return _Nest(kind, n, options, stream, device)


# A call writing at least this many bytes of blocks uses the nest variant with non-temporal
# stores (compiled on first such call): its output cannot stay in the caches, and streaming
# skips reading each output line before writing it (4096 x 1024 f32 LayerNorm: ~25 -> ~32 GB/s).
STREAM_BYTES = 8 << 20


also_clear(_nest.cache_clear)      # tpp.clear_caches() empties it too


def _run(kind, n, options, arrays, outputs, like, m, seed=None, plan=None):
    """Run the nest of (kind, n, options) on the input arrays; outputs: name -> dtype of the
    results wanted (allocated here: block (m, n), col (m,), partial rows summed to (n,)).
    like (x's rows) on a device: every array must be there (ArgumentError naming a mix), the
    results are allocated there and the nest's device form runs there. plan: the call's
    ops.norm_plans signature (or None), under which a host nest without seeds is recorded for
    the planned calls (_planned)."""
    t = type(like)
    if t is np.ndarray or (t in _host._CPU_TENSOR_TYPES and like.is_cpu) \
            or not _host.on_device(like):
        nest = _nest(kind, n, options)
        written = sum(m * n * dt.itemsize for _, layout, dt in nest.outputs
                      if layout == "block")
        if written >= STREAM_BYTES:
            nest = _nest(kind, n, options, True)
        empty = _np_empty if t is np.ndarray else _host.empty
    else:
        _on_device(arrays, like)
        nest = _nest(kind, n, options, False, True)
        empty = _host.empty
    results = _execute(nest, n, arrays, outputs, like, m, seed, empty)
    if plan is not None and m and not nest.device and not nest.seeded:
        _plans.remember(plan, (nest, m, n, {k: arrays[k] for k in _PARAMS if k in arrays},
                               outputs))
    return results


def _execute(nest, n, arrays, outputs, like, m, seed, empty):
    """_run's work once the nest is chosen: the outputs allocated (empty), the nest run, the
    partial rows summed."""
    results, partials = {}, {}
    for name, layout, dt in nest.outputs:
        if layout == "vector":
            partials[name] = arrays[name] = empty((nest.partial_rows(m), n), _dt.F32, like)
        elif layout == "block":
            results[name] = arrays[name] = empty((m, n), dt, like)
        elif layout == "mask":
            results[name] = arrays[name] = empty((m, mask_bytes(n)), _dt.U8, like)
        else:   # col
            results[name] = arrays[name] = empty((m,), _dt.F32, like)
    if m:
        nest.run(arrays, m, seed)      # a host / device mix: ArgumentError naming them
    for name, part in partials.items():
        out = _host.zeros((n,), outputs[name], like) if m == 0 else \
            _host.empty((n,), outputs[name], like)
        if m:
            column_sums(part, out)
        results[name] = out
    return results


def _planned(key, like, given):
    """The results of the call of signature key (ops.norm_plans) as _run gives them ((m, n)
    blocks, (m,) columns, (n,) sums) from the plan a checked call of that signature recorded,
    or None where there is none. given: tensor name -> array in the caller's shapes (blocks
    of like's shape, columns of its leading shape, rows (n,); None entries left out, and so
    are arrays the nest does not read, as the checked call leaves them: a backward's weight
    when dx is not wanted)."""
    plan = _plans.lookup(key)
    if plan is None:
        return None
    nest, m, n, constants, outputs = plan
    arrays = dict(constants)
    layouts = nest.layouts
    for name, a in given.items():
        layout = layouts.get(name)
        if a is not None and layout is not None:
            arrays[name] = a.reshape(m, n) if layout == "block" else \
                a.reshape(m) if layout == "col" else a
    return _execute(nest, n, arrays, outputs, like, m, None,
                    _np_empty if type(like) is np.ndarray else _host.empty)


def _on_device(arrays, like):
    """arrays (name -> array) for a nest on like's device: ArgumentError naming a mix of
    devices; the f32 parameters (eps, scale: _scalar's host arrays) replaced by copies on the
    device (_host.constant: made once per device and value)."""
    _host.same_device(**{name: a for name, a in arrays.items() if name not in _PARAMS})
    for name in _PARAMS:
        value = arrays.get(name)
        if type(value) is np.ndarray:
            arrays[name] = _host.constant(float(value[0]), _dt.F32, like)


_PARAMS = ("eps", "scale")      # the equations' f32 scalar parameters


# ---------------------------------------------------------------- layer norm
def layer_norm(x, weight=None, bias=None, eps=1e-5, **unknown):
    """torch.nn.functional.layer_norm(x, (n,), weight, bias, eps) over the last axis."""
    _host.reject_unknown(layer_norm, unknown)
    return _layer_norm(x, weight, bias, eps, False)[0]


def layer_norm_forward(x, weight=None, bias=None, eps=1e-5, **unknown):
    """(y, mean, rstd): y like x; mean and rstd f32 of x's leading shape."""
    _host.reject_unknown(layer_norm_forward, unknown)
    return _layer_norm(x, weight, bias, eps, True)


def _layer_norm(x, weight, bias, eps, stats):
    plan = _plans.signature("ln_fwd", x, (weight, bias), (eps, stats))
    res = _planned(plan, x, {"x": x, "weight": weight, "bias": bias})
    if res is not None:
        lead, n = x.shape[:-1], x.shape[-1]
    else:
        x2, lead, dt = _rows(x, "x")
        m, n = x2.shape
        weight, bias = _vector(weight, n, "weight"), _vector(bias, n, "bias")
        wdt = _param_dtype(weight, bias, dt)
        arrays = {"x": x2, "eps": _scalar(_eps(eps))}
        if weight is not None:
            arrays["weight"] = weight
        if bias is not None:
            arrays["bias"] = bias
        res = _run("ln_fwd", n, (dt, wdt, weight is not None, bias is not None, stats), arrays,
                   {}, x2, m, plan=plan)
    y = res["y"].reshape(*lead, n)
    if not stats:
        return (y,)
    return y, res["mean"].reshape(lead), res["rstd"].reshape(lead)


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, bias=True, need=(True, True, True),
                        **unknown):
    """(dx, dweight, dbias) of layer_norm_forward: dx like x; dweight, dbias (n,) in weight's
    dtype (None without a weight, without a bias (bias=False: the forward had none) or where
    need says so)."""
    _host.reject_unknown(layer_norm_backward, unknown)
    plan = _plans.signature("ln_bwd", x, (dy, mean, rstd, weight), (bias, *need)) \
        if type(need) is tuple else None
    res = _planned(plan, x, {"x": x, "dy": dy, "mean": mean, "rstd": rstd, "weight": weight})
    if res is not None:
        dx = res.get("dx")
        return (None if dx is None else dx.reshape(x.shape), res.get("dweight"),
                res.get("dbias"))
    x2, lead, dt = _rows(x, "x")
    m, n = x2.shape
    need = _need(need, 3)
    weight = _vector(weight, n, "weight")
    wdt = _param_dtype(weight, None, dt)
    has_w, has_b = weight is not None, bool(bias)
    arrays = {"x": x2, "dy": _same_rows(dy, x, m, n, "dy", dt),
              "mean": _stats(mean, lead, m, "mean"), "rstd": _stats(rstd, lead, m, "rstd"),
              "eps": _scalar(0.0)}
    if has_w:
        arrays["weight"] = weight
    need = (need[0], need[1] and has_w, need[2] and has_b)
    if not any(need):
        return None, None, None
    if need[1] or need[2]:
        _grad_cols(n, "layer_norm_backward")
    res = _run("ln_bwd", n, (dt, wdt, has_w, has_b, need), arrays,
               {"dweight": wdt, "dbias": wdt}, x2, m, plan=plan)
    dx = res.get("dx")
    return (None if dx is None else dx.reshape(*lead, n), res.get("dweight"),
            res.get("dbias"))


# ---------------------------------------------------------------- rms norm
def rms_norm(x, weight=None, eps=1e-6, **unknown):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (torch.nn.functional.rms_norm)."""
    _host.reject_unknown(rms_norm, unknown)
    return _rms_norm(x, weight, eps, False)[0]


def rms_norm_forward(x, weight=None, eps=1e-6, **unknown):
    """(y, rstd): rstd f32 of x's leading shape."""
    _host.reject_unknown(rms_norm_forward, unknown)
    return _rms_norm(x, weight, eps, True)


def _rms_norm(x, weight, eps, stats):
    plan = _plans.signature("rms_fwd", x, (weight,), (eps, stats))
    res = _planned(plan, x, {"x": x, "weight": weight})
    if res is not None:
        lead, n = x.shape[:-1], x.shape[-1]
    else:
        x2, lead, dt = _rows(x, "x")
        m, n = x2.shape
        weight = _vector(weight, n, "weight")
        wdt = _param_dtype(weight, None, dt)
        arrays = {"x": x2, "eps": _scalar(_eps(eps))}
        if weight is not None:
            arrays["weight"] = weight
        res = _run("rms_fwd", n, (dt, wdt, weight is not None, stats), arrays, {}, x2, m,
                   plan=plan)
    y = res["y"].reshape(*lead, n)
    return (y, res["rstd"].reshape(lead)) if stats else (y,)


def rms_norm_backward(dy, x, rstd, weight=None, *, need=(True, True), **unknown):
    """(dx, dweight) of rms_norm_forward (dweight None without a weight)."""
    _host.reject_unknown(rms_norm_backward, unknown)
    plan = _plans.signature("rms_bwd", x, (dy, rstd, weight), need) \
        if type(need) is tuple else None
    res = _planned(plan, x, {"x": x, "dy": dy, "rstd": rstd, "weight": weight})
    if res is not None:
        dx = res.get("dx")
        return None if dx is None else dx.reshape(x.shape), res.get("dweight")
    x2, lead, dt = _rows(x, "x")
    m, n = x2.shape
    need = _need(need, 2)
    weight = _vector(weight, n, "weight")
    wdt = _param_dtype(weight, None, dt)
    arrays = {"x": x2, "dy": _same_rows(dy, x, m, n, "dy", dt),
              "rstd": _stats(rstd, lead, m, "rstd"), "eps": _scalar(0.0)}
    if weight is not None:
        arrays["weight"] = weight
    need = (need[0], need[1] and weight is not None)
    if not any(need):
        return None, None
    if need[1]:
        _grad_cols(n, "rms_norm_backward")
    res = _run("rms_bwd", n, (dt, wdt, weight is not None, need), arrays, {"dweight": wdt},
               x2, m, plan=plan)
    dx = res.get("dx")
    return None if dx is None else dx.reshape(*lead, n), res.get("dweight")


# ---------------------------------------------------------------- softmax
def softmax(x, *, mask=None, scale=None, **unknown):
    """softmax(x * scale + mask) over the last axis. mask: additive, f32 or x's dtype, of x's
    2-D view's shape (rows, n), or one row (n,) for every row; any other shape that numpy
    broadcasting takes to x's shape is expanded to (rows, n) first (a copy)."""
    _host.reject_unknown(softmax, unknown)
    plan = None
    if mask is None and scale is None:
        plan = _plans.signature("sm_fwd", x, (), ())
        res = _planned(plan, x, {"x": x})
        if res is not None:
            return res["y"].reshape(x.shape)
    x2, lead, dt = _rows(x, "x")
    m, n = x2.shape
    arrays = {"x": x2}
    scaled = scale is not None
    if scaled:
        arrays["scale"] = _scalar(_number(scale, "scale"))
    layout = mdt = None
    if mask is not None:
        mask = _host.host(mask, "mask", device=True)
        mdt = _dtype(mask, "mask")
        mshape = tuple(mask.shape)
        if mshape == (n,) or (len(mshape) >= 1 and math.prod(mshape) == n and
                              mshape[-1] == n):
            layout, mask = "row", _host.contiguous(mask).reshape(n)
        elif mshape == (m, n) or mshape == tuple(x.shape):
            layout, mask = "block", _host.contiguous(mask).reshape(m, n)
        else:
            layout, mask = "block", _expand(mask, tuple(x.shape), m, n)
        arrays["mask"] = mask
    res = _run("sm_fwd", n, (dt, layout, mdt, scaled), arrays, {}, x2, m, plan=plan)
    return res["y"].reshape(*lead, n)


def _expand(mask, shape, m, n):
    try:
        np.broadcast_shapes(tuple(mask.shape), shape)
        ok = np.broadcast_shapes(tuple(mask.shape), shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ArgumentError(f"mask: shape {tuple(mask.shape)} does not broadcast to x's "
                            f"shape {shape} (or its 2-D view ({m}, {n}))")
    if _host.on_device(mask):
        raise UnsupportedError(f"{_host._operator()}: on a device, the mask is one row ({n},) or "
                               f"of x's shape (or its 2-D view ({m}, {n})); got shape "
                               f"{tuple(mask.shape)} (expand it on the device first)")
    if _arrays.is_torch(mask):
        return mask.expand(shape).contiguous().reshape(m, n)
    return np.ascontiguousarray(np.broadcast_to(mask, shape)).reshape(m, n)


_number = _host.finite_number


def softmax_backward(dy, y, scale=None, **unknown):
    """dx of softmax (from its output y): y * (dy - sum(dy * y)) (times scale)."""
    _host.reject_unknown(softmax_backward, unknown)
    plan = None
    if scale is None:
        plan = _plans.signature("sm_bwd", y, (dy,), ())
        res = _planned(plan, y, {"y": y, "dy": dy})
        if res is not None:
            return res["dx"].reshape(y.shape)
    y2, lead, dt = _rows(y, "y")
    m, n = y2.shape
    arrays = {"y": y2, "dy": _same_rows(dy, y, m, n, "dy", dt)}
    scaled = scale is not None
    if scaled:
        arrays["scale"] = _scalar(_number(scale, "scale"))
    res = _run("sm_bwd", n, (dt, scaled), arrays, {}, y2, m, plan=plan)
    return res["dx"].reshape(*lead, n)


# ---------------------------------------------------------------- bias + activation + dropout
def _check_activation(activation):
    try:
        ok = activation in ACTIVATIONS
    except TypeError:
        ok = False
    if not ok:
        raise ArgumentError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _probability(p):
    p = _number(p, "p")
    if not 0.0 <= p < 1.0:
        raise ArgumentError(f"p must be in [0, 1), got {p!r}")
    return p


def bias_act_dropout(x, bias=None, activation="gelu", p=0.0, seed=None, **unknown):
    """(y, keep): y = dropout(act(x + bias), p) like x; keep the (rows, ceil(n/8)) uint8 keep
    bitmask of x's leading shape + (ceil(n/8),), or None when p == 0. seed: an int (None: a
    random one from numpy's global stream)."""
    _host.reject_unknown(bias_act_dropout, unknown)
    x2, lead, dt = _rows(x, "x")
    m, n = x2.shape
    _check_activation(activation)
    p = _probability(p)
    bias = _vector(bias, n, "bias")
    bdt = _param_dtype(None, bias, dt)
    if seed is None:
        seed = int(np.random.randint(0, 2 ** 62, dtype=np.int64))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ArgumentError(f"seed must be an int, got {seed!r}")
    arrays = {"x": x2}
    if bias is not None:
        arrays["bias"] = bias
    res = _run("bad_fwd", n, (dt, bdt, bias is not None, activation, p), arrays, {}, x2, m,
               seed=int(seed) & ((1 << 64) - 1))
    keep = res.get("keep")
    return (res["y"].reshape(*lead, n),
            None if keep is None else keep.reshape(*lead, keep.shape[-1]))


def bias_act_dropout_backward(dy, x, bias=None, keep=None, activation="gelu", p=0.0, *,
                              need=(True, True), **unknown):
    """(dx, dbias) of bias_act_dropout: x and bias the forward's inputs, keep its bitmask."""
    _host.reject_unknown(bias_act_dropout_backward, unknown)
    x2, lead, dt = _rows(x, "x")
    m, n = x2.shape
    _check_activation(activation)
    p = _probability(p)
    need = _need(need, 2)
    bias = _vector(bias, n, "bias")
    bdt = _param_dtype(None, bias, dt)
    arrays = {"x": x2, "dy": _same_rows(dy, x, m, n, "dy", dt)}
    if bias is not None:
        arrays["bias"] = bias
    if p > 0:
        if keep is None:
            raise ArgumentError("keep: p > 0 needs the forward's keep bitmask")
        keep = _host.host(keep, "keep", device=True)
        if tuple(keep.shape) != (*lead, mask_bytes(n)) or str(keep.dtype).split(".")[-1] \
                != "uint8":
            raise ArgumentError(f"keep: expected a uint8 bitmask of shape "
                                f"{(*lead, mask_bytes(n))}, got {keep.dtype} "
                                f"{tuple(keep.shape)}")
        arrays["keep"] = _host.contiguous(keep).reshape(m, mask_bytes(n))
    need = (need[0], need[1] and bias is not None)
    if not any(need):
        return None, None
    if need[1]:
        _grad_cols(n, "bias_act_dropout_backward")
    res = _run("bad_bwd", n, (dt, bdt, bias is not None, activation, p, need), arrays,
               {"dbias": bdt}, x2, m)
    dx = res.get("dx")
    return None if dx is None else dx.reshape(*lead, n), res.get("dbias")
