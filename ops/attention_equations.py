"""The equations of one attention block step (ops.flash_attention), forward and backward.

A score block is kept transposed, S^T = K_j Q_i^T: (BK x BQ, both Options.block: 64, or less
for short sequences), keys down and queries across, so a query's softmax statistics are
reductions down the columns (see ops.attention_kernels for why). Each *_spec function gives the EquationSpec of one piece of a step for one Options (and
the block's kind: the first key block, the causal diagonal, the padded tail); the nests in
ops.attention_kernels call them. The backward step's equation is tpp.grad of the forward
softmax graph with the forward's saved statistics substituted.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import tpp
from tpp.core import dtypes as _dt
from tpp.core import expr as X
from tpp.runtime.lru import also_clear

BLOCK = 64          # rows of the query and key blocks of sequences longer than 48;
                    # the two are equal (causal blocks align): see block_for
NEG_INF = -math.inf
SEED_BLOCK_BITS = 16   # a block's seed: (CH + h) in the low word, j + (i << 16) in the high


@dataclass(frozen=True)
class Options:
    """What a compiled nest is specialised for (its cache key, with the head geometry).

    d: head dim; dtype: of q/k/v/out (F32 or BF16); hc: query heads per call; group: query
    heads per kv head (hc % group == 0); causal; keymask: an additive (per key) mask input
    of `mheads` heads (1: shared by the chunk's heads, else hc); mask2d: an additive
    (query x key) mask input per (head, key block, query block) of `mheads` heads, which makes
    the nest the per-query-block variant; dropout: the probability (0.0: none)."""
    d: int
    dtype: object
    hc: int
    group: int
    causal: bool = False
    keymask: bool = False
    mask2d: bool = False
    mheads: int = 1
    dropout: float = 0.0
    negscale: bool = False      # scale < 0: the largest score is scale * the smallest s
    cuda: bool = False          # the variant for device backends (see attention_kernels):
                                # no equation reduces over the rows of a block
    block: int = BLOCK          # query rows and key rows per block (block_for)


BLOCKS = (16, 32, 48, BLOCK)   # the block sizes block_for picks
# The cost of a score element in a block of each size, relative to the 64 x 64 block's:
# ops.attention forward and forward + backward, f32, head sizes 32 and 64, B1 H12, on
# sequences that are whole multiples of the blocks compared (128, 384, 512), 2-core Zen 4,
# AVX-512 and AVX2 code: forward 16: 1.25-1.7, 32: 1.08-1.11, 48: ~1.1; forward + backward
# 16 and 32: 1.02-1.04. Smaller blocks compute fewer padded scores and pay more per score.
BLOCK_COST = {16: 1.4, 32: 1.1, 48: 1.15, BLOCK: 1.0}


def block_for(sq: int, sk: int) -> int:
    """The block size of a problem with sq queries and sk keys: the one of BLOCKS with the
    least padded work, ceil(sq / b) * ceil(sk / b) blocks of b * b scores weighted by
    BLOCK_COST[b] (the larger block on a tie; causal problems are weighed as if whole). A
    sequence that is a whole number of 64-row blocks keeps them; a short or ragged one takes
    smaller blocks instead of padding to 64 x 64 (f32, B1 H12 D32, 2-core Zen 4, forward:
    S = 16 145 -> 56 us, S = 70 209-245 -> 153-162 us, S = 200 660 -> 550; forward + backward
    S = 70 1080 -> 558 us, S = 200 2297 -> 1883; D64 S = 70 1562 -> 607)."""
    def work(b):
        return -(-sq // b) * -(-sk // b) * b * b * BLOCK_COST[b]
    return min(reversed(BLOCKS), key=work)


# ---------------------------------------------------------------- equations
def _scores(eq, o: Options, *, diag: bool, tail: bool):
    """z, the scaled and masked scores of a (BK x BQ) S^T block: s * scale + masks."""
    z = eq.input("s") * eq.param("scale")
    if o.keymask or (tail and not o.mask2d):
        z = z + eq.input("cm", bcast="col")          # per key: the mask, -inf past the end
    if o.mask2d:
        z = z + eq.input("mk")                       # per (key, query); -inf past the end
    if diag:                                         # causal diagonal block: key > query out
        z = X.select(X.islt(X.index("col"), X.index("row")), NEG_INF, z)
    return z


def _exp_nonpos(x):
    """exp of an argument that is <= 0, -inf or NaN: tpp.core.mathlib's exp_nonpos, the cheaper
    expansion (11 vector operations with AVX-512 masks, 13 on AVX2, to exp's 15; e^x for
    every x <= 44). Attention's arguments are z - m with m >= z (z - 0 = -inf where
    m = -inf), or m_old - m_new with m_new = max(m_old, ...): see each use."""
    return X.prim("exp_nonpos", x)


def _minus(z, shift):
    """z - shift, z rounded first: where shift is the rounded maximum of z, the difference is
    <= 0 exactly (rounding is monotonic). One fma(s, scale, -shift) would save an operation
    but exceed 0 by up to half an ulp of shift, past exp_nonpos's domain (e^x up to x = 44)
    for scores over ~7e8 (NaN and inf where torch is finite)."""
    return z - shift


def _clamped(d):
    """d where <= 0 (or NaN), else 0: a difference that rounding may push a few ulps above 0
    (a few ulps of a huge score exceed exp_nonpos's domain)."""
    return X.select(X.compare("gt", d, 0.0), 0.0, d)


def _finite_or_zero(m):
    """m where finite-from-below, 0 where -inf (a column with no key yet): exp(z - m) is then
    exp(-inf) = 0 there instead of NaN."""
    return X.select(X.compare("eq", m, NEG_INF), 0.0, m)


def _dropped(eq, o: Options, p):
    """p with dropout's keep bits applied (the op table's definition), or p."""
    if not o.dropout:
        return p
    y, _keep = eq.op("dropout", p, p=o.dropout)
    return y


def vnni(o: Options) -> bool:
    """Whether the nests run the bf16 path: P (and dS) rounded to bf16 and every BRGEMM on
    bf16 A with VNNI-packed bf16 B, for bf16 on hosts with a bf16 dot instruction
    (vdpbf16ps: avx512_bf16) and on devices. A host without one (AVX2) runs bf16 inputs
    through the f32 path's layouts instead: its BRGEMMs widen bf16 to f32 either way, so the
    VNNI packing and the rounding of P only cost (B4 H12 S512 D64 forward with AVX2 code on
    Zen 4, 2 threads: 152 -> 173 GFLOP/s, our f32 172-176), and P and dS stay f32."""
    return o.dtype == _dt.BF16 and (o.cuda or tpp.has_dot_instruction(_dt.BF16))


def tiles(o: Options) -> bool:
    """Whether the bf16 nests transpose P^T (and dS^T) into a second block before the
    products that read them as A, instead of passing them with trans_a: where bf16 BRGEMMs
    run on a matrix unit (AMX, tpp.has_matrix_unit), a transposed A is turned into tile rows
    inside the kernel per k step and per column block, and one 64 x 64 transpose TPP is level
    to slightly faster (B4 H12 S512 D64 bf16, 2 threads: forward 6.9-7.3 vs 7.4 ms, forward
    + backward 20.5-24.4 vs 20.9-25.3). The scratch pb (dsb) then holds two blocks: P^T, P."""
    return vnni(o) and not o.cuda and tpp.has_matrix_unit(_dt.BF16)


@functools.lru_cache(maxsize=256)
def stats_row_spec(first: bool, block: int):
    """The statistics of the online-softmax step of block (i, j), as a (1 x BQ) equation on
    the column extremes c of its scores (the block's pass is the reduce TPP's): m (the running
    column maxima) updated in place, alpha = exp(m_old - m_new), l = alpha * l_old (the
    caller's ones-row BRGEMM then adds the column sums of P^T) and `safe`, m_new where finite
    and 0 where -inf, the shift the exponentials subtract. c: on an unmasked block the max of
    the raw s (or min with a negative scale; scale * c is the largest z exactly, rounding
    being monotonic); on the others the max of z (scores_spec's, in place of s), scale 1.
    `first`: the first key block of a query block (no m_old / l_old, no alpha)."""
    eq = tpp.equation(1, block)
    cmax = eq.input("c") * eq.param("scale")
    if first:
        return eq.spec(m_out=cmax, safe=_finite_or_zero(cmax))
    m_old = eq.input("m")
    m_new = eq.maximum(m_old, cmax)
    safe = _finite_or_zero(m_new)
    alpha = _exp_nonpos(m_old - safe)                   # m_new >= m_old
    return eq.spec(m_out=m_new, safe=safe, alpha=alpha, l_out=alpha * eq.input("l"))


@functools.lru_cache(maxsize=256)
def probs_spec(o: Options, diag: bool, tail: bool):
    """P^T = exp(z - safe) over the S^T block (in place; with the bf16 path also rounded to
    bf16 into pb), safe from stats_row_spec: s * scale <= c * scale (the column extreme c),
    so z - safe <= 0. For unmasked blocks (the others: scores_spec, then exp_spec)."""
    eq = tpp.equation(o.block, o.block)
    p = _exp_nonpos(_minus(_scores(eq, o, diag=diag, tail=tail), eq.input("sf", bcast="row")))
    if vnni(o):
        return eq.spec(p=p, pf=p, dtypes={"p": o.dtype})
    return eq.spec(p=p)


@functools.lru_cache(maxsize=256)
def probs_rescale_spec(o: Options, diag: bool, tail: bool):
    """probs_spec's P^T (f32) and rescale_spec's acc *= alpha in one pass over the two
    (64 x 64) blocks (head dim 64: acc's shape is the score block's), for an unmasked block
    after the first: the rescale's loads and stores overlap the exponentials' arithmetic
    instead of taking a pass of their own. alpha is per query: a row of acc (bcast col), a
    column of P^T (where sf is bcast row)."""
    assert o.d == o.block and not vnni(o)
    eq = tpp.equation(o.block, o.block)
    p = _exp_nonpos(_minus(_scores(eq, o, diag=diag, tail=tail), eq.input("sf", bcast="row")))
    return eq.spec(p=p, acc_out=eq.input("acc") * eq.input("alpha", bcast="col"))


@functools.lru_cache(maxsize=256)
def rescale_spec(d: int, block: int):
    """acc (BQ x d) *= alpha (one factor per query row), in place."""
    eq = tpp.equation(block, d)
    acc = eq.input("acc")
    return eq.spec(acc_out=acc * eq.input("alpha", bcast="col"))


@functools.lru_cache(maxsize=256)
def finish_row_spec(block: int):
    """The end of a query block, first half: inv = 1 / l (0 where l == 0: a query no key may
    see, which torch gives a row of 0) and lse = m + log(l) (-inf there), as a (1 x BQ)
    equation, a lane per query (vectors across the queries, not a log and a division per
    output row); scale_rows_spec then writes out = acc * inv."""
    eq = tpp.equation(1, block)
    l_in = eq.input("l")
    inv = X.select(X.compare("gt", l_in, 0.0), 1.0 / l_in, 0.0)
    return eq.spec(inv=inv, lse=eq.input("m") + eq.log(l_in))


@functools.lru_cache(maxsize=256)
def scale_rows_spec(d: int, dtype, block: int):
    """out = acc * inv (one factor per query row, finish_row_spec's) in the output's dtype."""
    eq = tpp.equation(block, d)
    return eq.spec(out=eq.input("acc") * eq.input("inv", bcast="col"), dtypes={"out": dtype})


# ---------------------------------------------------------------- the split step
# The step of a masked, causal-diagonal, tail or dropout block is split into passes that no
# equation reduces over rows in (a device backend, tpp_cuda, builds equations that reduce
# along axis 1 only; on the host the split passes are also faster than one equation with a
# column reduction): z in place of s (scores_spec), its column maxima by the reduce_max TPP,
# stats_row_spec on them (scale 1), p = exp(z - safe) (exp_spec), the column sums by the
# ones-row BRGEMM, and with dropout the keep bits applied to P^T last (drop_spec: the same
# seed and element index as backward_step_spec's, so the same bits).
@functools.lru_cache(maxsize=256)
def scores_spec(o: Options, diag: bool, tail: bool):
    """z = s * scale + masks (-inf for keys past the end or above the causal diagonal) over
    the S^T block, in place."""
    eq = tpp.equation(o.block, o.block)
    return eq.spec(z=_scores(eq, o, diag=diag, tail=tail))


@functools.lru_cache(maxsize=256)
def exp_spec(o: Options):
    """P^T = exp(z - safe) over the z block, in place (f32: the column sums read it); the bf16
    path without dropout also rounds it to bf16 into p. safe is from the column maxima of
    this z, so z - safe <= 0."""
    eq = tpp.equation(o.block, o.block)
    p = _exp_nonpos(eq.input("z") - eq.input("sf", bcast="row"))
    if vnni(o) and not o.dropout:
        return eq.spec(pf=p, p=p, dtypes={"p": o.dtype})
    return eq.spec(pf=p)


@functools.lru_cache(maxsize=256)
def drop_spec(o: Options):
    """P^T with dropout's keep bits (backward_step_spec's: a function of the block's seed and
    the element's index in it), in the dtype of P V's A operand (bf16 on the VNNI path)."""
    eq = tpp.equation(o.block, o.block)
    return eq.spec(p=_dropped(eq, o, eq.input("pf")),
                   dtypes={"p": o.dtype if vnni(o) else _dt.F32})


def _brgemm(m, n, k, **kw):
    return tpp.make_brgemm(m, n, k, **kw)


# ---------------------------------------------------------------- backward
@functools.lru_cache(maxsize=256)
def backward_step_spec(o: Options, diag: bool, tail: bool):
    """The backward equation of block (i, j), from tpp.grad of the forward softmax graph: on
    the S^T block s and dP^T (the cotangent of the dropped probabilities, dO_i V_j^T), with
    the forward's lse and Delta = rowsum(dO * O) per query column, it writes pt, the dropped
    P^T (for dV), and ds = dS^T = scale * P^T * (dP^T - Delta) (for dK and dQ).

    The gradient of softmax(z) = e / sum(e), e = exp(z - max), differentiated with the max as
    a constant, is rewritten with the saved statistics: e -> exp(z - lse) (= P, the forward's
    probabilities), sum(e) -> 1, and its one column reduction sum(P * dP) -> Delta (the sum
    over *all* key blocks, which one block cannot see; Delta is that sum: dO . O)."""
    eq = tpp.equation(o.block, o.block)
    z = _scores(eq, o, diag=diag, tail=tail)
    s = X.input("s")
    dpd = eq.input("dp")
    lse = eq.input("lse", bcast="row")
    delta = eq.input("delta", bcast="row")
    mx = eq.max(z, 0)
    e = _exp_nonpos(z - mx)
    total = eq.sum(e, 0)
    pd = _dropped(eq, o, e / total)
    ds, = tpp.grad([pd], [s], [dpd], stop_gradient=[mx])
    # a query that saw no key (lse -inf): exp(z - +inf) = 0, not NaN. z - lse <= 0 up to
    # rounding: lse = m + log(l) with m the forward's maximum of z and l >= 1 (l sums P, which
    # holds exp(0) = 1 at the maximum, and alpha * l_old + ...), so log(l) >= 0; a recomputed
    # z may exceed m by a few ulps (another BRGEMM's rounding): clamped at 0
    p_saved = _exp_nonpos(_clamped(_minus(z, X.select(X.compare("eq", lse, NEG_INF), math.inf,
                                                      lse))))
    pd, ds = X.substitute([pd, ds], {e: p_saved, total: X.const(1.0)})
    sums = [n for n in X.topological([ds]) if n.op in X.REDUCTIONS]
    assert len(sums) == 1 and sums[0].attr[0] == 0, "the softmax gradient's one column sum"
    ds, = X.substitute([ds], {sums[0]: delta})
    rounded = o.dtype if vnni(o) else _dt.F32       # the products' A operands
    return eq.spec(pt=pd, ds=ds, dtypes={"pt": rounded, "ds": rounded})


@functools.lru_cache(maxsize=256)
def delta_spec(d: int, dtype, block: int):
    """Delta = rowsum(dO * O) of a (BQ x d) block: one value per query row. (The input is
    "dout", not "do": operand names become C identifiers in the CUDA backend's code.)"""
    eq = tpp.equation(block, d)
    return eq.spec(delta=eq.sum(eq.input("dout", dtype=dtype) * eq.input("o", dtype=dtype), 1))


for _cache in (stats_row_spec, probs_spec, probs_rescale_spec, rescale_spec,
               finish_row_spec, scale_rows_spec, backward_step_spec, delta_spec, scores_spec,
               exp_spec, drop_spec):
    also_clear(_cache.cache_clear)      # tpp.clear_caches() empties them too
