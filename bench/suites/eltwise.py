"""eltwise: bandwidth of elementwise, reduction and transform primitives vs numpy and torch.

Every case runs on the same f32 arrays for every provider, in the same run. Small blocks (the
working set within `_common.RAW_PATH_BYTES`) go through tpp's raw-pointer path in a loop, large
ones through the array API with `out=` preallocated; numpy and torch always write into
preallocated outputs where their API allows (torch tensors share the numpy arrays' memory).

GB/s counts the bytes a call must read and write once: 2*m*n*4 for copies, maps and
transposes, plus n*4 for a broadcast row, m*n*4 + m*4 for a row reduction. The first case of
each shape is a plain copy (tpp identity, np.copyto, torch copy_): the best copy at the memory
level of a shape is the yardstick there, as fast as any map can go, so `peak_fraction` divides
by the best copy measured at the same memory level in the run (this suite's and the peak
suite's) and never exceeds 1 (bench.records.settle_copy_peaks).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import register
from ._common import bandwidth_record, call_path, empty, filled, timed_group, tpp_runner

SHAPES = [(64, 64), (4096, 4096)]
TINY_SHAPES = [(64, 64), (256, 256)]

# rows checked against tpp.core.reference on large blocks (the reference is exact and slow)
_VERIFY_ROWS = 8


@dataclass(frozen=True)
class Case:
    name: str
    kernel: object          # (tpp, m, n) -> tpp.Kernel
    numpy: object | None    # (arrays) -> run(k), or None where numpy has no such op
    torch: object | None    # (torch, tensors) -> run(k)
    out_shape: object       # (m, n) -> shape of "out"
    extra_inputs: tuple = ()    # names of inputs besides "in"/"in0": ("in1",) = a row
    bytes: object = None    # (m, n) -> bytes per call
    rtol: float = 1e-4
    atol: float = 1e-5


def _loop(fn, *args):
    def run(k):
        for _ in range(k):
            fn(*args)
    return run


def _map_bytes(m, n):
    return 2 * m * n * 4


def _torch_relu(torch, t):
    # torch.relu has no out=; clamp_min(x, 0) is the same result written into a given output
    return _kw_loop(torch.clamp_min, (t["in"], 0.0), t["out"])


def _kw_loop(fn, args, out):
    def run(k):
        for _ in range(k):
            fn(*args, out=out)
    return run


def _torch_gelu(torch, t):
    # torch.nn.functional.gelu has no out=; this is the same ATen kernel with an output
    return _kw_loop(torch._C._nn.gelu, (t["in"],), t["out"])


def _np_transpose(a):
    copyto, y, xt = np.copyto, a["out"], a["in"].T
    return _loop(copyto, y, xt)


def _torch_transpose(torch, t):
    y, xt = t["out"], t["in"].t()
    return _loop(y.copy_, xt)


CASES = [
    Case("copy",
         kernel=lambda tpp, m, n: tpp.unary("identity", m, n),
         numpy=lambda a: _loop(np.copyto, a["out"], a["in"]),
         torch=lambda torch, t: _loop(t["out"].copy_, t["in"]),
         out_shape=lambda m, n: (m, n), bytes=_map_bytes, rtol=0, atol=0),
    Case("relu",
         kernel=lambda tpp, m, n: tpp.unary("relu", m, n),
         numpy=lambda a: _kw_loop(np.maximum, (a["in"], np.float32(0)), a["out"]),
         torch=_torch_relu,
         out_shape=lambda m, n: (m, n), bytes=_map_bytes),
    Case("gelu",
         kernel=lambda tpp, m, n: tpp.unary("gelu", m, n),
         numpy=None,   # numpy has no erf; composing one from ufuncs would not be numpy's speed
         torch=_torch_gelu,
         out_shape=lambda m, n: (m, n), bytes=_map_bytes),
    Case("exp",
         kernel=lambda tpp, m, n: tpp.unary("exp", m, n),
         numpy=lambda a: _kw_loop(np.exp, (a["in"],), a["out"]),
         torch=lambda torch, t: _kw_loop(torch.exp, (t["in"],), t["out"]),
         out_shape=lambda m, n: (m, n), bytes=_map_bytes),
    Case("add_row",
         kernel=lambda tpp, m, n: tpp.binary("add", m, n, bcast_in1="row"),
         numpy=lambda a: _kw_loop(np.add, (a["in"], a["in1"]), a["out"]),
         torch=lambda torch, t: _kw_loop(torch.add, (t["in"], t["in1"]), t["out"]),
         out_shape=lambda m, n: (m, n), extra_inputs=("in1",),
         bytes=lambda m, n: 2 * m * n * 4 + n * 4),
    Case("reduce_sum",
         kernel=lambda tpp, m, n: tpp.unary("reduce_sum", m, n, axis=1),
         numpy=lambda a: _kw_loop(np.sum, (a["in"], 1), a["out"]),
         torch=lambda torch, t: _kw_loop(torch.sum, (t["in"], 1), t["out"]),
         out_shape=lambda m, n: (m,), bytes=lambda m, n: m * n * 4 + m * 4,
         rtol=1e-3, atol=1e-3),
    Case("transpose",
         kernel=lambda tpp, m, n: tpp.unary("transpose", m, n),
         numpy=_np_transpose,
         torch=_torch_transpose,
         out_shape=lambda m, n: (n, m), bytes=_map_bytes, rtol=0, atol=0),
]

CASE_NAMES = tuple(c.name for c in CASES)


def shapes(ctx) -> list:
    if ctx.config.shapes:
        return list(ctx.config.shapes)
    return TINY_SHAPES if ctx.config.tiny else SHAPES


@register("eltwise", default=True, requires=("peak",),
          help="GB/s of copy, relu, gelu, exp, add (row bcast), reduce_sum, transpose vs numpy, "
               "torch")
def run(ctx):
    if not ctx.wants_dtype("f32"):   # every case is f32
        return
    rng = np.random.default_rng(1)
    for m, n in shapes(ctx):
        x = filled(rng.standard_normal((m, n), dtype=np.float32))
        row = filled(rng.standard_normal(n, dtype=np.float32))
        outs = {}
        for case in CASES:
            oshape = case.out_shape(m, n)
            if oshape not in outs:   # allocated once per shape, outside every timed loop
                outs[oshape] = empty(oshape)
                outs[oshape][...] = 0
            arrays = {"in": x, "out": outs[oshape]}
            if "in1" in case.extra_inputs:
                arrays["in1"] = row
            _run_case(ctx, case, m, n, arrays)
        del x, row, outs


def _run_case(ctx, case: Case, m: int, n: int, arrays: dict):
    nbytes = case.bytes(m, n)
    label = f"eltwise {case.name} {m}x{n}"
    runs = {}
    path = call_path(nbytes)
    k = named = None
    if ctx.wants("tpp"):
        try:
            import tpp
            k = case.kernel(tpp, m, n)
            named = _tpp_arrays(k, arrays)
            runs["tpp"] = tpp_runner(k, named, path)
        except Exception as exc:  # noqa: BLE001 - e.g. an op whose generator is not there yet
            ctx.failed(f"{label} tpp", exc)
    if ctx.wants("numpy") and case.numpy is not None:
        runs["numpy"] = case.numpy(arrays)
    torch = ctx.torch if case.torch is not None else None
    if torch is not None:
        tensors = {name: torch.from_numpy(a) for name, a in arrays.items()}
        try:
            runs["torch"] = case.torch(torch, tensors)
        except Exception as exc:  # noqa: BLE001
            ctx.failed(f"{label} torch", exc)
    results = timed_group(ctx, label, runs)
    for provider in ("tpp", "numpy", "torch"):
        stats = results.get(provider)
        if stats is None:
            continue
        extra = {}
        if provider == "tpp":
            extra["path"] = path
            if ctx.config.verify:
                runs["tpp"](1)   # the output holds tpp's result again (the others wrote it too)
                extra["verified"] = _verify(ctx, label, k, named, case)
        bandwidth_record(ctx, suite="eltwise", case=case.name, provider=provider, shape=(m, n),
                         stats=stats, nbytes=nbytes, **extra)


def _tpp_arrays(k, arrays: dict) -> dict:
    """The case's arrays under the kernel's operand names (binary ops call theirs in0/in1)."""
    named = {}
    for o in k.spec.operands():
        key = "in" if o.name == "in0" else o.name
        named[o.name] = arrays[key]
    return named


def _verify(ctx, label, k, named, case) -> bool | None:
    """Compare the output the timed calls left with tpp.core.reference on the first rows."""
    import tpp
    spec = k.spec
    rows = min(spec.m, _VERIFY_ROWS)
    try:
        sub = spec.replace(m=rows) if rows != spec.m else spec
        inputs = []
        for o in sub.operands():
            if o.role == "in":
                a = named[o.name]
                inputs.append(a[:rows] if o.layout == "block" else a)
        want = tpp.core.reference.run(sub, *inputs)
        out_op = [o for o in sub.operands() if o.role != "in"][0]
        got = named["out"]
        if out_op.layout == "block":
            got = got[:out_op.rows, :out_op.cols]
        else:
            got = got[:out_op.cols]
        ok = bool(np.allclose(got, want, rtol=case.rtol, atol=case.atol, equal_nan=True))
    except Exception as exc:  # noqa: BLE001
        ctx.failed(f"{label} tpp verification", exc)
        return None
    if not ok:
        err = float(np.max(np.abs(got.astype(np.float64) - want)))
        ctx.note(f"{label} tpp: WRONG RESULTS (max abs error {err:.3g} vs tpp.core.reference); "
                 f"its bandwidth is not meaningful")
    return ok
