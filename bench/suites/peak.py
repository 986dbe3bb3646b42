"""peak: the yardsticks: one core's compute peak and the machine's streaming bandwidth.

Compute: the register-resident probe of `tpp_cpu.peak_probe` (independent FMA chains, no
memory traffic), in GFLOP/s: case "fma f32" (vfmadd231ps) and "dot bf16" (AMX tile dots,
tdpbf16ps, where the target has AMX; else vdpbf16ps where it has avx512_bf16; elsewhere bf16 is computed with f32 FMAs, so its record repeats the f32
figure with extra["via"] saying so). They become ctx.peaks["f32"] and ctx.peaks["bf16"], the
denominators of every compute record's `peak_fraction`.

Bandwidth: a copy of an f32 block, at a cache-resident size (the working set fits the per-core
L2) and at a DRAM size (far beyond the last-level cache), by the library's own `identity`
kernel and by numpy's `np.copyto`. Bytes counted: read + written (2 * m * n * 4);
write-allocate traffic, which a non-temporal store avoids, is not counted. At the DRAM size the
identity kernel is the streaming copy: outputs of 16 MiB and more are written with
non-temporal stores. The yardstick of a memory level, which every bandwidth record's
`peak_fraction` divides by, is the best copy measured at that level in the run: these, and
the copy the eltwise suite measures at each of its shapes (bench.records.settle_copy_peaks).
"""
from __future__ import annotations

import numpy as np

from . import register
from ..timing import looped
from ._common import (bandwidth_record, call_path, compute_record, empty, filled, memory_level,
                      timed, timed_group, tpp_runner)

SIZES = {"cache": (128, 256), "dram": (4096, 4096)}
TINY_SIZES = {"cache": (32, 256), "dram": (1024, 1024)}
PROBE_ITERATIONS = 20_000      # loop trips per call of the compute probe: ~0.5 ms
TINY_PROBE_ITERATIONS = 500
COMPUTE_CASES = {"f32": "fma f32", "bf16": "dot bf16"}


def sizes(ctx) -> dict:
    return TINY_SIZES if ctx.config.tiny else SIZES


@register("peak", default=True,
          help="compute peak (FMA/bf16-dot probe) and copy bandwidth at a cache-resident and a "
               "DRAM size (tpp identity, np.copyto)")
def run(ctx):
    compute(ctx)
    bandwidth(ctx)


def compute(ctx):
    """GFLOP/s of the compute probe of each kind; sets ctx.peaks["f32"] and ctx.peaks["bf16"].
    It runs whatever --providers says: it is the machine's yardstick, not a contender."""
    iterations = TINY_PROBE_ITERATIONS if ctx.config.tiny else PROBE_ITERATIONS
    measured = {}   # instruction -> Stats: a kind computed by another kind's probe reuses it
    for kind, case in COMPUTE_CASES.items():
        try:
            from tpp_cpu import peak_probe
            probe = peak_probe.build(kind)
        except Exception as exc:  # noqa: BLE001
            ctx.failed(f"peak {case}", exc)
            continue
        stats = measured.get(probe.instruction)
        if stats is None:
            stats = timed(ctx, f"peak {case}", looped(probe, iterations))
            if stats is None:
                continue
            measured[probe.instruction] = stats
        flops = probe.flops_per_iteration * iterations
        ctx.peaks[kind] = flops / stats.median / 1e9
        extra = {"instruction": probe.instruction}
        if probe.via:
            extra["via"] = probe.via
            ctx.note(f"peak {case}: measured via {probe.via}: the bf16 peak is the f32 one")
        compute_record(ctx, suite="peak", case=case, provider="tpp", shape=(), stats=stats,
                       flops=flops, dtype=kind, iterations=iterations,
                       flops_per_iteration=probe.flops_per_iteration, **extra)


def bandwidth(ctx):
    """Copy GB/s at each memory level (records of case "copy": yardsticks)."""
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
        del x, y


def _np_copy(y, x):
    copyto = np.copyto

    def run(k):
        for _ in range(k):
            copyto(y, x)
    return run
