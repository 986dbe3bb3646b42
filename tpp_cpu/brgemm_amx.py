"""BRGEMM on AMX tiles: bf16 A times VNNI-paired bf16 B into f32 accumulator tiles.

Where the target has AMX (tpp_cpu.amx) and the spec is bf16 A with bf16 VNNI B (B not
transposed; a transposed A with an even k), the whole of C runs on the tile unit
(`eligible`).

Tiles: four f32 accumulators (tmm0-3) hold a block of 2 x 2 tiles of C; per k step two A
tiles (tmm4-5, read with A's row stride) and two B tiles (tmm6-7, VNNI rows read with B's row
stride) feed four `tdpbf16ps`: each tile loaded serves two multiplies (the libxsmm/oneDNN
blocking). The accumulators stay in tiles across the whole batch and every k step:

    ldtilecfg                                     (once per call)
    for each block of C (2 x 2 tiles; 2 x 1, 1 x 2 or 1 x 1 at the edges):
      acc tiles = beta ? C (f32 straight from C; bf16/f16 C widened through a stack buffer) : 0
      for i in range(count):  for each k step:
        load A0, B0; acc00 += A0 B0; load B1; acc01 += A0 B1; load A1; acc10 += ...; acc11
      f32 C without an epilogue: tiles stored straight into C; otherwise the tiles go to one
      of two stack slots, and their rows' vector epilogue (bias, activation, bitmask,
      rounding to dtype_c) runs a few rows after each k step of the NEXT block (`Pending`),
      on the vector units while the tile unit multiplies (what is left of it runs before
      that block's own tiles are stored)
    the last block's epilogue; tilerelease

The deferred epilogue (Sapphire Rapids, one core, 64 x 192 x 384 bf16 C with bias and gelu,
operands hot): 636-704 -> 781-853 GFLOP/s (bias alone: 1136-1260), k = 1536 1001 -> 1356
(bias alone: 1318-1488); ops.linear bf16 4096 x 384 -> 1536 with gelu (2 threads) 4.3-4.5 -> 3.2 ms.

Shapes (one configuration per kernel, `Layout`). A tile multiply takes the same time whatever
its tiles' sizes (16 cycles on a Sapphire Rapids core, measured for K 2..32 and M 1..16), so
every tile is as large as C allows:
- rows: 16-row tiles; where m is not a multiple of 16, the last tile starts at m - 16 and
  overlaps the one before, in the same block (both read C before either writes it, and both
  compute the overlapping rows with the same sums in the same order: the same bits). m < 16:
  one tile of m rows. Columns likewise (16 f32 per tile).
- k: steps of ks = k / steps values, the fewest steps with ks even and at most 32 (k = 48:
  two steps of 24). An odd k (whose last VNNI pair has a padding half that may hold
  anything, NaN included) takes steps of min(32, k + 1) read in place and one tail step read
  from zero-filled stack copies: A's last columns (masked loads: no read past A's k) and
  B's last VNNI rows, the padding half cleared (k = 7: one step; k = 49: 32 + 17).
Where a bitmask is written, the overlapping column tile would start at a column that is not
a multiple of 8 (the mask's bytes): such specs (n > 16, n % 16 != 0) stay on the vector code.

Transposed A (trans_a: A stored (k, m), an even k): tiles read A's rows, so each A tile is
built per k step in a stack buffer: two stored rows (k values 2p, 2p+1) interleave into the
VNNI pair of column p for 16 rows of A, and a 16 x 16 transpose of those 32-bit pairs
(tpp_cpu.transform.transpose_tile) gives the tile's rows: ~100 vector instructions per tile
beside its multiplies, still far faster than vdpbf16ps on this core (conv's 1x1 data
gradients read their operand so).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import amx, irx, transform
from .irx import F32, I16, i64

TILE = 16            # most rows, and most f32 columns, of an accumulator tile
K_STEP = 32          # most bf16 k values per step (one 64-byte A tile row)
ACC = ((0, 1), (2, 3))   # accumulator tile of [row slot][column slot]
A_TILES = (4, 5)
B_TILES = (6, 7)
SCRATCH_COLS = 2 * TILE  # f32 per row of the stack buffer (a 32 x 32 block)
SLOT = SCRATCH_COLS * 2 * TILE   # f32 of one block in the stack buffer


def eligible(spec, target) -> bool:
    """Whether this spec runs on tiles (then all of its C does)."""
    return (target.amx and target.bf16_dot and spec.vnni_b and not spec.trans_b
            and spec.dtype_a.name == "bf16" and spec.dtype_b.name == "bf16"
            and not (spec.trans_a and spec.k % 2)
            and not (spec.bitmask and spec.n > TILE and spec.n % TILE))


def k_steps(k: int) -> tuple:
    """(steps, k values per step): the fewest steps of an even size of at most 32."""
    steps = -(-k // K_STEP)
    while k % steps or (k // steps) % 2:
        steps += 1
    return steps, k // steps


def tile_starts(extent: int) -> tuple:
    """Start of each 16-wide tile covering `extent` (the last one overlapping where needed);
    one tile of `extent` when it is smaller than 16."""
    if extent <= TILE:
        return (0,)
    full = extent // TILE
    starts = tuple(TILE * t for t in range(full))
    return starts + ((extent - TILE,) if extent % TILE else ())


@dataclass(frozen=True)
class Blocks:
    """Blocks of one or two tiles along one dimension of C: `count` blocks from `start`,
    `step` apart, each with tiles at the offsets `tiles` from the block's start."""
    count: int
    start: int
    step: int
    tiles: tuple


def blocks(extent: int) -> tuple:
    """The blocks along one dimension: tiles paired in order, an overlapping last tile paired
    with the one it overlaps (see the module docstring), a lone tile left as one block."""
    starts = tile_starts(extent)
    overlap = len(starts) > 1 and starts[-1] % TILE
    body = starts[:-2] if overlap else starts
    out = []
    if len(body) >= 2:
        out.append(Blocks(len(body) // 2, 0, 2 * TILE, (0, TILE)))
    if len(body) % 2:
        out.append(Blocks(1, body[-1], 0, (0,)))
    if overlap:
        out.append(Blocks(1, starts[-2], 0, (0, starts[-1] - starts[-2])))
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """A kernel's tile shapes: rows and f32 columns of its accumulator tiles, k per step;
    steps read in place, and (odd k) the k values of the tail step read from copies."""
    rows: int
    cols: int
    steps: int
    ks: int
    tail: int = 0

    @classmethod
    def of(cls, spec):
        rows, cols = min(spec.m, TILE), min(spec.n, TILE)
        if spec.k % 2 == 0:
            return cls(rows, cols, *k_steps(spec.k))
        ks = min(K_STEP, spec.k + 1)
        return cls(rows, cols, spec.k // ks, ks, spec.k % ks)

    def shapes(self) -> list:
        """(rows, bytes per row) of tiles 0-7 (the palette-1 configuration)."""
        acc = (self.rows, 4 * self.cols)
        return [acc] * 4 + [(self.rows, 2 * self.ks)] * 2 + [(self.ks // 2, 4 * self.cols)] * 2


class TileBlocks:
    """Emits the BRGEMM kernel body on tiles for a tpp_cpu.brgemm._Generator `gen` (its
    builder, operands, batch pointers and epilogue `finish` are shared)."""

    def __init__(self, gen):
        self.gen, self.spec, self.b = gen, gen.spec, gen.b
        self.layout = Layout.of(gen.spec)
        self.direct = (gen.spec.dtype_c.name == "f32" and not gen.spec.bias
                       and gen.activation is None)
        self.scratch = None

    def emit(self):
        b = self.b
        # deferred epilogue: two slots, the finished block's tiles in one while the next
        # block's C is staged in the other
        self.scratch = self._stack(F32, SLOT * (1 if self.direct else 2), "amx_tiles")
        self.pending = None if self.direct else Pending(self)
        if self.spec.trans_a:   # the A tiles built from A's stored rows, per k step
            self.a_built = self._stack(I16, 2 * TILE * 2 * TILE, "amx_a_rows")
        if self.layout.tail:    # the tail step's copies: zero past the tail, once per call
            ks = self.layout.ks
            self.a_tail = self._stack(I16, 2 * TILE * ks, "amx_a_tail", zero=True)
            self.b_tail = self._stack(I16, 2 * (ks // 2) * 2 * TILE, "amx_b_tail", zero=True)
        amx.load_config(b, self.layout.shapes())
        for rb in blocks(self.spec.m):
            with irx.for_range(b, rb.count, name="amx_m") as i:
                row0 = b.add(i64(rb.start), b.mul(i, i64(rb.step)))
                for cb in blocks(self.spec.n):
                    with irx.for_range(b, cb.count, name="amx_n") as j:
                        col0 = b.add(i64(cb.start), b.mul(j, i64(cb.step)))
                        self.block(row0, col0, rb.tiles, cb.tiles)
        if self.pending is not None:
            self.pending.drain()                  # the last block's epilogue
        amx.release(b)

    def _stack(self, ty, count, name, zero=False):
        """A 64-byte aligned stack buffer of `count` elements (zeroed: a memset)."""
        b = self.b
        buf = b.alloca(ty, size=count, name=name)
        buf.align = 64
        ptr = b.inttoptr(b.ptrtoint(buf, irx.I64), irx.PTR)
        if zero:
            fn = irx.intrinsic(b.module, "llvm.memset", ir.VoidType(),
                               [irx.PTR, irx.I8, irx.I64, irx.I1], [irx.PTR, irx.I64])
            b.call(fn, [ptr, ir.Constant(irx.I8, 0), i64(count * ty.width // 8),
                        ir.Constant(irx.I1, 0)])
        return ptr

    # ------------------------------------------------------------ one block of tiles
    def block(self, row0, col0, rows, cols):
        """The tiles at (row0 + rows[r], col0 + cols[c]): start, every pair and k step, finish."""
        spec, b = self.spec, self.b
        rows = [b.add(row0, i64(r)) for r in rows]
        cols = [b.add(col0, i64(c)) for c in cols]
        self.start(rows, cols)
        with irx.for_range(b, self.gen.count, name="amx_batch") as i:
            a_i, b_i = self.gen.batch_pointers(i)
            a_rows = [irx.element_ptr(b, a_i, r if spec.trans_a else b.mul(r, i64(spec.lda)),
                                      I16) for r in rows]
            b_cols = [irx.element_ptr(b, b_i, b.mul(c, i64(2)), I16) for c in cols]
            if self.layout.steps == 1:
                self.k_step(a_rows, b_cols, i64(0))
                self.drain_some()
            elif self.layout.steps > 1:
                with irx.for_range(b, self.layout.steps, name="amx_k") as kk:
                    self.k_step(a_rows, b_cols, kk)
                    self.drain_some()
            if self.layout.tail:
                self.tail_step(a_rows, b_cols)
                self.drain_some()
        self.finish(rows, cols)

    def drain_some(self):
        """After a k step: the next few rows of the previous block's epilogue (a share that
        finishes it within one batch item's steps), which run on the vector units while the
        tile unit multiplies."""
        if self.pending is not None:
            steps = self.layout.steps + (1 if self.layout.tail else 0)
            self.pending.drain(-(-2 * self.layout.rows // max(1, steps)))

    def k_step(self, a_rows, b_cols, kk):
        """acc += A[:, ks kk : ks (kk+1)] B[ks kk : ks (kk+1), :] for the block's tiles."""
        spec, b, ks = self.spec, self.b, self.layout.ks
        b_off = b.mul(kk, i64(ks // 2 * spec.ldb))       # VNNI rows down B
        b_tiles = [irx.element_ptr(b, c, b_off, I16) for c in b_cols]
        if spec.trans_a:
            self.dots([self.build_a(r, a, b.mul(kk, i64(ks))) for r, a in enumerate(a_rows)],
                      4 * TILE, b_tiles, 2 * spec.ldb)
            return
        a_off = b.mul(kk, i64(ks))                       # bf16 elements along a row
        self.dots([irx.element_ptr(b, a, a_off, I16) for a in a_rows], 2 * spec.lda,
                  b_tiles, 2 * spec.ldb)

    def build_a(self, slot, a_col, k0):
        """The A tile of rows a_col .. a_col + 15 of a transposed A (stored (k, m): a_col
        points at stored row 0, column of the tile's first row) and k values k0 .. k0 + ks - 1,
        into the stack buffer of `slot`; returns its address (rows of 64 bytes)."""
        spec, b, lay = self.spec, self.b, self.layout
        count = None if lay.rows == TILE else lay.rows
        pairs = []
        for p in range(TILE):
            if p >= lay.ks // 2:
                pairs.append(irx.const(irx.vec(irx.I32, TILE), 0))
                continue
            even, odd = (irx.load_vec(b, a_col, b.mul(b.add(k0, i64(2 * p + t)), i64(spec.lda)),
                                      I16, TILE, count) for t in (0, 1))
            both = irx.shuffle(b, even, odd, [x for j in range(TILE) for x in (j, TILE + j)])
            pairs.append(b.bitcast(both, irx.vec(irx.I32, TILE)))
        rows = transform.transpose_tile(b, pairs, 4)
        dst = irx.element_ptr(b, self.a_built, i64(slot * TILE * 2 * TILE), I16)
        for r in range(lay.rows):
            irx.store_vec(b, rows[r], dst, i64(r * TILE))   # <16 x i32>: 64 bytes a row
        return dst

    def dots(self, a_tiles, a_stride, b_tiles, b_stride):
        """Load the block's A and B tiles (their first rows' addresses, strides in bytes)
        and multiply every pair into its accumulator."""
        b = self.b
        amx.load(b, A_TILES[0], a_tiles[0], a_stride)
        for c, ptr in enumerate(b_tiles):
            amx.load(b, B_TILES[c], ptr, b_stride)
            amx.dot_bf16(b, ACC[0][c], A_TILES[0], B_TILES[c])
        if len(a_tiles) == 2:
            amx.load(b, A_TILES[1], a_tiles[1], a_stride)
            for c in range(len(b_tiles)):
                amx.dot_bf16(b, ACC[1][c], A_TILES[1], B_TILES[c])

    def tail_step(self, a_rows, b_cols):
        """The last `tail` (odd) k values from the zero-filled copies: A's columns by masked
        loads, B's VNNI rows with the last pair's padding half cleared."""
        spec, b, lay = self.spec, self.b, self.layout
        k0, ks, pairs = lay.steps * lay.ks, lay.ks, (lay.tail + 1) // 2
        a_copies, b_copies = [], []
        for r, a in enumerate(a_rows):
            dst = irx.element_ptr(b, self.a_tail, i64(r * TILE * ks), I16)
            with irx.for_range(b, lay.rows, name="amx_a_tail") as y:
                x = irx.load_vec(b, a, b.add(b.mul(y, i64(spec.lda)), i64(k0)), I16,
                                 2 * TILE, lay.tail)
                irx.store_vec(b, x, dst, b.mul(y, i64(ks)), lay.tail)
            a_copies.append(dst)
        low = irx.const(irx.vec(irx.I32, TILE), 0xFFFF)
        for c, col in enumerate(b_cols):
            dst = irx.element_ptr(b, self.b_tail, i64(c * (ks // 2) * 2 * TILE), I16)
            for p in range(pairs):
                row = irx.element_ptr(b, col, i64((k0 // 2 + p) * spec.ldb), I16)
                x = irx.load_vec(b, row, i64(0), irx.I32, TILE,
                                 None if lay.cols == TILE else lay.cols, align=2)
                if p == pairs - 1:
                    x = b.and_(x, low)          # the padding half of the last pair
                irx.store_vec(b, x, dst, i64(p * 2 * TILE // 2))
            b_copies.append(dst)
        self.dots(a_copies, 2 * ks, b_copies, 4 * TILE)

    def c_offset(self, row, col):
        return self.b.add(self.b.mul(row, i64(self.spec.ldc)), col)

    def c_ptr(self, row, col):
        return irx.element_ptr(self.b, self.gen.pc, self.c_offset(row, col),
                               irx.storage_type(self.spec.dtype_c))

    def slot(self):
        """The scratch slot of the block being computed (the other holds the pending one)."""
        if self.pending is None:
            return self.scratch
        return self.pending.slot_ptr(self.pending.free_slot())

    def scratch_ptr(self, r, c):
        return irx.element_ptr(self.b, self.slot(), i64(r * TILE * SCRATCH_COLS + c * TILE),
                               F32)

    def count(self):
        """Active lanes of a tile row's vector (None: all 16)."""
        return None if self.layout.cols == TILE else self.layout.cols

    def start(self, rows, cols):
        """The accumulators: zero, or C (beta = 1; a narrow C is widened into the buffer).
        Every tile of the block is read before any is written (overlapping tiles)."""
        spec, b = self.spec, self.b
        for r, row in enumerate(rows):
            for c, col in enumerate(cols):
                t = ACC[r][c]
                if not spec.beta:
                    amx.zero(b, t)
                elif spec.dtype_c.name == "f32":
                    amx.load(b, t, self.c_ptr(row, col), 4 * spec.ldc)
                else:
                    with irx.for_range(b, self.layout.rows, name="amx_cin") as y:
                        x = irx.load_f32(b, self.gen.pc, self.c_offset(b.add(row, y), col),
                                         spec.dtype_c, TILE, self.count())
                        irx.store_vec(b, x, self.slot(), b.add(
                            b.mul(b.add(y, i64(r * TILE)), i64(SCRATCH_COLS)), i64(c * TILE)))
                    amx.load(b, t, self.scratch_ptr(r, c), 4 * SCRATCH_COLS)

    def finish(self, rows, cols):
        """Tiles into C: straight (f32 C, no epilogue), else into a scratch slot whose rows
        go through the vector epilogue during the next block's k steps (Pending)."""
        spec, b = self.spec, self.b
        if self.direct:
            for r, row in enumerate(rows):
                for c, col in enumerate(cols):
                    amx.store(b, ACC[r][c], self.c_ptr(row, col), 4 * spec.ldc)
            return
        self.pending.drain()                      # the previous block's rows left
        for r in range(len(rows)):
            for c in range(len(cols)):
                amx.store(b, ACC[r][c], self.scratch_ptr(r, c), 4 * SCRATCH_COLS)
        self.pending.hand_over(rows, cols)


class Pending:
    """The deferred epilogue of a finished block (bias, activation, bitmask, rounding to C's
    dtype): its tiles wait in one scratch slot while the next block's tiles multiply, and
    drain(n) runs n more of its rows. Without this the tile unit idled through every epilogue
    (a gelu on a 32 x 32 block costs about two blocks' worth of k = 384 multiplies). Blocks
    write disjoint parts of C, so the order of the writes does not matter; overlapping tiles
    within one block write the same values twice, as before.

    State (stack slots, runtime values, since blocks are visited in loops): the block's row
    and column tile starts, its row count (tile slots x tile rows), its column tile count,
    the next row to drain, and the slot that holds it."""

    def __init__(self, tiles):
        self.t, b = tiles, tiles.b
        self.starts = tiles._stack(irx.I64, 4, "amx_pending_starts")   # rows 0-1, cols 2-3
        self.state = tiles._stack(irx.I64, 4, "amx_pending_state")      # total, ncols, next, slot
        for k, v in enumerate((0, 0, 0, 1)):
            self._set(self.state, k, i64(v))

    def _get(self, base, k):
        return irx.load_scalar(self.t.b, base, k if not isinstance(k, int) else i64(k), irx.I64)

    def _set(self, base, k, value):
        self.t.b.store(value, irx.element_ptr(self.t.b, base, i64(k), irx.I64))

    def slot_ptr(self, slot):
        return irx.element_ptr(self.t.b, self.t.scratch, self.t.b.mul(slot, i64(SLOT)), F32)

    def free_slot(self):
        return self.t.b.sub(i64(1), self._get(self.state, 3))

    def hand_over(self, rows, cols):
        """The block just stored (in the free slot) becomes the pending one."""
        self._set(self.state, 3, self.free_slot())
        for r, row in enumerate(rows):
            self._set(self.starts, r, row)
        for c, col in enumerate(cols):
            self._set(self.starts, 2 + c, col)
        self._set(self.state, 0, i64(len(rows) * self.t.layout.rows))
        self._set(self.state, 1, i64(len(cols)))
        self._set(self.state, 2, i64(0))

    def drain(self, rows=None):
        """The epilogue of the pending block's next `rows` rows (None: all that are left)."""
        b = self.t.b
        first, total = self._get(self.state, 2), self._get(self.state, 0)
        end = total
        if rows is not None:
            want = b.add(first, i64(rows))
            end = b.select(b.icmp_signed("<", want, total), want, total)
        with irx.for_range(b, end, start=first, name="amx_drain") as d:
            self._row(d)
        self._set(self.state, 2, end)

    def _row(self, d):
        t, b = self.t, self.t.b
        spec, gen, lr = t.spec, t.gen, t.layout.rows
        r, y = b.udiv(d, i64(lr)), b.urem(d, i64(lr))     # tile slot, row in the tile
        row = b.add(self._get(self.starts, r), y)
        base = self.slot_ptr(self._get(self.state, 3))
        at = b.add(b.mul(r, i64(TILE * SCRATCH_COLS)), b.mul(y, i64(SCRATCH_COLS)))
        count = t.count()

        def column(c):
            col = self._get(self.starts, 2 + c)
            x = irx.load_vec(b, base, b.add(at, i64(c * TILE)), F32, TILE)
            bias = None
            if spec.bias == "row":
                bias = [irx.load_f32(b, gen.pbias, col, spec.dtype_c, TILE, count)] * 2
            gen.finish(x, row, col, bias, c, count, t.c_offset(row, col))

        column(0)
        with b.if_then(b.icmp_signed(">", self._get(self.state, 1), i64(1))):
            column(1)
