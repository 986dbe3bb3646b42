"""The weight-gradient nests of ops.conv on its blocked layouts: the generic one (brgemm_nest)
and, for bf16 host data, one on the bf16 dot instruction (weight_grad); and the blocked bias
gradient (bias_nest, device data: host data sums dy's rows as they are).

The generic weight gradient is per (output block, input block, tap) a BRGEMM dy^T @ x over
the output pixels of a row with a transposed A, batch-reduced over runs of output rows (see
DW_CALL_BYTES) and summed over the batch; in bf16 the BRGEMM then widens both operands to
f32 and multiplies with f32 FMAs. The bf16 nest swaps the roles so that the contracted
dimension (the output pixels) is VNNI-paired in B and contiguous in A's rows:

    dwt[g, c, tap, k] += sum over n, p, q of xt[c, pixel(p, q, tap)] * dy[p, q, k]

  A  x transposed, [N][G*Cb][Hp][sw][bc][Wq] (each padded row split into its sw column
     phases, Wq = ceil(Wp/sw) pixels each; one transpose TPP per row and phase from the
     blocked x): the pixels a tap reads at stride sw are contiguous in one phase, so a row of
     A (one input channel) is q consecutive pixels and a VNNI pair is one 32-bit load
  B  dy in VNNI pairs over the pixels of a row, [N][G*Kb][P][ceil(Q/2)][2*bk] (vnni2 TPPs)
  C  dwt [G][Cb*bc][R*S][Kb*bk] f32, one (bc x bk) block per (input block, tap, output block)

so each BRGEMM (m = bc, n = bk, k = Q, batch-reduced over the output rows, summed over the
batch) runs vdpbf16ps on hosts with avx512_bf16 (two pixels per instruction, f32
accumulation). The result is rounded to bf16 and transposed into (K, C/groups, R, S).
Layers with few (block, block, tap) work items (3x3 64: 9) split each input block's
channels in two (m = bc/2), so that two threads get equal shares (3x3 64 @56: -7%).

Small images with short or odd rows (flat_serves: ResNet's 7x7 and 14x14 stages) gather each
tap's pixels instead (`_cols_nest`), so that the depth is a whole image and the count the
batch, and the BRGEMM rounds its sums to bf16 itself (see FLAT_PIXELS; 2 Sapphire Rapids
cores, batch 4, the whole weight gradient: 3x3 512 @7 4.9 -> 1.9 ms, torch 4.5; 1x1 1024->256
@14 0.67 -> 0.61; 3x3 256 @14 and 1x1 512->2048 @7 level).

Measured (2 Zen 4 cores, batch 4, the pass with its conversions, vs the generic nest):
3x3 64 @56 4.9 -> 2.6-2.8 ms, 128 @28 4.3 -> 2.4, 256 @14 4.4 -> 2.4, 512 @7 5.2 -> 3.6,
3x3/2 128 @56 4.6 -> 2.7 (the weight-gradient BRGEMMs at 300-390 GFLOP/s).
"""
from __future__ import annotations

import functools
import math

import tpp
from tpp.core import dtypes as _dt
from tpp.runtime.lru import also_clear

from . import _host
from .conv_layout import BLOCK, _block_cases, _threads


# The weight gradient's BRGEMM reads its A (dy) and B (x) rows once per register tile of its
# (bk x bc) block (11 row tiles at 64 x 64), so a call's operands should stay in cache across
# them: a call takes as many output rows as keep its operands within DW_CALL_BYTES (3x3 64 @56
# f32: 4 rows, 116 KiB, where all 56 rows, 1.6 MB, streamed from L3 11 times). With fewer
# than DW_MIN_ITEMS parallel blocks (3x3 64: 9 taps for the threads), each block's rows are
# split in two halves (18 items, 32-row tiles). 3x3 64 @56, batch 4, 2 Zen 5 cores, the
# whole weight gradient, interleaved: 2.74 -> 2.33 ms; 128 @28 2.31 -> 2.25; 256 @14 2.10 ->
# 2.01; 512 @7 level.
DW_CALL_BYTES = 128 * 1024
DW_MIN_ITEMS = 32


@functools.lru_cache(maxsize=256)
def brgemm_nest(groups, cb, kb, bc, bk, hp, wp, r, s, sh, sw, dh, dw, p, q, dtype):
    """dwt (groups, kb*bk, r*s, cb*bc) f32 = sum over n, p, q of dy^T x (every block written:
    the first call of the first image with beta 0, so dwt needs no zeroing; N >= 1)."""
    n = tpp.size("N")
    row_bytes = (q * bk + wp * bc) * dtype.itemsize     # one output row's A and B
    rows = max(1, min(p, DW_CALL_BYTES // row_bytes))
    full, tail = divmod(p, rows)
    halves = 2 if groups * kb * cb * r * s < DW_MIN_ITEMS and bk % 32 == 0 else 1
    bm = bk // halves
    nest = tpp.LoopNest("ABCDEHfg", a=groups, b=kb, c=cb, d=r, e=s, f=n,
                        g=full + (tail > 0), h=halves)
    g, k, b, c, d, e, part, half = nest.vars
    xb = nest.tensor("xb", (n, groups * cb, hp, wp, bc), dtype)
    dyb = nest.tensor("dyb", (n, groups * kb, p, q, bk), dtype)
    dwt = nest.tensor("dwt", (groups, kb * bk, r * s, cb * bc), _dt.F32)
    cases = ([(rows, (part < full,) if tail else ())] if full else []) + \
        ([(tail, (part == full,))] if tail else [])
    for count, when in cases:
        for beta, first in ((0, (e == 0, part == 0)), (1, (e > 0,)), (1, (e == 0, part > 0))):
            spec = tpp.make_brgemm(bm, bc, q, lda=bk, ldb=sw * bc, ldc=r * s * cb * bc,
                                   dtype_a=dtype, dtype_b=dtype, dtype_c=_dt.F32, beta=beta,
                                   trans_a=True)
            nest.call(spec, dyb[e, g * kb + k, part * rows, 0, half * bm],
                      xb[e, g * cb + b, c * dh + part * rows * sh, d * dw],
                      dwt[g, k * bk + half * bm, c * s + d, b * bc],
                      count=count, stride_a=q * bk, stride_b=sh * wp * bc, when=when + first)
    return nest.compile()


also_clear(brgemm_nest.cache_clear)


@functools.lru_cache(maxsize=256)
def bias_nest(kbt, bk, pq, dtype):
    """db (kbt*bk,) f32 = sum over n and pixels of dyb (N, kbt, pq, bk)."""
    n = tpp.size("N")
    nest = tpp.LoopNest("A", a=kbt)
    a, = nest.vars
    ones = nest.tensor("ones", (pq,), dtype)
    dyb = nest.tensor("dyb", (n, kbt, pq, bk), dtype)
    db = nest.tensor("db", (kbt * bk,), _dt.F32)
    spec = tpp.make_brgemm(1, bk, pq, lda=pq, ldb=bk, ldc=bk, dtype_a=dtype, dtype_b=dtype,
                           dtype_c=_dt.F32)
    nest.call(spec, ones[0], dyb[0, a], db[a * bk], count=n, stride_a=0,
              stride_b=kbt * pq * bk)
    return nest.compile()


also_clear(bias_nest.cache_clear)


@functools.lru_cache(maxsize=256)
def _xt_nest(gcb, bc, hp, wp, sw, wq, dtype):
    """xb (N, gcb, hp, wp, bc) -> xt (N, gcb, hp, sw, bc, wq): xt[.., h, ph, c, j] =
    xb[.., h, ph + sw*j, c] (entries past a phase's pixels left unwritten)."""
    n = tpp.size("N")
    nest = tpp.LoopNest("ABC", a=n, b=gcb, c=hp)
    a, b, c = nest.vars
    xb = nest.tensor("xb", (n, gcb, hp, wp, bc), dtype)
    xt = nest.tensor("xt", (n, gcb, hp, sw, bc, wq), dtype)
    for ph in range(min(sw, wp)):
        rows = -(-(wp - ph) // sw)
        spec = tpp.make_unary("transpose", rows, bc, ldi=sw * bc, ldo=wq, dtype_in=dtype)
        nest.call(spec, xb[a, b, c, ph, 0], xt[a, b, c, ph, 0, 0])
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _dyv_nest(gkb, p, q, bk, dtype):
    """dyb (N, gkb, p, q, bk) -> dyv (N, gkb, p, ceil(q/2), 2*bk), VNNI pairs of pixels."""
    n = tpp.size("N")
    q2 = -(-q // 2)
    nest = tpp.LoopNest("ABC", a=n, b=gkb, c=p)
    a, b, c = nest.vars
    dyb = nest.tensor("dyb", (n, gkb, p, q, bk), dtype)
    dyv = nest.tensor("dyv", (n, gkb, p, q2, 2 * bk), dtype)
    nest.call(tpp.make_unary("vnni2", q, bk, dtype_in=dtype), dyb[a, b, c, 0, 0],
              dyv[a, b, c, 0, 0])
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _dw_nest(groups, cb, kb, bc, bk, hp, wq, r, s, sh, sw, dh, dw, p, q, ms, dtype):
    """dwt (groups, cb*bc, r*s, kb*bk) f32 = sum over n, p, q of xt^T dyv;
    each input block's bc channels in ms parts (more work items for the threads)."""
    n = tpp.size("N")
    q2, mb = -(-q // 2), bc // ms
    nest = tpp.LoopNest("ABCDEFg", a=groups, b=cb, c=ms, d=kb, e=r, f=s, g=n)
    g, b, m, k, i, j, e = nest.vars
    xt = nest.tensor("xt", (n, groups * cb, hp, sw, bc, wq), dtype)
    dyv = nest.tensor("dyv", (n, groups * kb, p, q2, 2 * bk), dtype)
    dwt = nest.tensor("dwt", (groups, cb * bc, r * s, kb * bk), _dt.F32)
    for beta in (0, 1):                # the first image writes dwt, the others add
        spec = tpp.make_brgemm(mb, bk, q, lda=wq, ldb=2 * bk, ldc=r * s * kb * bk,
                               dtype_a=dtype, dtype_b=dtype, dtype_c=_dt.F32, beta=beta,
                               vnni_b=True)
        for t in range(s):             # tap column t: its pixels' phase and first pixel
            j0, ph = divmod(t * dw, sw)
            nest.call(spec, xt[e, g * cb + b, i * dh, ph, m * mb, j0],
                      dyv[e, g * kb + k, 0, 0, 0], dwt[g, b * bc + m * mb, i * s + j, k * bk],
                      when=(j == t, (e > 0) if beta else (e == 0)), count=p,
                      stride_a=sh * sw * bc * wq, stride_b=q2 * 2 * bk)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _round_nest(groups, cgp, rs, kgp, dtype):
    """tmp (groups, cgp, rs, kgp) dtype = dwt (groups, cgp, rs, kgp) f32, rounded."""
    nest = tpp.LoopNest("AB", a=groups, b=cgp)
    a, b = nest.vars
    dwt = nest.tensor("dwt", (groups, cgp, rs, kgp), _dt.F32)
    tmp = nest.tensor("tmp", (groups, cgp, rs, kgp), dtype)
    nest.call(tpp.make_unary("identity", rs, kgp, dtype_in=_dt.F32, dtype_out=dtype),
              dwt[a, b], tmp[a, b])
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _out_nest(groups, kg, cg, kgp, cgp, rs, dtype):
    """dw (groups*kg, cg, rs) from tmp (groups, cgp, rs, kgp): per block of up to 64 output
    channels one (cg*rs, channels) -> (channels, cg*rs) transpose (whole rows out)."""
    nb = -(-kg // BLOCK)
    nest = tpp.LoopNest("AB", a=groups, b=nb)
    a, b = nest.vars
    tmp = nest.tensor("tmp", (groups, cgp, rs, kgp), dtype)
    dw = nest.tensor("dw", (groups * kg, cg, rs), dtype)
    for cols, when in _block_cases(b, nb, kg, BLOCK):
        spec = tpp.make_unary("transpose", cg * rs, cols, ldi=kgp, ldo=cg * rs, dtype_in=dtype)
        nest.call(spec, tmp[a, 0, 0, b * BLOCK], dw[a * kg + b * BLOCK], when=when)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def dw_out_nest(groups, kg, cg, kgp, cgp, rs, dtype):
    """dw (groups*kg, cg, rs) from dwt (groups, kgp, rs, cgp) f32 (rounded for bf16): the
    output of ops.conv's blocked weight-gradient nest (brgemm_nest)."""
    nest = tpp.LoopNest("AB", a=groups, b=kg)
    a, b = nest.vars
    dwt = nest.tensor("dwt", (groups, kgp, rs, cgp), _dt.F32)
    dw = nest.tensor("dw", (groups * kg, cg, rs), dtype)
    src = dwt
    if dtype != _dt.F32:
        src = nest.tensor("tmp", (groups, kgp, rs, cgp), dtype)
        nest.call(tpp.make_unary("identity", rs, cgp, dtype_in=_dt.F32, dtype_out=dtype),
                  dwt[a, b], src[a, b])
    spec = tpp.make_unary("transpose", rs, cg, ldi=cgp, ldo=rs, dtype_in=dtype)
    nest.call(spec, src[a, b], dw[a * kg + b])
    return nest.compile()


for _cache in (_xt_nest, _dyv_nest, _dw_nest, _round_nest, _out_nest, dw_out_nest):
    also_clear(_cache.cache_clear)


# Flat pixels. A row of Q output pixels is the BRGEMM's depth above; a short or odd row
# (7 pixels: ResNet's last stage) wastes most of each tile multiply (a depth of 8 where a tile
# takes 32) and an odd depth takes the kernel's tail copies on every row. Where P * Q is at
# most FLAT_PIXELS, each tap's input pixels are instead gathered once per call (an im2col of
# the tap: `_cols_nest`, (bc x P*Q) per input block, zero-padded to `flat_depth`) and dy's
# pixels are VNNI-paired across rows, so one BRGEMM per (input block, tap, output block) has
# the whole image as its depth and the batch as its count. The gather costs R*S copies of x,
# small at these sizes (3x3 512 @7, batch 4: 2.4 MB).
FLAT_PIXELS = 256
FLAT = None         # None: flat where flat_serves says; True / False forces it (tests)


def flat_serves(geo) -> bool:
    """Whether weight_grad gathers each tap's pixels (see FLAT_PIXELS): images of at most
    FLAT_PIXELS output pixels whose rows are odd or shorter than a tile's depth (32)."""
    if FLAT is not None:
        return FLAT
    return geo.p * geo.q <= FLAT_PIXELS and (geo.q % 2 == 1 or geo.q < 32)


def flat_depth(pixels: int) -> int:
    """The gathered depth: pixels rounded up to even, and to a multiple of 32 (a whole tile
    step) past 32."""
    return pixels + pixels % 2 if pixels <= 32 else -(-pixels // 32) * 32


@functools.lru_cache(maxsize=256)
def _cols_nest(gcb, bc, hp, wp, r, s, sh, sw, dh, dw, p, q, depth, dtype):
    """cols (N, gcb, r*s, bc, depth): cols[.., i*s + j, c, row*q + col] = the input pixel that
    output pixel (row, col) meets at tap (i, j), channel c; zeros past p*q."""
    n = tpp.size("N")
    nest = tpp.LoopNest("ABCDe", a=n, b=gcb, c=r, d=s, e=p)
    a, b, i, j, row = nest.vars
    xb = nest.tensor("xb", (n, gcb, hp, wp, bc), dtype)
    cols = nest.tensor("cols", (n, gcb, r * s, bc, depth), dtype)
    spec = tpp.make_unary("transpose", q, bc, ldi=sw * bc, ldo=depth, dtype_in=dtype)
    nest.call(spec, xb[a, b, row * sh + i * dh, j * dw, 0], cols[a, b, i * s + j, 0, row * q])
    if depth > p * q:
        pad = tpp.make_unary("zero", bc, depth - p * q, ldo=depth, dtype_in=dtype,
                             dtype_out=dtype)
        nest.call(pad, cols[a, b, i * s + j, 0, p * q], when=(row == 0,))
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _dy_flat_nest(gkb, pq, depth, bk, dtype):
    """dyb (N, gkb, pq, bk) -> dyf (N, gkb, depth/2, 2*bk): VNNI pairs of consecutive pixels
    across rows, zero pairs past pq."""
    n = tpp.size("N")
    nest = tpp.LoopNest("AB", a=n, b=gkb)
    a, b = nest.vars
    dyb = nest.tensor("dyb", (n, gkb, pq, bk), dtype)
    dyf = nest.tensor("dyf", (n, gkb, depth // 2, 2 * bk), dtype)
    nest.call(tpp.make_unary("vnni2", pq, bk, dtype_in=dtype), dyb[a, b, 0, 0],
              dyf[a, b, 0, 0])
    pairs = -(-pq // 2)
    if depth // 2 > pairs:
        pad = tpp.make_unary("zero", depth // 2 - pairs, 2 * bk, dtype_in=dtype,
                             dtype_out=dtype)
        nest.call(pad, dyf[a, b, pairs, 0])
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _dw_flat_nest(groups, cb, kb, bc, bk, rs, depth, ms, dtype):
    """tmp (groups, cb*bc, rs, kb*bk) = sum over the batch of cols^T dyf (N >= 1), summed in
    f32 and rounded once (one BRGEMM per block: its count is the batch); each input block's
    bc channels in ms parts."""
    n = tpp.size("N")
    mb = bc // ms
    nest = tpp.LoopNest("ABCDE", a=groups, b=cb, c=ms, d=kb, e=rs)
    g, b, m, k, t = nest.vars
    cols = nest.tensor("cols", (n, groups * cb, rs, bc, depth), dtype)
    dyf = nest.tensor("dyf", (n, groups * kb, depth // 2, 2 * bk), dtype)
    dwt = nest.tensor("tmp", (groups, cb * bc, rs, kb * bk), dtype)
    spec = tpp.make_brgemm(mb, bk, depth, lda=depth, ldb=2 * bk, ldc=rs * kb * bk,
                           dtype_a=dtype, dtype_b=dtype, dtype_c=dtype, vnni_b=True)
    nest.call(spec, cols[0, g * cb + b, t, m * mb, 0], dyf[0, g * kb + k, 0, 0],
              dwt[g, b * bc + m * mb, t, k * bk], count=n,
              stride_a=groups * cb * rs * bc * depth, stride_b=groups * kb * depth * bk)
    return nest.compile()


for _cache in (_cols_nest, _dy_flat_nest, _dw_flat_nest):
    also_clear(_cache.cache_clear)


def _flat_sums(xb, dyb, tmp, geo, n, cb, kb, ms, like):
    """tmp (weight_grad's rounded dwt) from the gathered taps (flat_serves; n >= 1)."""
    bc, bk, dt = geo.bc, geo.bk, geo.dtype
    gcb, gkb, rs, pq = geo.groups * cb, geo.groups * kb, geo.r * geo.s, geo.p * geo.q
    depth = flat_depth(pq)
    cols = _host.temp("conv_dw_cols", (n, gcb, rs, bc, depth), dt, like)
    _cols_nest(gcb, bc, geo.hp, geo.wp, geo.r, geo.s, *geo.stride, *geo.dilation, geo.p,
               geo.q, depth, dt)(xb, cols, threads=_threads(64 * math.prod(cols.shape)))
    dyf = _host.temp("conv_dw_dy", (n, gkb, depth // 2, 2 * bk), dt, like)
    _dy_flat_nest(gkb, pq, depth, bk, dt)(
        _host.reshape(dyb, (n, gkb, pq, bk)), dyf, threads=_threads(64 * math.prod(dyf.shape)))
    _dw_flat_nest(geo.groups, cb, kb, bc, bk, rs, depth, ms, dt)(
        cols, dyf, tmp, threads=_threads(geo.flops(n)))


def serves(geo, host) -> bool:
    """Whether weight_grad runs this layer: bf16 host data (the dot instruction's case)."""
    return host and geo.dtype == _dt.BF16


def weight_grad(xb, dyb, geo, n, like):
    """dw (K, C/groups, R, S) bf16 from the blocked x (N, G*Cb, Hp, Wp, bc) and dy
    (N, G*Kb, P, Q, bk)."""
    bc, bk, dt = geo.bc, geo.bk, geo.dtype
    cb, kb = -(-geo.cg // bc), -(-geo.kg // bk)
    sh, sw = geo.stride
    wq = -(-geo.wp // sw)
    rs = geo.r * geo.s
    shape = (geo.groups, cb * bc, rs, kb * bk)
    tmp = _host.temp("conv_dw_rounded", shape, dt, like)      # dw's blocks, rounded
    threads = _threads(64 * math.prod(shape))
    # few (input block, output block, tap) items (3x3 64: 9 for the threads): halves
    ms = 2 if geo.groups * cb * kb * rs < 32 and bc % 32 == 0 else 1
    if n and flat_serves(geo):
        _flat_sums(xb, dyb, tmp, geo, n, cb, kb, ms, like)
    else:
        dwt = _host.temp("conv_dwt", shape, _dt.F32, like, zero=not n)
        if n:
            gcb, gkb = geo.groups * cb, geo.groups * kb
            xt = _host.temp("conv_dw_cols", (n, gcb, geo.hp, sw, bc, wq), dt, like)
            _xt_nest(gcb, bc, geo.hp, geo.wp, sw, wq, dt)(
                xb, xt, threads=_threads(64 * math.prod(xt.shape)))
            dyv = _host.temp("conv_dw_dy", (n, gkb, geo.p, -(-geo.q // 2), 2 * bk), dt,
                             like)
            _dyv_nest(gkb, geo.p, geo.q, bk, dt)(
                dyb, dyv, threads=_threads(64 * math.prod(dyv.shape)))
            _dw_nest(geo.groups, cb, kb, bc, bk, geo.hp, wq, geo.r, geo.s, sh, sw,
                     geo.dilation[0], geo.dilation[1], geo.p, geo.q, ms, dt)(
                xt, dyv, dwt, threads=_threads(geo.flops(n)))
        _round_nest(geo.groups, cb * bc, rs, kb * bk, dt)(dwt, tmp, threads=threads)
    dw = _host.empty((geo.k, geo.cg, geo.r, geo.s), dt, like)
    _out_nest(geo.groups, geo.kg, geo.cg, kb * bk, cb * bc, rs, dt)(
        tmp, _host.reshape(dw, (geo.k, geo.cg, rs)), threads=threads)
    return dw
