"""The expression IR: one small set of scalar nodes in which every element-wise op, every
transcendental and every equation is written once, and which every backend renders.

A `Node` is an immutable value of one of three kinds, evaluated independently per element of an
(m, n) block:
  "f32"   a float32 value (arithmetic is IEEE f32, one rounding per node; fma rounds once)
  "i32"   a 32-bit integer (wrapping arithmetic; shifts and unsigned compares as in C on uint32)
  "bool"  a predicate (compares, masks read from a bitmask)

and of one *shape* saying how it varies over the block: "block" (per element), "row" (one value
per column, the same in every row: an (1, n) row), "col" (one value per row: an (m, 1) column)
or "scalar". Shapes combine by broadcasting. Reductions (`sum`, `max`, `min` along axis 1 -> a
"col" node, along axis 0 -> a "row" node) are nodes too; backends that render element-wise code
only (the map generators) never meet them.

Nodes are hash-consed: building the same (op, args, attr) twice returns the same object, so a
graph has no duplicate subexpressions by construction (common-subexpression elimination for
free, which `tpp.grad` relies on) and nodes compare and hash by identity.

Ops (kind of the result in brackets):
  leaves      input(name, shape) [f32], param(name) [f32 runtime scalar], const(value) [f32],
              iconst(value) [i32], index(which) [i32: "flat" = i*n + j, "row" = i, "col" = j],
              seed(word) [i32: the low (0) or high (1) word of the int64 seed argument],
              maskbit(name) [bool: the bit of element (i, j) of a bitmask input],
              extent(axis) [f32: the block's row count m (axis 0) or column count n (axis 1)]
  f32         add sub mul div fma(a, b, c) neg abs sqrt min max (both propagate NaN)
              select(c, a, b)  fbits(i) (i32 -> f32 bitcast)  round_f32(x) (no-op in f32;
              the rounding point of the float64 reference)
  compare     lt le gt ge eq (ordered: false on NaN) ne (unordered: true on NaN) [bool]
  bool        and_ or_ not_ ; select also chooses between bools
  i32         bits(x) (f32 -> i32 bitcast) iadd isub imul iand ior ixor inot shl lshr (logical)
              islt (signed <) iuge (unsigned >=) [bool]
  prim        a named transcendental (exp, log, erf, tanh, gelu, ...): see `tpp.core.mathlib`,
              which states each one's error bound, its exact float64 meaning (what the numpy
              reference computes) and its expansion into the nodes above (what the CPU and
              CUDA backends render, so both give the same bits)
  reduce      rsum rmax rmin with attr (axis,)
"""
from __future__ import annotations

import math
import struct
import threading

from .errors import SpecError

SHAPES = ("scalar", "row", "col", "block")
KINDS = ("f32", "i32", "bool")

_F32_BINARY = ("add", "sub", "mul", "div", "min", "max")
_F32_UNARY = ("neg", "abs", "sqrt", "round_f32")
COMPARES = ("lt", "le", "gt", "ge", "eq", "ne")
_INT_BINARY = ("iadd", "isub", "imul", "iand", "ior", "ixor", "shl", "lshr")
REDUCTIONS = ("rsum", "rmax", "rmin")
LEAVES = ("input", "param", "const", "iconst", "index", "seed", "maskbit", "extent")


def f32(value: float) -> float:
    """value rounded to the nearest float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", float(value)))[0]


def _join_shapes(shapes) -> str:
    """The broadcast of several shapes: row and col give block."""
    s = set(shapes) - {"scalar"}
    if not s:
        return "scalar"
    if len(s) == 1:
        return s.pop()
    return "block"


class Node:
    """One value of the IR (see the module docstring). Build nodes with the functions of this
    module or the arithmetic operators (+ - * / unary -, < <= > >= on f32 nodes; numbers
    become constants); == and != are identity (nodes are hash-consed), use eq()/ne() for
    comparisons of values."""

    __slots__ = ("op", "args", "attr", "kind", "shape", "__weakref__")

    def __init__(self, op, args, attr, kind, shape):
        self.op, self.args, self.attr, self.kind, self.shape = op, args, attr, kind, shape

    def __repr__(self):
        if self.op in LEAVES:
            return f"{self.op}{self.attr!r}"
        return f"{self.op}({', '.join(map(repr, self.args))}{', ' if self.attr else ''}" \
               f"{', '.join(map(repr, self.attr))})"

    # arithmetic sugar (f32 nodes)
    def __add__(self, o): return add(self, o)
    def __radd__(self, o): return add(o, self)
    def __sub__(self, o): return sub(self, o)
    def __rsub__(self, o): return sub(o, self)
    def __mul__(self, o): return mul(self, o)
    def __rmul__(self, o): return mul(o, self)
    def __truediv__(self, o): return div(self, o)
    def __rtruediv__(self, o): return div(o, self)
    def __neg__(self): return neg(self)
    def __lt__(self, o): return compare("lt", self, o)
    def __le__(self, o): return compare("le", self, o)
    def __gt__(self, o): return compare("gt", self, o)
    def __ge__(self, o): return compare("ge", self, o)
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __bool__(self):
        return True


_TABLE: dict = {}
_LOCK = threading.Lock()


def node(op, args=(), attr=(), kind="f32", shape=None) -> Node:
    """The unique node (op, args, attr); shape defaults to the broadcast of the args' shapes."""
    args = tuple(args)
    if shape is None:
        shape = _join_shapes(a.shape for a in args)
    key = (op, tuple(id(a) for a in args), attr, kind, shape)
    with _LOCK:
        found = _TABLE.get(key)
        if found is not None:
            return found[0]
        made = Node(op, args, attr, kind, shape)
        _TABLE[key] = (made, args)          # args kept alive so ids stay unique
        return made


def as_node(value) -> Node:
    if isinstance(value, Node):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"expected an expression node or a number, got {value!r}")
    return const(value)


def _f(value, what="operand") -> Node:
    n = as_node(value)
    if n.kind != "f32":
        raise SpecError(f"{what} must be an f32 expression, got a {n.kind} one: {n!r}")
    return n


def _i(value) -> Node:
    if isinstance(value, int) and not isinstance(value, bool):
        return iconst(value)
    if not isinstance(value, Node) or value.kind != "i32":
        raise SpecError(f"expected an i32 expression, got {value!r}")
    return value


# ---------------------------------------------------------------- leaves
def const(value) -> Node:
    """An f32 constant (value rounded to f32; -0.0, inf and nan are kept)."""
    v = f32(value)
    return node("const", (), (struct.pack("<f", v),), "f32", "scalar")


def const_value(n: Node) -> float:
    return struct.unpack("<f", n.attr[0])[0]


def iconst(value: int) -> Node:
    """An i32 constant, given as any integer (taken modulo 2**32)."""
    v = int(value) & 0xFFFFFFFF
    if v >= 2 ** 31:
        v -= 2 ** 32
    return node("iconst", (), (v,), "i32", "scalar")


def input(name: str, shape: str = "block") -> Node:  # noqa: A001 - the IR's own word
    if shape not in SHAPES:
        raise SpecError(f"input shape must be one of {SHAPES}, got {shape!r}")
    return node("input", (), (name,), "f32", shape)


def param(name: str) -> Node:
    """A runtime f32 scalar argument (or an op parameter bound at build time by `bind`)."""
    return node("param", (), (name,), "f32", "scalar")


def index(which: str = "flat") -> Node:
    if which not in ("flat", "row", "col"):
        raise SpecError(f"index must be 'flat', 'row' or 'col', got {which!r}")
    shape = {"flat": "block", "row": "col", "col": "row"}[which]
    return node("index", (), (which,), "i32", shape)


def seed(word: int) -> Node:
    return node("seed", (), (int(word),), "i32", "scalar")


def extent(axis: int) -> Node:
    """The number of rows (axis 0) or columns (axis 1) of the block, as an f32 scalar."""
    if axis not in (0, 1):
        raise SpecError(f"extent axis must be 0 or 1, got {axis!r}")
    return node("extent", (), (axis,), "f32", "scalar")


def maskbit(name: str, shape: str = "block") -> Node:
    return node("maskbit", (), (name,), "bool", shape)


# ---------------------------------------------------------------- f32 arithmetic
def _fold(op, a, b):
    """Constant folding of f32 constants (exact in f32 semantics), else None."""
    if a.op == "const" and b.op == "const":
        x, y = const_value(a), const_value(b)
        import numpy as np
        with np.errstate(all="ignore"):
            fx, fy = np.float32(x), np.float32(y)
            r = {"add": fx + fy, "sub": fx - fy, "mul": fx * fy, "div": fx / fy}.get(op)
        if r is not None:
            return const(float(r))
    return None


def _binary(op, a, b) -> Node:
    a, b = _f(a), _f(b)
    folded = _fold(op, a, b)
    return folded if folded is not None else node(op, (a, b))


def add(a, b): return _binary("add", a, b)
def sub(a, b): return _binary("sub", a, b)
def mul(a, b): return _binary("mul", a, b)
def div(a, b): return _binary("div", a, b)
def minimum(a, b): return _binary("min", a, b)
def maximum(a, b): return _binary("max", a, b)


def fma(a, b, c) -> Node:
    """a*b + c rounded once."""
    return node("fma", (_f(a), _f(b), _f(c)))


def _unary(op, x) -> Node:
    return node(op, (_f(x),))


def neg(x): return _unary("neg", x)
def fabs(x): return _unary("abs", x)
def sqrt(x): return _unary("sqrt", x)


def round_f32(x):
    """x itself in f32 code; marks where the float64 reference rounds to f32 (to reproduce a
    rounding that the f32 code does, e.g. the accumulator before a BRGEMM epilogue)."""
    return _unary("round_f32", x)


def compare(op, a, b) -> Node:
    if op not in COMPARES:
        raise SpecError(f"compare op must be one of {COMPARES}, got {op!r}")
    return node(op, (_f(a), _f(b)), kind="bool")


def select(cond, a, b) -> Node:
    """a where cond else b; cond a bool node, a and b of one kind."""
    if not isinstance(cond, Node) or cond.kind != "bool":
        raise SpecError(f"select's condition must be a bool expression, got {cond!r}")
    if isinstance(a, Node) and a.kind != "f32" or isinstance(b, Node) and b.kind != "f32":
        a, b = (a if isinstance(a, Node) else iconst(a)), (b if isinstance(b, Node) else iconst(b))
        if a.kind != b.kind:
            raise SpecError(f"select between a {a.kind} and a {b.kind} expression")
        return node("select", (cond, a, b), kind=a.kind)
    return node("select", (cond, _f(a), _f(b)))


def and_(a, b): return node("and", (a, b), kind="bool")
def or_(a, b): return node("or", (a, b), kind="bool")
def not_(a): return node("not", (a,), kind="bool")


# ---------------------------------------------------------------- i32
def bits(x) -> Node:
    """The bits of an f32 as an i32."""
    return node("bits", (_f(x),), kind="i32")


def fbits(i) -> Node:
    """The f32 whose bits are the i32 i."""
    return node("fbits", (_i(i),))


def _ibinary(op, a, b) -> Node:
    return node(op, (_i(a), _i(b)), kind="i32")


def iadd(a, b): return _ibinary("iadd", a, b)
def isub(a, b): return _ibinary("isub", a, b)
def imul(a, b): return _ibinary("imul", a, b)
def iand(a, b): return _ibinary("iand", a, b)
def ior(a, b): return _ibinary("ior", a, b)
def ixor(a, b): return _ibinary("ixor", a, b)
def shl(a, k): return _ibinary("shl", a, k)
def lshr(a, k): return _ibinary("lshr", a, k)
def inot(a): return node("inot", (_i(a),), kind="i32")
def islt(a, b): return node("islt", (_i(a), _i(b)), kind="bool")
def iuge(a, b): return node("iuge", (_i(a), _i(b)), kind="bool")


# ---------------------------------------------------------------- named transcendentals
def prim(name: str, *args) -> Node:
    """A named transcendental of `tpp.core.mathlib` applied to f32 args."""
    from . import mathlib
    if name not in mathlib.PRIMS:
        raise SpecError(f"unknown transcendental {name!r}; known: {', '.join(mathlib.PRIMS)}")
    return node("prim", tuple(_f(a) for a in args), (name,))


# ---------------------------------------------------------------- reductions
def reduce(op: str, x, axis: int) -> Node:
    """rsum / rmax / rmin of x along axis 1 (over the columns: one value per row, a "col"
    node) or axis 0 (over the rows: a "row" node)."""
    if op not in REDUCTIONS:
        raise SpecError(f"reduction must be one of {REDUCTIONS}, got {op!r}")
    if axis not in (0, 1):
        raise SpecError(f"reduction axis must be 0 or 1, got {axis!r}")
    x = _f(x)
    shape = {("block", 1): "col", ("row", 1): "scalar", ("block", 0): "row",
             ("col", 0): "scalar"}.get((x.shape, axis))
    if shape is None:
        raise SpecError(f"cannot reduce a {x.shape} expression along axis {axis} (it is "
                        f"already constant along it)")
    return node(op, (x,), (axis,), "f32", shape)


# ---------------------------------------------------------------- graph utilities
def topological(outputs, stop=None) -> list:
    """Every node the outputs depend on, each once, arguments before their users. `stop`
    (a predicate) marks nodes whose arguments are not visited (they are listed themselves)."""
    order, seen = [], set()
    stack = [(n, False) for n in reversed(list(outputs))]
    while stack:
        n, expanded = stack.pop()
        if id(n) in seen:
            continue
        if expanded:
            seen.add(id(n))
            order.append(n)
            continue
        stack.append((n, True))
        if stop is not None and stop(n):
            continue
        for a in reversed(n.args):
            if id(a) not in seen:
                stack.append((a, False))
    return order


def substitute(outputs, mapping: dict) -> list:
    """The outputs with every node in mapping (node -> node) replaced, rebuilt bottom-up."""
    memo = dict(mapping)

    def rebuild(n):
        got = memo.get(n)
        if got is not None:
            return got
        if not n.args:
            memo[n] = n
            return n
        args = tuple(rebuild(a) for a in n.args)
        if all(x is y for x, y in zip(args, n.args)):
            out = n
        else:
            out = node(n.op, args, n.attr, n.kind, None if n.op not in REDUCTIONS else
                       _reduced_shape(args[0].shape, n.attr[0]))
        memo[n] = out
        return out

    for n in topological(outputs):
        rebuild(n)
    return [memo[n] for n in outputs]


def _reduced_shape(shape, axis):
    return {("block", 1): "col", ("row", 1): "scalar", ("block", 0): "row",
            ("col", 0): "scalar", ("scalar", 0): "scalar", ("scalar", 1): "scalar",
            ("col", 1): "col", ("row", 0): "row"}[(shape, axis)]


def leaves(outputs, op: str) -> list:
    """The distinct leaves of one op ("input", "param", ...) in first-use order."""
    return [n for n in topological(outputs) if n.op == op]


def is_finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
