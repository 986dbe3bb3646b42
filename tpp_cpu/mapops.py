"""The f32 vector expression of every elementwise op, for the map generator.

Each emitter takes a MapContext and the loaded operand vectors (f32 vectors, or <w x i1>
vectors for bitmask inputs) and returns the output vector, or (output, bits) for ops that also
write a bitmask. The semantics they implement are `tpp.reference`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from tpp import reference

from . import irx, vecmath
from .irx import F32, I32, const, vec


@dataclass
class MapContext:
    b: ir.IRBuilder
    params: dict
    w: int            # lanes of this vector
    flat_index: object = None   # callable -> <w x i32> index i*n + j + lane (dropout)
    seed: object = None         # i64 value (dropout)

    def c(self, value):
        return const(vec(F32, self.w), value)

    def gt0(self, x):
        return self.b.fcmp_ordered(">", x, self.c(0.0))


def _expm1(ctx, x):
    """exp(x) - 1 without cancellation near 0 (Taylor degree 9 on |x| < 0.5)."""
    b = ctx.b
    poly = ctx.c(1.0 / 362880)
    for k in range(8, 0, -1):
        poly = irx.fma(b, poly, x, ctx.c(1.0 / _fact(k)))
    small = b.fmul(poly, x)
    big = b.fsub(vecmath.exp(b, x), ctx.c(1.0))
    return b.select(b.fcmp_ordered("<", irx.fabs(b, x), ctx.c(0.5)), small, big)


def _fact(k):
    out = 1
    for i in range(2, k + 1):
        out *= i
    return out


def _relu(ctx, x):
    y = ctx.b.select(ctx.b.fcmp_ordered("<=", x, ctx.c(0.0)), ctx.c(0.0), x)
    return (y, ctx.gt0(x)) if ctx.params["bitmask"] else y


def _gelu(ctx, x):
    if ctx.params["approximate"] == "tanh":
        return vecmath.gelu_tanh(ctx.b, x)
    return vecmath.gelu(ctx.b, x)


def _gelu_grad(ctx, x):
    if ctx.params["approximate"] == "tanh":
        return vecmath.gelu_tanh_grad(ctx.b, x)
    return vecmath.gelu_grad(ctx.b, x)


def _keep_bits(ctx):
    """<w x i1>: the dropout draw of each lane is >= the threshold (see reference.dropout_bits)."""
    b, w = ctx.b, ctx.w
    vi = vec(I32, w)
    seed_lo = irx.splat(b, b.trunc(ctx.seed, I32), w)
    seed_hi = irx.splat(b, b.trunc(b.lshr(ctx.seed, irx.i64(32)), I32), w)
    h = b.xor(b.mul(ctx.flat_index(), const(vi, 0x9E3779B9)), seed_lo)
    h = _fmix32(b, h, vi)
    h = _fmix32(b, b.xor(h, seed_hi), vi)
    threshold = reference.dropout_threshold(ctx.params["p"])
    return b.icmp_unsigned(">=", h, const(vi, threshold))


def _fmix32(b, h, vi):
    h = b.xor(h, b.lshr(h, const(vi, 16)))
    h = b.mul(h, const(vi, 0x85EBCA6B))
    h = b.xor(h, b.lshr(h, const(vi, 13)))
    h = b.mul(h, const(vi, 0xC2B2AE35))
    return b.xor(h, b.lshr(h, const(vi, 16)))


def _dropout(ctx, x):
    keep = _keep_bits(ctx)
    scale = ctx.c(float(reference.dropout_scale(ctx.params["p"])))
    return ctx.b.select(keep, ctx.b.fmul(x, scale), ctx.c(0.0)), keep


def _masked_scale(ctx, g, keep):
    if ctx.params.get("p") is None:
        return ctx.b.select(keep, g, ctx.c(0.0))
    scale = ctx.c(float(reference.dropout_scale(ctx.params["p"])))
    return ctx.b.select(keep, ctx.b.fmul(g, scale), ctx.c(0.0))


UNARY = {
    "identity": lambda ctx, x: x,
    "replicate_col": lambda ctx, x: x,
    "zero": lambda ctx: ctx.c(0.0),
    "square": lambda ctx, x: ctx.b.fmul(x, x),
    "sqrt": lambda ctx, x: irx.call(ctx.b, "llvm.sqrt", x),
    "rsqrt": lambda ctx, x: ctx.b.fdiv(ctx.c(1.0), irx.call(ctx.b, "llvm.sqrt", x)),
    "reciprocal": lambda ctx, x: ctx.b.fdiv(ctx.c(1.0), x),
    "exp": lambda ctx, x: vecmath.exp(ctx.b, x),
    "negate": lambda ctx, x: ctx.b.fneg(x),
    "abs": lambda ctx, x: irx.fabs(ctx.b, x),
    "increment": lambda ctx, x: ctx.b.fadd(x, ctx.c(1.0)),
    "relu": _relu,
    "leaky_relu": lambda ctx, x: ctx.b.select(
        ctx.gt0(x), x, ctx.b.fmul(x, ctx.c(ctx.params["alpha"]))),
    "elu": lambda ctx, x: ctx.b.select(
        ctx.gt0(x), x, ctx.b.fmul(_expm1(ctx, x), ctx.c(ctx.params["alpha"]))),
    "gelu": _gelu,
    "tanh": lambda ctx, x: vecmath.tanh(ctx.b, x),
    "sigmoid": lambda ctx, x: vecmath.sigmoid(ctx.b, x),
    "dropout": _dropout,
}

UNARY_INV = {
    "relu_inv": lambda ctx, g, s: ctx.b.select(
        s if s.type.element == irx.I1 else ctx.gt0(s), g, ctx.c(0.0)),
    "leaky_relu_inv": lambda ctx, g, s: ctx.b.select(
        ctx.gt0(s), g, ctx.b.fmul(g, ctx.c(ctx.params["alpha"]))),
    "elu_inv": lambda ctx, g, s: ctx.b.select(
        ctx.gt0(s), g, ctx.b.fmul(g, ctx.b.fadd(s, ctx.c(ctx.params["alpha"])))),
    "gelu_inv": lambda ctx, g, s: ctx.b.fmul(g, _gelu_grad(ctx, s)),
    "tanh_inv": lambda ctx, g, s: ctx.b.fmul(g, irx.fma(ctx.b, ctx.b.fneg(s), s, ctx.c(1.0))),
    "sigmoid_inv": lambda ctx, g, s: ctx.b.fmul(ctx.b.fmul(g, s), ctx.b.fsub(ctx.c(1.0), s)),
    "dropout_inv": _masked_scale,
}

BINARY = {
    "add": lambda ctx, a, b: ctx.b.fadd(a, b),
    "sub": lambda ctx, a, b: ctx.b.fsub(a, b),
    "mul": lambda ctx, a, b: ctx.b.fmul(a, b),
    "div": lambda ctx, a, b: ctx.b.fdiv(a, b),
    "max": lambda ctx, a, b: irx.call(ctx.b, "llvm.maximum", a, b),
    "min": lambda ctx, a, b: irx.call(ctx.b, "llvm.minimum", a, b),
    "muladd": lambda ctx, a, b, c: irx.fma(ctx.b, a, b, c),
}

_CMP = {"gt": (">", False), "ge": (">=", False), "lt": ("<", False), "le": ("<=", False),
        "eq": ("==", False), "ne": ("!=", True)}


def compare(ctx, op, a, b):
    """<w x i1> of `a op b`; ne is unordered (nan != anything), the rest ordered."""
    pred, unordered = _CMP[op]
    if unordered:
        return ctx.b.fcmp_unordered(pred, a, b)
    return ctx.b.fcmp_ordered(pred, a, b)
