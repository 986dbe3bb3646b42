#!/usr/bin/env python3
"""Measure the error of every transcendental expansion (tpp.core.transcendentals) as the CPU
backend renders it, against its exact float64 meaning (tpp.core.mathlib.PRIMS[name].exact).

Run:  python tools/measure_transcendentals.py [names...] [--exhaustive-log] [--n N]

For each function: N random bit patterns (every exponent, both signs), a dense grid over
[-30, 30] and the special values. Prints the max relative error where the exact result is a
normal f32 (the `bound` that tpp.core.mathlib states) and the max absolute error in units of 2^-149
where it is subnormal. --exhaustive-log runs log on every positive finite f32 (2^31 - 2^23
inputs, ~1 min), which is how log's bound was measured.
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


def kernel(name: str, w: int = 8):
    """numpy f32 array -> f32 array of the rendered expansion (W lanes per iteration)."""
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
    b.store(getattr(vecmath, name)(b, v), b.gep(dst, [i], source_etype=f32), align=4)
    i2 = b.add(i, ir.Constant(i64, w))
    i.add_incoming(i2, b.block)
    b.cbranch(b.icmp_signed("<", i2, n), loop, done)
    b.position_at_end(done)
    b.ret_void()
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
    of 2^-149 where it is subnormal, count of wrong non-finite results)."""
    with np.errstate(all="ignore"):
        want = np.asarray(mathlib.PRIMS[name].exact(x.astype(np.float64)), np.float64)
        got = y.astype(np.float64)
        finite = np.isfinite(want) & (np.abs(want) < 3.4028234663852886e38)
        bad = int(((np.isnan(want) != np.isnan(got)) |
                   (np.isinf(want) & (got != want))).sum())
        err = np.abs(got - want)
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
    args = ap.parse_args()
    x = inputs(args.n)
    for name in args.names:
        rel, at, sub, bad = errors(name, x, kernel(name)(x))
        print(f"{name:15s} max rel {rel:.3e} (x={at!r})  subnormal abs {sub:.2f} * 2^-149  "
              f"wrong specials {bad}   (stated bound {mathlib.PRIMS[name].bound:g})")
    if args.exhaustive_log:
        exhaustive_log()


if __name__ == "__main__":
    main()
