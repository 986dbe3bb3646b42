"""The BRGEMM generator: a register-blocked microkernel whose accumulators live in registers
across the whole batch.

Shape of the code (see brgemm_blocking for the tile sizes, chosen per ISA register count,
shape and A's row stride):

    for each row group, for each tile of rows:                 (loops; A's rows stay in L1
      for each column group, for each tile of columns:          across the column tiles)
        acc[R][V] = beta ? C tile : 0                           (registers)
        for i in range(count):                                  (A_i, B_i from the batch mode)
          for each k step (unrolled by UNROLL steps, remainder unrolled):
            b[v] = B_i[kk, cols of vector v]                    (V vector loads)
            acc[r][v] += broadcast(A_i[row r, kk]) * b[v]       (R broadcasts, R*V FMAs)
        epilogue on the tile: + bias row, activation, bitmask, round to dtype_c, store

Inputs of any dtype are widened to f32 exactly (bf16 by a shift, f16 by vcvtph2ps) and
multiplied with f32 FMAs. A VNNI-packed B row holds two k steps: as 32-bit lanes, the low
halves are B[2p, :] and the high halves B[2p+1, :]. On hosts with avx512_bf16 and bf16 A and
VNNI B, a pair of k steps is one `vdpbf16ps` instead. A transposed B is read with gathers (its
columns are strided), correct but slower than packing B with the transpose TPP first.

Widened A: where A is narrower than f32 and no dot instruction takes it (bf16 A on hosts
without avx512_bf16 or with a B not VNNI-packed; f16 A), each row tile first widens its rows
of every pair into a stack buffer of f32 (one vector load, widen and store per 8 or 16
elements), and its column tiles read A from there with plain broadcasts: the widening is paid
once per row tile instead of once per column tile and k step, and A needs one register, not
three (its pair and the halves' mask), so the AVX2 tile grows from 4x2 to 5x2. A transposed
A (attention's P^T V) is widened too and kept transposed: per k step, the tile's rows as one
vector. The buffer (a dynamic alloca of batch * rows * k f32 on the calling thread's stack) is
capped at WIDE_ELEMENTS: a larger batch (more than 102 pairs of k = 64 on AVX2) reads A in
place as before. f32 A and the bf16 dot path are unchanged. Attention forward+backward in bf16
with AVX2 code (Zen 4, 2 threads, paired runs): 0.83-0.88x -> 0.91-1.0x of its f32 rate.

No software prefetch: prefetching the next pair's B rows measured 4-6% slower on Zen 3 (the
blocks are cache-resident and the prefetches compete for the load ports), and prefetching A's
rows 64-256 elements ahead in the k loop changed nothing measurable on Zen 4 (ops.matmul at
2048^3, 1 thread: within +-2%, the run-to-run noise).

Instruction budget of the inner loop (f32, counted in Kernel.dump("asm"), LLVM 22, Zen 4), per
vector FMA:
  AVX-512 (32 zmm), 6x4 tile (64x64 and larger blocks): one k-loop iteration of 8 steps is
    192 vfmadd231ps, 32 B loads (vmovups), 48 vbroadcastss of A and 9 instructions of loop
    and address arithmetic: 1.46 instructions, 0.42 loads (0.17 B + 0.25 A) and 0.05
    overhead per FMA. 11x2 tile (32x32): 176 FMAs, 16 + 88 loads, 9 others: 1.64
    instructions, 0.59 loads. 16x1 tile (16x16, k <= 16: no k loop): each A element is a
    broadcast operand of its FMA (vfmadd231ps mem{1to16}), 256 FMAs, 16 B loads and 10
    instructions of batch loop per pair: 1.10 instructions, 1.06 loads per FMA. bf16 VNNI
    (vdpbf16ps, 6x4): 1.51 instructions, 0.42 loads per dot (two k steps).
  AVX2 (16 ymm), 6x2 tile: one iteration of 8 steps is 96 FMAs, 16 B loads, 48 broadcasts
    and 9 instructions: 1.76 instructions, 0.67 loads (0.17 B + 0.50 A) and 0.09 overhead per
    FMA; 16x16 (6x2 and 5x2 tiles, no k loop): 1.72 instructions, 0.67 loads.
  bf16 without a dot instruction (AVX2; VNNI B): A widened once per row tile (see Widened
    A), 5x2 tile: per pair of k steps 2 B loads, a shift and a blend per B vector for its two
    f32 halves, 10 broadcasts of widened A and 20 FMAs: 1.84 instructions per FMA. 64^3 x16
    on Zen 4 as AVX2 (raw calls, paired runs): 86-96 -> 99-103 GFLOP/s, f32 109-111. Before
    the widening (the batches too big for its buffer still run so), a 4x2 tile split each A
    pair on the vector per column tile: one broadcast load, a shift and a mask (see _opaque)
    per row and pair, ~2.4 instructions per FMA.
The per-call cost on top (C tile zeroed or loaded, stored; pointers per pair) is < 1% of a
16^3 x32 call's FMAs; what remains measurable for small calls is the caller's: from Python a
raw call costs ~0.5 us (cffi, 8 arguments), 18% of a 16^3 x32 call, which reaches 94-98% of the
FMA peak when called from native code (a LoopNest), 77-81% through Kernel.raw from Python
(bench/suites/brgemm.py reports both).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from tpp.core import dtypes as _dtypes
from tpp.core import optable
from tpp.core.spec import mask_bytes

from . import brgemm_amx, irx, mapops
from .brgemm_blocking import plan
from .irx import F32, I16, I32, I64, PTR, i64, vec

UNROLL_STEPS = 8     # k steps per iteration of the k loop
WIDEN_A = True       # narrow A (no dot instruction) widened to f32 once per row tile
WIDE_ELEMENTS = 32768  # most f32 of the widened-A stack buffer (128 KiB)


def _wide_ld(k: int, lanes: int) -> int:
    """f32 per widened A row: k in whole vectors, one more line where rows would lie a multiple
    of 4 KiB apart (every row of a tile in one L1 set)."""
    ld = -(-k // lanes) * lanes
    return ld + 16 if (4 * ld) % 4096 == 0 else ld


@dataclass(frozen=True)
class _Wide:
    """The stack copy of a row tile's A rows as f32: A[row r, k step kk] of pair i at
    i * pair + r * ld + kk, or (A transposed) i * pair + kk * ld + r."""
    ld: int         # f32 per row: k (transposed: the tile's rows) in whole vectors
    pair: int       # f32 per pair
    pairs: int      # pairs that fit WIDE_ELEMENTS: batches of more read A in place
STRAIGHT_STEPS = 16  # up to this many k steps, no k loop at all


def generate(spec, target, symbol: str) -> ir.Module:
    module, b, (pa, pb, pc, pbias, pmask), (count, arg_a, arg_b) = irx.new_kernel(symbol, 5, 3)
    _Generator(spec, target, b, pa, pb, pc, pbias, pmask, count, arg_a, arg_b).emit()
    b.ret_void()
    return module


class _Generator:
    def __init__(self, spec, target, b, pa, pb, pc, pbias, pmask, count, arg_a, arg_b):
        self.spec, self.b, self.lanes = spec, b, target.lanes
        self.pa, self.pb, self.pc, self.pbias, self.pmask = pa, pb, pc, pbias, pmask
        self.count, self.arg_a, self.arg_b = count, arg_a, arg_b
        self.tb = irx.storage_type(spec.dtype_b)
        self.dot = (target.bf16_dot and spec.vnni_b and spec.dtype_a.name == "bf16"
                    and spec.dtype_b.name == "bf16")
        self.step = 2 if spec.vnni_b else 1     # k values per step (one B row)
        registers = target.vector_registers
        widened = 2 if (spec.vnni_b and not self.dot) else 1
        a_row_bytes = None if spec.trans_a else spec.lda * spec.dtype_a.itemsize
        self.blocking = plan(spec.m, spec.n, target.lanes, registers, widened, a_row_bytes)
        # A widened once per row tile (see the module docstring): its k loop reads A as f32,
        # so a tile needs no registers for A's pair and its mask, only the broadcast
        self.widen = self.wide_blocking = None
        if WIDEN_A and not self.dot and spec.dtype_a.name != "f32":
            ld = None if spec.trans_a else _wide_ld(spec.k, target.lanes)
            self.wide_blocking = plan(spec.m, spec.n, target.lanes, registers, widened,
                                      None if ld is None else 4 * ld, spare=2)
            self.widen = self.widen_plan(self.wide_blocking, ld)
        # (op info, params) of the epilogue's activation
        self.activation = None if spec.activation is None else \
            optable.epilogue(spec.activation, spec.bitmask)
        # activations with long vector code (transcendentals) run in a loop: one copy per column
        self.looped = self.activation is not None and mapops.uses_transcendentals(
            *self.activation)
        self.scratch = None
        # how the k loop reads A now: from the operand, or from the widened stack copy
        self.reading_wide(False)
        if self.looped:   # in the entry block: one fixed stack slot
            blockings = [x for x in (self.blocking, self.wide_blocking) if x is not None]
            most = max(rg.rows * cg.vectors for bl in blockings for rg in bl.row_groups
                       for cg in bl.col_groups)
            self.scratch = b.alloca(vec(F32, target.lanes), size=most, name="tile")
        # bf16 A x VNNI bf16 B on AMX tiles where the target has them (brgemm_amx)
        self.amx = brgemm_amx.TileBlocks(self) if brgemm_amx.eligible(spec, target) else None

    # ------------------------------------------------------------ tiles
    def emit(self):
        if self.amx is not None:
            self.amx.emit()
            return
        if not self.widen:
            self.tiles(self.blocking, False)
            return
        b = self.b
        fits = b.icmp_unsigned("<=", self.count, i64(self.widen.pairs))
        with b.if_else(fits) as (then, otherwise):
            with then:      # the buffer: as big as this call's batch needs (a dynamic alloca)
                slots = b.alloca(F32, size=b.mul(self.count, i64(self.widen.pair)),
                                 name="wide_a")
                slots.align = 64
                self.wide = b.inttoptr(b.ptrtoint(slots, I64), PTR)   # untyped, as operands
                self.tiles(self.wide_blocking, True)
            with otherwise:
                self.tiles(self.blocking, False)

    def tiles(self, blocking, wide):
        """Every tile of C, row tiles outside column tiles; wide: each row tile's A rows are
        widened first and the k loops read them there."""
        b, lanes = self.b, self.lanes
        for rg in blocking.row_groups:
            with irx.for_range(b, rg.count, name="mtile") as i:
                row0 = b.add(i64(rg.start), b.mul(i, i64(rg.rows)))
                if wide:
                    self.widen_rows(row0, rg.rows)
                self.reading_wide(wide)
                for cg in blocking.col_groups:
                    with irx.for_range(b, cg.count, name="ntile") as j:
                        col0 = b.add(i64(cg.start), b.mul(j, i64(cg.vectors * lanes)))
                        self.tile(row0, col0, rg.rows, cg.vectors, cg.tail)
                self.reading_wide(False)

    # ------------------------------------------------------------ A widened once per row tile
    def widen_plan(self, blocking, ld):
        """The layout of the widened rows (_Wide), or None where not even one pair's rows fit
        WIDE_ELEMENTS. ld: f32 per widened row (None: A transposed, kept so: k rows of the
        tile's rows, in whole vectors)."""
        rows = max(rg.rows for rg in blocking.row_groups)
        if ld is None:
            ld = -(-rows // self.lanes) * self.lanes
            pair = self.spec.k * ld
        else:
            pair = rows * ld
        pairs = WIDE_ELEMENTS // pair
        return _Wide(ld, pair, pairs) if pairs else None

    def widen_rows(self, row0, rows):
        """A's rows row0 .. row0 + rows - 1 of every pair as f32 into the stack buffer (the
        layout of _Wide), the k tail zero-filled."""
        b = self.b
        with irx.for_range(b, self.count, name="widen") as i:
            a_i, _ = self.batch_pointers(i)
            base = b.mul(i, i64(self.widen.pair))
            if self.spec.trans_a:   # per k, the tile's rows are adjacent: vectors of them
                self.widen_columns(a_i, base, row0, rows)
            else:
                self.widen_row_major(a_i, base, row0, rows)

    def widen_row_major(self, a_i, base, row0, rows):
        """A's rows row0 .. row0 + rows - 1 as f32 at wide[base + r * ld], the k tail zero."""
        b, spec, lanes = self.b, self.spec, self.lanes
        full, tail = divmod(spec.k, lanes)
        for r in range(rows):
            src = irx.element_ptr(b, a_i, b.mul(b.add(row0, i64(r)), i64(spec.lda)),
                                  irx.storage_type(spec.dtype_a))
            dst = irx.element_ptr(b, self.wide, b.add(base, i64(r * self.widen.ld)), F32)
            with irx.for_range(b, full * lanes, step=lanes, name="wcol") as c:
                x = irx.load_f32(b, src, c, spec.dtype_a, lanes)
                irx.store_vec(b, x, dst, c)
            if tail:
                x = irx.load_f32(b, src, i64(full * lanes), spec.dtype_a, lanes, tail)
                irx.store_vec(b, x, dst, i64(full * lanes))

    def widen_columns(self, a_i, base, row0, rows):
        """A transposed (k rows of lda elements): per k, the tile's rows row0 .. row0 + rows - 1
        as f32 at wide[base + k * ld], in whole vectors (the lanes past `rows` zero)."""
        b, spec, lanes = self.b, self.spec, self.lanes
        with irx.for_range(b, spec.k, name="wk") as kk:
            src = b.add(b.mul(kk, i64(spec.lda)), row0)
            dst = b.add(base, b.mul(kk, i64(self.widen.ld)))
            for c in range(0, self.widen.ld, lanes):
                active = min(lanes, max(rows - c, 0))
                x = irx.load_f32(b, a_i, b.add(src, i64(c)), spec.dtype_a, lanes,
                                 None if active == lanes else active) if active else \
                    irx.const(vec(F32, lanes), 0.0)
                irx.store_vec(b, x, self.wide, b.add(dst, i64(c)))

    def reading_wide(self, on: bool):
        """Make the k loop read A from the widened stack copy (on) or from the operand."""
        if on:
            self.ta, self.dtype_a, self.lda = F32, _dtypes.F32, self.widen.ld
        else:
            spec = self.spec
            self.ta, self.dtype_a, self.lda = irx.storage_type(spec.dtype_a), spec.dtype_a, \
                spec.lda
        self.wide_now = on

    def _counts(self, vectors, tail):
        """Active lanes of each vector of a tile (None: all)."""
        return [None] * (vectors - 1) + [None if tail == self.lanes else tail]

    def tile(self, row0, col0, rows, vectors, tail):
        spec, b, lanes = self.spec, self.b, self.lanes
        counts = self._counts(vectors, tail)
        c_at = [[b.add(b.mul(b.add(row0, i64(r)), i64(spec.ldc)), b.add(col0, i64(v * lanes)))
                 for v in range(vectors)] for r in range(rows)]
        if spec.beta:
            acc = [irx.load_f32(b, self.pc, c_at[r][v], spec.dtype_c, lanes, counts[v])
                   for r in range(rows) for v in range(vectors)]
        else:
            acc = [irx.const(vec(F32, lanes), 0.0)] * (rows * vectors)
        with irx.for_carry(b, self.count, acc, name="batch") as batch:
            a_i, b_i = self.batch_pointers(batch.index)
            a_row0 = row0
            if self.wide_now:       # the tile's rows of pair i, widened
                a_i = irx.element_ptr(b, self.wide, b.mul(batch.index, i64(self.widen.pair)),
                                      F32)
                a_row0 = i64(0)
            a_tile, b_tile = self.tile_pointers(a_i, b_i, a_row0, col0)
            batch.values = self.k_loop(batch.values, a_tile, b_tile, rows, vectors, counts)
        self.epilogue(batch.values, row0, col0, rows, vectors, counts, c_at)

    def batch_pointers(self, i):
        """(A_i, B_i) base pointers of pair i."""
        b, spec = self.b, self.spec
        ta = irx.storage_type(spec.dtype_a)     # the operand's (not the widened copy's)
        if spec.batch == "stride":
            return (irx.element_ptr(b, self.pa, b.mul(i, self.arg_a), ta),
                    irx.element_ptr(b, self.pb, b.mul(i, self.arg_b), self.tb))
        if spec.batch == "offset":
            out = []
            for base, offsets, ty in ((self.pa, self.arg_a, ta), (self.pb, self.arg_b, self.tb)):
                off = irx.load_scalar(b, b.inttoptr(offsets, PTR), i, I64)
                out.append(irx.element_ptr(b, base, off, ty))
            return tuple(out)
        return tuple(b.inttoptr(irx.load_scalar(b, base, i, I64), PTR) for base in (self.pa, self.pb))

    def tile_pointers(self, a_i, b_i, row0, col0):
        """Pointers to the tile's first A row (or column) and first B column."""
        spec, b = self.spec, self.b
        a_off = row0 if spec.trans_a else b.mul(row0, i64(self.lda))
        if spec.trans_b:
            b_off = b.mul(col0, i64(spec.ldb))
        else:
            b_off = b.mul(col0, i64(2)) if spec.vnni_b else col0
        return (irx.element_ptr(b, a_i, a_off, self.ta), irx.element_ptr(b, b_i, b_off, self.tb))

    # ------------------------------------------------------------ the k loop
    def k_loop(self, acc, a_tile, b_tile, rows, vectors, counts):
        """acc after all k steps of one pair; a_tile/b_tile point at the tile's k = 0."""
        spec, b = self.spec, self.b
        steps, odd = divmod(spec.k, self.step)
        unroll = max(1, UNROLL_STEPS // self.step)
        if spec.k <= STRAIGHT_STEPS:
            unroll = steps + 1          # no loop: every step in the remainder
        loops, rest = divmod(steps, unroll)
        a_step = self.step * (self.lda if spec.trans_a else 1)      # elements per k step
        b_step = 1 if spec.trans_b else spec.ldb
        if loops:
            with irx.for_carry(b, loops * unroll, acc, step=unroll, name="k") as kl:
                a_k = irx.element_ptr(b, a_tile, b.mul(kl.index, i64(a_step)), self.ta)
                b_k = irx.element_ptr(b, b_tile, b.mul(kl.index, i64(b_step)), self.tb)
                values = kl.values
                for u in range(unroll):
                    values = self.k_step(values, a_k, b_k, u, self.step, rows, vectors, counts)
                kl.values = values
            acc = kl.values
        done = loops * unroll
        a_k = irx.element_ptr(b, a_tile, i64(done * a_step), self.ta)
        b_k = irx.element_ptr(b, b_tile, i64(done * b_step), self.tb)
        for u in range(rest):
            acc = self.k_step(acc, a_k, b_k, u, self.step, rows, vectors, counts)
        if odd:
            acc = self.k_step(acc, a_k, b_k, rest, 1, rows, vectors, counts)
        return acc

    def k_step(self, acc, a_k, b_k, u, width, rows, vectors, counts):
        """acc after step u (k values u*step .. u*step+width-1 from a_k/b_k)."""
        b = self.b
        if self.dot:
            return self.dot_step(acc, a_k, b_k, u, width, rows, vectors, counts)
        acc = list(acc)
        bvecs = [[self.load_b(b_k, u, s, v, counts[v]) for v in range(vectors)]
                 for s in range(width)]
        paired = width == 2 and self.dtype_a.name == "bf16" and not self.spec.trans_a
        for r in range(rows):
            # both k values of a row before the next row: A's pair is loaded once
            for s in range(width):
                if paired:
                    a = self.load_a_half(a_k, u * self.step, r, s)
                else:
                    a = irx.splat(b, self.load_a(a_k, u * self.step + s, r), self.lanes)
                for v in range(vectors):
                    acc[r * vectors + v] = irx.fma(b, a, bvecs[s][v], acc[r * vectors + v])
        return acc

    def a_offset(self, kk, r):
        """Elements from a_k to A[row r, k step kk]."""
        lda = self.lda
        return i64(kk * lda + r if self.spec.trans_a else r * lda + kk)

    def load_a(self, a_k, kk, r):
        """A[row r, k step kk] as an f32 scalar."""
        raw = irx.load_scalar(self.b, a_k, self.a_offset(kk, r), self.ta)
        return irx.to_f32(self.b, raw, self.dtype_a)

    def load_a_half(self, a_k, kk, r, s):
        """Broadcast f32 vector of bf16 A[row r, kk + s] (s = 0 or 1), from one 32-bit load of
        the pair (kk, kk+1) and one shift or mask: cheaper than widening a scalar and moving it
        into a vector register."""
        b, lanes = self.b, self.lanes
        pair = irx.load_scalar(b, irx.element_ptr(b, a_k, self.a_offset(kk, r), I16),
                               i64(0), I32, align=2)
        vi = vec(I32, lanes)
        pairs = irx.splat(b, pair, lanes)
        half = b.shl(pairs, self._opaque("tpp_bf16_shift", 16)) if s == 0 else \
            b.and_(pairs, self._opaque("tpp_bf16_high", -65536))
        return b.bitcast(half, vec(F32, lanes))

    def _opaque(self, name, value):
        """A vector of `value` in every lane, loaded from a module global LLVM cannot see
        into: with a visible constant, LLVM moves the shift or mask of a broadcast pair onto
        the scalar and broadcasts each half separately (two shuffles per pair), where a
        broadcast load and two vector operations do."""
        b, lanes = self.b, self.lanes
        vi = vec(I32, lanes)
        gname = f"{name}_{lanes}"
        g = b.module.globals.get(gname)
        if g is None:
            g = ir.GlobalVariable(b.module, vi, gname)
            g.initializer = ir.Constant(vi, [value] * lanes)
            g.linkage = "internal"
            g.align = 64
        return b.load(g, typ=vi, align=32)

    def load_b(self, b_k, u, s, v, count):
        """The f32 vector of B[k step u (+ half s of a VNNI pair), columns of vector v]."""
        spec, b, lanes = self.spec, self.b, self.lanes
        if spec.vnni_b:
            pairs = self._load_pairs(b_k, u, v, count)
            vi = vec(I32, lanes)
            if spec.dtype_b.name == "bf16":   # the bf16 bits in the high half are the f32
                half = b.shl(pairs, irx.const(vi, 16)) if s == 0 else \
                    b.and_(pairs, irx.const(vi, -65536))
                return b.bitcast(half, vec(F32, lanes))
            bits = pairs if s == 0 else b.lshr(pairs, irx.const(vi, 16))
            return irx.to_f32(b, b.bitcast(b.trunc(bits, vec(I16, lanes)), vec(irx.F16, lanes)),
                              spec.dtype_b)
        if spec.trans_b:
            return self.gather_b(b_k, u, v, count)
        return irx.load_f32(b, b_k, i64(u * spec.ldb + v * lanes), spec.dtype_b, lanes, count)

    def _load_pairs(self, b_k, u, v, count):
        """The VNNI row u, columns of vector v, as <lanes x i32>: one (even, odd) pair per lane."""
        row = irx.element_ptr(self.b, b_k, i64(u * self.spec.ldb + 2 * v * self.lanes), I16)
        return irx.load_vec(self.b, row, i64(0), I32, self.lanes, count, align=2)

    def gather_b(self, b_k, u, v, count):
        """A vector of a transposed B: element j is at b_k[(v*lanes + j)*ldb + u]."""
        spec, b, lanes = self.spec, self.b, self.lanes
        size = spec.dtype_b.itemsize
        base = irx.splat(b, b.ptrtoint(b_k, I64), lanes)
        offsets = ir.Constant(vec(I64, lanes), [((v * lanes + j) * spec.ldb + u) * size
                                                for j in range(lanes)])
        ptrs = b.inttoptr(b.add(base, offsets), vec(PTR, lanes))
        vt = vec(self.tb, lanes)
        active = count if count is not None else lanes
        fn = irx.intrinsic(b.module, "llvm.masked.gather", vt,
                           [vec(PTR, lanes), I32, vec(irx.I1, lanes), vt], [vt, vec(PTR, lanes)])
        raw = b.call(fn, [ptrs, ir.Constant(I32, size), irx.lane_mask(lanes, active),
                          irx.const(vt, 0)])
        return irx.to_f32(b, raw, spec.dtype_b)

    def dot_step(self, acc, a_k, b_k, u, width, rows, vectors, counts):
        """One VNNI pair (or the last single k value when width is 1) through vdpbf16ps."""
        spec, b, lanes = self.spec, self.b, self.lanes
        bvecs = [self._load_pairs(b_k, u, v, counts[v]) for v in range(vectors)]
        if width == 1:
            # The last pair of an odd k: its high half is padding, whatever it holds (a NaN
            # there times A's zero would still be NaN), so clear it in B as well as in A.
            low = irx.const(bvecs[0].type, 0xFFFF)
            bvecs = [b.and_(x, low) for x in bvecs]
        acc = list(acc)
        for r in range(rows):
            kk = 2 * u
            pair = b.zext(self._a_bits(a_k, kk, r), I32)
            if width == 2:
                high = b.zext(self._a_bits(a_k, kk + 1, r), I32)
                pair = b.or_(pair, b.shl(high, ir.Constant(I32, 16)))
            a = irx.splat(b, pair, lanes)
            for v in range(vectors):
                acc[r * vectors + v] = irx.dpbf16(b, acc[r * vectors + v], a, bvecs[v])
        return acc

    def _a_bits(self, a_k, kk, r):
        return irx.load_scalar(self.b, a_k, self.a_offset(kk, r), I16)

    # ------------------------------------------------------------ epilogue
    def epilogue(self, acc, row0, col0, rows, vectors, counts, c_at):
        """bias, activation, bitmask and the store of a tile. Costly activations run in a loop
        over the tile's rows from a stack copy of the accumulators, so their code is emitted
        once per vector column rather than once per accumulator (compile time, code size)."""
        spec, b, lanes = self.spec, self.b, self.lanes
        cols = [b.add(col0, i64(v * lanes)) for v in range(vectors)]
        bias = None
        if spec.bias == "row":
            bias = [irx.load_f32(b, self.pbias, cols[v], spec.dtype_c, lanes, counts[v])
                    for v in range(vectors)]
        if not self.looped:
            for r in range(rows):
                for v in range(vectors):
                    self.finish(acc[r * vectors + v], b.add(row0, i64(r)), cols[v], bias, v,
                                counts[v], c_at[r][v])
            return
        vt = vec(F32, lanes)
        for k, value in enumerate(acc):
            b.store(value, b.gep(self.scratch, [i64(k)], source_etype=vt), align=4)
        with irx.for_range(b, rows, name="erow") as r:
            row = b.add(row0, r)
            for v in range(vectors):
                slot = b.add(b.mul(r, i64(vectors)), i64(v))
                x = b.load(b.gep(self.scratch, [slot], source_etype=vt), typ=vt, align=4)
                at = b.add(b.mul(row, i64(spec.ldc)), cols[v])
                self.finish(x, row, cols[v], bias, v, counts[v], at)

    def col_bias(self, row, lanes):
        """bias[row] (a "col" bias: one value per row of C) on `lanes` lanes, as f32."""
        dt = self.spec.dtype_c
        value = irx.to_f32(self.b, irx.load_scalar(self.b, self.pbias, row,
                                                   irx.storage_type(dt)), dt)
        return irx.splat(self.b, value, lanes)

    def finish(self, x, row, col, bias, v, count, c_offset):
        """One accumulator vector through bias, activation and bitmask into C."""
        spec, b = self.spec, self.b
        if bias is not None:
            x = b.fadd(x, bias[v])
        elif spec.bias == "col":        # the row's value, on every lane
            x = b.fadd(x, self.col_bias(row, x.type.count))
        if self.activation is not None:
            results = mapops.render(*self.activation, b, self.lanes, {"in": x})
            x = results[0]
        if spec.bitmask:
            bits = results[1]
            byte = b.add(b.mul(row, i64(mask_bytes(spec.n))), b.udiv(col, i64(8)))
            irx.store_bits(b, bits, self.pmask, byte, count)
        irx.store_f32(b, x, self.pc, c_offset, spec.dtype_c, count)
