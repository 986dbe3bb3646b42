"""peak: the machine's streaming bandwidth, from a copy, as every bandwidth figure's yardstick.

A copy of an f32 block, at a cache-resident size (the working set fits the per-core L2) and at a
DRAM size (far beyond the last-level cache), by the library's own `identity` kernel and by
numpy's `np.copyto`. Bytes counted: read + written (2 * m * n * 4); write-allocate traffic, which
a non-temporal store avoids, is not counted. The best of the providers at each level is the
peak that `peak_fraction` divides by.
"""
from __future__ import annotations

import numpy as np

from . import register
from ._common import (bandwidth_record, call_path, empty, filled, memory_level, timed_group,
                      tpp_runner)

SIZES = {"cache": (128, 256), "dram": (4096, 4096)}
TINY_SIZES = {"cache": (32, 256), "dram": (1024, 1024)}


def sizes(ctx) -> dict:
    return TINY_SIZES if ctx.config.tiny else SIZES


@register("peak", default=True,
          help="copy bandwidth at a cache-resident and a DRAM size (tpp identity, np.copyto)")
def run(ctx):
    for level, (m, n) in sizes(ctx).items():
        nbytes = 2 * m * n * 4
        assert memory_level(nbytes) == level, (level, nbytes)
        x = filled(np.random.default_rng(0).standard_normal((m, n), dtype=np.float32))
        y = empty((m, n))
        label = f"peak copy {m}x{n}"
        runs, path = {}, call_path(nbytes)
        if ctx.wants("tpp"):
            try:
                import tpp
                runs["tpp"] = tpp_runner(tpp.unary("identity", m, n), {"in": x, "out": y}, path)
            except Exception as exc:  # noqa: BLE001
                ctx.failed(f"{label} tpp", exc)
        if ctx.wants("numpy"):
            runs["numpy"] = _np_copy(y, x)
        found = []
        for provider, stats in timed_group(ctx, label, runs).items():
            extra = {"path": path} if provider == "tpp" else {}
            found.append(bandwidth_record(ctx, suite="peak", case="copy", provider=provider,
                                          shape=(m, n), stats=stats, nbytes=nbytes, **extra))
        if "tpp" in runs and found and ctx.config.verify:
            runs["tpp"](1)
            if not np.array_equal(x, y):
                ctx.note(f"{label} tpp: the identity kernel's output differs from its input")
        if not found:
            ctx.note(f"no copy bandwidth at the {level} level: peak fractions there are unknown")
            continue
        best = max(r.median for r in found)
        ctx.peaks[level] = best
        for r in found:
            r.peak_fraction = r.median / best
            r.extra["peak_gbps"] = best
            r.extra["is_peak"] = r.median == best
        del x, y


def _np_copy(y, x):
    copyto = np.copyto

    def run(k):
        for _ in range(k):
            copyto(y, x)
    return run
