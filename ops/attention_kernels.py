"""The loop nests of ops.flash_attention (the equations of one block step are in
ops.attention_equations).

Orientation. Every score block is kept *transposed*: S^T = K_j Q_i^T, a (BK x BQ) block whose
rows are keys and whose columns are queries. Then K_j and V_j are read straight from the
caller's row-major (S, D) head slices (a BRGEMM's A rows, and B of the P.V product), only the
query block is transposed (Q_i^T, once per work item, into the item's own scratch), the
softmax statistics of a query are column reductions (a vectorised max / sum down the rows,
no horizontal reductions), and O_i += P_ij V_j is a BRGEMM with trans_a on the stored P^T
(trans_a costs nothing: A is read by broadcasts). The backward keeps the same orientation, so
dropout's keep bits (a function of the element's flat index in the block) are the same bits.

Nests. Loop expressions are affine (a loop value times a size is not), so a tensor can have
one runtime extent that loop values index: the query (or key) blocks of a head. Heads are
therefore *unrolled*: a nest serves a fixed number HC of consecutive (batch, head) rows of the
flattened (B*H, S, D) inputs, with one copy of its calls per head h, guarded by `a == h` on the
parallel head loop `a` (the head's data at the constant offset h * S * D, which is affine).
The caller runs the nest once per chunk of HC heads (ops.flash_attention: B * H / HC calls). Sizes:
SQ and SK (the sequence lengths; ceil(S / 64) blocks), and for the dropout seed CH (the
chunk's first head) with SEEDLO / SEEDHI; the per-query-block variant (2-D masks: the mask
block of (i, j) needs two runtime indices, which no affine address has) adds I, the query
block, and runs once per (chunk, query block).

Tails. Sequence lengths that are not multiples of the block size are handled by the caller's
zero-padded copies of the last partial block of each head (q, k, v and, backward, o, do, lse;
small: one block per head): the nest reads block i < SQ // BQ from the slab and the tail block
(i == SQ // BQ) from the tail array; outputs likewise (the caller copies the tail rows back).
Padded keys get -inf through the additive column input `cm` (0 for a valid key, -inf past the
end), padded queries are computed and never stored. The block size (BQ = BK = Options.block)
is 64, or for short sequences (both at most 48) the next multiple of 16 (block_for): a
16-token sequence pads to a 16 x 16 block, not 64 x 64.
"""
from __future__ import annotations

import functools

import tpp
from tpp.core import dtypes as _dt
from tpp.runtime.lru import also_clear

from .attention_equations import (  # noqa: F401  (Options, vnni, block_for: ops.flash_attention's)
    BLOCK, BLOCKS, SEED_BLOCK_BITS, block_for, Options, vnni, tiles, stats_row_spec, probs_spec, probs_rescale_spec,
    rescale_spec, finish_row_spec, scale_rows_spec, _brgemm, backward_step_spec,
    delta_spec, scores_spec, exp_spec, drop_spec
)


# ---------------------------------------------------------------- the forward nest
def _seed(h, i, j):
    """The dropout seed of block (i, j) of the chunk's head h (see SEED_BLOCK_BITS)."""
    lo = tpp.size("SEEDLO") + tpp.size("CH") + h
    hi = tpp.size("SEEDHI") + j + i * (1 << SEED_BLOCK_BITS)
    return lo + hi * (1 << 32)


class _Nest:
    """A compiled nest (self.nest) with its tensors' names (self.names), run on arrays by
    name; sizes the arrays do not give go as keywords."""

    def run(self, arrays: dict, threads=None, **sizes):
        args = [arrays[name] for name in self.names]
        if sizes:
            self.nest(*args, threads=threads, **sizes)
        else:
            self.nest.call(tuple(args), threads)


class Forward(_Nest):
    """The forward nest of one Options: `run(arrays)` over one chunk of heads.

    Tensors (by name, in `names` order; f32 unless noted):
      q (hc, SQ, d) dtype, k and v (hc // group, SK, d) dtype   the chunk's slabs
      qt, kt, vt                                               their zero-padded tail blocks
                                                               ((heads, 64, d), dtype)
      out (hc, SQ, d) dtype, outt (hc, 64, d) dtype           the output and its tail block
      lse (hc, NQ * 64)                                        log-sum-exp per query row
      cm (64,)                                                 0 / -inf per key of the tail
      km (mheads, NK * 64) or mk (mheads, NK, 64, 64)         masks (keymask / mask2d)
      scale (1,), ones (64,)
      scratch (one block per head: loop a is parallel, the query blocks i and key blocks j
               run in order inside it): qT (hc, d, 64) dtype, work (hc, work_size(d)):
               st (64, 64), acc (64, d), m, l, alpha, sf, cx (64,); bf16 also qV (hc, d/2, 128),
               pb (hc, 64, 64), vV (hc, 32, 2d) (VNNI-packed Q_i^T, bf16 P^T, packed V_j)
    In the per-query-block variant (mask2d) the query block is the size I.
    The step of an unmasked block is three calls: the column extreme of s (reduce TPP), a
    (1 x 64) statistics equation (column values once per column, not per element), then
    probs_spec's exponentials (after the first key block, with head dim 64 on the host f32
    path: probs_rescale_spec, the exponentials and acc *= alpha in one pass; elsewhere
    rescale_spec's pass follows the step). The other steps (masks, the causal diagonal, the
    key tail, dropout) are split likewise, with z = scale * s + masks written in place first
    (see _split_step): no equation reduces over rows, which the device variant (Options.cuda)
    needs and which on the host is faster than one equation with a column reduction."""

    def __init__(self, o: Options):
        self.o = o
        d, dt, hc, group = o.d, o.dtype, o.hc, o.group
        BQ = BK = o.block       # noqa: N806  (the module docstring's names)
        sq, sk = tpp.size("SQ"), tpp.size("SK")
        nq_full, nk_full = sq // BQ, sk // BK
        nk = (sk + BK - 1) // BK
        per_block = o.mask2d
        if per_block:
            nest = tpp.LoopNest("Ab", a=hc, b=nk)
            a, j = nest.vars
            qi = tpp.size("I")             # the query block
        else:
            nq = (sq + BQ - 1) // BQ
            nest = tpp.LoopNest("Abc", a=hc, b=nq, c=nk)
            a, qi, j = nest.vars
        hk = hc // group
        bf = vnni(o)
        tiled = tiles(o)    # P^T transposed to P once per block for the P V product
        t = {}

        def tensor(name, shape, dtype=_dt.F32):
            t[name] = nest.tensor(name, shape, dtype)

        tensor("q", (hc, sq, d), dt)
        tensor("k", (hk, sk, d), dt)
        tensor("v", (hk, sk, d), dt)
        tensor("qt", (hc, BQ, d), dt)
        tensor("kt", (hk, BK, d), dt)
        tensor("vt", (hk, BK, d), dt)
        tensor("out", (hc, sq, d), dt)
        tensor("outt", (hc, BQ, d), dt)
        tensor("lse", (hc, (sq + BQ - 1) // BQ * BQ))
        tensor("cm", (BK,))
        if o.keymask:
            tensor("km", (o.mheads, nk * BK))
        if o.mask2d:
            tensor("mk", (o.mheads, nk, BK, BQ))
        tensor("scale", (1,))
        tensor("ones", (BK,))
        tensor("qT", (hc, d, BQ), dt)
        tensor("work", (hc, work_size(d, BQ)))    # st, acc, m, l, alpha, sf, cx (see work_size)
        if bf:
            tensor("qV", (hc, (d + 1) // 2, 2 * BQ), dt)    # Q_i^T in VNNI pairs
            tensor("pb", (hc, (2 if tiled else 1) * BK, BQ), dt)  # P^T in bf16 (then P)
            tensor("vV", (hc, BK // 2, 2 * d), dt)          # V_j in VNNI pairs
        self.names = tuple(t)

        q_cases = ((qi < nq_full,), lambda h: t["q"][h, qi * BQ]), \
                  ((qi == nq_full,), lambda h: t["qt"][h])
        out_cases = ((qi < nq_full,), lambda h: t["out"][h, qi * BQ]), \
                    ((qi == nq_full,), lambda h: t["outt"][h])
        k_cases = (False, (j < nk_full,), lambda c, x: t[x][c, j * BK]), \
                  (True, (j == nk_full,), lambda c, x: t[x + "t"][c])
        if o.causal:
            visible = (j <= qi,)
            diag_cases = ((False, (j < qi,)), (True, (j == qi,)))
            # the last key block a query block sees: min(i, NK - 1)
            last_cases = ((j == qi, qi < nk), (j == nk - 1, qi >= nk))
        else:
            visible = ()
            diag_cases = ((False, ()),)
            last_cases = ((j == nk - 1,),)
        first_cases = ((True, (j == 0,)), (False, (j > 0,)))

        transpose = tpp.make_unary("transpose", BQ, d, ldi=d, ldo=BQ, dtype_in=dt)
        if bf:      # every product on vdpbf16ps: B operands VNNI-packed, P^T in bf16
            pack_q = tpp.make_unary("vnni2", d, BQ, dtype_in=dt)
            pack_v = tpp.make_unary("vnni2", BK, d, ldi=d, dtype_in=dt)
            scores = _brgemm(BK, BQ, d, lda=d, ldb=2 * BQ, ldc=BQ, dtype_a=dt, dtype_b=dt,
                             vnni_b=True)
            pv = {first: _brgemm(BQ, d, BK, lda=BK if tiled else BQ, ldb=2 * d, ldc=d,
                                 trans_a=not tiled, dtype_a=dt, dtype_b=dt, vnni_b=True,
                                 beta=0 if first else 1)
                  for first in (True, False)}
            if tiled:
                untranspose = tpp.make_unary("transpose", BK, BQ, dtype_in=dt)   # P^T -> P
        else:
            scores = _brgemm(BK, BQ, d, lda=d, ldb=BQ, ldc=BQ, dtype_a=dt, dtype_b=dt)
            pv = {first: _brgemm(BQ, d, BK, lda=BQ, ldb=d, ldc=d, trans_a=True,
                                 dtype_a=_dt.F32, dtype_b=dt, beta=0 if first else 1)
                  for first in (True, False)}
        sums = {first: _brgemm(1, BQ, BK, lda=BK, ldb=BQ, ldc=BQ, beta=0 if first else 1)
                for first in (True, False)}
        rescale, finish_row, finish = rescale_spec(d, BQ), finish_row_spec(BQ), scale_rows_spec(d, dt, BQ)
        scale, ones, cm = t["scale"][0], t["ones"][0], t["cm"][0]
        extreme = tpp.make_unary("reduce_min" if o.negscale else "reduce_max", BK, BQ, axis=0)
        # Q_i read once in row order (a row reduction into cx, which the block's column
        # extremes overwrite before anything reads it) before the transpose reads it: the
        # transpose's strided reads of a block that is not in cache wait on one miss after
        # another (~1.3-2.6 us per 64 x 64 f32 block from L3 on the 2-core Zen 4), the
        # row-order pass streams it (~0.3 us) and the transpose then hits L1 / L2: 4-8% of a
        # B8 H12 S128 nest (one thread), whose query blocks come from L3 on every call.
        # Reading K_j / V_j ahead the same way measured no gain (the BRGEMMs' own reads
        # overlap their misses). Host only.
        touch = None if o.cuda else tpp.make_unary("reduce_max", BQ, d, ldi=d, axis=1,
                                                   dtype_in=dt, dtype_out=_dt.F32)

        fuse = d == BK and not bf and not o.cuda     # probs_rescale_spec's shapes

        def plain(diag, tail):      # no element masks: z = s * scale
            return not (diag or o.keymask or o.mask2d or (tail and not o.mask2d))

        for h in range(hc):
            c = h // group
            mh = h if o.mheads > 1 else 0
            own = (a == h,)
            qT, work = t["qT"][h], t["work"]
            st, acc = work[h, 0], work[h, BK * BQ]
            m, l, alpha, sf, cx = (work[h, BK * BQ + BQ * d + x * BQ] for x in range(5))
            p_at = t["pb"][h] if bf else st
            for cond, addr in q_cases:       # Q_i^T, once per work item
                if touch is not None:       # (cx: free until the block's column extremes)
                    nest.call(touch, addr(h), cx, when=own + (j == 0,) + cond)
                nest.call(transpose, addr(h), qT, when=own + (j == 0,) + cond)
            if bf:
                nest.call(pack_q, qT, t["qV"][h], when=own + (j == 0,))
            q_b = t["qV"][h] if bf else qT
            for tail, kcond, kaddr in k_cases:
                nest.call(scores, kaddr(c, "k"), q_b, st, when=own + visible + kcond)
                for diag, dcond in diag_cases:
                    for first, fcond in first_cases:
                        names = {"s": st, "scale": scale, "p": p_at, "pf": st, "m": m, "l": l,
                                 "m_out": m, "l_out": l, "alpha": alpha, "cm": cm,
                                 "safe": sf, "sf": sf, "c": cx, "acc": acc, "acc_out": acc}
                        if o.keymask:
                            names["cm"] = t["km"][mh, j * BK]
                        if o.mask2d:
                            names["mk"] = t["mk"][mh, j]
                        when = own + visible + kcond + dcond + fcond
                        if o.dropout or not plain(diag, tail):
                            self._split_step(nest, o, first, diag, tail, names, when,
                                             ones, sums[first], _seed(h, qi, j))
                        else:
                            nest.call(extreme, st, cx, when=when)
                            fused = fuse and not first      # P^T and acc *= alpha, one pass
                            for spec in (stats_row_spec(first, BQ), probs_rescale_spec(
                                    o, diag, tail) if fused else probs_spec(o, diag, tail)):
                                nest.call(spec, *[names[op.name] for op in spec.operands()],
                                          when=when)
                            if fused:
                                continue
                        if not first:
                            nest.call(rescale, acc, alpha, acc, when=when)
                v_b, p_a = kaddr(c, "v"), p_at
                if bf:
                    nest.call(pack_v, v_b, t["vV"][h], when=own + visible + kcond)
                    v_b = t["vV"][h]
                if tiled:
                    p_a = t["pb"][h, BK]
                    nest.call(untranspose, p_at, p_a, when=own + visible + kcond)
                for first, fcond in first_cases:
                    nest.call(pv[first], p_a, v_b, acc,
                              when=own + visible + kcond + fcond)
                    if not o.dropout:
                        nest.call(sums[first], ones, st, l,
                                  when=own + visible + kcond + fcond)
            for lcond in last_cases:     # inv = 1 / l into sf (free after the last step)
                args = {"l": l, "m": m, "inv": sf, "lse": t["lse"][h, qi * BQ]}
                nest.call(finish_row, *[args[op.name] for op in finish_row.operands()],
                          when=own + lcond)
                for cond, addr in out_cases:
                    nest.call(finish, acc, sf, addr(h), when=own + lcond + cond)
        self.nest = nest.compile()

    @staticmethod
    def _split_step(nest, o, first, diag, tail, names, when, one, sums, seed):
        """The step of a masked / diagonal / tail / dropout block without equations that
        reduce over rows (see attention_equations' split step): z in place of
        s, its column maxima (reduce TPP), the statistics on them (stats_row_spec, scale 1),
        P^T = exp(z - safe), l += its column sums (ones-row BRGEMM) and, with dropout, the
        keep bits applied to P^T last."""
        st = names["s"]

        def call(spec, names, seed=None):
            nest.call(spec, *[names[op.name] for op in spec.operands()], when=when, seed=seed)

        call(scores_spec(o, diag, tail), dict(names, z=st))
        names = dict(names, z=st, pf=st, scale=one)
        nest.call(_column_max(o.block), st, names["c"], when=when)
        call(stats_row_spec(first, o.block), names)
        call(exp_spec(o), names)
        if o.dropout:
            nest.call(sums, one, st, names["l"], when=when)
            call(drop_spec(o), names, seed)


def work_size(d: int, block: int) -> int:
    """f32 elements of the forward's per-head scratch tensor `work`, one tensor (each tensor
    of a nest call costs its Python overlap check): S^T (block x block), acc (block x d),
    then the (block,) rows m, l, alpha, sf, cx."""
    return block * block + block * d + 5 * block


@functools.lru_cache(maxsize=8)
def _column_max(block):
    return tpp.make_unary("reduce_max", block, block, axis=0)


@functools.lru_cache(maxsize=256)     # (four block classes per options)
def forward(o: Options) -> Forward:
    return Forward(o)


also_clear(forward.cache_clear)


# ---------------------------------------------------------------- the backward nest
class Backward(_Nest):
    """The backward nest of one Options over one chunk of heads: `run(arrays)`.

    Parallel over the chunk's kv heads (loop a); per kv head, serial over key blocks j and
    query blocks i, and over the query heads of its group (unrolled): the thread owning a kv
    head writes the dK_j, dV_j of that head and the dQ_i of its query heads, no other.

    Tensors (by name, in `names` order; f32 unless noted): q, o, do (hc, SQ, d) dtype and
    their tail blocks qt, ot, dot (hc, 64, d); k, v (hk, SK, d) dtype and kt, vt (hk, 64, d);
    lse (hc, NQ * 64) (padded queries: +inf); dq (hc, SQ, d), dk, dv (hk, SK, d) dtype and
    their tail blocks dqt (hc, 64, d), dkt, dvt (hk, 64, d); cm, km / mk, scale as forward;
    scratch: qT, doT (hc, NQ, d, 64) dtype, delta (hc, NQ * 64), gq (hc, NQ, 64, d),
    gk, gv (hk, NK, 64, d) (f32 accumulators; not in a `direct` nest: host f32 without 2-D
    masks accumulates in dq, dk, dv and their tail blocks, saving the zeroing and the copies
    out, ~5% of a B8 H12 S128 backward), st, dpt (hk, 64, 64). The per-query-block
    variant (mask2d) runs once per query block I (the caller's loop, in order): the scratch
    holds that one block (NQ = 1), gk / gv carry the sums across the calls (zeroed at I == 0,
    stored at the last I), and mk is (mheads, NK, 64, 64) as in the forward."""

    def __init__(self, o: Options):
        self.o = o
        d, dt, hc, group = o.d, o.dtype, o.hc, o.group
        BQ = BK = o.block       # noqa: N806
        hk = hc // group
        sq, sk = tpp.size("SQ"), tpp.size("SK")
        nq_full, nk_full = sq // BQ, sk // BK
        nq, nk = (sq + BQ - 1) // BQ, (sk + BK - 1) // BK
        per_block = o.mask2d
        if per_block:               # the query block is the size I (see Forward)
            nest = tpp.LoopNest("Ab", a=hk, b=nk)
            a, j = nest.vars
            ii, i = 0, tpp.size("I")
            snq, snk, jj = 1, nk, j
        else:
            nest = tpp.LoopNest("Abc", a=hk, b=nk, c=nq)
            a, j, i = nest.vars
            ii, snq, snk, jj = i, nq, 1, 0
        bf = vnni(o)
        tiled = tiles(o)    # dS^T transposed to dS once per block for the dQ product
        # f32 on the host, one call per chunk: dQ, dK, dV accumulated in the outputs (their
        # first product with beta 0), no gq / gk / gv, no zeroing and no copies out
        self.direct = direct = dt == _dt.F32 and not o.cuda and not per_block
        t = {}

        def tensor(name, shape, dtype=_dt.F32):
            t[name] = nest.tensor(name, shape, dtype)

        for name in ("q", "o", "do"):
            tensor(name, (hc, sq, d), dt)
        for name in ("k", "v"):
            tensor(name, (hk, sk, d), dt)
        for name in ("qt", "ot", "dot"):
            tensor(name, (hc, BQ, d), dt)
        for name in ("kt", "vt"):
            tensor(name, (hk, BK, d), dt)
        tensor("lse", (hc, nq * BQ))
        tensor("dq", (hc, sq, d), dt)
        tensor("dk", (hk, sk, d), dt)
        tensor("dv", (hk, sk, d), dt)
        tensor("dqt", (hc, BQ, d), dt)
        tensor("dkt", (hk, BK, d), dt)
        tensor("dvt", (hk, BK, d), dt)
        tensor("cm", (BK,))
        if o.keymask:
            tensor("km", (o.mheads, nk * BK))
        if o.mask2d:
            tensor("mk", (o.mheads, nk, BK, BQ))
        tensor("scale", (1,))
        if bf:      # the query side packed once per query block (at j == 0), VNNI pairs
            tensor("qT", (hc, d, BQ), dt)                       # a transpose's staging
            for name in ("qV", "doV"):                          # Q_i^T, dO_i^T
                tensor(name, (hc, snq, (d + 1) // 2, 2 * BQ), dt)
            for name in ("qN", "doN"):                          # Q_i, dO_i
                tensor(name, (hc, snq, BQ // 2, 2 * d), dt)
        else:
            tensor("qT", (hc, snq, d, BQ), dt)
            tensor("doT", (hc, snq, d, BQ), dt)
        tensor("delta", (hc, snq * BQ))
        if not direct:
            tensor("gq", (hc, snq, BQ, d))
            tensor("gk", (hk, snk, BK, d))
            tensor("gv", (hk, snk, BK, d))
        tensor("st", (hk, BK, BQ))
        tensor("dpt", (hk, BK, BQ))
        if bf:
            tensor("pb", (hk, BK, BQ), dt)                      # P^T, dS^T in bf16
            tensor("dsb", (hk, (2 if tiled else 1) * BK, BQ), dt)   # dS^T (then dS)
            tensor("kN", (hk, BK // 2, 2 * d), dt)              # K_j in VNNI pairs
        self.names = tuple(t)

        def q_side(name, h):    # a query block of a (hc, SQ, d) input or output, or its tail
            return (((i < nq_full,), t[name][h, i * BQ]), ((i == nq_full,), t[name + "t"][h]))

        def k_side(name, c):
            return (((j < nk_full,), t[name][c, j * BK], False),
                    ((j == nk_full,), t[name + "t"][c], True))

        transpose = tpp.make_unary("transpose", BQ, d, ldi=d, ldo=BQ, dtype_in=dt)
        zero = tpp.make_unary("zero", BQ, d)
        to_out = tpp.make_unary("identity", BQ, d, dtype_in=_dt.F32, dtype_out=dt)
        if bf:
            pack_t = tpp.make_unary("vnni2", d, BQ, dtype_in=dt)            # qT -> qV
            pack_r = tpp.make_unary("vnni2", BQ, d, ldi=d, dtype_in=dt)    # rows -> pairs
            scores = _brgemm(BK, BQ, d, lda=d, ldb=2 * BQ, ldc=BQ, dtype_a=dt, dtype_b=dt,
                             vnni_b=True)
            acc_k = _brgemm(BK, d, BQ, lda=BQ, ldb=2 * d, ldc=d, dtype_a=dt, dtype_b=dt,
                            vnni_b=True, beta=1)
            acc_q = _brgemm(BQ, d, BK, lda=BK if tiled else BQ, ldb=2 * d, ldc=d,
                            trans_a=not tiled, dtype_a=dt, dtype_b=dt, vnni_b=True, beta=1)
            if tiled:
                untranspose = tpp.make_unary("transpose", BK, BQ, dtype_in=dt)   # dS^T -> dS
        else:
            scores = _brgemm(BK, BQ, d, lda=d, ldb=BQ, ldc=BQ, dtype_a=dt, dtype_b=dt)
            # dP^T = V_j dO_i^T; dV_j += P^T dO_i; dK_j += dS^T Q_i; dQ_i += dS K_j
            acc_k = _brgemm(BK, d, BQ, lda=BQ, ldb=d, ldc=d, dtype_a=_dt.F32, dtype_b=dt,
                            beta=1)
            acc_q = _brgemm(BQ, d, BK, lda=BQ, ldb=d, ldc=d, trans_a=True, dtype_a=_dt.F32,
                            dtype_b=dt, beta=1)
        if direct:      # the first products into dQ_i, dK_j, dV_j
            acc_k0 = _brgemm(BK, d, BQ, lda=BQ, ldb=d, ldc=d, dtype_a=_dt.F32, dtype_b=dt,
                             beta=0)
            acc_q0 = _brgemm(BQ, d, BK, lda=BQ, ldb=d, ldc=d, trans_a=True, dtype_a=_dt.F32,
                             dtype_b=dt, beta=0)
        delta = delta_spec(d, dt, BQ)
        # Q_i read once in row order (a row reduction into Delta_i's row, which the delta
        # equation overwrites next) before its transpose, and dO_i's transpose after the
        # delta equation has read dO_i by rows: as in the forward, the transpose's strided
        # reads of a block not in cache miss one line after another (host, unpacked)
        touch = tpp.make_unary("reduce_max", BQ, d, ldi=d, axis=1, dtype_in=dt,
                               dtype_out=_dt.F32)
        visible = (i >= j,) if o.causal else ()
        diag_cases = ((False, (j < i,)), (True, (j == i,))) if o.causal else ((False, ()),)
        scale, cm = t["scale"][0], t["cm"][0]

        for c in range(hk):
            own = (a == c,)
            st, dpt = t["st"][c], t["dpt"][c]
            pt_at, ds_at = (t["pb"][c], t["dsb"][c]) if bf else (st, dpt)
            if not direct:
                gk, gv = t["gk"][c, jj], t["gv"][c, jj]
                nest.call(zero, gk, when=own + (i == 0,))
                nest.call(zero, gv, when=own + (i == 0,))
            elif o.causal:      # key blocks no query block sees: dK_j = dV_j = 0
                for kcond, addr, _ in k_side("dk", c) + k_side("dv", c):
                    nest.call(zero, addr, when=own + (i == 0, j >= nq) + kcond)
            # direct: the first query block that sees key block j (beta 0 there)
            kfirst = ((True, (i == j,)), (False, (i > j,))) if o.causal else \
                ((True, (i == 0,)), (False, (i > 0,)))
            if bf:      # K_j in pairs for dQ_i += dS K_j (every step: cheap, any order)
                for kcond, k_at, _ in k_side("k", c):
                    nest.call(pack_r, k_at, t["kN"][c], when=own + visible + kcond)
            for g in range(group):
                h = c * group + g
                mh = h if o.mheads > 1 else 0
                gq = None if direct else t["gq"][h, ii]
                dl = t["delta"][h, ii * BQ]
                first = own + (j == 0,)
                if bf:
                    qT = t["qT"][h]
                    for name, side in (("qV", "q"), ("doV", "do")):
                        for cond, addr in q_side(side, h):
                            nest.call(transpose, addr, qT, when=first + cond)
                        nest.call(pack_t, qT, t[name][h, ii], when=first)
                    for name, side in (("qN", "q"), ("doN", "do")):
                        for cond, addr in q_side(side, h):
                            nest.call(pack_r, addr, t[name][h, ii], when=first + cond)
                    q_b, do_b = t["qV"][h, ii], t["doV"][h, ii]
                    q_n, do_n = (((), t["qN"][h, ii]),), (((), t["doN"][h, ii]),)
                    for (cond, o_at), (_, do_at) in zip(q_side("o", h), q_side("do", h)):
                        nest.call(delta, do_at, o_at, dl, when=first + cond)
                elif not o.cuda:
                    q_b, do_b = t["qT"][h, ii], t["doT"][h, ii]
                    for cond, addr in q_side("q", h):
                        nest.call(touch, addr, dl, when=first + cond)
                        nest.call(transpose, addr, q_b, when=first + cond)
                    for (cond, o_at), (_, do_at) in zip(q_side("o", h), q_side("do", h)):
                        nest.call(delta, do_at, o_at, dl, when=first + cond)
                    for cond, addr in q_side("do", h):
                        nest.call(transpose, addr, do_b, when=first + cond)
                    q_n, do_n = q_side("q", h), q_side("do", h)
                else:
                    q_b, do_b = t["qT"][h, ii], t["doT"][h, ii]
                    for cond, addr in q_side("q", h):
                        nest.call(transpose, addr, q_b, when=first + cond)
                    for cond, addr in q_side("do", h):
                        nest.call(transpose, addr, do_b, when=first + cond)
                    q_n, do_n = q_side("q", h), q_side("do", h)
                    for (cond, o_at), (_, do_at) in zip(q_side("o", h), q_side("do", h)):
                        nest.call(delta, do_at, o_at, dl, when=first + cond)
                if not direct:
                    nest.call(zero, gq, when=first)
                for kcond, k_at, tail in k_side("k", c):
                    (_, v_at, _), = [x for x in k_side("v", c) if x[2] == tail]
                    step = own + visible + kcond
                    nest.call(scores, k_at, q_b, st, when=step)
                    nest.call(scores, v_at, do_b, dpt, when=step)
                    for diag, dcond in diag_cases:
                        spec = backward_step_spec(o, diag, tail)
                        names = {"s": st, "dp": dpt, "lse": t["lse"][h, i * BQ], "delta": dl,
                                 "scale": scale, "cm": cm, "pt": pt_at, "ds": ds_at}
                        if o.keymask:
                            names["cm"] = t["km"][mh, j * BK]
                        if o.mask2d:
                            names["mk"] = t["mk"][mh, j]
                        args = [names[op.name] for op in spec.operands()]
                        seed = _seed(h, i, j) if spec.scalars else None
                        nest.call(spec, *args, when=step + dcond, seed=seed)
                    if direct:
                        (_, dk_at, _), = [x for x in k_side("dk", c) if x[2] == tail]
                        (_, dv_at, _), = [x for x in k_side("dv", c) if x[2] == tail]
                        for g0, gcond in kfirst:
                            # (g > 0: the group's earlier heads wrote dK_j, dV_j already)
                            kk = acc_k0 if g0 and g == 0 else acc_k
                            for q_cond, q_at in q_n:
                                nest.call(kk, ds_at, q_at, dk_at, when=step + gcond + q_cond)
                            for do_cond, do_at in do_n:
                                nest.call(kk, pt_at, do_at, dv_at,
                                          when=step + gcond + do_cond)
                        for q0, qcond in ((True, (j == 0,)), (False, (j > 0,))):
                            for cond, addr in q_side("dq", h):
                                nest.call(acc_q0 if q0 else acc_q, ds_at, k_at, addr,
                                          when=step + qcond + cond)
                        continue
                    for q_cond, q_at in q_n:
                        nest.call(acc_k, ds_at, q_at, gk, when=step + q_cond)
                    for do_cond, do_at in do_n:
                        nest.call(acc_k, pt_at, do_at, gv, when=step + do_cond)
                    ds_a = ds_at
                    if tiled:
                        ds_a = t["dsb"][c, BK]
                        nest.call(untranspose, ds_at, ds_a, when=step)
                    nest.call(acc_q, ds_a, t["kN"][c] if bf else k_at, gq, when=step)
                if direct:
                    continue
                for cond, addr in q_side("dq", h):      # dQ_i is complete after the last j
                    nest.call(to_out, gq, addr, when=own + (j == nk - 1,) + cond)
            if direct:
                continue
            last = own + (i == nq - 1,)                 # dK_j, dV_j after the last i
            for cond, addr, _ in k_side("dk", c):
                nest.call(to_out, gk, addr, when=last + cond)
            for cond, addr, _ in k_side("dv", c):
                nest.call(to_out, gv, addr, when=last + cond)
        self.nest = nest.compile()



@functools.lru_cache(maxsize=256)
def backward(o: Options) -> Backward:
    return Backward(o)


also_clear(backward.cache_clear)
