"""Register blocking of a BRGEMM: how C is cut into tiles whose accumulators fit the registers.

A tile is R rows by V vectors of `lanes` columns. Per step of k it costs R*V FMAs, V loads of B
and R broadcasts of A, and it holds R*V accumulators, V B vectors and one broadcast A value in
registers: R*V + V + 1 <= registers (libxsmm's rule). When a VNNI pair is widened to f32 in
registers, B takes 2V and A two more (its pair and a zero for masking): R*V + 2V + 3. Among
the V that fit, the planner takes the one with the fewest estimated cycles per k step over the
whole C block, where a tile's cycles are the largest of its FMA throughput, the
FMA latency (too few accumulators leave the pipes idle) and its load throughput.

Rows are split into equal blocks (m=16 with R<=6 gives 6+5+5, not 6+6+4), columns into
blocks of V vectors with the last block narrower if needed; a partial last vector is a masked
tail.
"""
from __future__ import annotations

from dataclasses import dataclass

FMA_PER_CYCLE = 2       # vector FMAs issued per cycle (Zen 3/4, Intel cores since Haswell)
FMA_LATENCY = 4         # cycles
LOADS_PER_CYCLE = 2     # vector loads per cycle


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


def plan(m: int, n: int, lanes: int, registers: int, b_regs_per_vector: int = 1) -> Blocking:
    """The blocking with the fewest estimated cycles per k step (see the module docstring)."""
    nvec = -(-n // lanes)
    max_vectors = 4 if registers >= 32 else 3
    best = None
    for vectors in range(1, min(max_vectors, nvec) + 1):
        spare = 1 if b_regs_per_vector == 1 else 3
        most_rows = (registers - spare - b_regs_per_vector * vectors) // vectors
        if most_rows < 1:
            continue
        rows = split_rows(m, most_rows)
        cols = split_cols(n, lanes, vectors)
        cost = sum(rg.count * cg.count * tile_cycles(rg.rows, cg.vectors)
                   for rg in rows for cg in cols)
        if best is None or cost < best[0]:
            best = (cost, Blocking(lanes, rows, cols))
    return best[1]
