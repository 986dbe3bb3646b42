"""Helpers shared by the suites: memory levels, tpp call paths, bandwidth/compute/time records,
and for the multi-threaded operator suites (gemm, mlp): thread teams, sizes, capped timing."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import time

import numpy as np

from ..records import Record
from ..timing import Settings, Stats, looped, measure, measure_interleaved

# A case whose working set (bytes read + written per call) is at most this many bytes is
# compared with the cache-resident copy peak; anything larger with the DRAM copy peak.
CACHE_LEVEL_BYTES = 2 << 20

# Working sets up to this size go through the raw-pointer path in a loop (per-call overhead of
# the array API would dominate); larger ones through the array API with out= preallocated.
RAW_PATH_BYTES = 1 << 20


_PAGE = 4096
_stagger = itertools.count()


def empty(shape, dtype=np.float32, past: int = 0) -> np.ndarray:
    """A C-contiguous array at a cache-line boundary (`past` bytes after one: numpy's own
    arrays start 16 bytes past), each new one at another offset in its page (0, 256, 512, ...
    bytes), so no two arrays alias modulo 4 KiB.

    The allocator's own placement is not neutral: two same-sized arrays allocated one after the
    other by numpy typically lie 16 bytes apart modulo 4 KiB, and glibc's memcpy (`rep movsb`)
    on Zen 3 then runs ~10x slower; np.copyto would measure the allocator, not the copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    offset = (next(_stagger) % 16) * 256
    buf = np.empty(nbytes + 2 * _PAGE, np.uint8)
    start = (-buf.ctypes.data) % _PAGE + offset + past
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def filled(values: np.ndarray, past: int = 0) -> np.ndarray:
    """An `empty` copy of values."""
    out = empty(values.shape, values.dtype, past)
    out[...] = values
    return out


def memory_level(nbytes: int) -> str:
    return "cache" if nbytes <= CACHE_LEVEL_BYTES else "dram"


def call_path(nbytes: int) -> str:
    return "raw" if nbytes <= RAW_PATH_BYTES else "array"


def tpp_runner(kernel, arrays: dict, path: str):
    """run(k) for a tpp kernel on named arrays ({"in": x, "out": y, ...} by operand name).

    path "raw": k.raw(addresses...) in spec.operands() order; "array": kernel(*inputs, out=...).
    """
    operands = kernel.spec.operands()
    missing = [o.name for o in operands if o.name not in arrays]
    if missing:
        raise KeyError(f"no array for operand(s) {missing}")
    if path == "raw":
        kernel.compile()
        addrs = [arrays[o.name].ctypes.data for o in operands]
        return looped(kernel.raw, *addrs)
    inputs = [arrays[o.name] for o in operands if o.role == "in"]
    outs = {o.name: arrays[o.name] for o in operands if o.role != "in"}
    if set(outs) == {"out"}:
        y = outs["out"]
        if len(inputs) == 1:
            x0, = inputs

            def run(k):
                for _ in range(k):
                    kernel(x0, out=y)
            return run
        if len(inputs) == 2:
            x0, x1 = inputs

            def run(k):
                for _ in range(k):
                    kernel(x0, x1, out=y)
            return run

    def run(k):
        for _ in range(k):
            kernel(*inputs, **outs)
    return run


def bandwidth_record(ctx, *, suite: str, case: str, provider: str, shape, stats: Stats,
                     nbytes: int, dtype: str = "f32", **extra) -> Record:
    """A GB/s record (decimal GB) of a case moving nbytes per call, at the memory level of
    nbytes (extra["peak_level"]). Its peak fraction is set when the run ends, against the best
    copy measured at that level (records.settle_copy_peaks); a record of case "copy" is one of
    those yardsticks."""
    median, p20, p80 = (v / 1e9 for v in stats.rate(nbytes))
    info = {"bytes_per_call": int(nbytes), "peak_level": memory_level(nbytes),
            "samples": stats.samples, "calls_per_sample": stats.calls_per_sample,
            "time_median_s": stats.median}
    info.update(extra)
    return ctx.add(Record(suite=suite, case=case, provider=provider, shape=list(shape),
                          dtype=dtype, metric="bandwidth", unit="GB/s", median=median, p20=p20,
                          p80=p80, extra=info))


def compute_record(ctx, *, suite: str, case: str, provider: str, shape, stats: Stats,
                   flops: int, dtype: str = "f32", cores: int = 1, **extra) -> Record:
    """A GFLOP/s record of a case doing `flops` floating-point operations per call, with its
    fraction of the compute peak the peak suite measured for `dtype` (ctx.peaks[dtype], one
    core's) times `cores`, the cores the case ran on."""
    median, p20, p80 = (v / 1e9 for v in stats.rate(flops))
    peak = ctx.peaks.get(dtype)
    peak = peak * cores if peak else peak
    info = {"flops_per_call": int(flops), "samples": stats.samples,
            "calls_per_sample": stats.calls_per_sample, "time_median_s": stats.median}
    info.update(extra)
    if peak:
        info["peak_gflops"] = peak
    return ctx.add(Record(suite=suite, case=case, provider=provider, shape=list(shape),
                          dtype=dtype, metric="compute", unit="GFLOP/s", median=median, p20=p20,
                          p80=p80, peak_fraction=(median / peak) if peak else None, extra=info))


def time_record(ctx, *, suite: str, case: str, provider: str, shape, stats: Stats, unit: str,
                dtype: str = "f32", **extra) -> Record:
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[unit]
    s = stats.scaled(scale)
    info = {"samples": stats.samples, "calls_per_sample": stats.calls_per_sample}
    info.update(extra)
    return ctx.add(Record(suite=suite, case=case, provider=provider, shape=list(shape),
                          dtype=dtype, metric="time", unit=unit, median=s.median, p20=s.p20,
                          p80=s.p80, extra=info))


def timed_group(ctx, what: str, runs: dict, settings: Settings | None = None) -> dict:
    """measure_interleaved(runs) with the context's settings (or `settings`); {provider: Stats}
    of those that ran, failures noted."""
    runs = {k: v for k, v in runs.items() if v is not None}
    if not runs:
        return {}
    ctx.step(what)
    try:
        res = measure_interleaved(runs, settings or ctx.settings)
    except Exception as exc:  # noqa: BLE001 - a broken case must not stop the run
        ctx.failed(what, exc)
        return {}
    for name, exc in res.pop("errors", {}).items():
        ctx.failed(f"{what} {name}", exc)
    return res


def timed(ctx, what: str, run, settings: Settings | None = None, **kw) -> Stats | None:
    """measure(run) with the context's settings (or `settings`); a failure becomes a note and
    None."""
    ctx.step(what)
    try:
        return measure(run, settings or ctx.settings, **kw)
    except Exception as exc:  # noqa: BLE001 - a broken case must not stop the run
        ctx.failed(what, exc)
        return None


# ------------------------------------------------------------ multi-threaded operator suites
# Seconds one slow reference may take per case (warm-up call included): by mode.
SLOW_BUDGET = {"tiny": 0.5, "quick": 2.0, "full": 6.0}
SLOW_CALL = 0.05    # a reference predicted slower than this per call is measured on its own
SETTLE = 0.2        # seconds of pause before each provider of a multi-threaded case


def quick_sizes(ctx) -> bool:
    """The smaller problem sizes: --quick, or the default set run without naming suites."""
    return ctx.config.quick or ctx.config.overview


def all_threads(ctx) -> int:
    """The team of the multi-threaded cases: --threads N when N > 1, else every core this
    process may run on (what tpp uses when no variable pins it)."""
    if ctx.config.threads > 1:
        return ctx.config.threads
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def numpy_threads():
    """The threads numpy's BLAS runs (threadpoolctl's answer, else the pinned variable), or
    None when unknown."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        value = os.environ.get("OPENBLAS_NUM_THREADS", "")
        return int(value) if value.isdigit() else None
    counts = [p["num_threads"] for p in threadpool_info() if p.get("user_api") == "blas"]
    return max(counts) if counts else None


@contextlib.contextmanager
def team(ctx, n: int):
    """tpp and torch on n threads (numpy's BLAS too where threadpoolctl is installed; else it
    keeps the count pinned at import); yields numpy's thread count (None: unknown)."""
    import tpp
    torch = ctx.torch
    limits = None
    tpp.set_num_threads(n)
    if torch is not None:
        torch.set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits
        limits = threadpool_limits(n, user_api="blas")
    except ImportError:
        pass
    try:
        yield numpy_threads()
    finally:
        if limits is not None:
            limits.restore_original_limits()
        tpp.set_num_threads(None)
        if torch is not None:
            torch.set_num_threads(ctx.config.threads)


def big_settings(ctx) -> Settings:
    """Settings for GEMM-sized calls run by thread teams: the wall clock (a thread's CPU time
    misses its team's work), and one warm-up call enough for a call slower than the warm-up
    time (the samples stay at least min_samples: a median of fewer is at a burst's mercy)."""
    return dataclasses.replace(ctx.settings, clock="wall", min_warmup_calls=1)


@functools.lru_cache(maxsize=None)
def torch_gflops(torch, threads: int, n: int = 256) -> float:
    """GFLOP/s of an n^3 bf16 torch.mm on `threads` threads (the best of 5 calls after a
    warm-up, so that a burst of load elsewhere does not make it look slower than it is): the
    rate that predicts how long a torch bf16 reference will take."""
    a = torch.ones((n, n), dtype=torch.bfloat16)
    c = torch.empty((n, n), dtype=torch.bfloat16)
    torch.mm(a, a, out=c)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, a, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def capped_group(ctx, what: str, runs: dict, settings: Settings, predicted: dict) -> dict:
    """Each provider of one multi-threaded case measured in turn (not interleaved: thread
    pools interfere), with slow references kept within a budget.

    predicted: {provider: seconds per call expected}. A provider expected slower than SLOW_CALL
    is measured on its own, one warm-up call and as many samples (1 to 5) as SLOW_BUDGET
    allows; one that would not fit even one sample is skipped, with a note."""
    mode = "tiny" if ctx.config.tiny else ("quick" if quick_sizes(ctx) else "full")
    budget = SLOW_BUDGET[mode]
    slow = {p: s for p, s in predicted.items() if p in runs and s > SLOW_CALL}
    out = {}
    for provider, run in runs.items():
        if provider in slow:
            continue
        # one provider at a time, after a pause: the thread pool of the one before (OpenBLAS
        # spins ~0.1 s after a call, libgomp a few ms) would otherwise take the cores
        time.sleep(SETTLE)
        stats = timed(ctx, f"{what} {provider}", run, settings)
        if stats is not None:
            out[provider] = stats
    for provider, seconds in slow.items():
        calls = int(budget / seconds)
        if calls < 2:
            ctx.note(f"{what} {provider}: skipped, one call would take ~{seconds:.0f} s "
                     f"(over the {budget:.0f} s budget of a slow reference)")
            continue
        capped = dataclasses.replace(settings, min_time=0.0, warmup=0.0, min_warmup_calls=1,
                                     min_samples=min(5, calls - 1))
        stats = timed(ctx, f"{what} {provider}", runs[provider], capped)
        if stats is not None:
            out[provider] = stats
    return out
