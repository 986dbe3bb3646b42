"""Helpers shared by the suites: memory levels, tpp call paths, bandwidth/compute/time records."""
from __future__ import annotations

import itertools

import numpy as np

from ..records import Record
from ..timing import Stats, looped, measure, measure_interleaved

# A case whose working set (bytes read + written per call) is at most this many bytes is
# compared with the cache-resident copy peak; anything larger with the DRAM copy peak.
CACHE_LEVEL_BYTES = 2 << 20

# Working sets up to this size go through the raw-pointer path in a loop (per-call overhead of
# the array API would dominate); larger ones through the array API with out= preallocated.
RAW_PATH_BYTES = 1 << 20


_PAGE = 4096
_stagger = itertools.count()


def empty(shape, dtype=np.float32) -> np.ndarray:
    """A C-contiguous array at a cache-line boundary, each new one at another offset in its page
    (0, 256, 512, ... bytes), so no two arrays alias modulo 4 KiB.

    The allocator's own placement is not neutral: two same-sized arrays allocated one after the
    other by numpy typically lie 16 bytes apart modulo 4 KiB, and glibc's memcpy (`rep movsb`)
    on Zen 3 then runs ~10x slower; np.copyto would measure the allocator, not the copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    offset = (next(_stagger) % 16) * 256
    buf = np.empty(nbytes + 2 * _PAGE, np.uint8)
    start = (-buf.ctypes.data) % _PAGE + offset
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def filled(values: np.ndarray) -> np.ndarray:
    """An `empty` copy of values."""
    out = empty(values.shape, values.dtype)
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
    """A GB/s record (decimal GB) of a case moving nbytes per call, with its peak fraction."""
    median, p20, p80 = (v / 1e9 for v in stats.rate(nbytes))
    level = memory_level(nbytes)
    peak = ctx.peaks.get(level)
    info = {"bytes_per_call": int(nbytes), "peak_level": level, "samples": stats.samples,
            "calls_per_sample": stats.calls_per_sample, "time_median_s": stats.median}
    info.update(extra)
    if peak:
        info["peak_gbps"] = peak
    return ctx.add(Record(suite=suite, case=case, provider=provider, shape=list(shape),
                          dtype=dtype, metric="bandwidth", unit="GB/s", median=median, p20=p20,
                          p80=p80, peak_fraction=(median / peak) if peak else None, extra=info))


def compute_record(ctx, *, suite: str, case: str, provider: str, shape, stats: Stats,
                   flops: int, dtype: str = "f32", **extra) -> Record:
    """A GFLOP/s record of a case doing `flops` floating-point operations per call, with its
    fraction of the compute peak the peak suite measured for `dtype` (ctx.peaks[dtype])."""
    median, p20, p80 = (v / 1e9 for v in stats.rate(flops))
    peak = ctx.peaks.get(dtype)
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


def timed_group(ctx, what: str, runs: dict) -> dict:
    """measure_interleaved(runs) with the context's settings; {provider: Stats} of those that
    ran, failures noted."""
    runs = {k: v for k, v in runs.items() if v is not None}
    if not runs:
        return {}
    ctx.step(what)
    try:
        res = measure_interleaved(runs, ctx.settings)
    except Exception as exc:  # noqa: BLE001 - a broken case must not stop the run
        ctx.failed(what, exc)
        return {}
    for name, exc in res.pop("errors", {}).items():
        ctx.failed(f"{what} {name}", exc)
    return res


def timed(ctx, what: str, run, **kw) -> Stats | None:
    """measure(run) with the context's settings; a failure becomes a note and None."""
    ctx.step(what)
    try:
        return measure(run, ctx.settings, **kw)
    except Exception as exc:  # noqa: BLE001 - a broken case must not stop the run
        ctx.failed(what, exc)
        return None
