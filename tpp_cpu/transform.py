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

Large transposes go through cache blocks (see _transpose): walking whole rows of tiles writes
each output row a few bytes at a time, and at row pitches that are multiples of a large power of
two those writes keep landing in the same cache sets and DRAM banks (4096 x 4096 f32 ran at
about 6 GB/s). Blocks of 64 input columns by 256 bytes of output row are transposed into a
stack buffer and copied out as runs of 256 bytes per output row, overlapped with the next
block, with non-temporal stores for outputs much bigger than the caches.

vnni2: output row r is input rows 2r and 2r+1 interleaved element by element; a chunk of w
columns of both rows becomes one shufflevector of 2w elements (an odd last row pairs with a zero
vector). vnni2_inv de-interleaves the same way. Both write outputs much bigger than the caches
with non-temporal stores when the rows are 16-byte aligned.

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
        self.use_masks = target.masked_lanes or ety.width == 32

    def load(self, base, offset, w, count=None):
        """w elements from base[offset]; count < w: only the first count, the rest zero."""
        b, ety = self.b, self.ety
        if count is None or count >= w or self.use_masks:
            return irx.load_vec(b, base, offset, ety, w, count)
        result = irx.const(vec(ety, w), 0)
        for pos, size in _pieces(count):
            piece = irx.load_vec(b, base, b.add(offset, i64(pos)), ety, size)
            widened = _shuffle(b, piece, irx.undef(piece.type),
                               [k if k < size else size for k in range(w)])
            result = _shuffle(b, result, widened,
                              [w + k - pos if pos <= k < pos + size else k for k in range(w)])
        return result

    def store(self, value, base, offset, count=None, streaming=False):
        """Store a vector; count < its width: only the first count elements. streaming: a whole
        vector is stored non-temporally (16-byte pieces: the address must be 16-byte aligned)."""
        b = self.b
        w = value.type.count
        if count is None or count >= w or self.use_masks:
            irx.store_vec(b, value, base, offset, count, streaming=streaming)
            return
        undef = irx.undef(value.type)
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
    return b.shuffle_vector(x, y, irx.indices(mask))


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


# Tuning of large blocks (measured on Zen 3; see _transpose and _with_streaming).
LINE = 64                    # cache line bytes
BLOCK_BYTES = 256            # a cache block: this many bytes of each output row (input rows)
BLOCK_COLS = 64              # and this many elements of each input row (output rows)
STREAM_BYTES = irx.STREAM_BYTES  # outputs this big are written with non-temporal stores
SMALL_BYTES = 256 << 10      # input + output bytes up to which the plain tile loop is used
LARGE_BYTES = 32 << 20       # input + output bytes from which cache blocks are always used
BAD_PITCH = 512              # row pitches that are multiples of this thrash the plain loop


def _store_nt(b, value, base, offset):
    """A non-temporal store of a whole vector; the address must be aligned to its size."""
    ptr = irx.element_ptr(b, base, offset, value.type.element)
    flag = b.module.add_metadata([ir.Constant(I32, 1)])
    nbytes = value.type.count * value.type.element.width // 8
    b.store(value, ptr, align=nbytes).set_metadata("nontemporal", flag)


def _transpose(b, spec, mv, src, dst):
    m, n, ldi, ldo = spec.m, spec.n, spec.ldi, spec.ldo
    w = mv.w
    size = mv.ety.width // 8
    zero = irx.const(vec(mv.ety, w), 0)

    def load_tile(i0, j0, rcount, ccount):
        """Input rows [i0, i0+rcount), columns [j0, j0+ccount), transposed: the w columns."""
        cnt = None if ccount == w else ccount
        rows = []
        for r in range(w):
            if r < rcount:
                off = b.add(b.mul(b.add(i0, i64(r)), i64(ldi)), j0)
                rows.append(mv.load(src, off, w, cnt))
            else:
                rows.append(zero)
        return transpose_tile(b, rows, mv.group)

    def store_col(col, i0, j0, c, rcount):
        off = b.add(b.mul(b.add(j0, i64(c)), i64(ldo)), i0)
        mv.store(col, dst, off, None if rcount == w else rcount)

    def tile(i0, j0, rcount, ccount):
        """Input rows [i0, i0+rcount), columns [j0, j0+ccount) -> output rows j0.., columns i0.."""
        cols = load_tile(i0, j0, rcount, ccount)
        for c in range(ccount):
            store_col(cols[c], i0, j0, c, rcount)

    full_i, tail_i = divmod(m, w)
    full_j, tail_j = divmod(n, w)
    fi, fj = full_i * w, full_j * w

    def row_of_tiles(i0, rcount):
        if full_j:
            with irx.for_range(b, fj, step=w, name="tj") as j0:
                tile(i0, j0, rcount, w)
        if tail_j:
            tile(i0, i64(fj), rcount, tail_j)

    def edges():
        """The right edge (columns past fj) of the full rows, then the bottom rows past fi."""
        if tail_j and full_i:
            with irx.for_range(b, fi, step=w, name="ei") as i0:
                tile(i0, i64(fj), w, tail_j)
        if tail_i:
            row_of_tiles(i64(fi), tail_i)

    line = LINE // size                         # elements per cache line
    unit = max(line, w)
    bi = max(unit, BLOCK_BYTES // size // unit * unit)  # block rows: whole tiles and lines
    bj = max(w, BLOCK_COLS // w * w)                    # block columns: whole tiles
    nbj = fj // bj
    # Non-temporal stores for outputs far bigger than the caches, if the rows are 16-byte
    # aligned (the pointer is checked at run time); as whole aligned vectors when ldo is a
    # multiple of a line (see h below), else as 16-byte pieces. Cache blocks for those, for
    # footprints beyond the caches, and where a pitch that is a multiple of BAD_PITCH makes
    # the rows of tiles thrash a few cache sets; else (the plain loop is faster on benign
    # pitches while the data stays in the caches) rows of tiles.
    out_bytes = n * ldo * size
    streams = out_bytes >= STREAM_BYTES and (ldo * size) % irx.STREAM_PIECE == 0
    wide = streams and (ldo * size) % LINE == 0
    footprint = m * n * size * 2
    bad_pitch = (ldi * size) % BAD_PITCH == 0 or (ldo * size) % BAD_PITCH == 0
    blocked = streams or footprint > LARGE_BYTES or (footprint > SMALL_BYTES and bad_pitch)
    if not blocked or fi < bi + unit or not nbj:
        if full_i:
            with irx.for_range(b, fi, step=w, name="ti") as i0:
                row_of_tiles(i0, w)
        edges()
        return

    # Cache blocks: bi x bj blocks of full tiles, in row-major block order, through two stack
    # buffers of bj rows x bp elements (rows padded by a line against cache-set conflicts).
    # While the tiles of block k are transposed into one buffer (each tile also prefetches its
    # rows of the next block), block k-1 is copied from the other buffer to its bj output
    # rows, each row one run of bi elements: input and output move in runs of 128 or 256
    # bytes per row rather than a half or whole cache line per row. The buffers take 40 KiB.
    bp = bi + line
    with b.goto_entry_block():
        slot = b.alloca(ir.ArrayType(mv.ety, 2 * bj * bp))
        slot.align = LINE
        slot.type = irx.PTR          # llvmlite types allocas; the module uses opaque pointers
    buf = slot
    vpr = bi // w                    # vectors per buffer row
    tpr = bj // w                    # tiles per block row
    ntiles = (bi // w) * tpr

    # The blocks start at input row h, chosen so that the output runs start on a cache line
    # (all of them when ldo is a multiple of a line: the whole-vector streaming stores then
    # only need an element-aligned pointer).
    addr = b.ptrtoint(dst, I64)
    h = b.lshr(b.and_(b.sub(i64(0), addr), i64(LINE - 1)), i64(size.bit_length() - 1))
    nbi = b.udiv(b.sub(i64(fi), h), i64(bi))
    total = b.mul(nbi, i64(nbj))
    rows_end = b.add(h, b.mul(nbi, i64(bi)))
    if streams:
        align = size if wide else irx.STREAM_PIECE
        nt = b.icmp_unsigned("==", b.and_(addr, i64(align - 1)), i64(0))

    def origin(k):
        return (b.add(h, b.mul(b.udiv(k, i64(nbj)), i64(bi))),
                b.mul(b.urem(k, i64(nbj)), i64(bj)))

    def half(k):
        return b.mul(b.and_(k, i64(1)), i64(bj * bp))

    def put_tile(k, t):
        """Tile t (row-major) of block k into its buffer, transposed."""
        ib, jb = origin(k)
        s_, jt = b.udiv(t, i64(tpr)), b.urem(t, i64(tpr))
        i0 = b.add(ib, b.mul(s_, i64(w)))
        j0 = b.add(jb, b.mul(jt, i64(w)))
        for r in range(w):
            off = b.add(b.mul(b.add(i0, i64(r)), i64(ldi)), b.add(j0, i64(bj)))
            irx.prefetch(b, src, off, mv.ety)
        cols = load_tile(i0, j0, w, w)
        boff = b.add(half(k), b.add(b.mul(jt, i64(w * bp)), b.mul(s_, i64(w))))
        for c in range(w):
            ptr = irx.element_ptr(b, buf, b.add(boff, i64(c * bp)), mv.ety)
            b.store(cols[c], ptr, align=w * size)

    def copy_out(k, q0):
        """Vectors q0 .. q0+w-1 of block k's buffer (row-major) to the output."""
        ib, jb = origin(k)
        moves = []
        for u in range(w):
            q = b.add(q0, i64(u))
            c, v = b.udiv(q, i64(vpr)), b.mul(b.urem(q, i64(vpr)), i64(w))
            ptr = irx.element_ptr(b, buf, b.add(half(k), b.add(b.mul(c, i64(bp)), v)), mv.ety)
            moves.append((b.load(ptr, typ=vec(mv.ety, w), align=w * size),
                          b.add(b.mul(b.add(jb, c), i64(ldo)), b.add(ib, v))))
        if not streams:
            for x, off in moves:
                mv.store(x, dst, off)
            return
        with b.if_else(nt) as (then, otherwise):
            with then:
                for x, off in moves:
                    if wide:
                        _store_nt(b, x, dst, off)
                    else:
                        mv.store(x, dst, off, streaming=True)
            with otherwise:
                for x, off in moves:
                    mv.store(x, dst, off)

    # k = 0 only fills a buffer, k = total only empties one
    with b.if_then(b.icmp_unsigned(">", total, i64(0))):
        with irx.for_range(b, b.add(total, i64(1)), name="blk") as k:
            with irx.for_range(b, ntiles, name="bt") as t:
                with b.if_then(b.icmp_unsigned("<", k, total)):
                    put_tile(k, t)
                with b.if_then(b.icmp_unsigned(">", k, i64(0))):
                    copy_out(b.sub(k, i64(1)), b.mul(t, i64(w)))
    if streams:
        irx.call(b, "llvm.x86.sse.sfence", ret=ir.VoidType(), overloads=[])

    # The full tiles outside the blocks, as rows of tiles: the rows above h (from row 0), the
    # rows right of the last whole block column (when bj does not divide fj), the rows below
    # the last block row (the last tile row moved up to end at fi). Tiles may overlap the
    # blocks and rewrite their elements with the same values.
    n_top = b.udiv(b.add(h, i64(w - 1)), i64(w))
    n_right = b.udiv(b.sub(rows_end, h), i64(w)) if nbj * bj < fj else i64(0)
    n_bottom = b.udiv(b.sub(i64(fi + w - 1), rows_end), i64(w))
    first_bottom = b.add(n_top, n_right)
    with irx.for_range(b, b.add(first_bottom, n_bottom), name="lt") as t:
        top = b.icmp_unsigned("<", t, n_top)
        right = b.and_(b.icmp_unsigned("<", t, first_bottom), b.not_(top))
        i_right = b.add(h, b.mul(b.sub(t, n_top), i64(w)))
        i_bottom = b.add(rows_end, b.mul(b.sub(t, first_bottom), i64(w)))
        i_bottom = b.select(b.icmp_unsigned("<", i_bottom, i64(fi - w)), i_bottom, i64(fi - w))
        i0 = b.select(top, b.mul(t, i64(w)), b.select(right, i_right, i_bottom))
        j_start = b.select(right, i64(nbj * bj), i64(0))
        with irx.for_range(b, fj, step=w, start=j_start, name="ltj") as j0:
            tile(i0, j0, w, w)
    edges()


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


def _with_streaming(b, spec, dst, body):
    """body(streaming) behind irx.with_streaming's size and alignment rules for the output."""
    out = spec.operands()[-1]
    irx.with_streaming(b, [(dst, out.rows, out.ld * out.dtype.itemsize)], body)


def _vnni2(b, spec, mv, src, dst):
    """out[r][2j + t] = in[2r + t][j]; an odd last row pairs with zeros."""
    _with_streaming(b, spec, dst, lambda streaming: _vnni2_rows(b, spec, mv, src, dst, streaming))


def _vnni2_rows(b, spec, mv, src, dst, streaming):
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
            mv.store(out, dst, off, None if count is None else 2 * count, streaming)
        _column_chunks(b, n, c, body)

    _for_row_pairs(b, pairs, odd, row_pair)


def _for_row_pairs(b, pairs, odd, row_pair):
    """row_pair(r, True) for each full pair of rows, then row_pair(pairs, False) if m is odd."""
    if pairs:
        with irx.for_range(b, pairs, name="pair") as r:
            row_pair(r, True)
    if odd:
        row_pair(i64(pairs), False)


def _vnni2_inv(b, spec, mv, src, dst):
    """out[2r + t][j] = in[r][2j + t]; for odd m the last pair's second row is dropped."""
    _with_streaming(b, spec, dst,
                    lambda streaming: _vnni2_inv_rows(b, spec, mv, src, dst, streaming))


def _vnni2_inv_rows(b, spec, mv, src, dst, streaming):
    m, n, ldi, ldo = spec.m, spec.n, spec.ldi, spec.ldo
    c = mv.w
    evens = [2 * k for k in range(c)]
    odds = [2 * k + 1 for k in range(c)]
    pairs, odd = divmod(m, 2)

    def row_pair(r, second):
        # Both output rows in one pass; when streaming, one output row per pass (the second
        # pass reads the input row again from the cache): non-temporal stores are much faster
        # as one sequential run than as two interleaved ones.
        halves = [evens, odds] if second else [evens]
        passes = [[t] for t in range(len(halves))] if streaming else [range(len(halves))]
        for outs in passes:
            def body(col, count, outs=outs):
                off = b.add(b.mul(r, i64(ldi)), b.mul(col, i64(2)))
                x = mv.load(src, off, 2 * c, None if count is None else 2 * count)
                undef = irx.undef(x.type)
                for t in outs:
                    out_off = b.add(b.mul(b.add(b.mul(r, i64(2)), i64(t)), i64(ldo)), col)
                    mv.store(_shuffle(b, x, undef, halves[t]), dst, out_off, count, streaming)
            _column_chunks(b, n, c, body)

    _for_row_pairs(b, pairs, odd, row_pair)


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
