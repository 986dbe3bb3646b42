"""How ops.matmul cuts a problem into BRGEMM calls: the Blocking, its checks and the heuristic.

    ops.Blocking(bm, kc, order="CB", threads=None, group=None)

bm rows of x per call, kc K elements per call (whole K, or chunks summed in the f32 output),
the parallel band's order ("CB": weight panels outer, "BC": row blocks outer), threads=1 for a
problem that always runs on one thread, and group: the weight's panels taken `group` at a time
(the largest divisor of the panel count at most that: `panel_group`), the groups outermost, then
the row blocks, then the group's panels (the parallel band is then all three; order unused;
a weight with a narrower last panel, N not a multiple of its panel width, is not grouped). A row block of x then meets a whole group of panels while the group stays in L2,
and x streams from memory once per group instead of once per panel ("CB") or the whole
weight overflowing L2 ("BC").

`heuristic_blocking` is what a call without blocking= or a stored winner (ops.tune) runs;
`choose_blocking` its rows and K chunks alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import tpp
from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError

# K per BRGEMM call: whole up to 8192, else 4096-element chunks. Each K chunk is one pass over
# C (loaded and stored again) and one barrier of the team; the kernel streams its B panel
# (kc x 64) from L2 or L3 either way. f32, 1 thread, Zen 4, GFLOP/s by kc (medians of 5):
# 2048^3: 512: 91, 1024: 98-100, 2048: 104; 4096x4096x1024: 512: 88, 1024: 97, 4096: 105;
# 1024x8192x1024: 1024: 106, 8192: 110 (OpenBLAS: 94-100).
_WHOLE_K = 8192
_KC = 4096

_ORDERS = ("CB", "BC")
# bf16 on a matrix unit with a weight of at most this many bytes: the row band outer ("BC"),
# each block of x rows then multiplied by every panel while in L2, the weight staying in L2
# across the row blocks. ops.linear bf16, x 4096 rows, 2 threads, Sapphire Rapids (AMX),
# GFLOP/s CB / BC: K 384 N 1152 1751 / 1989, 384 x 384 1697 / 1836, 1536 x 384 (1.2 MB)
# 2383 / 2429, 384 x 1536 gelu level; larger weights lose (768 x 2304: 2299 / 1636, 768 x
# 3072 gelu 1849 / 1485).
_TILE_ROWS_OUTER_BYTES = 1 << 20
# f32: the weight's panels in groups of at most this many bytes (the largest group size that
# divides the panel count, so the threads' groups are equal). x 4096 rows, Sapphire Rapids,
# GFLOP/s of the nest with panels ungrouped "CB" / grouped (1 thread; 2 threads): K 384 N 1152
# 137 / 155, 269 / 312; 384 x 1536 141 / 156, 277 / 315; 384 x 384 145 / 155, 291 / 316;
# 1536 x 384 149 / 154, 298 / 307 ("CB" re-read x from L3 once per panel).
GROUP_BYTES = 512 << 10


@dataclass(frozen=True)
class Blocking:
    bm: int                    # rows of x per BRGEMM
    kc: int                    # K elements per BRGEMM (a chunk)
    order: str = "CB"          # the parallel band: "CB" column panels outer, "BC" rows outer
    threads: int | None = None  # 1: always one thread; None: the thread rule (serial)
    group: int | None = None   # weight panels per group (see the module docstring)


def choose_blocking(k: int, dtype_out: _dt.DType) -> Blocking:
    """64 rows; K whole up to _WHOLE_K (always for a bf16 output), else chunks of _KC."""
    if dtype_out == _dt.BF16 or k <= _WHOLE_K:
        return Blocking(64, k)
    return Blocking(64, _KC)


def heuristic_blocking(k, n, bn, dt, dt_out, host=True) -> Blocking:
    """What a call without blocking= or a stored winner runs on an (n, k) weight in panels of
    bn: choose_blocking's rows and K chunks; f32 weights in groups of panels (GROUP_BYTES);
    the row band outer for bf16 weights of at most _TILE_ROWS_OUTER_BYTES on a host matrix
    unit."""
    bl = choose_blocking(k, dt_out)
    if dt == _dt.F32 and n > bn and n % bn == 0:
        most = max(1, GROUP_BYTES // (min(bl.kc, k) * bn * dt.itemsize))
        return Blocking(bl.bm, bl.kc, group=panel_group(most, -(-n // bn)))
    small = dt == _dt.BF16 and k * n * dt.itemsize <= _TILE_ROWS_OUTER_BYTES
    return Blocking(bl.bm, bl.kc, "BC") if small and host and tpp.has_matrix_unit(dt) else bl


def panel_group(group: int, panels: int) -> int:
    """The panels per group a nest over `panels` panels takes for Blocking.group: the largest
    divisor of the panel count that is at most `group` (equal groups, no partial one)."""
    return max(g for g in range(1, min(group, panels) + 1) if panels % g == 0)


def as_blocking(bl):
    """None, or bl with Python int fields >= 1 (numpy integers accepted). Run before the plan
    lookup: Blocking(4.0, 4) and Blocking(True, 4) equal valid keys and would skip the checks."""
    if bl is None:
        return None
    if not isinstance(bl, Blocking):
        raise ArgumentError(f"blocking must be an ops.Blocking, got {bl!r}")
    if bl.order not in _ORDERS:
        raise ArgumentError(f"blocking.order must be one of {_ORDERS}, got {bl.order!r}")
    if bl.threads is not None and (isinstance(bl.threads, bool) or bl.threads != 1):
        raise ArgumentError(f"blocking.threads must be None (the thread rule) or 1, got "
                            f"{bl.threads!r}")
    group = None if bl.group is None else _positive(bl.group, "blocking.group")
    return Blocking(_positive(bl.bm, "blocking.bm"), _positive(bl.kc, "blocking.kc"),
                    bl.order, bl.threads, group)


def check_blocking(bl, k, dtype_out, vnni):
    """bl (from as_blocking or choose_blocking) with kc clamped to K, or an ArgumentError
    if the output dtype or VNNI pairs forbid its K chunks."""
    bl = Blocking(bl.bm, min(bl.kc, k), bl.order, bl.threads, bl.group)
    if bl.kc < k and dtype_out == _dt.BF16:
        raise ArgumentError("blocking.kc < K needs an f32 output (partial sums would be "
                            "rounded to bf16)")
    if bl.kc < k and vnni and bl.kc % 2:
        raise ArgumentError(f"blocking.kc must be even for bf16 (VNNI pairs), got {bl.kc}")
    return bl


def _positive(value, what):
    """value as a Python int >= 1 (numpy integers too), else an ArgumentError."""
    converted = checks.as_int(value)
    if converted is None or converted < 1:
        raise ArgumentError(f"{what} must be a positive int, got {value!r}")
    return converted
