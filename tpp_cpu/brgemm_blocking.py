"""Register blocking of a BRGEMM: how C is cut into tiles whose accumulators fit the registers.

A tile is R rows by V vectors of `lanes` columns. Per step of k it costs R*V FMAs, V loads of B
and R broadcasts of A, and it holds R*V accumulators, V B vectors and one broadcast A value in
registers: R*V + V + 1 <= registers - 1 (libxsmm's rule, with one register left to the
compiler: a 4x3 AVX2 tile, which takes all 16 ymm registers, ran at 87 GFLOP/s where 6x2 ran
at 103, 64^3 x16 on Zen 4). When a VNNI pair is widened to f32 in
registers, B takes 2V and A two more (its pair and a zero for masking): R*V + 2V + 3; with
A widened beforehand (brgemm's Widened A), one register less (`spare`). Among
the V that fit, the planner takes the one with the fewest estimated cycles per k step over the
whole C block, where a tile's cycles are the largest of its FMA throughput, the
FMA latency (too few accumulators leave the pipes idle) and its load throughput; a tie goes to
the wider tile, which loads less per FMA (64x64 on AVX-512: 6x4, 10 loads per 24 FMAs, rather
than 13x2, 15 per 26: equal in L1, 102 against 71 GFLOP/s in ops.matmul at 2048^3), except
where a tied plan of tiles at least 2 vectors wide holds all of C's rows in one row of tiles:
then every B vector is loaded once per k step of the call instead of once per row of tiles,
and B (a batch of blocks, rarely within L1) streams from L2 once. That is AVX-512 with 7-14
rows (7 x 2 instead of 4 + 3 rows x 4; a 2-core Zen 5, one thread, 7x64x64 batch 8 in a
compiled loop: 218 -> 269 GFLOP/s, 7x128x128 batch 4 176 -> 262, 8-14 rows level to +7%, one
16 KiB B block (in L1) level to -5%; 3x3 convolutions at 7x7 pixels, batch 4, 2 threads, no
bias: 256 channels 356-391 -> 427-437 GFLOP/s, 512 331-391 -> 382-411, and within the noise in
tpp-bench conv's layers with their NCHW conversions; ops.linear f32, 8 rows, 384 -> 1152:
26.7-29.2 -> 21.9-22.1 us) and AVX2 with 6 rows; a 1-vector tile is not preferred (AVX2
7 x 1 instead of 4 + 3 rows x 2: 8 loads per 7 FMAs, 104 -> 97 GFLOP/s).

A's rows are read R at a time, one broadcast from each per k step, each cache line serving 16
steps (f32). When A's row stride is a multiple of the L1 cache's way size (4 KiB: 64 sets of 64
bytes), every row of a tile falls into the same set, and an 8-way L1 cannot hold more than a
few of them along with B's lines: a 13-row tile then misses in L1 on every row of every line
(ops.matmul at 2048^3 f32, one thread, Zen 4: 61% of the FMA peak with 13x2 tiles, 79% with
6x2, 88% with 6x4; at 1000^3, no aliasing, 13x2 and 6x4 are within 2%). `plan` therefore caps
R at A_LINES_PER_SET times the number of distinct sets A's rows fall into, given the row
stride in bytes (`a_row_bytes`; None for a transposed A, whose k step reads consecutive
elements of one row).

Rows are split into equal blocks (m=16 with R<=6 gives 6+5+5, not 6+6+4), columns into
blocks of V vectors with the last block narrower if needed; a partial last vector is a masked
tail.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

FMA_PER_CYCLE = 2       # vector FMAs issued per cycle (Zen 3/4, Intel cores since Haswell)
FMA_LATENCY = 4         # cycles
LOADS_PER_CYCLE = 2     # vector loads per cycle
L1_SETS = 64            # sets of 64-byte lines in L1D (32 KiB 8-way, 48 KiB 12-way: 64 both)
LINE = 64               # bytes per cache line
A_LINES_PER_SET = 6     # A rows of one tile that may share an L1 set (8 ways, 2 left for B)


@dataclass(frozen=True)
class RowGroup:
    start: int      # first row
    rows: int       # rows per tile (R)
    count: int      # tiles in the group


@dataclass(frozen=True)
class ColGroup:
    start: int      # first column
    vectors: int    # vectors per tile (V)
    count: int      # tiles in the group
    tail: int       # active lanes of each tile's last vector (== lanes when full)


@dataclass(frozen=True)
class Blocking:
    lanes: int
    row_groups: tuple
    col_groups: tuple

    def tiles(self):
        for cg in self.col_groups:
            for rg in self.row_groups:
                yield rg, cg


def split_rows(m: int, most: int) -> tuple:
    """m rows as equal blocks of at most `most` rows: RowGroups of sizes q+1 then q."""
    blocks = -(-m // most)
    base, extra = divmod(m, blocks)
    groups = []
    if extra:
        groups.append(RowGroup(0, base + 1, extra))
    if blocks - extra:
        groups.append(RowGroup(extra * (base + 1), base, blocks - extra))
    return tuple(groups)


def split_cols(n: int, lanes: int, vectors: int) -> tuple:
    """n columns as tiles of `vectors` vectors; the last tile may hold fewer vectors, and its
    last vector only n % lanes active lanes."""
    nvec = -(-n // lanes)
    full, rest = divmod(nvec, vectors)
    tail = n % lanes or lanes
    groups = []
    if rest:
        if full:
            groups.append(ColGroup(0, vectors, full, lanes))
        groups.append(ColGroup(full * vectors * lanes, rest, 1, tail))
    elif tail == lanes:
        groups.append(ColGroup(0, vectors, full, lanes))
    else:
        if full > 1:
            groups.append(ColGroup(0, vectors, full - 1, lanes))
        groups.append(ColGroup((full - 1) * vectors * lanes, vectors, 1, tail))
    return tuple(groups)


def tile_cycles(rows: int, vectors: int) -> float:
    return max(rows * vectors / FMA_PER_CYCLE, FMA_LATENCY, (rows + vectors) / LOADS_PER_CYCLE)


def alias_rows(a_row_bytes) -> int | None:
    """The most rows of A a tile may read at once for A's row stride in bytes (None: no cap):
    A_LINES_PER_SET per L1 set the rows fall into. A stride that is not a multiple of a line
    spreads the rows over the sets (no cap)."""
    if a_row_bytes is None or a_row_bytes <= 0 or a_row_bytes % LINE:
        return None
    lines = a_row_bytes // LINE
    sets = L1_SETS // math.gcd(L1_SETS, lines)
    return A_LINES_PER_SET * sets


def plan(m: int, n: int, lanes: int, registers: int, b_regs_per_vector: int = 1,
         a_row_bytes: int | None = None, spare: int | None = None) -> Blocking:
    """The blocking with the fewest estimated cycles per k step (see the module docstring);
    a_row_bytes, A's row stride in bytes (None: transposed A), caps the rows per tile; spare:
    registers a tile leaves to A and the compiler (default 2, 3 with VNNI pairs widened)."""
    nvec = -(-n // lanes)
    max_vectors = 4 if registers >= 32 else 3
    cap = alias_rows(a_row_bytes)
    plans = []
    for vectors in range(1, min(max_vectors, nvec) + 1):
        if spare is None:
            spare = 2 if b_regs_per_vector == 1 else 3
        most_rows = (registers - spare - b_regs_per_vector * vectors) // vectors
        if cap is not None:
            most_rows = min(most_rows, cap)
        if most_rows < 1:
            continue
        rows = split_rows(m, most_rows)
        cols = split_cols(n, lanes, vectors)
        cost = sum(rg.count * cg.count * tile_cycles(rg.rows, cg.vectors)
                   for rg in rows for cg in cols)
        plans.append((cost, vectors, Blocking(lanes, rows, cols)))
    least = min(cost for cost, _, _ in plans)
    tied = [(vectors, blocking) for cost, vectors, blocking in plans if cost == least]
    # among the cheapest: one pass over B (all rows in one tile row) where a tile of >= 2
    # vectors allows it, else the widest tile: fewer loads per FMA (see the module docstring)
    one_pass = [t for t in tied if t[0] >= 2 and len(t[1].row_groups) == 1
                and t[1].row_groups[0].count == 1]
    return max(one_pass or tied, key=lambda t: t[0])[1]
