"""Timing GPU work with CUDA events (the method of `bench.timing`, on the device's clock).

`measure_cuda(run, settings)` times `run(k)`, which queues k launches on cupy's current stream:
warm-up until `warmup` seconds have passed, calibration of k so that one sample lasts about
`target_sample` seconds (at least 1 ms: events resolve about 0.5 us), then samples of
event(start) - run(k) - event(end), each synchronised on its end event, until `min_time` and
`min_samples` are reached. Returns per-launch Stats (seconds) like `bench.timing.measure`.
Host time spent queuing is hidden as long as the queue stays ahead of the GPU, which is what a
kernel's own speed means.
"""
from __future__ import annotations

import time

from .timing import Settings, Stats, quantile


def measure_cuda(run, settings: Settings | None = None) -> Stats:
    import cupy
    s = settings or Settings()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def sample(k: int) -> float:
        start.record()
        run(k)
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e-3 / k

    deadline = time.perf_counter() + s.warmup
    one = sample(1)
    while time.perf_counter() < deadline:
        one = sample(1)
    target = max(s.target_sample, 1e-3)
    k = 1 if one >= target else max(1, min(10_000, int(target / max(one, 1e-7))))
    times, total = [], 0.0
    while (total < s.min_time or len(times) < s.min_samples) and len(times) < s.max_samples:
        t = sample(k)
        times.append(t)
        total += t * k
    times.sort()
    return Stats(quantile(times, 0.5), quantile(times, 0.2), quantile(times, 0.8), len(times), k,
                 tuple(times))
