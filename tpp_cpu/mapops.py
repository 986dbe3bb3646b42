"""The LLVM vector code of an element-wise op: its one definition (`tpp.core.optable`), rendered
node by node by `tpp_cpu.expr_llvm`.

`render(info, params, b, w, values, flat_index=None, seed=None)` returns the op's output
vectors (the value, then the <w x i1> bits of an op that writes a bitmask) for one chunk of w
lanes. `values` maps each input operand name the definition reads ("in", "grad", "x", "mask",
"in0", ...) to its loaded value: a <w x float> vector (already widened to f32), or a <w x i1>
vector for a bitmask. `flat_index()` gives the <w x i32> flat element indices i*n + j of the
lanes and `seed` the i64 seed argument; only an op that draws random numbers (dropout) uses
them.
"""
from __future__ import annotations

from llvmlite import ir

from tpp.core import expr as X
from tpp.core import optable
from tpp.core.errors import UnsupportedError

from . import expr_llvm, irx
from .irx import I32


def render(info, params, b: ir.IRBuilder, w: int, values: dict, flat_index=None,
           seed=None) -> list:
    """The output vectors of `info`'s definition under params (see the module docstring)."""
    definition = optable.definition(info, params)
    cache = {}

    def leaf(nd):
        if nd.op in ("input", "maskbit"):
            return values[nd.attr[0]]
        if nd.op == "index" and nd.attr[0] == "flat" and flat_index is not None:
            if "flat" not in cache:
                cache["flat"] = flat_index()
            return cache["flat"]
        if nd.op == "seed" and seed is not None:
            word = seed if nd.attr[0] == 0 else b.lshr(seed, irx.i64(32))
            return irx.splat(b, b.trunc(word, I32), w)
        raise UnsupportedError(f"{info.name}: an element-wise kernel has no value for {nd!r}")

    return expr_llvm.render(list(definition.outputs), b, w, leaf)


def uses_transcendentals(info, params) -> bool:
    """Whether the op's definition calls a transcendental (long vector code)."""
    return any(nd.op == "prim" for nd in X.topological(optable.definition(info, params).outputs))


def vector_ops(info, params) -> int:
    """The vector operations of the op's definition per vector (expr_llvm.vector_ops)."""
    return expr_llvm.vector_ops(X.topological(optable.definition(info, params).outputs))
