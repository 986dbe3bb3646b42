"""The CUDA C rendering of the expression IR (`tpp.core.expr`): one SSA temporary per node.

`render(outputs, leaf, prefix="e")` returns (lines, values): the C statements that compute
every node the outputs depend on, each once, as `const` locals named prefix0, prefix1, ...
(f32 -> float, i32 -> unsigned int, bool -> bool), and the C expression of each output.
`leaf(node)` gives the C expression of every leaf other than constants (inputs, params, mask
bits, indices, seed words, extents) and of every reduction node (whose argument is not
rendered); it may raise ValueError for one the caller cannot supply. A leaf expression is
inlined where it is used (parenthesized unless it is a name or a literal). Named transcendentals
render their `tpp.core.mathlib` expansion, so CUDA runs the very code the CPU backend runs.

Rounding is spelled out so that nvcc can neither contract a*b + c into an fma nor substitute
an approximation: __fadd_rn / __fsub_rn / __fmul_rn / __fdiv_rn / __fmaf_rn / __fsqrt_rn
(IEEE round-to-nearest-even, also under -use_fast_math), __float_as_uint / __uint_as_float for
the bitcasts, unsigned arithmetic for the i32 nodes (wrap-around; `lshr` is a logical shift,
`islt` compares as signed). min / max propagate NaN and order -0 < +0 (`tpp_fminimum` /
`tpp_fmaximum` of PREAMBLE, written with compares and selects), like LLVM's llvm.minimum /
llvm.maximum. So, NaN payloads aside, a CUDA kernel computes the bits the CPU kernel does.
"""
from __future__ import annotations

import math
import re
import struct

from tpp.core import expr as X
from tpp.core import mathlib

PREAMBLE = r"""#ifndef TPP_CUDA_EXPR_PREAMBLE
#define TPP_CUDA_EXPR_PREAMBLE
/* llvm.maximum / llvm.minimum: NaN if either is NaN, -0 < +0 */
static __device__ __forceinline__ float tpp_fmaximum(float a, float b) {
  if (a != a || b != b) return __fadd_rn(a, b);
  if (a > b) return a;
  if (b > a) return b;
  return __uint_as_float(__float_as_uint(a) & __float_as_uint(b));   /* +0 over -0 */
}
static __device__ __forceinline__ float tpp_fminimum(float a, float b) {
  if (a != a || b != b) return __fadd_rn(a, b);
  if (a < b) return a;
  if (b < a) return b;
  return __uint_as_float(__float_as_uint(a) | __float_as_uint(b));   /* -0 over +0 */
}
#endif
"""

_SIMPLE = re.compile(r"[A-Za-z_]\w*|[-+.\w]+")     # an identifier or a literal
_CTYPE = {"f32": "float", "i32": "unsigned int", "bool": "bool"}
_FCALL = {"add": "__fadd_rn", "sub": "__fsub_rn", "mul": "__fmul_rn", "div": "__fdiv_rn",
          "fma": "__fmaf_rn", "sqrt": "__fsqrt_rn", "abs": "fabsf", "min": "tpp_fminimum",
          "max": "tpp_fmaximum"}
_INFIX = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
          "and": "&&", "or": "||", "iadd": "+", "isub": "-", "imul": "*", "iand": "&",
          "ior": "|", "ixor": "^", "shl": "<<", "lshr": ">>", "iuge": ">="}


def float_literal(value: float) -> str:
    """A C float literal of value rounded to f32, exactly (bits for inf and nan)."""
    v = X.f32(value)
    if math.isfinite(v):
        return f"{v!r}f"
    return f"__uint_as_float(0x{struct.unpack('<I', struct.pack('<f', v))[0]:08x}u)"


def render(outputs, leaf, prefix: str = "e") -> tuple:
    """(lines, values) of the outputs (see the module docstring)."""
    outputs = _expand(list(outputs))
    names: dict = {}
    lines: list = []
    for nd in _order(outputs):
        if nd.op in ("const", "iconst"):
            names[nd] = _expression(nd, names)
            continue
        if nd.op in X.LEAVES or nd.op in X.REDUCTIONS:
            expr = leaf(nd)
            names[nd] = expr if _SIMPLE.fullmatch(expr) else f"({expr})"
            continue
        expr = _expression(nd, names)
        name = f"{prefix}{len(lines)}"
        lines.append(f"const {_CTYPE[nd.kind]} {name} = {expr};")
        names[nd] = name
    return lines, [names[o] for o in outputs]


def _order(outputs) -> list:
    """X.topological, except that a reduction is a leaf (its value comes from `leaf`)."""
    order, seen = [], set()
    stack = [(n, False) for n in reversed(outputs)]
    while stack:
        n, done = stack.pop()
        if id(n) in seen:
            continue
        if done or n.op in X.REDUCTIONS or not n.args:
            seen.add(id(n))
            order.append(n)
            continue
        stack.append((n, True))
        stack += [(a, False) for a in reversed(n.args) if id(a) not in seen]
    return order


def _expand(outputs) -> list:
    """The outputs with every transcendental replaced by its expansion (recursively)."""
    mapping = {}
    for nd in X.topological(outputs):
        if nd.op == "prim":
            body = mathlib.PRIMS[nd.attr[0]].expand(*nd.args)
            mapping[nd] = _expand([body])[0]
    return X.substitute(outputs, mapping) if mapping else outputs


def _expression(nd, names) -> str:
    op = nd.op
    a = [names[x] for x in nd.args]
    if op == "const":
        return float_literal(X.const_value(nd))
    if op == "iconst":
        return f"0x{nd.attr[0] & 0xFFFFFFFF:08x}u"
    if op in _FCALL:
        return f"{_FCALL[op]}({', '.join(a)})"
    if op == "neg":
        return f"-({a[0]})"
    if op == "round_f32":
        return a[0]
    if op in _INFIX:
        return f"{a[0]} {_INFIX[op]} {a[1]}"
    if op == "select":
        return f"{a[0]} ? {a[1]} : {a[2]}"
    if op == "not":
        return f"!{a[0]}"
    if op == "inot":
        return f"~{a[0]}"
    if op == "bits":
        return f"__float_as_uint({a[0]})"
    if op == "fbits":
        return f"__uint_as_float({a[0]})"
    if op == "islt":
        return f"(int){a[0]} < (int){a[1]}"
    raise ValueError(f"no CUDA rendering of {op!r}")
