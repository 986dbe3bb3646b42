"""The op table: every unary and binary primitive, its operands, parameters and pairing, and
the single definition of every element-wise op.

This table is the single list of what the virtual ISA offers, and the single place where the
semantics of an element-wise op is written: `expr`, a function building its value as an
expression of `tpp.core.expr` (the IR). Every backend renders that one definition: `tpp.core.reference`
evaluates it exactly in float64 (`tpp.core.expr_eval`), the CPU backend renders it as LLVM IR
(`tpp_cpu.expr_llvm`), the CUDA backend as CUDA C (`tpp_cuda.expr_cuda`); transcendentals are
the IR's named primitives (`tpp.core.mathlib`), which every backend renders from the same
expansion, so CPU and CUDA compute the same bits.

Kinds of unary op:
  map        elementwise, output (m, n) from input (m, n) (or a broadcast input)
  map_inv    elementwise backward: inputs are the gradient and a second operand named by
             `second` ("x": the forward's input, "y": its output, "mask": its bitmask)
  reduce     reduction of a block to a vector along `axis` (0: over rows -> n values,
             1: over columns -> m values)
  transpose  (m, n) -> (n, m)
  vnni2 / vnni2_inv   VNNI-2 packing of a 16-bit (k=m, n) block into (ceil(m/2), 2n) and back
  gather / scatter    rows selected by an int64 index vector
Binary ops are elementwise with two inputs; compare ops write a bitmask instead of a block.

Definitions (`expr`; p is the dict of the op's parameters, values as Python numbers / strings):
  map        expr(x, p) -> value, or (value, mask) for an op that writes a bitmask (a bool node)
  map_inv    expr(g, s, p) -> value; s is the second operand: an f32 node, or a bool node (the
             mask bit) when the second operand is a bitmask
  binary     expr(a, b, p) -> value (compare: a bool node); an op with `reads_out` also gets
             the output's old value: expr(a, b, p, c)
`definition(info, params)` builds it over leaves named after the spec's operands.

Test metadata (tests/test_opdefs.py is parametrized from it): `domain` the (lo, hi) range of
test inputs (of the second operand for map_inv), `specials` extra values to test, `tol` the
(rtol, atol) of the f32 result against the exact math (0, 0: correctly rounded).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable

import numpy as np

from . import dtypes as _dt
from . import expr as X
from .errors import SpecError

_INF = float("inf")
_NAN = float("nan")
SPECIALS = (_INF, -_INF, _NAN, 0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38)
_ULP = 2.0 ** -24           # half an f32 ulp: the error of one correct rounding


@dataclass(frozen=True)
class OpInfo:
    name: str
    family: str                     # "unary" or "binary"
    kind: str                       # see the module docstring
    params: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    second: str | None = None       # map_inv only: "x", "y" or "mask"
    backward: str | None = None     # the *_inv op of an activation
    doc: str = ""
    expr: Callable | None = None    # the definition (module docstring); None: not element-wise
    mask_param: str | None = None   # the bool param that makes a map write (map_inv: read) a
                                    # bitmask instead of its second operand
    reads_out: bool = False         # binary: the output is read too (expr gets its old value)
    bcast: str | None = None        # the one input layout the op takes ("col": replicate_col)
    epilogue: bool = False          # may be a BRGEMM's epilogue activation (params: defaults)
    domain: tuple = (-10.0, 10.0)   # test inputs (map_inv: of the second operand)
    specials: tuple = SPECIALS      # extra test inputs
    tol: tuple = (0.0, 0.0)         # (rtol, atol) of the f32 result vs the exact math

    def second_operand(self, params: dict) -> str | None:
        """The name of a map_inv's second operand under these params ("mask" when the
        mask_param is set)."""
        if self.mask_param is not None and params.get(self.mask_param):
            return "mask"
        return self.second


def _params(**defaults):
    return MappingProxyType(defaults)


# ---------------------------------------------------------------- helpers of the definitions
def _positive(s):
    """s > 0, or s itself when it is already a predicate (a bitmask bit)."""
    return s if s.kind == "bool" else s > 0.0


def _relu(x, p):
    y = X.select(x <= 0.0, 0.0, x)        # +0 for x <= 0 (also -0); nan propagates
    return (y, x > 0.0) if p["bitmask"] else y


def _gelu(x, p):
    return X.prim("gelu_tanh" if p["approximate"] == "tanh" else "gelu", x)


def _gelu_inv(g, s, p):
    return g * X.prim("gelu_tanh_grad" if p["approximate"] == "tanh" else "gelu_grad", s)


def _fmix32(h):
    """murmur3's 32-bit finalizer."""
    h = X.ixor(h, X.lshr(h, 16))
    h = X.imul(h, 0x85EBCA6B)
    h = X.ixor(h, X.lshr(h, 13))
    h = X.imul(h, 0xC2B2AE35)
    return X.ixor(h, X.lshr(h, 16))


def dropout_draw():
    """The counter-based random stream of dropout as an i32 node: element (i, j) of an (m, n)
    block draws fmix32(fmix32((i*n + j) * 0x9E3779B9 ^ lo) ^ hi) in wrap-around 32-bit
    arithmetic, lo / hi the low and high words of the 64-bit seed: a function of (seed, i*n + j)
    only. Give each block its own seed."""
    h = _fmix32(X.ixor(X.imul(X.index("flat"), 0x9E3779B9), X.seed(0)))
    return _fmix32(X.ixor(h, X.seed(1)))


def dropout_threshold(p: float) -> int:
    """An element is kept when its uint32 draw is >= this threshold (probability 1 - p)."""
    return min(int(round(p * 2.0 ** 32)), 2 ** 32 - 1)


def dropout_scale(p: float) -> np.float32:
    """The f32 factor of a kept element, 1 / (1 - p)."""
    return np.float32(1.0 / (1.0 - p))


def _dropout(x, p):
    keep = X.iuge(dropout_draw(), dropout_threshold(p["p"]))
    return X.select(keep, x * float(dropout_scale(p["p"])), 0.0), keep


def _above_m128(x):
    """max(x, -128) (NaN kept): below -128, sigmoid(x) is 0 in f32 and the factor x of silu
    must stay finite (silu(-inf) = -0, not -inf * 0)."""
    return X.select(x < -128.0, -128.0, x)


def _silu(x, p):
    return _above_m128(x) * X.prim("sigmoid", x)


def _silu_inv(g, x, p):
    # silu' = s(x) (1 + x s(-x)): s(-x) = 1 - s(x) without its cancellation for large x;
    # x clamped to [-128, 128] (s(-x) or s(x) is 0 beyond), so silu'(+-inf) = 1 / 0
    xc = X.select(x > 128.0, 128.0, _above_m128(x))
    return g * (X.prim("sigmoid", x) * X.fma(xc, X.prim("sigmoid", -x), 1.0))


def _softplus(x, p):
    # max(x, 0) + log1p(e^-|x|), log1p(u) = log(w) u / (w - 1), w = 1 + u (Goldberg: a few
    # ulps, also where w rounds to 1)
    u = X.prim("exp", -X.fabs(x))
    w = u + 1.0
    log1p = X.select(X.compare("eq", w, 1.0), u, X.prim("log", w) * (u / (w - 1.0)))
    return X.maximum(x, 0.0) + log1p


_TRANSCENDENTAL = (1e-6, 1e-37)     # the bound of tpp.core.mathlib (atol: subnormal results)
_POS = (0.0, 100.0)

_UNARY = [
    OpInfo("identity", "unary", "map", doc="copy; converts between dtypes",
           expr=lambda x, p: x),
    OpInfo("zero", "unary", "map", doc="writes zeros; reads no input",
           expr=lambda x, p: X.const(0.0)),
    OpInfo("square", "unary", "map", doc="x*x", expr=lambda x, p: x * x),
    OpInfo("sqrt", "unary", "map", expr=lambda x, p: X.sqrt(x), domain=_POS),
    OpInfo("rsqrt", "unary", "map", doc="1/sqrt(x)", expr=lambda x, p: 1.0 / X.sqrt(x),
           domain=(1e-3, 100.0), tol=(4 * _ULP, 0.0)),
    OpInfo("reciprocal", "unary", "map", doc="1/x", expr=lambda x, p: 1.0 / x),
    OpInfo("exp", "unary", "map", expr=lambda x, p: X.prim("exp", x), domain=(-20.0, 20.0),
           tol=_TRANSCENDENTAL),
    OpInfo("log", "unary", "map", doc="natural logarithm (log(0) = -inf, log(x < 0) = nan)",
           expr=lambda x, p: X.prim("log", x), domain=(1e-3, 1e3), tol=_TRANSCENDENTAL),
    OpInfo("negate", "unary", "map", expr=lambda x, p: -x),
    OpInfo("abs", "unary", "map", expr=lambda x, p: X.fabs(x)),
    OpInfo("increment", "unary", "map", doc="x + 1", expr=lambda x, p: x + 1.0),
    OpInfo("replicate_col", "unary", "map", bcast="col", expr=lambda x, p: x,
           doc="fills each row i of the (m, n) output with in[i]; the input is a column of m values"),
    OpInfo("relu", "unary", "map", _params(bitmask=False), backward="relu_inv", expr=_relu,
           mask_param="bitmask", epilogue=True,
           doc="x if x > 0 else +0 (nan propagates); bitmask=True also writes bit (x > 0)"),
    OpInfo("relu_inv", "unary", "map_inv", _params(bitmask=False), second="x",
           mask_param="bitmask", expr=lambda g, s, p: X.select(_positive(s), g, 0.0),
           doc="g where x > 0 else 0; with bitmask=True the second operand is relu's bitmask"),
    OpInfo("leaky_relu", "unary", "map", _params(alpha=0.01), backward="leaky_relu_inv",
           expr=lambda x, p: X.select(x > 0.0, x, x * p["alpha"]),
           doc="x if x > 0 else alpha*x (alpha rounded to f32)"),
    OpInfo("leaky_relu_inv", "unary", "map_inv", _params(alpha=0.01), second="x",
           expr=lambda g, s, p: X.select(s > 0.0, g, g * p["alpha"]),
           doc="g if x > 0 else alpha*g"),
    OpInfo("elu", "unary", "map", _params(alpha=1.0), backward="elu_inv",
           expr=lambda x, p: X.select(x > 0.0, x, X.prim("expm1", x) * p["alpha"]),
           domain=(-10.0, 5.0), tol=(1e-6, 1e-37), doc="x if x > 0 else alpha*(exp(x)-1)"),
    OpInfo("elu_inv", "unary", "map_inv", _params(alpha=1.0), second="y",
           expr=lambda g, s, p: X.select(s > 0.0, g, g * (s + p["alpha"])),
           domain=(-1.0, 5.0), tol=(4 * _ULP, 1e-7),
           doc="g if y > 0 else g*(y + alpha), y the forward's output"),
    OpInfo("gelu", "unary", "map", _params(approximate="none"), backward="gelu_inv",
           expr=_gelu, epilogue=True, tol=_TRANSCENDENTAL,
           doc="x*Phi(x) (erf form); approximate='tanh' for the tanh approximation"),
    OpInfo("gelu_inv", "unary", "map_inv", _params(approximate="none"), second="x",
           expr=_gelu_inv, tol=(1.5e-6, 1e-37), doc="g * gelu'(x)"),
    OpInfo("tanh", "unary", "map", backward="tanh_inv", epilogue=True,
           expr=lambda x, p: X.prim("tanh", x), tol=_TRANSCENDENTAL),
    OpInfo("tanh_inv", "unary", "map_inv", second="y", domain=(-1.0, 1.0),
           expr=lambda g, s, p: g * X.fma(-s, s, 1.0), tol=(2 * _ULP, 0.0),
           doc="g * (1 - y*y), y = tanh(x)"),
    OpInfo("sigmoid", "unary", "map", backward="sigmoid_inv", epilogue=True,
           expr=lambda x, p: X.prim("sigmoid", x), tol=_TRANSCENDENTAL),
    OpInfo("sigmoid_inv", "unary", "map_inv", second="y", domain=(0.0, 1.0),
           expr=lambda g, s, p: (g * s) * (1.0 - s), tol=(4 * _ULP, 1e-8),
           doc="g * y * (1 - y), y = sigmoid(x)"),
    OpInfo("silu", "unary", "map", backward="silu_inv",
           expr=_silu, domain=(-20.0, 20.0),
           tol=(1.5e-6, 1e-40), doc="x * sigmoid(x) (swish)"),
    OpInfo("silu_inv", "unary", "map_inv", second="x", expr=_silu_inv, domain=(-20.0, 20.0),
           tol=(3e-6, 1e-7), doc="g * silu'(x) = g * s(x) (1 + x s(-x)), s = sigmoid"),
    OpInfo("softplus", "unary", "map", backward="softplus_inv", expr=_softplus,
           domain=(-30.0, 30.0), tol=(2e-6, 1e-40), doc="log(1 + exp(x)), overflow-free"),
    OpInfo("softplus_inv", "unary", "map_inv", second="x", domain=(-30.0, 30.0),
           expr=lambda g, x, p: g * X.prim("sigmoid", x), tol=(1.5e-6, 1e-40),
           doc="g * sigmoid(x)"),
    OpInfo("dropout", "unary", "map", _params(p=0.5), backward="dropout_inv", expr=_dropout,
           specials=(),
           doc="x*keep/(1-p) with keep drawn from a counter-based RNG (seed given per call); "
               "always writes the keep bitmask"),
    OpInfo("dropout_inv", "unary", "map_inv", _params(p=0.5), second="mask",
           expr=lambda g, keep, p: X.select(keep, g * float(dropout_scale(p["p"])), 0.0),
           doc="g*keep/(1-p), keep read from dropout's bitmask"),
    OpInfo("reduce_sum", "unary", "reduce", _params(axis=1)),
    OpInfo("reduce_sumsq", "unary", "reduce", _params(axis=1), doc="sum of squares"),
    OpInfo("reduce_max", "unary", "reduce", _params(axis=1)),
    OpInfo("reduce_min", "unary", "reduce", _params(axis=1)),
    OpInfo("reduce_absmax", "unary", "reduce", _params(axis=1), doc="max of |x|"),
    OpInfo("transpose", "unary", "transpose", doc="(m, n) -> (n, m), bit-exact"),
    OpInfo("vnni2", "unary", "vnni2",
           doc="[k][n] -> [k/2][n][2] for 16-bit dtypes (m = k rows); an odd last row pairs with 0"),
    OpInfo("vnni2_inv", "unary", "vnni2_inv", doc="the inverse of vnni2"),
    OpInfo("gather_rows", "unary", "gather", doc="out[i] = in[idx[i]]"),
    OpInfo("scatter_rows", "unary", "scatter", doc="out[idx[i]] = in[i]"),
]

_BINARY = [
    OpInfo("add", "binary", "map", expr=lambda a, b, p: a + b),
    OpInfo("sub", "binary", "map", expr=lambda a, b, p: a - b),
    OpInfo("mul", "binary", "map", expr=lambda a, b, p: a * b),
    OpInfo("div", "binary", "map", expr=lambda a, b, p: a / b),
    OpInfo("max", "binary", "map", doc="nan propagates", expr=lambda a, b, p: X.maximum(a, b)),
    OpInfo("min", "binary", "map", doc="nan propagates", expr=lambda a, b, p: X.minimum(a, b)),
    OpInfo("muladd", "binary", "map", doc="out += a*b (rounded once): the output is also read",
           reads_out=True, expr=lambda a, b, p, c: X.fma(a, b, c)),
] + [OpInfo(f"cmp_{c}", "binary", "compare", doc=f"bitmask of a {c} b",
            expr=functools.partial(lambda c, a, b, p: X.compare(c, a, b), c))
     for c in ("gt", "ge", "lt", "le", "eq", "ne")]

UNARY_OPS = MappingProxyType({op.name: op for op in _UNARY})
BINARY_OPS = MappingProxyType({op.name: op for op in _BINARY})


def lookup(family: str, name: str) -> OpInfo:
    table = UNARY_OPS if family == "unary" else BINARY_OPS
    try:
        return table[name]
    except KeyError:
        raise SpecError(f"unknown {family} op {name!r}; known: {', '.join(table)}") from None


def check_params(op: OpInfo, given: dict) -> tuple:
    """Fill defaults, reject unknown or ill-typed parameters; returns sorted (key, value) pairs."""
    unknown = set(given) - set(op.params)
    if unknown:
        allowed = ", ".join(op.params) or "none"
        raise SpecError(f"op {op.name!r} takes no parameter {sorted(unknown)}; allowed: {allowed}")
    merged = dict(op.params)
    merged.update(given)
    for key, value in merged.items():
        default = op.params[key]
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise SpecError(f"{op.name}: {key} must be True or False, got {value!r}")
        elif isinstance(default, float):
            # numpy scalars too (a numpy bool is a bool here as well)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float,
                                                                              np.integer,
                                                                              np.floating)):
                raise SpecError(f"{op.name}: {key} must be a number, got {value!r}")
            merged[key] = float(value)
            if _dt.overflows_f32(merged[key]):
                raise SpecError(f"{op.name}: {key}={value!r} is beyond the f32 range (the "
                                f"kernel computes in f32; |{key}| < 3.4e38)")
        elif isinstance(default, int):
            if value not in (0, 1) or isinstance(value, (bool, np.bool_)):
                raise SpecError(f"{op.name}: {key} must be 0 or 1, got {value!r}")
        elif key == "approximate" and value not in ("none", "tanh"):
            raise SpecError(f"{op.name}: approximate must be 'none' or 'tanh', got {value!r}")
    if "p" in merged and not 0.0 <= merged["p"] < 1.0:
        raise SpecError(f"{op.name}: p must be in [0, 1), got {merged['p']}")
    return tuple(sorted(merged.items()))


# the activations a BRGEMM may apply in its epilogue (with their default params)
EPILOGUES = tuple(op.name for op in _UNARY if op.epilogue)


@dataclass(frozen=True)
class Definition:
    """An element-wise op's definition built for one set of params: `outputs` in the order of
    the spec's output operands (the value, then the bitmask of an op that writes one), over
    leaves named after the spec's input operands ("in"; "grad" and the second operand; "in0",
    "in1" and "out" for an op that reads its output)."""
    outputs: tuple
    mask: bool          # the op writes a bitmask (its last output)
    reads: tuple        # the names of the input operands the outputs depend on, in order
    seeded: bool        # the outputs depend on the seed (a kernel takes a seed argument)


def definition(info: OpInfo, params: tuple) -> Definition:
    """The definition of an element-wise op (kinds map, map_inv, compare) under params (sorted
    (key, value) pairs as `check_params` returns them); built once per (op, params)."""
    return _definition(info.family, info.name, tuple(params))


@functools.lru_cache(maxsize=512)
def _definition(family: str, name: str, params: tuple) -> Definition:
    info = lookup(family, name)
    if info.expr is None:
        raise SpecError(f"op {info.name!r} (kind {info.kind}) is not element-wise")
    p = dict(params)
    if info.family == "binary":
        args = [X.input("in0"), X.input("in1"), p] + ([X.input("out")] if info.reads_out else [])
        names = ["in0", "in1"] + (["out"] if info.reads_out else [])
    elif info.kind == "map_inv":
        second = info.second_operand(p)
        s = X.maskbit("mask") if second == "mask" else X.input(second)
        args, names = [X.input("grad"), s, p], ["grad", second]
    else:
        args, names = [X.input("in"), p], ["in"]
    got = info.expr(*args)
    outputs = tuple(X.as_node(o) for o in (got if isinstance(got, tuple) else (got,)))
    used = {n.attr[0] for n in X.topological(outputs) if n.op in ("input", "maskbit")}
    return Definition(outputs, len(outputs) == 2 or info.kind == "compare",
                      tuple(n for n in names if n in used),
                      bool(X.leaves(outputs, "seed")))


def epilogue(name: str, bitmask: bool = False):
    """(info, params) of BRGEMM epilogue activation `name`: its default params, with its
    mask_param set when the BRGEMM records the activation's bitmask."""
    info = lookup("unary", name)
    if not info.epilogue:
        raise SpecError(f"{name!r} is not a BRGEMM epilogue activation; those are "
                        f"{', '.join(EPILOGUES)}")
    if bitmask and info.mask_param is None:
        raise SpecError(f"activation {name!r} writes no bitmask")
    return info, check_params(info, {info.mask_param: True} if bitmask else {})
