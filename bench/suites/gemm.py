"""gemm: GFLOP/s of ops.matmul (weights packed once) vs numpy and torch, on a thread team.

Cases, shape [M, K, N], GFLOP/s counting 2*M*K*N per call: f32 and bf16 (bf16 A and B, f32
accumulation, bf16 C) at 512^3 and 1024^3, f32 also at 2048^3 and at 1000^3 (no dimension a
multiple of the blocks: tail kernels); --quick (and the default set): 256^3 and 512^3 only.
Cases run on every core (or --threads N, N > 1; case names end in "t<threads>"), and f32
1024^3 and 2048^3 (the GEMM issue's OpenBLAS targets) once more on one thread ("f32 t1"; the
team's record carries extra["vs_t1"], its rate over it). `peak_fraction` divides by the peak
suite's one-core compute peak times the threads.
One overhead case: ops.linear on 64x64x64 f32, one thread, in microseconds per call.

tpp: ops.matmul(a, b_packed, out=c), B packed by ops.pack_kn before timing. numpy: np.matmul
into a preallocated C, on f32 (the bf16 case: exact f32 copies of the bf16 values; numpy has no
bf16 matmul); its BLAS keeps the thread count it was pinned to at import unless threadpoolctl
is installed (extra["threads"] says which). torch: torch.matmul(out=c) in the case's dtype, on
the case's threads; a reference predicted slow (torch bf16 without native bf16: ~1 GFLOP/s) is
measured alone within a time budget (_common.capped_group). Everything on the wall clock but
the overhead case (a team's work is not the calling thread's CPU time). --shapes is eltwise's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import register
from ..timing import looped
from ._common import (all_threads, big_settings, capped_group, compute_record, empty, filled,
                      quick_sizes, team, time_record, timed_group, torch_gflops)

SUITE = "gemm"
LINEAR = (64, 64, 64)       # the overhead case, M x K x N


@dataclass(frozen=True)
class Case:
    dtype: str
    m: int
    k: int
    n: int
    threads: int

    @property
    def name(self) -> str:
        return f"{self.dtype} t{self.threads}"

    @property
    def shape(self) -> tuple:
        return (self.m, self.k, self.n)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


def cases(ctx) -> list:
    team_size = all_threads(ctx)
    if ctx.config.tiny:
        f32, bf16, extra = [(64, 64, 64), (50, 70, 90)], [(64, 64, 64)], [(64, 64, 64)]
    elif quick_sizes(ctx):
        f32 = bf16 = [(256, 256, 256), (512, 512, 512)]
        extra = []
    else:
        f32 = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (1000, 1000, 1000)]
        bf16, extra = f32[:2], [(1024, 1024, 1024), (2048, 2048, 2048)]
    out = [Case("f32", *s, team_size) for s in f32]
    if team_size > 1:   # the one-thread twins, next to their team's case
        for s in extra:
            at = next(i for i, c in enumerate(out) if c.shape == s)
            out.insert(at + 1, Case("f32", *s, 1))
    return out + [Case("bf16", *s, team_size) for s in bf16]


@register(SUITE, default=True, requires=("peak",),
          help="GFLOP/s of ops.matmul (f32, bf16; packed weights; all cores) vs numpy, torch")
def run(ctx):
    rng = np.random.default_rng(3)
    ours, np_threads = {}, set()
    for case in cases(ctx):
        if ctx.wants_dtype(case.dtype):
            ours[case] = _run_case(ctx, case, rng, np_threads)
    for case, rec in ours.items():      # the 1 -> team scaling
        twin = Case(case.dtype, *case.shape, 1)
        if rec is not None and case.threads > 1 and ours.get(twin) is not None:
            rec.extra["vs_t1"] = rec.median / ours[twin].median
    if ctx.wants_dtype("f32"):
        _overhead(ctx, rng)
    if np_threads:
        blas = ", ".join(sorted({str(t or "unknown") for _, t in np_threads}))
        names = ", ".join(sorted({name for name, _ in np_threads}))
        ctx.note(f"gemm: numpy's BLAS ran {blas} thread(s), fixed at import (threadpoolctl "
                 f"is not installed): in {names} its ratio compares other thread counts")


def _data(case: Case, rng):
    """(a, b) in the case's dtype and their exact f32 values (a32, b32)."""
    a32 = rng.standard_normal((case.m, case.k), dtype=np.float32)
    b32 = rng.standard_normal((case.k, case.n), dtype=np.float32)
    if case.dtype == "bf16":
        import tpp
        bf = tpp.BF16.numpy
        a, b = filled(a32.astype(bf)), filled(b32.astype(bf))
        return a, b, filled(a.astype(np.float32)), filled(b.astype(np.float32))
    a, b = filled(a32), filled(b32)
    return a, b, a, b


def _run_case(ctx, case: Case, rng, np_threads: set):
    """Measure every provider on one case; returns tpp's record (or None)."""
    label = f"gemm {case.name} {'x'.join(map(str, case.shape))}"
    a, b, a32, b32 = _data(case, rng)
    runs, predicted, c = {}, {}, None
    with team(ctx, case.threads) as blas_threads:
        if ctx.wants("tpp"):
            try:
                import ops
                packed = ops.pack_kn(b)
                c = empty((case.m, case.n), a.dtype)
                runs["tpp"] = looped(functools.partial(ops.matmul, out=c), a, packed)
            except Exception as exc:  # noqa: BLE001
                ctx.failed(f"{label} tpp", exc)
        if ctx.wants("numpy"):
            if blas_threads != case.threads:
                np_threads.add((case.name, blas_threads))
            cn = empty((case.m, case.n))
            runs["numpy"] = looped(functools.partial(np.matmul, out=cn), a32, b32)
        torch = ctx.torch
        if torch is not None:
            tdt = torch.bfloat16 if case.dtype == "bf16" else torch.float32
            ta, tb = torch.from_numpy(a32).to(tdt), torch.from_numpy(b32).to(tdt)
            tc = torch.empty((case.m, case.n), dtype=tdt)
            runs["torch"] = looped(functools.partial(torch.matmul, out=tc), ta, tb)
            if case.dtype == "bf16":    # slow where the CPU has no bf16 dot (f32: BLAS)
                predicted["torch"] = case.flops / 1e9 / torch_gflops(torch, case.threads)
        results = capped_group(ctx, label, runs, big_settings(ctx), predicted)
    threads = {"tpp": case.threads, "numpy": blas_threads, "torch": case.threads}
    notes = {"numpy": "f32 copies (numpy has no bf16 matmul)",
             "torch": "bfloat16 tensors, bf16 C"} if case.dtype == "bf16" else {}
    ours = None
    for provider, stats in results.items():
        extra = {"threads": threads[provider], "clock": "wall"}
        if provider in notes:
            extra["computed_on"] = notes[provider]
        if provider == "tpp":
            extra["weights"] = "packed once (ops.pack_kn), outside the timed loop"
            if ctx.config.verify:
                extra["verified"] = _verify(ctx, label, case, a32, b32, c)
        r = compute_record(ctx, suite=SUITE, case=case.name, provider=provider,
                           shape=case.shape, stats=stats, flops=case.flops, dtype=case.dtype,
                           cores=case.threads, **extra)
        if provider == "tpp":
            ours = r
    return ours


def _verify(ctx, label, case: Case, a32, b32, got) -> bool:
    """tpp's C (first and last 8 rows, every column) against a float64 product."""
    rows = np.r_[0:8, case.m - 8:case.m] if case.m > 16 else np.arange(case.m)
    want = a32[rows].astype(np.float64) @ b32.astype(np.float64)
    scale = float(np.max(np.abs(want))) or 1.0
    err = float(np.max(np.abs(got[rows].astype(np.float64) - want)))
    tol = scale * ((2.0 ** -8 if case.dtype == "bf16" else 0.0) + 1e-5 * np.sqrt(case.k))
    if err > tol:
        ctx.note(f"{label} tpp: WRONG RESULTS (max abs error {err:.3g}, largest |C| "
                 f"{scale:.3g}, vs a float64 product); its GFLOP/s is not meaningful")
        return False
    return True


def _overhead(ctx, rng):
    """ops.linear(x, w_packed) on 64x64x64 f32, one thread: microseconds per call, against
    torch.nn.functional.linear(x, w) and numpy's x @ w.T (each allocating its output)."""
    m, k, n = LINEAR
    x = filled(rng.standard_normal((m, k), dtype=np.float32))
    w = filled(rng.standard_normal((n, k), dtype=np.float32))
    runs, calls = {}, {}
    with team(ctx, 1):
        if ctx.wants("tpp"):
            try:
                import ops
                runs["tpp"], calls["tpp"] = looped(ops.linear, x, ops.pack_nk(w)), \
                    "ops.linear(x, pw), pw = ops.pack_nk(w) once"
            except Exception as exc:  # noqa: BLE001
                ctx.failed("gemm linear tpp", exc)
        if ctx.wants("numpy"):
            runs["numpy"], calls["numpy"] = looped(np.matmul, x, w.T), "np.matmul(x, w.T)"
        torch = ctx.torch
        if torch is not None:
            tx, tw = torch.from_numpy(x), torch.from_numpy(w)
            runs["torch"] = looped(torch.nn.functional.linear, tx, tw)
            calls["torch"] = "torch.nn.functional.linear(x, w)"
        results = timed_group(ctx, "gemm linear 64x64x64", runs)
    for provider, stats in results.items():
        time_record(ctx, suite=SUITE, case="linear t1", provider=provider, shape=LINEAR,
                    stats=stats, unit="us", call=calls[provider], threads=1)
