"""BRGEMM on AMX tiles: bf16 A times VNNI-paired bf16 B into f32 accumulator tiles.

Where the target has AMX (tpp_cpu.amx) and the spec is bf16 A (row-major) with bf16 VNNI B
(not transposed) and k a multiple of 32, the part of C made of whole 16 x 16 tiles runs on
the tile unit; the rest of C (rows past the last multiple of 16, columns past the last
multiple of 16) runs on the vector code of tpp_cpu.brgemm, in the same kernel.

Tiles: four f32 accumulators (tmm0-3) hold a 32 x 32 block of C, as 2 x 2 tiles; per step of
32 k values, two A tiles (tmm4-5: 16 rows x 32 bf16, read with A's row stride) and two B
tiles (tmm6-7: 16 VNNI rows x 16 column pairs, read with B's row stride) feed four
`tdpbf16ps`: each A and B tile loaded serves two multiplies (the libxsmm/oneDNN blocking).
At C's edges a block is 2 x 1, 1 x 2 or 1 x 1 tiles. The accumulators stay in tiles across
the whole batch and every k step:

    ldtilecfg                                     (once per call)
    for each 32 x 32 block of C (fewer tiles at the edges):
      acc tiles = beta ? C (f32 straight from C; bf16/f16 C widened through a stack buffer) : 0
      for i in range(count):  for each 32 k values:
        load A0, B0; acc00 += A0 B0; load B1; acc01 += A0 B1; load A1; acc10 += ...; acc11
      f32 C without an epilogue: tiles stored straight into C; otherwise the tiles go to a
      stack buffer and the vector epilogue (bias, activation, bitmask, rounding to dtype_c)
      runs on its rows, as on the vector path
    tilerelease

Figures (one Sapphire Rapids core of a 2-core guest, 64x64x64 x16 pairs, f32 C, in a
compiled loop): see bench/suites/brgemm.py's `bf16 vnni` case and the AMX peak of `tpp-bench
peak`.
"""
from __future__ import annotations

from . import amx, irx
from .irx import F32, I16, i64

K_STEP = 32          # bf16 k values per tile step: one 64-byte A row, 16 VNNI B rows
TILE = 16            # rows and f32 columns of an accumulator tile
ACC = ((0, 1), (2, 3))   # accumulator tile of [row tile][column tile]
A_TILES = (4, 5)
B_TILES = (6, 7)
SCRATCH_COLS = 2 * TILE  # f32 per row of the stack buffer (a 32 x 32 block)
SHAPES = [(TILE, 4 * TILE)] * 4 + [(TILE, 2 * K_STEP)] * 2 + [(K_STEP // 2, 4 * TILE)] * 2


def eligible(spec, target) -> bool:
    """Whether some of this spec's C runs on tiles."""
    return (target.amx and target.bf16_dot and spec.vnni_b and not spec.trans_a
            and not spec.trans_b and spec.dtype_a.name == "bf16"
            and spec.dtype_b.name == "bf16" and spec.k % K_STEP == 0
            and spec.m >= TILE and spec.n >= TILE)


def tiled_extent(spec) -> tuple:
    """(rows, columns) of C computed on tiles: the whole 16 x 16 tiles from C's origin."""
    return spec.m - spec.m % TILE, spec.n - spec.n % TILE


class TileBlocks:
    """Emits the tiled part of a BRGEMM kernel for a tpp_cpu.brgemm._Generator `gen` (its
    builder, operands, batch pointers and epilogue `finish` are shared)."""

    def __init__(self, gen):
        self.gen, self.spec, self.b = gen, gen.spec, gen.b
        self.rows, self.cols = tiled_extent(gen.spec)
        self.direct = (gen.spec.dtype_c.name == "f32" and not gen.spec.bias
                       and gen.activation is None)
        self.scratch = None

    def emit(self):
        b = self.b
        buf = b.alloca(F32, size=SCRATCH_COLS * 2 * TILE, name="amx_tiles")
        buf.align = 64
        self.scratch = b.inttoptr(b.ptrtoint(buf, irx.I64), irx.PTR)
        amx.load_config(b, SHAPES)
        row_tiles, col_tiles = self.rows // TILE, self.cols // TILE
        row_kinds = [(2, 0, row_tiles // 2)] if row_tiles >= 2 else []
        if row_tiles % 2:
            row_kinds.append((1, (row_tiles - 1) * TILE, 1))
        col_kinds = [(2, 0, col_tiles // 2)] if col_tiles >= 2 else []
        if col_tiles % 2:
            col_kinds.append((1, (col_tiles - 1) * TILE, 1))
        for rt, rstart, rcount in row_kinds:
            with irx.for_range(b, rcount, name="amx_m") as i:
                row0 = b.add(i64(rstart), b.mul(i, i64(rt * TILE)))
                for ct, cstart, ccount in col_kinds:
                    with irx.for_range(b, ccount, name="amx_n") as j:
                        col0 = b.add(i64(cstart), b.mul(j, i64(ct * TILE)))
                        self.block(row0, col0, rt, ct)
        amx.release(b)

    # ------------------------------------------------------------ one block of tiles
    def block(self, row0, col0, rt, ct):
        spec, b = self.spec, self.b
        self.start(row0, col0, rt, ct)
        with irx.for_range(b, self.gen.count, name="amx_batch") as i:
            a_i, b_i = self.gen.batch_pointers(i)
            a_rows = [irx.element_ptr(b, a_i, b.mul(b.add(row0, i64(r * TILE)),
                                                     i64(spec.lda)), I16) for r in range(rt)]
            b_cols = [irx.element_ptr(b, b_i, b.mul(b.add(col0, i64(c * TILE)), i64(2)), I16)
                      for c in range(ct)]
            steps = spec.k // K_STEP
            if steps == 1:
                self.k_step(a_rows, b_cols, i64(0))
            else:
                with irx.for_range(b, steps, name="amx_k") as kk:
                    self.k_step(a_rows, b_cols, kk)
        self.finish(row0, col0, rt, ct)

    def k_step(self, a_rows, b_cols, kk):
        """acc += A[:, 32kk : 32kk+32] B[32kk : 32kk+32, :] for the block's tiles."""
        spec, b = self.spec, self.b
        a_off = b.mul(kk, i64(K_STEP))                       # bf16 elements along a row
        b_off = b.mul(kk, i64(K_STEP // 2 * spec.ldb))       # VNNI rows down B
        a_stride, b_stride = 2 * spec.lda, 2 * spec.ldb
        amx.load(b, A_TILES[0], irx.element_ptr(b, a_rows[0], a_off, I16), a_stride)
        for c, col in enumerate(b_cols):
            amx.load(b, B_TILES[c], irx.element_ptr(b, col, b_off, I16), b_stride)
            amx.dot_bf16(b, ACC[0][c], A_TILES[0], B_TILES[c])
        if len(a_rows) == 2:
            amx.load(b, A_TILES[1], irx.element_ptr(b, a_rows[1], a_off, I16), a_stride)
            for c in range(len(b_cols)):
                amx.dot_bf16(b, ACC[1][c], A_TILES[1], B_TILES[c])

    def c_ptr(self, row0, col0, r, c):
        """Address of C's element at tile (r, c) of the block at (row0, col0)."""
        spec, b = self.spec, self.b
        at = b.add(b.mul(b.add(row0, i64(r * TILE)), i64(spec.ldc)), b.add(col0, i64(c * TILE)))
        return irx.element_ptr(b, self.gen.pc, at, irx.storage_type(spec.dtype_c))

    def scratch_ptr(self, r, c):
        return irx.element_ptr(self.b, self.scratch, i64(r * TILE * SCRATCH_COLS + c * TILE),
                               F32)

    def start(self, row0, col0, rt, ct):
        """The accumulators: zero, or C (beta = 1; a narrow C is widened into the buffer)."""
        spec, b = self.spec, self.b
        for r in range(rt):
            for c in range(ct):
                t = ACC[r][c]
                if not spec.beta:
                    amx.zero(b, t)
                elif spec.dtype_c.name == "f32":
                    amx.load(b, t, self.c_ptr(row0, col0, r, c), 4 * spec.ldc)
                else:
                    self.widen_c(row0, col0, r, c)
                    amx.load(b, t, self.scratch_ptr(r, c), 4 * SCRATCH_COLS)

    def widen_c(self, row0, col0, r, c):
        spec, b = self.spec, self.b
        with irx.for_range(b, TILE, name="amx_cin") as y:
            row = b.add(row0, b.add(y, i64(r * TILE)))
            x = irx.load_f32(b, self.gen.pc, b.add(b.mul(row, i64(spec.ldc)),
                                                   b.add(col0, i64(c * TILE))),
                             spec.dtype_c, TILE)
            irx.store_vec(b, x, self.scratch,
                          b.add(b.mul(b.add(y, i64(r * TILE)), i64(SCRATCH_COLS)),
                                i64(c * TILE)))

    def finish(self, row0, col0, rt, ct):
        """Tiles into C, straight or through the buffer and the vector epilogue."""
        spec, b, gen = self.spec, self.b, self.gen
        if self.direct:
            for r in range(rt):
                for c in range(ct):
                    amx.store(b, ACC[r][c], self.c_ptr(row0, col0, r, c), 4 * spec.ldc)
            return
        for r in range(rt):
            for c in range(ct):
                amx.store(b, ACC[r][c], self.scratch_ptr(r, c), 4 * SCRATCH_COLS)
        cols = [b.add(col0, i64(c * TILE)) for c in range(ct)]
        bias = None
        if spec.bias:
            bias = [irx.load_f32(b, gen.pbias, col, spec.dtype_c, TILE) for col in cols]
        with irx.for_range(b, rt * TILE, name="amx_out") as y:
            row = b.add(row0, y)
            for c in range(ct):
                x = irx.load_vec(b, self.scratch, b.add(b.mul(y, i64(SCRATCH_COLS)),
                                                        i64(c * TILE)), F32, TILE)
                gen.finish(x, row, cols[c], bias, c, None,
                           b.add(b.mul(row, i64(spec.ldc)), cols[c]))
