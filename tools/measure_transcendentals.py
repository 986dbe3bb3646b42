#!/usr/bin/env python3
"""Measure the error of every transcendental expansion (tpp.core.transcendentals) as the CPU
backend renders it, against its exact float64 meaning (tpp.core.mathlib.PRIMS[name].exact).

Run:  python tools/measure_transcendentals.py [names...] [--exhaustive-log] [--n N]
      python tools/measure_transcendentals.py --exhaustive-exp-nonpos
      python tools/measure_transcendentals.py --fit-exp-nonpos

For each function: N random bit patterns (every exponent, both signs), a dense grid over
[-30, 30] and the special values. Prints the max relative error where the exact result is a
normal f32 (the `bound` that tpp.core.mathlib states) and the max absolute error in units of 2^-149
where it is subnormal. --exhaustive-log runs log on every positive finite f32 (2^31 - 2^23
inputs, ~1 min), which is how log's bound was measured. --exhaustive-exp-nonpos runs exp_nonpos
on every f32 in [-104, 44] (its whole non-trivial domain: about 2.2e9 inputs, a few minutes),
which is how its bound was measured. --fit-exp-nonpos prints the coefficients
EXP_NONPOS_P of tpp.core.mathlib_coeffs (fit_exp_nonpos).

Inputs outside a prim's `domain` (exp_nonpos: x > 44) are not measured.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import llvmlite.binding as llvm  # noqa: E402
import llvmlite.ir as ir  # noqa: E402

from tpp.core import mathlib  # noqa: E402
from tpp_cpu import vecmath  # noqa: E402

TINY = 2.0 ** -126
_ENGINES = []


def module(name: str, w: int = 8):
    """The LLVM module of f(src, dst, n): dst = name(src), W lanes per iteration."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = ir.Module(name=name)
    mod.triple = llvm.get_process_triple()
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vty = ir.VectorType(f32, w)
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ir.PointerType()] * 2 + [i64]), "f")
    src, dst, n = fn.args
    entry, loop, done = (fn.append_basic_block(s) for s in ("entry", "loop", "exit"))
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_signed(">", n, ir.Constant(i64, 0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), entry)
    v = b.load(b.gep(src, [i], source_etype=f32), typ=vty, align=4)
    b.store(vecmath._render(name, b, v), b.gep(dst, [i], source_etype=f32), align=4)
    i2 = b.add(i, ir.Constant(i64, w))
    i.add_incoming(i2, b.block)
    b.cbranch(b.icmp_signed("<", i2, n), loop, done)
    b.position_at_end(done)
    b.ret_void()
    return mod


def kernel(name: str, w: int = 8):
    """numpy f32 array -> f32 array of the rendered expansion (W lanes per iteration)."""
    mod = module(name, w)
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    parsed = llvm.parse_assembly(str(mod))
    ee = llvm.create_mcjit_compiler(parsed, tm)
    ee.finalize_object()
    _ENGINES.append(ee)
    cf = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        ee.get_function_address("f"))

    def call(x):
        x = np.ascontiguousarray(x, np.float32)
        m = -(-len(x) // w) * w
        buf = np.zeros(m, np.float32)
        buf[:len(x)] = x
        out = np.empty(m, np.float32)
        cf(buf.ctypes.data, out.ctypes.data, m)
        return out[:len(x)]
    return call


def errors(name: str, x: np.ndarray, y: np.ndarray):
    """(max relative error where the exact result is normal, its x, max absolute error in units
    of 2^-149 where it is subnormal, count of wrong non-finite results and of flushed results
    other than a zero of the exact result's sign), over the inputs in
    the prim's domain (NaN included)."""
    lo, hi = mathlib.PRIMS[name].domain
    keep = ~((x < lo) | (x > hi))
    x, y = x[keep], y[keep]
    with np.errstate(all="ignore"):
        want = np.asarray(mathlib.PRIMS[name].exact(x.astype(np.float64)), np.float64)
        got = y.astype(np.float64)
        finite = np.isfinite(want) & (np.abs(want) < 3.4028234663852886e38)
        bad = int(((np.isnan(want) != np.isnan(got)) |
                   (np.isinf(want) & (got != want))).sum())
        err = np.abs(got - want)
        flush = mathlib.PRIMS[name].flush_below
        if flush is not None:           # a zero of the exact sign there: anything else is wrong
            dead = x < np.float32(flush)
            sign = (want != 0) & (np.signbit(got) != np.signbit(want))   # want 0: either
            bad += int((dead & ((got != 0) | sign)).sum())
            finite &= ~dead
        normal = finite & (np.abs(want) >= TINY)
        rel = np.where(normal, err / np.where(normal, np.abs(want), 1.0), 0.0)
        sub = finite & ~normal
        k = int(np.argmax(rel)) if rel.size else 0
        return (float(rel[k]) if rel.size else 0.0, float(x[k]) if rel.size else 0.0,
                float(err[sub].max(initial=0.0)) / 2.0 ** -149, bad)


def inputs(n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    grid = np.linspace(-30.0, 30.0, n, dtype=np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, TINY, 1.0, -1.0,
                         88.72, 89.0, -104.0, 3.4e38, -3.4e38], np.float32)
    return np.concatenate([pattern, grid, specials])


def fit_exp_nonpos():
    """EXP_NONPOS_P: P(r) = 1 + r q(r) ~ e^r, |r| <= ln2/2 (+0.2 %), q of degree 4 fitted by
    tools/fit_vecmath.py's weighted Remez (relative error of e^r), float32 rounding with re-fit."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fit_vecmath as fv
    half = np.log(2.0) / 2 * 1.002
    g = lambda r: np.where(r == 0, 1.0, np.expm1(r) / np.where(r == 0, 1.0, r))  # noqa: E731
    _, co = fv.fit_f32(g, lambda r: np.abs(r) * np.exp(-r) + 1e-300, -half, half, range(5))
    return (1.0,) + tuple(fv.as_list(co))


def exhaustive_exp_nonpos():
    f = kernel("exp_nonpos")
    worst, sub, bad = (0.0, 0.0), 0.0, 0
    for lo, hi in ((-104.0, -0.0), (0.0, 44.0)):
        a, b = np.array([lo, hi], np.float32).view(np.uint32).astype(np.int64)
        first, last = min(a, b), max(a, b)
        for start in range(int(first), int(last) + 1, 1 << 24):
            x = np.arange(start, min(start + (1 << 24), int(last) + 1),
                          dtype=np.int64).astype(np.uint32).view(np.float32)
            rel, at, s, bd = errors("exp_nonpos", x, f(x))
            worst, sub, bad = max(worst, (rel, at)), max(sub, s), bad + bd
    print(f"exp_nonpos exhaustive (every f32 in [-104, 44]): max rel {worst[0]:.3e} at "
          f"x={worst[1]!r}, subnormal abs {sub:.2f} * 2^-149, {bad} wrong specials")


def exhaustive_log():
    f = kernel("log")
    worst = (0.0, 0.0)
    bad = 0
    top = np.uint32(0x7F800000)
    step = 1 << 24
    for start in range(1, int(top), step):
        x = np.arange(start, min(start + step, int(top)), dtype=np.uint32).view(np.float32)
        rel, at, _, b = errors("log", x, f(x))
        bad += b
        worst = max(worst, (rel, at))
    print(f"log exhaustive (every positive finite f32): max rel {worst[0]:.3e} at x={worst[1]!r}"
          f", {bad} wrong specials")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=list(mathlib.PRIMS))
    ap.add_argument("--n", type=int, default=2_000_000)
    ap.add_argument("--exhaustive-log", action="store_true")
    ap.add_argument("--exhaustive-exp-nonpos", action="store_true")
    ap.add_argument("--fit-exp-nonpos", action="store_true")
    args = ap.parse_args()
    if args.fit_exp_nonpos:
        print("EXP_NONPOS_P = (\n" + "".join(f"    {c!r},\n" for c in fit_exp_nonpos()) + ")")
        return
    x = inputs(args.n)
    for name in args.names:
        rel, at, sub, bad = errors(name, x, kernel(name)(x))
        print(f"{name:15s} max rel {rel:.3e} (x={at!r})  subnormal abs {sub:.2f} * 2^-149  "
              f"wrong specials {bad}   (stated bound {mathlib.PRIMS[name].bound:g})")
    if args.exhaustive_log:
        exhaustive_log()
    if args.exhaustive_exp_nonpos:
        exhaustive_exp_nonpos()


if __name__ == "__main__":
    main()
