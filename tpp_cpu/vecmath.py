"""Vector float32 transcendentals as straight-line LLVM IR: `f(builder, x) -> value`.

A thin shim over the expression IR: each function renders the `tpp.core.mathlib` expansion of the
transcendental of its name (`tpp.core.transcendentals`, which documents the methods, special values
and costs) with `tpp_cpu.expr_llvm`. `x` is an `llvmlite.ir.Value` of type `<W x float>` (any
W >= 1) or a plain `float`; the result has the same type and is bitwise the same for every W.
The IR is branch-free and calls only LLVM intrinsics, declared on `builder.module`.
"""
from llvmlite import ir

from tpp.core import expr as X
from tpp.core import mathlib
from tpp.core.mathlib_coeffs import *  # noqa: F401,F403  (the fitted tables, for tools and tests)

from . import expr_llvm
from .irx import F32, I32

__all__ = ["exp", "expm1", "log", "sigmoid", "tanh", "erf", "erfc", "gelu", "gelu_grad",
           "gelu_tanh", "gelu_tanh_grad"]


def _render(name, b: ir.IRBuilder, x):
    """The expansion of transcendental `name` applied to x (<W x float> or float)."""
    scalar = isinstance(x.type, ir.FloatType)
    if not scalar and not (isinstance(x.type, ir.VectorType) and x.type.element == F32):
        raise TypeError(f"vecmath: expected <W x float> or float, got {x.type}")
    xv = b.insert_element(ir.Constant(ir.VectorType(F32, 1), None), x, ir.Constant(I32, 0)) \
        if scalar else x
    node = X.input("x")
    out = expr_llvm.render([mathlib.PRIMS[name].expand(node)], b, xv.type.count,
                           lambda nd: xv)[0]
    return b.extract_element(out, ir.Constant(I32, 0)) if scalar else out


def _function(name):
    def f(b, x):
        return _render(name, b, x)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"{name}(x) rendered from tpp.core.transcendentals.{name}."
    return f


exp = _function("exp")
expm1 = _function("expm1")
log = _function("log")
sigmoid = _function("sigmoid")
tanh = _function("tanh")
erf = _function("erf")
erfc = _function("erfc")
gelu = _function("gelu")
gelu_grad = _function("gelu_grad")
gelu_tanh = _function("gelu_tanh")
gelu_tanh_grad = _function("gelu_tanh_grad")
