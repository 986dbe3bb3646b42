"""The generator of data-movement kernels: transpose, vnni2, vnni2_inv, gather_rows, scatter_rows.

These ops move bits and never convert: elements are handled as integers of their width (i32 for
f32, i16 for bf16/f16), so every NaN payload and signed zero survives.

A vector is a full register of the element type: w = lanes * 32 / bits elements (8 x i32 or
16 x i16 on AVX2). Partial vectors at the right edge of a block read and write exactly their
elements: with masked loads/stores (k-masks on AVX-512, vmaskmov for 32-bit elements on AVX2),
and for 16-bit elements on AVX2, which has no 16-bit masked moves (LLVM would move one element
at a time), as a few full moves of power-of-two pieces (8 + 4 + 2 + 1 elements) assembled with
shufflevector.

transpose: the (m, n) input is cut into w x w register tiles; a tile's w rows are loaded as
vectors, transposed with log2(w) stages of two-input shufflevectors (the classic unpack /
unpack / 128-bit-lane-swap network), and stored as w rows of the (n, m) output. Full tiles run in
loops; the right and bottom edge tiles are emitted straight-line with partial loads (missing
rows are zero vectors) and partial stores.

vnni2: output row r is input rows 2r and 2r+1 interleaved element by element; a chunk of w
columns of both rows becomes one shufflevector of 2w elements (an odd last row pairs with a zero
vector). vnni2_inv de-interleaves the same way.

gather_rows / scatter_rows: a loop over the m index entries copies one row each with full
vector moves and a partial tail. Indices are used as given (no bounds check here; scatter with
a repeated index keeps the last row, as numpy's fancy assignment does).
"""
from __future__ import annotations

from llvmlite import ir

from . import irx
from .irx import I16, I32, I64, i64, vec


def _bits_type(dtype):
    """The integer type that carries one element's bits."""
    return {2: I16, 4: I32}[dtype.itemsize]


class _Mover:
    """Loads and stores of whole or partial vectors of one element type."""

    def __init__(self, b, target, ety):
        self.b = b
        self.ety = ety
        self.w = target.lanes * 32 // ety.width          # one full register
        self.group = 128 // ety.width                    # elements per 128-bit lane
        # AVX-512 masks every width; AVX2 has vmaskmov for 32-bit elements only
        self.use_masks = target.isa == "avx512" or ety.width == 32

    def load(self, base, offset, w, count=None):
        """w elements from base[offset]; count < w: only the first count, the rest zero."""
        b, ety = self.b, self.ety
        if count is None or count >= w or self.use_masks:
            return irx.load_vec(b, base, offset, ety, w, count)
        result = irx.const(vec(ety, w), 0)
        for pos, size in _pieces(count):
            piece = irx.load_vec(b, base, b.add(offset, i64(pos)), ety, size)
            widened = _shuffle(b, piece, ir.Constant(piece.type, ir.Undefined),
                               [k if k < size else size for k in range(w)])
            result = _shuffle(b, result, widened,
                              [w + k - pos if pos <= k < pos + size else k for k in range(w)])
        return result

    def store(self, value, base, offset, count=None, streaming=False):
        """Store a vector; count < its width: only the first count elements. streaming: a full
        vector is stored non-temporally (the address must be 16-byte aligned)."""
        b = self.b
        w = value.type.count
        if count is None or count >= w or self.use_masks:
            irx.store_vec(b, value, base, offset, count, streaming=streaming)
            return
        undef = ir.Constant(value.type, ir.Undefined)
        for pos, size in _pieces(count):
            piece = _shuffle(b, value, undef, list(range(pos, pos + size)))
            irx.store_vec(b, piece, base, b.add(offset, i64(pos)))


def _pieces(count):
    """count as (position, size) pieces of descending powers of two."""
    out, pos, size = [], 0, 1
    while size * 2 <= count:
        size *= 2
    while size:
        if count & size:
            out.append((pos, size))
            pos += size
        size //= 2
    return out


def generate(spec, target, symbol: str) -> ir.Module:
    kind = spec.info.kind
    operands = spec.operands()
    module, b, ptrs, _ = irx.new_kernel(symbol, len(operands))
    mv = _Mover(b, target, _bits_type(spec.dtype_in))
    if kind == "transpose":
        _transpose(b, spec, mv, *ptrs)
    elif kind == "vnni2":
        _vnni2(b, spec, mv, *ptrs)
    elif kind == "vnni2_inv":
        _vnni2_inv(b, spec, mv, *ptrs)
    elif kind == "gather":
        _rows_by_index(b, spec, mv, *ptrs, gather=True)
    elif kind == "scatter":
        _rows_by_index(b, spec, mv, *ptrs, gather=False)
    else:
        raise AssertionError(f"transform generator called for kind {kind!r}")
    b.ret_void()
    return module


def _shuffle(b, x, y, mask):
    return b.shuffle_vector(x, y, ir.Constant(vec(I32, len(mask)), mask))


# ---------------------------------------------------------------- transpose

def _swap_stage(b, rows, labels, h):
    """Rows r (bit h clear) and r + h exchange, lane by lane, their halves of each 2h-lane
    group: lane bit log2(h) and row bit log2(h) swap places."""
    w = len(rows)
    lo_mask, hi_mask = [], []
    for j in range(w):
        if j & h:                       # upper half of the 2h group
            lo_mask.append(w + j - h)   # row r takes row r+h's lower half
            hi_mask.append(w + j)       # row r+h keeps its upper half
        else:
            lo_mask.append(j)           # row r keeps its lower half
            hi_mask.append(j + h)       # row r+h takes row r's upper half
    nxt, nlab = list(rows), list(labels)
    for r in range(w):
        if not r & h:
            nxt[r] = _shuffle(b, rows[r], rows[r + h], lo_mask)
            nxt[r + h] = _shuffle(b, rows[r], rows[r + h], hi_mask)
            both = labels[r] + labels[r + h]
            nlab[r] = [both[k] for k in lo_mask]
            nlab[r + h] = [both[k] for k in hi_mask]
    return nxt, nlab


def _unpack_stage(b, rows, labels, group, u):
    """x86's unpack (unpcklps, punpcklwd, unpcklpd, ...) on units of u lanes within each group
    of `group` lanes (one 128-bit register lane): rows p and p + u (bit u of p clear) become
    the interleaved units of their lower halves (at p) and of their upper halves (at p + u)."""
    w = len(rows)
    masks = []
    for half in (0, 1):
        mask = []
        for j in range(w):
            g, t = divmod(j, group)
            unit, within = divmod(t, u)
            src_unit = half * (group // (2 * u)) + unit // 2
            mask.append(g * group + src_unit * u + within + (w if unit % 2 else 0))
        masks.append(mask)
    nxt, nlab = list(rows), list(labels)
    for p in range(w):
        if not p & u:
            for half in (0, 1):
                nxt[p + half * u] = _shuffle(b, rows[p], rows[p + u], masks[half])
                both = labels[p] + labels[p + u]
                nlab[p + half * u] = [both[k] for k in masks[half]]
    return nxt, nlab


def transpose_tile(b, rows, group):
    """Transpose a square tile given as a list of w vectors of w lanes (w a power of two);
    returns the w columns as vectors. `group` is the lanes per 128-bit register lane.

    The classic x86 sequence, written as generic shufflevectors: log2(group) unpack stages (the
    8x8 f32 tile: unpcklps/unpckhps, unpcklpd/unpckhpd), then one stage swapping whole 128-bit
    lanes per remaining bit (vperm2f128). Each stage is w two-input shuffles. The stages leave
    the columns in a permuted order, which is found by running the same stages on the (row,
    lane) labels and undone in the returned list."""
    w = len(rows)
    group = min(group, w)
    labels = [[(i, j) for j in range(w)] for i in range(w)]
    rows = list(rows)
    u = 1
    while u < group:
        rows, labels = _unpack_stage(b, rows, labels, group, u)
        u *= 2
    h = group
    while h < w:
        rows, labels = _swap_stage(b, rows, labels, h)
        h *= 2
    order = [None] * w
    for p, lab in enumerate(labels):
        j = lab[0][1]
        assert lab == [(i, j) for i in range(w)], "transpose_tile: stages do not transpose"
        order[j] = rows[p]
    return order


# Tuning of large transposes (see _transpose); module-level so experiments can change them.
SMALL_BYTES = 128 << 10      # blocks up to this (input + output bytes) keep the plain loop
BLOCK_ROWS = 64              # input rows per cache block (output columns)
BLOCK_COLS = 64              # input columns per cache block (output rows)
LINE = 64                    # cache line bytes
STREAM_BYTES = 16 << 20      # outputs this big use non-temporal stores (when aligned)
ORDER = "rows"
BLOCK_ORDER = "ij"
NT_WIDE = True
INTERLEAVE = True
PF_OUT = PF_IN = 0
PF_LOC = 3
EXP_NOLOAD = EXP_NOSTORE = False


def _store_nt(b, value, base, offset, align):
    ptr = irx.element_ptr(b, base, offset, value.type.element)
    flag = b.module.add_metadata([ir.Constant(I32, 1)])
    b.store(value, ptr, align=align).set_metadata("nontemporal", flag)


def _prefetch(b, base, offset, ety, write, locality=3):
    ptr = irx.element_ptr(b, base, offset, ety)
    irx.call(b, "llvm.prefetch", ptr, ir.Constant(I32, write), ir.Constant(I32, locality),
             ir.Constant(I32, 1), ret=ir.VoidType(), overloads=[irx.PTR])


def _transpose(b, spec, mv, src, dst):
    m, n, ldi, ldo = spec.m, spec.n, spec.ldi, spec.ldo
    w = mv.w
    size = mv.ety.width // 8
    zero = irx.const(vec(mv.ety, w), 0)

    def load_tile(i0, j0, rcount, ccount):
        cnt = None if ccount == w else ccount
        rows = []
        for r in range(w):
            if r < rcount:
                off = b.add(b.mul(b.add(i0, i64(r)), i64(ldi)), j0)
                if EXP_NOLOAD:
                    off = b.add(b.and_(off, i64(255)), i64(r * 64))
                rows.append(mv.load(src, off, w, cnt))
            else:
                rows.append(zero)
        return transpose_tile(b, rows, mv.group)

    def store_col(col, i0, j0, c, rcount, streaming):
        rcnt = None if rcount == w else rcount
        off = b.add(b.mul(b.add(j0, i64(c)), i64(ldo)), i0)
        if EXP_NOSTORE:
            off = i64(c * 64)
            streaming = False
        if streaming and NT_WIDE:
            _store_nt(b, col, dst, off, w * size)
        else:
            mv.store(col, dst, off, rcnt, streaming)

    def tile(i0, j0, rcount, ccount, streaming=False):
        """Input rows [i0, i0+rcount), columns [j0, j0+ccount) -> output rows j0.., columns i0.."""
        cols = load_tile(i0, j0, rcount, ccount)
        for c in range(ccount):
            store_col(cols[c], i0, j0, c, rcount, streaming)

    def group(i0, j0, streaming):
        """vt tiles stacked along i: each output row gets a cache line."""
        if not INTERLEAVE or vt == 1:
            for v in range(vt):
                tile(b.add(i0, i64(v * w)), j0, w, w, streaming)
            return
        if PF_OUT:
            for c in range(w):
                off = b.add(b.mul(b.add(j0, i64(c + PF_OUT)), i64(ldo)), i0)
                _prefetch(b, dst, off, mv.ety, 1, PF_LOC)
        if PF_IN:
            for r in range(gi):
                off = b.add(b.mul(b.add(i0, i64(r)), i64(ldi)), b.add(j0, i64(PF_IN)))
                _prefetch(b, src, off, mv.ety, 0, PF_LOC)
        starts = [b.add(i0, i64(v * w)) for v in range(vt)]
        tiles = [load_tile(s, j0, w, w) for s in starts]
        for c in range(w):
            for v in range(vt):
                store_col(tiles[v][c], starts[v], j0, c, w, streaming)

    full_i, tail_i = divmod(m, w)
    full_j, tail_j = divmod(n, w)
    fi, fj = full_i * w, full_j * w
    line = LINE // size                              # elements per cache line
    vt = max(1, line // w)                           # tiles per group, stacked along i
    gi = vt * w                                      # rows per group: a line of each output row

    def row_of_tiles(i0, rcount):
        if full_j:
            with irx.for_range(b, fj, step=w, name="tj") as j0:
                tile(i0, j0, rcount, w)
        if tail_j:
            tile(i0, i64(fj), rcount, tail_j)

    small = m * n * size * 2 <= SMALL_BYTES or fi < 2 * gi or not full_j
    if small:
        if full_i:
            with irx.for_range(b, fi, step=w, name="ti") as i0:
                row_of_tiles(i0, w)
        if tail_i:
            row_of_tiles(i64(fi), tail_i)
        return

    bi = max(gi, BLOCK_ROWS // gi * gi)
    bj = max(w, BLOCK_COLS // w * w)

    def smin(x, limit):
        return b.select(b.icmp_signed("<", x, limit), x, limit)

    def group_strip(i0, streaming):
        with irx.for_range(b, fj, step=w, name="gj") as j0:
            group(i0, j0, streaming)

    def blocked(start, stop, streaming):
        """Rows [start, stop) (a whole number of groups) x columns [0, fj), in blocks."""
        def block(ib, jb):
            i_end = smin(b.add(ib, i64(bi)), stop)
            j_end = smin(b.add(jb, i64(bj)), i64(fj))
            if ORDER == "rows":
                with irx.for_range(b, i_end, step=gi, start=ib, name="si") as i0:
                    with irx.for_range(b, j_end, step=w, start=jb, name="sj") as j0:
                        group(i0, j0, streaming)
            else:
                with irx.for_range(b, j_end, step=w, start=jb, name="sj") as j0:
                    with irx.for_range(b, i_end, step=gi, start=ib, name="si") as i0:
                        group(i0, j0, streaming)
        if BLOCK_ORDER == "ij":
            with irx.for_range(b, stop, step=bi, start=start, name="bi") as ib:
                with irx.for_range(b, fj, step=bj, name="bj") as jb:
                    block(ib, jb)
        else:
            with irx.for_range(b, fj, step=bj, name="bj") as jb:
                with irx.for_range(b, stop, step=bi, start=start, name="bi") as ib:
                    block(ib, jb)

    def aligned_rows(streaming):
        """Full tiles, with the group rows shifted so that every group writes whole cache lines of
        the output (all output rows share the phase when ldo is a multiple of a line): rows
        [h, stop) in blocks, and the rows before h and after stop as one overlapping group each
        (rewriting the same values with ordinary stores)."""
        addr = b.ptrtoint(dst, I64)
        h = b.lshr(b.and_(b.sub(i64(0), addr), i64(LINE - 1)), i64(size.bit_length() - 1))
        stop = b.add(h, b.mul(b.udiv(b.sub(i64(fi), h), i64(gi)), i64(gi)))
        with b.if_then(b.icmp_unsigned("!=", h, i64(0))):
            group_strip(i64(0), False)
        blocked(h, stop, streaming)
        with b.if_then(b.icmp_unsigned("!=", stop, i64(fi))):
            group_strip(i64(fi - gi), False)

    stream = n * ldo * size >= STREAM_BYTES and (ldo * size) % LINE == 0
    if stream:
        addr = b.ptrtoint(dst, I64)
        ok = b.icmp_unsigned("==", b.and_(addr, i64(size - 1)), i64(0))
        with b.if_else(ok) as (then, otherwise):
            with then:
                aligned_rows(True)
                irx.call(b, "llvm.x86.sse.sfence", ret=ir.VoidType(), overloads=[])
            with otherwise:
                aligned_rows(False)
    else:
        aligned_rows(False)
    # the right edge (columns past fj) and the bottom edge (rows past fi)
    if tail_j:
        with irx.for_range(b, fi, step=w, name="ei") as i0:
            tile(i0, i64(fj), w, tail_j)
    if tail_i:
        row_of_tiles(i64(fi), tail_i)


# ---------------------------------------------------------------- vnni2
def _column_chunks(b, n, c, body):
    """Call body(col, count) over columns [0, n) in chunks of c (count None for full chunks)."""
    full, tail = divmod(n, c)
    if full:
        with irx.for_range(b, full * c, step=c, name="col") as col:
            body(col, None)
    if tail:
        body(i64(full * c), tail)


def _interleave_mask(c):
    return [k // 2 + (c if k % 2 else 0) for k in range(2 * c)]


def _vnni2(b, spec, mv, src, dst):
    """out[r][2j + t] = in[2r + t][j]; an odd last row pairs with zeros."""
    m, n, ldi, ldo = spec.m, spec.n, spec.ldi, spec.ldo
    c = mv.w
    mask = _interleave_mask(c)
    pairs, odd = divmod(m, 2)

    def row_pair(r, second):
        def body(col, count):
            even_off = b.add(b.mul(b.mul(r, i64(2)), i64(ldi)), col)
            x0 = mv.load(src, even_off, c, count)
            if second:
                x1 = mv.load(src, b.add(even_off, i64(ldi)), c, count)
            else:
                x1 = irx.const(vec(mv.ety, c), 0)
            out = _shuffle(b, x0, x1, mask)
            off = b.add(b.mul(r, i64(ldo)), b.mul(col, i64(2)))
            mv.store(out, dst, off, None if count is None else 2 * count)
        _column_chunks(b, n, c, body)

    if pairs:
        with irx.for_range(b, pairs, name="pair") as r:
            row_pair(r, True)
    if odd:
        row_pair(i64(pairs), False)


def _vnni2_inv(b, spec, mv, src, dst):
    """out[2r + t][j] = in[r][2j + t]; for odd m the last pair's second row is dropped."""
    m, n, ldi, ldo = spec.m, spec.n, spec.ldi, spec.ldo
    c = mv.w
    evens = [2 * k for k in range(c)]
    odds = [2 * k + 1 for k in range(c)]
    pairs, odd = divmod(m, 2)

    def row_pair(r, second):
        def body(col, count):
            off = b.add(b.mul(r, i64(ldi)), b.mul(col, i64(2)))
            x = mv.load(src, off, 2 * c, None if count is None else 2 * count)
            undef = ir.Constant(x.type, ir.Undefined)
            even_off = b.add(b.mul(b.mul(r, i64(2)), i64(ldo)), col)
            mv.store(_shuffle(b, x, undef, evens), dst, even_off, count)
            if second:
                mv.store(_shuffle(b, x, undef, odds), dst, b.add(even_off, i64(ldo)), count)
        _column_chunks(b, n, c, body)

    if pairs:
        with irx.for_range(b, pairs, name="pair") as r:
            row_pair(r, True)
    if odd:
        row_pair(i64(pairs), False)


# ---------------------------------------------------------------- gather / scatter
def _rows_by_index(b, spec, mv, src, idx, dst, *, gather):
    """gather: out[i] = in[idx[i]]; scatter: out[idx[i]] = in[i] (in order: a repeated index
    keeps the last row written)."""
    m, n, ldi, ldo = spec.m, spec.n, spec.ldi, spec.ldo
    c = mv.w
    with irx.for_range(b, m, name="i") as i:
        k = irx.load_scalar(b, idx, i, I64)
        src_row, dst_row = (k, i) if gather else (i, k)
        src_base = b.mul(src_row, i64(ldi))
        dst_base = b.mul(dst_row, i64(ldo))

        def body(col, count):
            x = mv.load(src, b.add(src_base, col), c, count)
            mv.store(x, dst, b.add(dst_base, col), count)
        _column_chunks(b, n, c, body)
