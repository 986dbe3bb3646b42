"""The measuring method every suite uses.

`measure(run)` times `run(k)`, a function that performs k calls of the thing measured (so loops
over cheap calls amortise the timer's own cost), and returns per-call times:

1. warm-up: calls until `warmup` seconds have passed (at least `min_warmup_calls`), so code is
   compiled, pages are faulted in, caches and branch predictors are in their steady state;
2. calibration: k, the calls per sample, is chosen so that one sample lasts about
   `target_sample` seconds (k = 1 for anything slower than that);
3. samples: repeated until their total reaches `min_time` seconds and there are at least
   `min_samples` of them (or `max_samples` are taken);
4. statistics of the per-call times (sample / k): median, p20 and p80.

`measure_interleaved({name: run})` does the same for the providers of one case together, one
sample of each per round, so that the bursts of a noisy, shared machine hit all of them alike
and their ratios hold up even when absolute times wander.

The garbage collector is off while a case is timed. Nothing here flushes caches: DRAM-sized
cases use arrays far larger than the last-level cache, and outputs allocated once outside
the timed loop.
"""
from __future__ import annotations

import gc
import itertools
import math
import time
from dataclasses import dataclass, field

CLOCKS = {
    # elapsed time: what a user waits for, but on a shared machine it also counts the time
    # other processes held the core
    "wall": time.perf_counter_ns,
    # CPU time of this thread (user + system): immune to being descheduled, still exposed to
    # the cache and memory-bandwidth pressure of neighbours; ~1 us per reading in a VM
    "cpu": time.thread_time_ns,
}
_clock = CLOCKS["wall"]


@dataclass(frozen=True)
class Settings:
    min_time: float = 0.2          # seconds of samples per case
    warmup: float = 0.05           # seconds of warm-up calls per case
    min_warmup_calls: int = 2
    target_sample: float = 1e-3    # seconds per sample when calls are looped
    min_samples: int = 5
    max_samples: int = 10_000
    clock: str = "wall"            # a key of CLOCKS

    @classmethod
    def for_mode(cls, quick: bool = False, tiny: bool = False, clock: str = "wall"
                 ) -> "Settings":
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
        if tiny:
            return cls(min_time=0.005, warmup=0.001, min_warmup_calls=1, target_sample=2e-4,
                       min_samples=3, clock=clock)
        if quick:
            return cls(min_time=0.05, warmup=0.02, target_sample=5e-4, clock=clock)
        return cls(clock=clock)


@dataclass(frozen=True)
class Stats:
    """Per-call times in seconds."""
    median: float
    p20: float
    p80: float
    samples: int
    calls_per_sample: int
    times: tuple = field(default=(), repr=False)

    def scaled(self, factor: float) -> "Stats":
        """The same statistics times a factor (e.g. seconds -> microseconds)."""
        return Stats(self.median * factor, self.p20 * factor, self.p80 * factor,
                     self.samples, self.calls_per_sample)

    def rate(self, amount: float) -> tuple[float, float, float]:
        """(median, p20, p80) of amount / time, e.g. bytes per second. The quantiles swap:
        the 20th percentile of a rate comes from the 80th percentile of the time."""
        return amount / self.median, amount / self.p80, amount / self.p20


def quantile(sorted_values, q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) of an ascending sequence."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac


def looped(call, *args):
    """run(k) calling call(*args) k times, with as little loop overhead as Python allows."""
    repeat = itertools.repeat
    if not args:
        def run(k):
            for _ in repeat(None, k):
                call()
    elif len(args) == 1:
        a0, = args

        def run(k):
            for _ in repeat(None, k):
                call(a0)
    elif len(args) == 2:
        a0, a1 = args

        def run(k):
            for _ in repeat(None, k):
                call(a0, a1)
    elif len(args) == 3:
        a0, a1, a2 = args

        def run(k):
            for _ in repeat(None, k):
                call(a0, a1, a2)
    else:
        def run(k):
            for _ in repeat(None, k):
                call(*args)
    return run


def measure(run, settings: Settings | None = None, *, calls_per_sample: int | None = None
            ) -> Stats:
    """Per-call time statistics of run(k) (k calls per invocation); see the module docstring."""
    s = settings or Settings()
    clock = CLOCKS[s.clock]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if calls_per_sample is None:
            k = _warm_and_calibrate(run, s)
        else:
            _warm_and_calibrate(run, s)
            k = max(1, int(calls_per_sample))
        # samples
        times = []
        total = 0
        min_total = s.min_time * 1e9
        while (total < min_total or len(times) < s.min_samples) and len(times) < s.max_samples:
            t0 = clock()
            run(k)
            dt = clock() - t0
            total += dt
            times.append(dt / k * 1e-9)
    finally:
        if gc_was_enabled:
            gc.enable()
    times.sort()
    return Stats(quantile(times, 0.5), quantile(times, 0.2), quantile(times, 0.8), len(times), k,
                 tuple(times))


def measure_interleaved(runs: dict, settings: Settings | None = None) -> dict:
    """{name: Stats} for several run(k) functions measured in alternation.

    Each is warmed up and calibrated on its own (as in `measure`), then samples are taken in
    rounds, one sample of every function per round, until each has `min_time` seconds and
    `min_samples` samples. On a shared, noisy machine a disturbance then hits every provider of
    a case alike, so their ratios stay meaningful even when the absolute times move.
    A function that raises is left out of the result; its exception is in result["errors"].
    """
    s = settings or Settings()
    clock = CLOCKS[s.clock]
    ks, errors = {}, {}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name, run in runs.items():
            try:
                ks[name] = _warm_and_calibrate(run, s)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                errors[name] = exc
        times = {name: [] for name in ks}
        totals = {name: 0 for name in ks}
        min_total = s.min_time * 1e9
        active = list(ks)
        while active:
            for name in active:
                run, k = runs[name], ks[name]
                t0 = clock()
                run(k)
                dt = clock() - t0
                totals[name] += dt
                times[name].append(dt / k * 1e-9)
            active = [n for n in active
                      if (totals[n] < min_total or len(times[n]) < s.min_samples)
                      and len(times[n]) < s.max_samples]
    finally:
        if gc_was_enabled:
            gc.enable()
    out = {}
    for name, t in times.items():
        t.sort()
        out[name] = Stats(quantile(t, 0.5), quantile(t, 0.2), quantile(t, 0.8), len(t),
                          ks[name], tuple(t))
    if errors:
        out["errors"] = errors
    return out


def _warm_and_calibrate(run, s: Settings) -> int:
    """Warm run up; return the calls per sample that make a sample last ~target_sample."""
    clock = CLOCKS[s.clock]
    calls = 0
    deadline = clock() + int(s.warmup * 1e9)
    one = 0
    while calls < s.min_warmup_calls or clock() < deadline:
        t0 = clock()
        run(1)
        one = clock() - t0
        calls += 1
    target = s.target_sample * 1e9
    if one >= target:
        return 1
    probe = max(1, min(1000, int(target / max(one, 1))))
    t0 = clock()
    run(probe)
    per = max((clock() - t0) / probe, 1.0)
    return max(1, int(target / per))


def time_once(fn) -> float:
    """Seconds one call of fn takes (for things that can only happen once, like a cold compile)."""
    t0 = _clock()
    fn()
    return (_clock() - t0) * 1e-9


def summarize(values) -> Stats:
    """Stats of a list of single measurements (seconds)."""
    v = sorted(values)
    return Stats(quantile(v, 0.5), quantile(v, 0.2), quantile(v, 0.8), len(v), 1, tuple(v))


def steady_malloc() -> str:
    """Pin glibc's malloc (mmap threshold 32 MiB, trim threshold 1 GiB) so that freed large
    blocks stay in the process and no provider page-faults its outputs in again by the luck
    of the heap's layout (bench/suites/norm.py's docstring tells the story). The CLI calls it
    before any suite, so every suite runs under it; idempotent. "steady", or "glibc default"
    where it is not possible (another libc)."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 1 << 30) == 1
    except (OSError, AttributeError):
        ok = False
    return "steady" if ok else "glibc default"
