"""Reductions of vector accumulators in LLVM IR, shared by the equation generator's schedules:
each reduction op's identity, the combination of two vectors (NaN-propagating max/min), a
pairwise tree over accumulators and the horizontal combination of a vector's lanes."""
from __future__ import annotations

import math

from . import irx

IDENTITY = {"rsum": -0.0, "rmax": -math.inf, "rmin": math.inf}


def combine(b, op, x, y):
    if op == "rsum":
        return b.fadd(x, y)
    name = "llvm.maximum" if op == "rmax" else "llvm.minimum"
    fn = irx.intrinsic(b.module, name, x.type, [x.type, y.type])
    return b.call(fn, [x, y], fastmath=("nsz",))


def tree(b, op, values):
    """Combine accumulators pairwise."""
    values = list(values)
    while len(values) > 1:
        values = [combine(b, op, values[k], values[k + 1]) if k + 1 < len(values)
                  else values[k] for k in range(0, len(values), 2)]
    return values[0]


def horizontal(b, op, v):
    """All lanes of v combined, splat back to every lane."""
    w = v.type.count
    width = w
    while width > 1:
        half = width // 2
        hi = irx.shuffle(b, v, None, [half + (k % half) for k in range(w)])
        v = combine(b, op, v, hi)
        width = half
    return irx.shuffle(b, v, None, [0] * w)
