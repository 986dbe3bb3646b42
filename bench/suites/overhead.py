"""overhead: what one call costs on each of tpp's call paths, for work small enough that the
call is almost all of it. Times in microseconds per call, one thread, all measured in one
interleaved group (one sample of every call per round), so every ratio is of the same run.

A 64x64 f32 relu (shape [64, 64]):
  call_raw      k.raw(px, py): the compiled function through cffi with integer addresses, no
                checks; next to the floor, an empty JIT-compiled function of the same C
                signature called the same way (provider "cffi")
  call_out      k(x, out=y): the array API into a preallocated output (the fast path: C-
                contiguous numpy arrays of the spec's shapes); numpy np.maximum(x, 0, out=y),
                torch clamp_min(x, 0, out=y)
  call_alloc    k(x): the same, allocating the output; numpy np.maximum(x, 0), torch relu(x)
  call_checked  k(xs, out=ys) on 64x64 views of 64x128 arrays (row stride 128): the checked
                path; numpy np.maximum on the same views
  call_torch    k(tx, out=ty) on torch tensors (the checked path); torch clamp_min(out=)
A 16x16x16 f32 BRGEMM of one block, beta=0 (shape [16, 16, 16, 1]):
  brgemm_raw    mm.raw(pa, pb, pc, 0, 0, 1, 0, 0); cffi: an empty function of 8 arguments
  brgemm        mm(a, b, c): the checked call into a given C (every check: shapes, strides,
                C writable and not overlapping a or b); numpy np.matmul(a[0], b[0], out=c),
                torch matmul(out=c)
ops (threads 1):
  linear        ops.linear(x, pw) on 64x64x64 (shape [M, K, N]), pw = ops.pack_nk(w) once;
                numpy np.matmul(x, w.T), torch F.linear(x, w)
  Linear fwd    ops.torch.Linear(768, 768)(x) for x of shape (1, 768) (shape [1, 768, 768]),
                parameters requiring grad and grad mode on (autograd records the call);
                torch.nn.Linear(768, 768)(x)
  Linear fwd no_grad   the same under torch.no_grad()

The tpp records of the checked paths carry extra["raw_us"] (the raw call's median in the same
run: call_raw for the relu paths, brgemm_raw for brgemm) and extra["over_raw_us"] (the median
minus that: what the checks cost). --tiny: Linear(64, 64) on (1, 64).
"""
from __future__ import annotations

import functools

import numpy as np

from . import register
from ._common import empty, filled, team, time_record, timed_group
from ..timing import looped

M, N = 64, 64
BRGEMM = (16, 16, 16, 1)
LINEAR = (64, 64, 64)
LAYER = 768
_KEEP = []

# the case a checked path's record is compared with (extra["raw_us"], extra["over_raw_us"])
_RAW_OF = {"call_out": "call_raw", "call_alloc": "call_raw", "call_checked": "call_raw",
           "call_torch": "call_raw", "brgemm": "brgemm_raw"}


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
          help="per-call cost of each call path (raw, array API, checked, BRGEMM, ops.linear, "
               "ops.torch.Linear) vs numpy, torch and an empty cffi call")
def run(ctx):
    if not ctx.wants_dtype("f32"):   # every case is f32
        return
    # (case, provider) -> (shape, how, run(k))
    calls = {}
    with team(ctx, 1):
        _relu_calls(ctx, calls)
        _brgemm_calls(ctx, calls)
        _linear_calls(ctx, calls)
        _layer_calls(ctx, calls)
        names = {f"{case}:{prov}": (case, prov) for case, prov in calls}
        results = timed_group(ctx, "overhead", {name: calls[key][2]
                                                for name, key in names.items()})
    medians = {names[name]: stats.median for name, stats in results.items()}
    for name, (case, prov) in names.items():
        if name not in results:
            continue
        shape, how, _ = calls[case, prov]
        extra = {"call": how, "threads": 1}
        raw = medians.get((_RAW_OF.get(case), "tpp"))
        if prov == "tpp" and raw is not None:
            extra["raw_us"] = raw * 1e6
            extra["over_raw_us"] = (results[name].median - raw) * 1e6
        time_record(ctx, suite="overhead", case=case, provider=prov, shape=shape,
                    stats=results[name], unit="us", **extra)


def _relu_calls(ctx, calls):
    """The relu paths (call_raw, call_out, call_alloc, call_checked, call_torch)."""
    shape = (M, N)
    x = filled(np.random.default_rng(2).standard_normal(shape, dtype=np.float32))
    y = empty(shape)
    y[...] = 0
    xs, ys = empty((M, 2 * N))[:, :N], empty((M, 2 * N))[:, :N]    # row stride 2N: checked
    xs[...], ys[...] = x, 0
    torch = ctx.torch
    if ctx.wants("tpp"):
        try:
            import tpp
            k = tpp.unary("relu", M, N).compile()
            k(x, out=y), k(xs, out=ys)  # compile the array paths' variants too
        except Exception as exc:  # noqa: BLE001
            ctx.failed("overhead relu tpp", exc)
        else:
            px, py = x.ctypes.data, y.ctypes.data
            calls["call_raw", "tpp"] = (shape, "f = k.raw; f(px, py)", looped(k.raw, px, py))
            calls["call_out", "tpp"] = (shape, "k(x, out=y)", _kw_loop(k, (x,), y))
            calls["call_alloc", "tpp"] = (shape, "k(x)", looped(k, x))
            calls["call_checked", "tpp"] = (shape, "k(xs, out=ys), views of row stride "
                                            f"{2 * N}", _kw_loop(k, (xs,), ys))
            if torch is not None:
                tx, ty = torch.from_numpy(x), torch.from_numpy(y)
                calls["call_torch", "tpp"] = (shape, "k(tx, out=ty), torch tensors",
                                              _kw_loop(k, (tx,), ty))
    try:
        f = empty_function(2)
    except Exception as exc:  # noqa: BLE001
        ctx.failed("overhead empty cffi call", exc)
    else:
        calls["call_raw", "cffi"] = (shape, "empty JIT-compiled function through cffi (the "
                                     "floor)", looped(f, x.ctypes.data, y.ctypes.data))
    if ctx.wants("numpy"):
        zero = np.float32(0)
        calls["call_out", "numpy"] = (shape, "np.maximum(x, 0, out=y)",
                                      _kw_loop(np.maximum, (x, zero), y))
        calls["call_alloc", "numpy"] = (shape, "np.maximum(x, 0)", looped(np.maximum, x, zero))
        calls["call_checked", "numpy"] = (shape, "np.maximum(xs, 0, out=ys)",
                                          _kw_loop(np.maximum, (xs, zero), ys))
    if torch is not None:
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        clamp = _kw_loop(torch.clamp_min, (tx, 0.0), ty)
        calls["call_out", "torch"] = (shape, "torch.clamp_min(x, 0, out=y)", clamp)
        calls["call_torch", "torch"] = (shape, "torch.clamp_min(x, 0, out=y)", clamp)
        calls["call_alloc", "torch"] = (shape, "torch.relu(x)", looped(torch.relu, tx))


def _brgemm_calls(ctx, calls):
    """brgemm_raw and brgemm: one 16x16x16 block, beta=0, into a given C."""
    m, n, k, count = BRGEMM
    rng = np.random.default_rng(5)
    a = filled(rng.standard_normal((count, m, k), dtype=np.float32))
    b = filled(rng.standard_normal((count, k, n), dtype=np.float32))
    c = empty((m, n))
    if ctx.wants("tpp"):
        try:
            import tpp
            mm = tpp.brgemm(m, n, k).compile()
            mm(a, b, c)
        except Exception as exc:  # noqa: BLE001
            ctx.failed("overhead brgemm tpp", exc)
        else:
            pa, pb, pc = a.ctypes.data, b.ctypes.data, c.ctypes.data
            calls["brgemm_raw", "tpp"] = (BRGEMM, "f = mm.raw; f(pa, pb, pc, 0, 0, 1, 0, 0)",
                                          looped(mm.raw, pa, pb, pc, 0, 0, count, 0, 0))
            calls["brgemm", "tpp"] = (BRGEMM, "mm(a, b, c)", looped(mm, a, b, c))
    try:
        f = empty_function(8)
    except Exception as exc:  # noqa: BLE001
        ctx.failed("overhead empty cffi call", exc)
    else:
        calls["brgemm_raw", "cffi"] = (BRGEMM, "empty JIT-compiled function of 8 arguments "
                                       "through cffi (the floor)",
                                       looped(f, a.ctypes.data, b.ctypes.data, c.ctypes.data,
                                              0, 0, count, 0, 0))
    if ctx.wants("numpy"):
        cn = empty((m, n))
        calls["brgemm", "numpy"] = (BRGEMM, "np.matmul(a[0], b[0], out=c)",
                                    _kw_loop(np.matmul, (a[0], b[0]), cn))
    torch = ctx.torch
    if torch is not None:
        ta, tb, tc = torch.from_numpy(a[0]), torch.from_numpy(b[0]), torch.empty((m, n))
        calls["brgemm", "torch"] = (BRGEMM, "torch.matmul(a[0], b[0], out=c)",
                                    _kw_loop(torch.matmul, (ta, tb), tc))


def _linear_calls(ctx, calls):
    """linear: ops.linear on 64x64x64 with a weight packed once."""
    m, k, n = LINEAR
    rng = np.random.default_rng(3)
    x = filled(rng.standard_normal((m, k), dtype=np.float32))
    w = filled(rng.standard_normal((n, k), dtype=np.float32))
    if ctx.wants("tpp"):
        try:
            import ops
            pw = ops.pack_nk(w)
            ops.linear(x, pw)
        except Exception as exc:  # noqa: BLE001
            ctx.failed("overhead linear tpp", exc)
        else:
            calls["linear", "tpp"] = (LINEAR, "ops.linear(x, pw), pw = ops.pack_nk(w) once",
                                      looped(ops.linear, x, pw))
    if ctx.wants("numpy"):
        calls["linear", "numpy"] = (LINEAR, "np.matmul(x, w.T)", looped(np.matmul, x, w.T))
    torch = ctx.torch
    if torch is not None:
        calls["linear", "torch"] = (LINEAR, "torch.nn.functional.linear(x, w)",
                                    looped(torch.nn.functional.linear, torch.from_numpy(x),
                                           torch.from_numpy(w)))


def _layer_calls(ctx, calls):
    """Linear fwd (grad mode on) and Linear fwd no_grad: ops.torch.Linear vs torch.nn.Linear
    on one row."""
    torch = ctx.torch
    if torch is None:
        return
    width = 64 if ctx.config.tiny else LAYER
    shape = (1, width, width)
    torch.manual_seed(0)
    x = torch.randn(1, width)
    layers = {"torch": torch.nn.Linear(width, width)}
    if ctx.wants("tpp"):
        try:
            import ops.torch
            layer = ops.torch.Linear(width, width)
            layer(x)
            with torch.no_grad():
                layer(x)
        except Exception as exc:  # noqa: BLE001
            ctx.failed("overhead ops.torch.Linear", exc)
        else:
            layers["tpp"] = layer
    for prov, layer in layers.items():
        what = "ops.torch.Linear" if prov == "tpp" else "torch.nn.Linear"
        calls["Linear fwd", prov] = (shape, f"{what}({width}, {width})(x), x (1, {width})",
                                     looped(layer, x))
        calls["Linear fwd no_grad", prov] = (shape, "the same under torch.no_grad()",
                                             _no_grad_loop(torch, layer, x))


def _kw_loop(fn, args, out):
    def run(k):
        for _ in range(k):
            fn(*args, out=out)
    return run


def _no_grad_loop(torch, fn, x):
    def run(k):
        with torch.no_grad():
            for _ in range(k):
                fn(x)
    return run
