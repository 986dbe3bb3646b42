"""overhead: what one call costs, for a block small enough that the work is almost nothing.

A 64x64 f32 relu through each of tpp's call paths:
  call_out    k(x, out=y)   the array API into a preallocated output (validation, ld from strides)
  call_alloc  k(x)          the array API allocating its output
  call_raw    k.raw(px, py) the raw-pointer path (a cffi call, no checks)
next to the floor: an empty JIT-compiled function of the same C signature called through cffi
exactly as k.raw is (case "call_raw", provider "cffi"), and numpy's np.maximum(x, 0, out=y) and
torch's clamp_min(x, 0, out=y) on the same arrays (case "call_out"). Times in microseconds.
"""
from __future__ import annotations

import functools

import numpy as np

from . import register
from ._common import empty, filled, time_record, timed_group
from ..timing import looped

M, N = 64, 64
_KEEP = []


@functools.lru_cache(maxsize=None)
def empty_function(nargs: int = 2):
    """A cffi function pointer to `void f(intptr_t, ...)` that returns at once (JIT-compiled by
    llvmlite, so it is called exactly like a tpp kernel's raw path)."""
    import cffi
    import llvmlite.binding as llvm
    import llvmlite.ir as ir

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    i64 = ir.IntType(64)
    module = ir.Module(name="bench_empty")
    module.triple = llvm.get_default_triple()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [i64] * nargs), name="bench_empty")
    ir.IRBuilder(fn.append_basic_block()).ret_void()
    tm = llvm.Target.from_default_triple().create_target_machine(codemodel="jitdefault")
    mod = llvm.parse_assembly(str(module))
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    addr = engine.get_function_address("bench_empty")
    ffi = cffi.FFI()
    f = ffi.cast(f"void(*)({', '.join(['intptr_t'] * nargs)})", addr)
    _KEEP.append((engine, ffi))   # the engine owns the code: keep it as long as the pointer
    return f


@register("overhead", default=True,
          help="per-call cost of a 64x64 relu: k(x, out=y), k(x), k.raw(px, py), empty cffi call")
def run(ctx):
    if not ctx.wants_dtype("f32"):   # its one case is an f32 relu
        return
    x = filled(np.random.default_rng(2).standard_normal((M, N), dtype=np.float32))
    y = empty((M, N))
    y[...] = 0
    # (case, provider) -> (how, run(k))
    calls = {}
    if ctx.wants("tpp"):
        try:
            import tpp
            k = tpp.unary("relu", M, N).compile()
            k(x, out=y)   # compile the array path's variant too
        except Exception as exc:  # noqa: BLE001
            ctx.failed("overhead relu tpp", exc)
        else:
            px, py = x.ctypes.data, y.ctypes.data
            calls["call_out", "tpp"] = ("k(x, out=y)", _kw_loop(k, (x,), y))
            calls["call_alloc", "tpp"] = ("k(x)", looped(k, x))
            calls["call_raw", "tpp"] = ("f = k.raw; f(px, py)", looped(k.raw, px, py))
    try:
        f = empty_function(2)
    except Exception as exc:  # noqa: BLE001
        ctx.failed("overhead empty cffi call", exc)
    else:
        calls["call_raw", "cffi"] = ("empty JIT-compiled function through cffi (the floor)",
                                     looped(f, x.ctypes.data, y.ctypes.data))
    if ctx.wants("numpy"):
        zero = np.float32(0)
        calls["call_out", "numpy"] = ("np.maximum(x, 0, out=y)", _kw_loop(np.maximum, (x, zero), y))
        calls["call_alloc", "numpy"] = ("np.maximum(x, 0)", looped(np.maximum, x, zero))
    torch = ctx.torch
    if torch is not None:
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        calls["call_out", "torch"] = ("torch.clamp_min(x, 0, out=y)",
                                      _kw_loop(torch.clamp_min, (tx, 0.0), ty))
        calls["call_alloc", "torch"] = ("torch.relu(x)", looped(torch.relu, tx))
    keys = {f"{case}:{prov}": (case, prov) for case, prov in calls}
    results = timed_group(ctx, "overhead", {name: calls[key][1] for name, key in keys.items()})
    for name, (case, prov) in keys.items():
        if name in results:
            time_record(ctx, suite="overhead", case=case, provider=prov, shape=(M, N),
                        stats=results[name], unit="us", call=calls[case, prov][0])


def _kw_loop(fn, args, out):
    def run(k):
        for _ in range(k):
            fn(*args, out=out)
    return run
