"""The op table: every unary and binary primitive, its operands, parameters and pairing.

This table is the single list of what the virtual ISA offers. The reference semantics live in
`tpp.reference`, the code generators per backend; both are keyed by the names below.

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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from .errors import SpecError


@dataclass(frozen=True)
class OpInfo:
    name: str
    family: str                     # "unary" or "binary"
    kind: str                       # see the module docstring
    params: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    second: str | None = None       # map_inv only: "x", "y" or "mask"
    backward: str | None = None     # the *_inv op of an activation
    doc: str = ""


def _params(**defaults):
    return MappingProxyType(defaults)


_UNARY = [
    OpInfo("identity", "unary", "map", doc="copy; converts between dtypes"),
    OpInfo("zero", "unary", "map", doc="writes zeros; reads no input"),
    OpInfo("square", "unary", "map", doc="x*x"),
    OpInfo("sqrt", "unary", "map"),
    OpInfo("rsqrt", "unary", "map", doc="1/sqrt(x)"),
    OpInfo("reciprocal", "unary", "map", doc="1/x"),
    OpInfo("exp", "unary", "map"),
    OpInfo("negate", "unary", "map"),
    OpInfo("abs", "unary", "map"),
    OpInfo("increment", "unary", "map", doc="x + 1"),
    OpInfo("replicate_col", "unary", "map",
           doc="fills each row i of the (m, n) output with in[i]; the input is a column of m values"),
    OpInfo("relu", "unary", "map", _params(bitmask=False), backward="relu_inv",
           doc="x if x > 0 else +0 (nan propagates); bitmask=True also writes bit (x > 0)"),
    OpInfo("relu_inv", "unary", "map_inv", _params(bitmask=False), second="x",
           doc="g where x > 0 else 0; with bitmask=True the second operand is relu's bitmask"),
    OpInfo("leaky_relu", "unary", "map", _params(alpha=0.01), backward="leaky_relu_inv",
           doc="x if x > 0 else alpha*x"),
    OpInfo("leaky_relu_inv", "unary", "map_inv", _params(alpha=0.01), second="x",
           doc="g if x > 0 else alpha*g"),
    OpInfo("elu", "unary", "map", _params(alpha=1.0), backward="elu_inv",
           doc="x if x > 0 else alpha*(exp(x)-1)"),
    OpInfo("elu_inv", "unary", "map_inv", _params(alpha=1.0), second="y",
           doc="g if y > 0 else g*(y + alpha), y the forward's output"),
    OpInfo("gelu", "unary", "map", _params(approximate="none"), backward="gelu_inv",
           doc="x*Phi(x) (erf form); approximate='tanh' for the tanh approximation"),
    OpInfo("gelu_inv", "unary", "map_inv", _params(approximate="none"), second="x",
           doc="g * gelu'(x)"),
    OpInfo("tanh", "unary", "map", backward="tanh_inv"),
    OpInfo("tanh_inv", "unary", "map_inv", second="y", doc="g * (1 - y*y), y = tanh(x)"),
    OpInfo("sigmoid", "unary", "map", backward="sigmoid_inv"),
    OpInfo("sigmoid_inv", "unary", "map_inv", second="y", doc="g * y * (1 - y), y = sigmoid(x)"),
    OpInfo("dropout", "unary", "map", _params(p=0.5), backward="dropout_inv",
           doc="x*keep/(1-p) with keep drawn from a counter-based RNG (seed given per call); "
               "always writes the keep bitmask"),
    OpInfo("dropout_inv", "unary", "map_inv", _params(p=0.5), second="mask",
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
    OpInfo("add", "binary", "map"),
    OpInfo("sub", "binary", "map"),
    OpInfo("mul", "binary", "map"),
    OpInfo("div", "binary", "map"),
    OpInfo("max", "binary", "map", doc="nan propagates"),
    OpInfo("min", "binary", "map", doc="nan propagates"),
    OpInfo("muladd", "binary", "map", doc="out += a*b: the output is also read"),
] + [OpInfo(f"cmp_{c}", "binary", "compare", doc=f"bitmask of a {c} b")
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
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"{op.name}: {key} must be a number, got {value!r}")
            merged[key] = float(value)
        elif isinstance(default, int):
            if value not in (0, 1) or isinstance(value, bool):
                raise SpecError(f"{op.name}: {key} must be 0 or 1, got {value!r}")
        elif key == "approximate" and value not in ("none", "tanh"):
            raise SpecError(f"{op.name}: approximate must be 'none' or 'tanh', got {value!r}")
    if "p" in merged and not 0.0 <= merged["p"] < 1.0:
        raise SpecError(f"{op.name}: p must be in [0, 1), got {merged['p']}")
    return tuple(sorted(merged.items()))
