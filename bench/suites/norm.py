"""norm: GB/s of LayerNorm, RMSNorm and softmax (ops.norms, TPP equations) vs torch, one thread.

Cases, f32, one thread (tpp and torch pinned to 1), shape rows x n:
  layer_norm fwd       ops.layer_norm(x, w, b)             vs F.layer_norm
  layer_norm fwd+bwd   layer_norm_forward + layer_norm_backward (dx, dw, db)
                                                            vs F.layer_norm + autograd.grad
  rms_norm fwd, rms_norm fwd+bwd    the same with ops.rms_norm_* vs F.rms_norm
  softmax fwd, softmax fwd+bwd      ops.softmax(_backward) vs torch.softmax (+ autograd.grad),
                                    on rows of 1024 and of 128 (the same element count)
  layer_norm fwd @16B, rms_norm fwd @16B, layer_norm fwd+bwd @16B
                       the same with every input 16 bytes past a cache line, where numpy puts
                       its large arrays (the other cases: at one, as torch does)
  copy                 np.copyto of an array of the same size (the yardstick, provider numpy)
  fused: bias+gelu, bias+gelu+dropout, softmax
                       one tpp.equation kernel over the whole block (provider tpp) vs the same
                       chain of separate TPP calls (provider chain: binary add with a row
                       broadcast, unary gelu, unary dropout; softmax as reduce_max, sub, exp,
                       reduce_sum, div), both writing preallocated outputs: the fusion's gain
                       is the traffic of the intermediates it never writes
Sizes: 4096 x 1024 (softmax also 32768 x 128); --quick (and the default set): 1024 x 1024 and
8192 x 128; --tiny: 64 x 128. GB/s counts the bytes a call must move once: forward read x +
write y (2 * rows * n * 4), the backward read x (or y) and dy and write dx (3 * rows * n * 4);
weights and per-row statistics are ignored (under 0.5 %). Every record carries
extra["copy_gbps"] (the copy measured in this run, at the same size) and
extra["copy_fraction"] (its GB/s over that copy's); tpp records get ratios vs torch from the
report (fill_ratios). Both providers allocate their outputs in every call, as a model does.
tpp's results are checked against torch's once per case (extra["verified"]).

Allocation: glibc's malloc is pinned for the whole run by the CLI (bench.timing.steady_malloc:
M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB), so that the pages of a freed 16 MB output stay in the process and
neither provider page-faults its outputs in the steady state. Left to glibc's dynamic
thresholds, whether a provider's outputs fault on every call is a matter of heap layout: after
the first free of an mmapped 16 MB chunk the trim threshold becomes 2 x 16 MB, and when a
call's freed outputs leave that much free at the top of the heap, glibc gives it back (brk)
and the next call faults 16 MB of fresh 4 KiB pages in again (~4096 faults, 2-3 ms of system
time per 16 MB here). Which provider that hits changes with the order of allocations: torch's
LayerNorm forward swung from 3.7 to 27 GB/s between runs (its fwd+bwd: 1600-6500 faults per
call in one process, none in another), ours (numpy arrays elsewhere in the heap) faulted none.
Every record carries extra["malloc"] ("steady", or "glibc default" where mallopt is missing).
Each provider keeps its last outputs alive until its next call (_private), so the two never
write into each other's freed buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import register
from ..timing import looped, steady_malloc
from ._common import bandwidth_record, empty, filled, quick_sizes, team, timed_group

SUITE = "norm"
SIZES = {"full": ((4096, 1024), (32768, 128)), "quick": ((1024, 1024), (8192, 128)),
         "tiny": ((64, 128), (64, 128))}
# numpy's large arrays start 16 bytes past a cache line (torch's at one): these cases take
# their inputs there (the case name says "@16B"; tpp_cpu.irx.HALF_BYTES tells the story)
NUMPY_PAST = 16
UNALIGNED = (("layer_norm", False), ("rms_norm", False), ("layer_norm", True))


@dataclass(frozen=True)
class Case:
    op: str             # layer_norm, rms_norm, softmax
    backward: bool
    rows: int
    n: int
    past: int = 0       # the inputs start this many bytes past a 64-byte boundary

    @property
    def name(self) -> str:
        where = f" @{self.past}B" if self.past else ""
        return f"{self.op} {'fwd+bwd' if self.backward else 'fwd'}{where}"

    @property
    def nbytes(self) -> int:
        return (5 if self.backward else 2) * self.rows * self.n * 4


def cases(mode: str) -> list:
    (m, n), (m_short, n_short) = SIZES[mode]
    out = [Case(op, bwd, m, n) for op in ("layer_norm", "rms_norm", "softmax")
           for bwd in (False, True)]
    out += [Case(op, bwd, m, n, NUMPY_PAST) for op, bwd in UNALIGNED]
    if (m_short, n_short) != (m, n):
        out += [Case("softmax", bwd, m_short, n_short) for bwd in (False, True)]
    return out


@register(SUITE, default=False,
          help="GB/s of LayerNorm, RMSNorm, softmax forward and forward+backward (ops.norms) "
               "vs torch, one thread, with the copy bandwidth of the same size")
def run(ctx):
    if not ctx.wants_dtype("f32"):
        return
    mode = "tiny" if ctx.config.tiny else ("quick" if quick_sizes(ctx) else "full")
    rng = np.random.default_rng(5)
    copies = {}
    global _MALLOC
    _MALLOC = steady_malloc()     # the CLI pinned it already (idempotent)
    with team(ctx, 1):
        for case in cases(mode):
            shape = (case.rows, case.n)
            if shape not in copies:
                copies[shape] = _copy(ctx, shape, rng)
            _run_case(ctx, case, rng, copies[shape])
        if ctx.wants("tpp"):
            for name in FUSED:
                _run_fused(ctx, name, SIZES[mode][0], rng)


_MALLOC = "glibc default"


def _copy(ctx, shape, rng):
    """Measure np.copyto of this shape (provider numpy, case copy); its GB/s or None."""
    if not ctx.wants("numpy"):
        return None
    x = filled(rng.standard_normal(shape, dtype=np.float32))
    out = empty(shape)
    out[...] = 0
    nbytes = 2 * x.nbytes
    stats = timed_group(ctx, f"norm copy {shape[0]}x{shape[1]}",
                        {"numpy": looped(np.copyto, out, x)}).get("numpy")
    if stats is None:
        return None
    rec = bandwidth_record(ctx, suite=SUITE, case="copy", provider="numpy", shape=shape,
                           stats=stats, nbytes=nbytes, threads=1, malloc=_MALLOC)
    return rec.median


def _data(case: Case, rng) -> dict:
    m, n, past = case.rows, case.n, case.past
    return {"x": filled(rng.standard_normal((m, n), dtype=np.float32) + np.float32(0.5), past),
            "dy": filled(rng.standard_normal((m, n), dtype=np.float32), past),
            "w": filled(rng.standard_normal(n, dtype=np.float32), past),
            "b": filled(rng.standard_normal(n, dtype=np.float32), past)}


def _tpp(case: Case, d: dict):
    """step() -> the outputs of one call (a tuple of arrays)."""
    import ops.norms as N
    x, dy, w, b = d["x"], d["dy"], d["w"], d["b"]
    if case.op == "layer_norm":
        if not case.backward:
            return lambda: (N.layer_norm(x, w, b),)

        def step():
            y, mean, rstd = N.layer_norm_forward(x, w, b)
            return (y, *N.layer_norm_backward(dy, x, mean, rstd, w))
        return step
    if case.op == "rms_norm":
        if not case.backward:
            return lambda: (N.rms_norm(x, w, 1e-6),)

        def step():
            y, rstd = N.rms_norm_forward(x, w, 1e-6)
            return (y, *N.rms_norm_backward(dy, x, rstd, w))
        return step
    if not case.backward:
        return lambda: (N.softmax(x),)

    def step():
        y = N.softmax(x)
        return y, N.softmax_backward(dy, y)
    return step


def _torch(torch, case: Case, d: dict):
    F = torch.nn.functional
    x, dy, w, b = (torch.from_numpy(d[k]) for k in ("x", "dy", "w", "b"))
    n = case.n
    if case.op == "layer_norm":
        fwd = lambda *t: F.layer_norm(t[0], (n,), t[1], t[2])      # noqa: E731
        args = (x, w, b)
    elif case.op == "rms_norm":
        fwd = lambda *t: F.rms_norm(t[0], (n,), t[1], 1e-6)        # noqa: E731
        args = (x, w)
    else:
        fwd = lambda *t: torch.softmax(t[0], -1)                   # noqa: E731
        args = (x,)
    if not case.backward:
        return lambda: (fwd(*args),)
    params = tuple(t.clone().requires_grad_() for t in args)
    grad = torch.autograd.grad

    def step():
        y = fwd(*params)
        return (y.detach(), *grad(y, params, dy))
    return step


def _run_case(ctx, case: Case, rng, copy_gbps):
    label = f"norm {case.name} {case.rows}x{case.n}"
    d = _data(case, rng)
    runs, steps = {}, {}
    if ctx.wants("tpp"):
        try:
            steps["tpp"] = _tpp(case, d)
            steps["tpp"]()       # compile outside the timing
        except Exception as exc:  # noqa: BLE001
            ctx.failed(f"{label} tpp", exc)
            steps.pop("tpp", None)
    torch = ctx.torch
    if torch is not None:
        steps["torch"] = _torch(torch, case, d)
    runs = {k: looped(_private(v)) for k, v in steps.items()}
    results = timed_group(ctx, label, runs)
    verified = None
    if "tpp" in steps and "torch" in steps and ctx.config.verify:
        verified = _verify(ctx, label, steps["tpp"](), steps["torch"]())
    for provider, stats in results.items():
        extra = {"threads": 1, "malloc": _MALLOC}
        if copy_gbps:
            extra["copy_gbps"] = copy_gbps
            extra["copy_fraction"] = case.nbytes / stats.median / 1e9 / copy_gbps
        if provider == "tpp" and verified is not None:
            extra["verified"] = verified
        bandwidth_record(ctx, suite=SUITE, case=case.name, provider=provider,
                         shape=(case.rows, case.n), stats=stats, nbytes=case.nbytes, **extra)


def _private(step):
    """step() that keeps its last outputs alive until its next call: each provider then
    alternates between two output buffers of its own and never writes into memory that the
    other provider has just freed. Where freed buffers were shared, what a call found in the
    caches was the other provider's doing: after our non-temporal stores the glibc heap gave
    torch that block uncached, after plain stores a cached one, and torch's LayerNorm forward
    (plain stores, each line read first) took 2.4-2.6 or 1.3-1.4 ms by that alone (a 2-core
    Xeon guest whose L3 held x and one 16 MB output, not much more). With private buffers
    each provider's working set is x and its own outputs, beyond that L3: the DRAM regime
    this suite measures, for both."""
    last = [None]

    def run():
        out = step()
        last[0] = out
        return out
    return run


def _verify(ctx, label, ours, theirs) -> bool | None:
    try:
        ok = True
        for a, t in zip(ours, theirs):
            if a is None:
                continue
            t = t.detach().numpy()
            scale = max(1.0, float(np.max(np.abs(t))))
            ok &= bool(np.allclose(np.asarray(a), t, rtol=1e-3, atol=1e-3 * scale))
    except Exception as exc:  # noqa: BLE001
        ctx.failed(f"{label} verification", exc)
        return None
    if not ok:
        ctx.note(f"{label} tpp: WRONG RESULTS vs torch; its bandwidth is not meaningful")
    return ok


# ---------------------------------------------------------------- fusion vs separate calls
FUSED = ("bias+gelu", "bias+gelu+dropout", "softmax")
_P = 0.1


def _fused_kernel(tpp, name, m, n):
    """The equation of a fused case: (kernel, output names)."""
    eq = tpp.equation(m, n)
    x = eq.input("x")
    if name == "softmax":
        e = eq.exp(x - eq.max(x, axis=1))
        return eq.compile(e / eq.sum(e, axis=1))
    y = eq.gelu(x + eq.input("b", bcast="row"))
    if name == "bias+gelu":
        return eq.compile(y)
    out, keep = eq.op("dropout", y, p=_P)
    return eq.compile(out, mask=keep)


def _chain(tpp, name, m, n, x, b, y, t, mask, col, col2):
    """run() of the separate TPP calls of a fused case, into preallocated arrays."""
    if name == "softmax":
        rmax, sub = tpp.unary("reduce_max", m, n, axis=1), tpp.binary("sub", m, n, bcast_in1="col")
        exp, rsum = tpp.unary("exp", m, n), tpp.unary("reduce_sum", m, n, axis=1)
        div = tpp.binary("div", m, n, bcast_in1="col")

        def run():
            rmax(x, out=col)
            sub(x, col, out=t)
            exp(t, out=t)
            rsum(t, out=col2)
            div(t, col2, out=y)
        return run
    add, gelu = tpp.binary("add", m, n, bcast_in1="row"), tpp.unary("gelu", m, n)
    if name == "bias+gelu":
        def run():
            add(x, b, out=t)
            gelu(t, out=y)
        return run
    drop = tpp.unary("dropout", m, n, p=_P)

    def run():
        add(x, b, out=t)
        gelu(t, out=t)
        drop(t, out=y, mask=mask, seed=7)
    return run


def _run_fused(ctx, name, shape, rng):
    import tpp
    m, n = shape
    label = f"norm fused {name} {m}x{n}"
    x = filled(rng.standard_normal(shape, dtype=np.float32))
    b = filled(rng.standard_normal(n, dtype=np.float32))
    y, t = empty(shape), empty(shape)
    mask = np.zeros((m, (n + 7) // 8), np.uint8)
    col, col2 = np.zeros(m, np.float32), np.zeros(m, np.float32)
    try:
        k = _fused_kernel(tpp, name, m, n)
        args = {"x": x} if name == "softmax" else {"x": x, "b": b}
        outs = {"out": y} if name != "bias+gelu+dropout" else {"out": y, "mask": mask}
        seed = {"seed": 7} if name == "bias+gelu+dropout" else {}
        fused = lambda: k(**args, **outs, **seed)          # noqa: E731
        chain = _chain(tpp, name, m, n, x, b, y, t, mask, col, col2)
        fused()
        chain()
    except Exception as exc:  # noqa: BLE001
        ctx.failed(label, exc)
        return
    results = timed_group(ctx, label, {"tpp": looped(fused), "chain": looped(chain)})
    nbytes = 2 * m * n * 4     # what the fused kernel must move: read x, write y
    for provider, stats in results.items():
        bandwidth_record(ctx, suite=SUITE, case=f"fused {name}", provider=provider,
                         shape=shape, stats=stats, nbytes=nbytes, threads=1)
