"""The LLVM rendering of the expression IR (`tpp.core.expr`): one instruction (or intrinsic) per node.

`render(outputs, b, w, leaf)` emits the nodes the outputs depend on, each once, as `w`-lane
vectors (f32 -> <w x float>, i32 -> <w x i32>, bool -> <w x i1>) and returns the outputs'
values. `leaf(node)` supplies the value of every node this module does not compute itself:
inputs, params, extents, indices, the seed words, mask bits and reduction results, already
widened to w lanes (a generator hoists broadcast leaves out of its loops and hands the same
value back each time). Named transcendentals render their `tpp.core.mathlib` expansion, so the
CPU runs exactly the code every other backend runs.
"""
from __future__ import annotations

from llvmlite import ir

from tpp.core import expr as X
from tpp.core import mathlib

from . import irx
from .irx import F32, I1, I32, const, vec

_FBIN = {"add": "fadd", "sub": "fsub", "mul": "fmul", "div": "fdiv"}
_IBIN = {"iadd": "add", "isub": "sub", "imul": "mul", "iand": "and_", "ior": "or_",
         "ixor": "xor", "shl": "shl", "lshr": "lshr"}
_ORDERED = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "=="}


def render(outputs, b: ir.IRBuilder, w: int, leaf, memo: dict | None = None) -> list:
    """The values of `outputs` (see the module docstring). `memo` (node -> value) may be
    shared between calls that emit into the same basic block, to reuse values."""
    memo = {} if memo is None else memo
    # values in memo, and reductions (which leaf() supplies), are not rendered from their args
    for nd in X.topological(outputs, lambda nd: nd in memo or nd.op in X.REDUCTIONS):
        if nd not in memo:
            memo[nd] = _emit(nd, b, w, leaf, memo)
    return [memo[o] for o in outputs]


def vector_ops(nodes) -> int:
    """The vector operations that rendering `nodes` (each on its own, leaves and constants
    free) costs: one per node, a named transcendental counted by its expansion (exp's about
    18, gelu's about 35). A generator's measure of how compute-bound a loop body is."""
    ops = 0
    for nd in nodes:
        if nd.op in X.LEAVES or nd.op in ("const", "iconst"):
            continue
        if nd.op == "prim":
            body = mathlib.PRIMS[nd.attr[0]].expand(*nd.args)
            ops += sum(1 for e in X.topological([body], lambda e: e in nd.args)
                       if e not in nd.args and e.op not in X.LEAVES
                       and e.op not in ("const", "iconst"))
        else:
            ops += 1
    return ops


def _emit(nd, b, w, leaf, memo):
    op = nd.op
    if op == "const":
        return const(vec(F32, w), X.const_value(nd))
    if op == "iconst":
        return const(vec(I32, w), nd.attr[0])
    if op in X.LEAVES or op in X.REDUCTIONS:
        return leaf(nd)
    a = [memo[x] for x in nd.args]
    if op in _FBIN:
        return getattr(b, _FBIN[op])(*a)
    if op == "fma":
        return irx.fma(b, *a)
    if op == "min":
        return irx.call(b, "llvm.minimum", *a)
    if op == "max":
        return irx.call(b, "llvm.maximum", *a)
    if op == "neg":
        return b.fneg(a[0])
    if op == "abs":
        return irx.fabs(b, a[0])
    if op == "sqrt":
        return irx.call(b, "llvm.sqrt", a[0])
    if op == "round_f32":
        return a[0]
    if op in _ORDERED:
        return b.fcmp_ordered(_ORDERED[op], *a)
    if op == "ne":
        return b.fcmp_unordered("!=", *a)
    if op == "select":
        return b.select(*a)
    if op == "and":
        return b.and_(*a)
    if op == "or":
        return b.or_(*a)
    if op == "not":
        return b.xor(a[0], const(vec(I1, w), 1))
    if op == "bits":
        return b.bitcast(a[0], vec(I32, w))
    if op == "fbits":
        return b.bitcast(a[0], vec(F32, w))
    if op in _IBIN:
        return getattr(b, _IBIN[op])(*a)
    if op == "inot":
        return b.not_(a[0])
    if op == "islt":
        return b.icmp_signed("<", *a)
    if op == "iuge":
        return b.icmp_unsigned(">=", *a)
    if op == "prim":
        return _prim(nd, b, w, leaf, memo)
    raise AssertionError(f"no LLVM rendering of {op!r}")


def _prim(nd, b, w, leaf, memo):
    """A named transcendental: its `tpp.core.mathlib` expansion, rendered like any other nodes."""
    body = mathlib.PRIMS[nd.attr[0]].expand(*nd.args)
    return render([body], b, w, leaf, memo)[0]
