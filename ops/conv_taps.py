"""Convolution nests for layers with few input channels (the stem: 3): a kernel row's taps
folded into the BRGEMM's reduction. ops.conv's forward and weight gradient for layers with
one input-channel block of at most MAX_BC channels per group, S > 1 and no column dilation,
on host data.

The general nests run one BRGEMM of depth bc per tap (R*S of them, each loading and storing
the output tile; the weight gradient's tiles are (bk x bc): 3 columns for the stem). Here the
blocked activation [N][G][Hp][Wp][bc] is first expanded along its columns (a copy nest of
identity TPPs, S/sw times x's size):
    xs [N][G][Hp][Q][S*bc],  xs[n, g, row, q, s*bc + c] = xb[n, g, row, q*sw + s, c]
so a kernel row r's inputs of output pixel q are one contiguous run of S*bc values, and
    forward      y (pixels x bk) = sum_r xs_r (pixels x S*bc) @ W_r (S*bc x bk): one BRGEMM per
                 pixel block, batch-reduced over the R kernel rows (W_r = wb[kb, 0, r] is
                 contiguous in the packed layout [G*Kb][1][R][S][bc][bk]; bf16: its VNNI pairs
                 [S*bc/2][2*bk] too), bias and activation in its epilogue;
    weight grad  dW_r^T (S*bc x K) += xs_{p,r}^T (S*bc x Q, trans_a) @ dy_p (Q x K, blocked),
                 batch-reduced over the output rows p, summed over the images: per (group,
                 DW_COLS output channels, r) one f32 tile of dwT (groups, R*S*bc, Kgp), then
                 transposed into the general nest's dwt layout (groups, Kgp, R*S, bc) that
                 ops.conv transposes to (K, C/groups, R, S). (The stem, 2 cores: 4.5 ms
                 against 6.9 ms for dW_r (K x S*bc) = dy_p (NCHW) @ xs_{p,r}, whose 21
                 columns fill 2 vectors to 66%, and ~30 ms for the general nest.)
    bf16 weight grad  that other form, dW_r (K x S*bc) += dy_p (NCHW rows) @ xsv_{p,r}, on
                 vdpbf16ps (dw_dot_nest): dy's pixel pairs are adjacent in its rows, and
                 the expansion also writes xs in VNNI pairs of pixels (xsv); 28 columns
                 (bc = 4) fill 2 vectors to 88%, and the tiles land in dwt's layout. The
                 bf16 stem, batch 4, 2 cores: 6.3 ms (the f32-style nest, widening bf16 to
                 f32 FMAs) -> 3.6 ms, and no blocked copy of dy.
"""
from __future__ import annotations

import functools
import math

import tpp
from tpp.core import dtypes as _dt
from tpp.runtime.lru import also_clear

from . import _host
from .conv_layout import PIXELS, _block_cases, _size, _threads, nchw_output, write_nchw

DW_COLS = 32       # output channels per weight-gradient tile (2 tiles of a 64-channel block:
                   # twice the parallel units of R kernel rows; measured as fast as 64)
MAX_BC = 4         # the widest input-channel block served: the stem (3, bf16 4) and depthwise
                   # layers (1, bf16 2) gain (3x3 depthwise 128 @56: forward 4.9 -> 3.7 ms,
                   # dw 8.6 -> 4.4); 16 groups of 8 channels lost ~25% (the expansion, S/sw
                   # copies of x, outweighs the 8-channel GEMMs' gain), 16 channels broke even


def eligible(cb, bc, s, dw) -> bool:
    """Whether the folded nests serve a layer (cb input-channel blocks of bc per group, S
    kernel columns, column dilation dw)."""
    return cb == 1 and bc <= MAX_BC and s > 1 and dw == 1


def serves(geo) -> bool:
    """eligible() for a layer's Geometry."""
    return eligible(-(-geo.cg // geo.bc), geo.bc, geo.s, geo.dilation[1])


def dot_dy(geo) -> bool:
    """Whether weight_grad reads dy as it is (NCHW), not blocked: bf16 (dw_dot_nest, see the
    module docstring)."""
    return geo.dtype == _dt.BF16


@functools.lru_cache(maxsize=256)
def expand_nest(groups, bc, hp, wp, s, sw, q, dtype, vnni=False, cols=None):
    """xs (N, groups, hp, q, s*bc) from xb (N, groups, hp, wp, bc) (see the docstring); vnni:
    also xsv (N, groups, hp, ceil(q/2), 2*s*bc), each row of xs in VNNI pairs of pixels
    (packed right after it is written; an odd q's last pair padded with zero). cols: the
    unpadded form's rows instead (bf16 only), xs (N, groups, hp, q, depth) with
    xs[.., qq, j*cols + c] = xb[.., qq*sw + j, c] for the cols real channels of a block, a
    zero last column where depth = s*cols + 1 (unpadded_depth)."""
    n = tpp.size("N")
    width = bc if cols is None else cols
    depth = row_depth(s, bc, cols)
    nest = tpp.LoopNest("ABC", a=n, b=groups, c=hp)
    a, g, c = nest.vars
    xb = nest.tensor("xb", (n, groups, hp, wp, bc), dtype)
    xs = nest.tensor("xs", (n, groups, hp, q, depth), dtype)
    spec = tpp.make_unary("identity", q, width, ldi=sw * bc, ldo=depth, dtype_in=dtype)
    for j in range(s):
        nest.call(spec, xb[a, g, c, j], xs[a, g, c, 0, j * width])
    if depth > s * width:
        nest.call(tpp.make_unary("zero", q, 1, ldo=depth, dtype_in=dtype),
                  xs[a, g, c, 0, s * width])
    if vnni:
        xsv = nest.tensor("xsv", (n, groups, hp, (q + 1) // 2, 2 * s * bc), dtype)
        nest.call(tpp.make_unary("vnni2", q, s * bc, dtype_in=dtype), xs[a, g, c], xsv[a, g, c])
    return nest.compile()


def expand(xb, bc, hp, wp, s, sw, q, dtype, vnni=False, cols=None):
    """xs for the blocked activation data xb (host); vnni: xsv (see expand_nest) instead;
    cols: the unpadded form's xs."""
    n, groups = xb.shape[0], xb.shape[1]
    depth = row_depth(s, bc, cols)
    shape = (n, groups, hp, q, depth)
    xs = (_host.scratch("conv_taps_xs", shape, dtype) if vnni else
          _host.empty(shape, dtype, xb))
    args = [xb, xs]
    if vnni:
        args.append(_host.empty((n, groups, hp, (q + 1) // 2, 2 * s * bc), dtype, xb))
    if n:
        expand_nest(groups, bc, hp, wp, s, sw, q, dtype, vnni, cols)(*args, threads=_threads(
            64 * _size(xs)))
    return args[-1]


def staged_tiles(dtype, has_bias) -> bool:
    """Whether conv_nest sums a tile in an f32 accumulator (acc) and rounds it apart: bf16
    with a bias (its f32 row joins the BRGEMM's f32 C); a bias-free tile, one BRGEMM over all
    kernel rows, is rounded straight from it."""
    return dtype == _dt.BF16 and has_bias


@functools.lru_cache(maxsize=256)
def conv_nest(groups, kb, bc, bk, hp, r, s, sh, dh, p, q, dtype, has_bias, activation,
              frame=(0, 0, 0, 0), kg=None, depth=None):
    """yb (N, groups*kb, p, q, bk) (inside a frame, like ops.conv._conv_nest) from xs (N,
    groups, hp, q, depth) and the kernel rows' weights wr (groups*kb, r, depth*bk) (bf16 in
    VNNI pairs): depth s*bc with xs from expand and wr the packed weight wb (groups*kb, 1, r,
    s, bc, bk) as it is, or the unpadded form's (operands). With kg, the tiles also go to the
    NCHW y (N, groups*kg, p*q) (conv_layout.write_nchw); acc where staged_tiles."""
    n = tpp.size("N")
    vnni = dtype == _dt.BF16
    depth = s * bc if depth is None else depth
    bq = min(q, PIXELS)
    full, tail = divmod(q, bq)
    nest = tpp.LoopNest("ABCDe", a=n, b=groups, c=kb, d=p, e=full + (tail > 0))
    a, g, k, c, d = nest.vars
    b = g * kb + k
    xs = nest.tensor("xs", (n, groups, hp, q, depth), dtype)
    wr = nest.tensor("wr", (groups * kb, r, depth * bk), dtype)
    bias_t = nest.tensor("bias", (groups * kb * bk,), _dt.F32) if has_bias else None
    ft, fb, fl, fr = frame
    yb = nest.tensor("yb", (n, groups * kb, p + ft + fb, q + fl + fr, bk), dtype)
    staged = staged_tiles(dtype, has_bias)
    acc = nest.tensor("acc", (n, groups * kb, p, q, bk), _dt.F32) if staged else yb
    y = None if kg is None else nchw_output(nest, kg, groups, p, q, dtype)
    ah, aw = (0, 0) if staged else (ft, fl)
    cases = ([(bq, (d < full,) if tail else ())] if full else []) + \
        ([(tail, (d == full,))] if tail else [])
    for pixels, when in cases:
        spec = tpp.make_brgemm(
            pixels, bk, depth, lda=depth, ldb=2 * bk if vnni else bk, ldc=bk,
            dtype_a=dtype, dtype_b=dtype, dtype_c=_dt.F32 if staged else dtype, vnni_b=vnni,
            bias="row" if has_bias else None, activation=activation)
        nest.call(spec, xs[a, g, c * sh, d * bq], wr[b, 0, 0],
                  acc[a, b, ah + c, aw + d * bq], bias=bias_t[b * bk] if has_bias else None,
                  count=r, stride_a=dh * q * depth, stride_b=depth * bk, when=when)
        if staged:
            spec = tpp.make_unary("identity", pixels, bk, dtype_in=_dt.F32, dtype_out=dtype)
            nest.call(spec, acc[a, b, c, d * bq], yb[a, b, ft + c, fl + d * bq], when=when)
        if y is not None:
            write_nchw(nest, y, yb[a, b, ft + c, fl + d * bq], y[a, g * kg + k * bk,
                       c * q + d * bq], pixels, k, kb, kg, bk, when)
    return nest.compile()


# ------------------------------------------------------------------ bf16 without padding
# A bf16 block holds an even number of channels (VNNI pairs), so the stem's 3 become 4 and a
# depthwise layer's 1 becomes 2: a quarter (a half) of the forward's dot products multiply
# zeros. The unpadded form pairs the kernel row's (tap, channel) values instead: xs rows of
# depth = s*cg rounded up to even (the stem: 22 against 28), the weights repacked to match
# (per call: a few KB). Forward, batch 4, 2 Zen 4 cores, paired: the bf16 stem 4.0 -> 3.5 ms,
# 3x3 depthwise 128 @56 6.7 -> 5.5 ms.
def unpadded_depth(geo):
    """The unpadded form's depth for a bf16 layer whose channels were padded to bc, else
    None (the padded form is used)."""
    if geo.dtype != _dt.BF16 or geo.cg == geo.bc:
        return None
    return row_depth(geo.s, geo.bc, geo.cg)


def row_depth(s, bc, cols=None):
    """The length of an expanded row (expand's xs): the s taps' blocks of bc, or with cols,
    the unpadded form's s*cols rounded up to even (whole VNNI pairs)."""
    return s * bc if cols is None else s * cols + (s * cols) % 2


@functools.lru_cache(maxsize=256)
def _unpadded_w_nest(gk, cg, bc, bk, r, s, depth):
    """wr (gk, r, depth/2, 2*bk) from the packed weight wb (gk, 1, r, s, bc/2, 2*bk): per
    kernel row, the taps' bc x bk blocks unpacked (vnni2_inv, into flat), their cg real rows
    stacked into rows (depth x bk, a zero row where depth is odd past s*cg) and packed again
    (vnni2)."""
    nest = tpp.LoopNest("AB", a=gk, b=r)
    b, i = nest.vars
    bf16 = _dt.BF16
    wb = nest.tensor("wb", (gk, 1, r, s, bc // 2, 2 * bk), bf16)
    wr = nest.tensor("wr", (gk, r, depth // 2, 2 * bk), bf16)
    flat = nest.tensor("flat", (gk, r, s, bc, bk), bf16)
    rows = nest.tensor("rows", (gk, r, depth, bk), bf16)
    for j in range(s):
        nest.call(tpp.make_unary("vnni2_inv", bc, bk, dtype_in=bf16), wb[b, 0, i, j],
                  flat[b, i, j])
        nest.call(tpp.make_unary("identity", cg, bk, dtype_in=bf16), flat[b, i, j],
                  rows[b, i, j * cg])
    if depth > s * cg:
        nest.call(tpp.make_unary("zero", 1, bk, dtype_in=bf16), rows[b, i, s * cg])
    nest.call(tpp.make_unary("vnni2", depth, bk, dtype_in=bf16), rows[b, i], wr[b, i])
    return nest.compile()


def operands(xb, wb, geo, q):
    """(xs, wr, depth) of conv_nest for the blocked x data xb (host) and the packed weight
    data wb: the padded form (expand, wb as it is) or, for bf16 layers with padded channels,
    the unpadded one."""
    depth = unpadded_depth(geo)
    bc, hp, wp, r, s = geo.bc, geo.hp, geo.wp, geo.r, geo.s
    if depth is None:
        xs = expand(xb, bc, hp, wp, s, geo.stride[1], q, geo.dtype)
        return xs, _host.reshape(wb, (wb.shape[0], r, math.prod(wb.shape[3:]))), None
    gk, bk = wb.shape[0], geo.bk
    xs = expand(xb, bc, hp, wp, s, geo.stride[1], q, geo.dtype, cols=geo.cg)
    wr = _host.empty((gk, r, depth // 2, 2 * bk), geo.dtype, wb)
    _unpadded_w_nest(gk, geo.cg, bc, bk, r, s, depth)(
        wb, wr, _host.scratch("conv_taps_flat", (gk, r, s, bc, bk), geo.dtype),
        _host.scratch("conv_taps_rows", (gk, r, depth, bk), geo.dtype), threads=1)
    return xs, _host.reshape(wr, (gk, r, depth * bk)), depth


@functools.lru_cache(maxsize=256)
def dw_nest(groups, kb, bk, bc, hp, r, s, sh, dh, p, q, dtype):
    """dwT (groups, r*s*bc, kb*bk) f32 = sum over n, p of xs_{p,r}^T (s*bc x q) dy_p (q x bk),
    for xs (N, groups, hp, q, s*bc) and dyb (N, groups*kb, p, q, bk); column tiles of
    DW_COLS output channels."""
    n = tpp.size("N")
    split = bk // DW_COLS if bk % DW_COLS == 0 else 1
    cols = bk // split
    nest = tpp.LoopNest("ABCDe", a=groups, b=kb, c=split, d=r, e=n)
    g, b, c, i, a = nest.vars
    xs = nest.tensor("xs", (n, groups, hp, q, s * bc), dtype)
    dyb = nest.tensor("dyb", (n, groups * kb, p, q, bk), dtype)
    dwt = nest.tensor("dwT", (groups, r * s * bc, kb * bk), _dt.F32)
    for beta, first in ((0, (a == 0,)), (1, (a > 0,))):
        spec = tpp.make_brgemm(s * bc, cols, q, lda=s * bc, ldb=bk, ldc=kb * bk,
                               dtype_a=dtype, dtype_b=dtype, dtype_c=_dt.F32, beta=beta,
                               trans_a=True)
        nest.call(spec, xs[a, g, i * dh, 0, 0], dyb[a, g * kb + b, 0, 0, c * cols],
                  dwt[g, i * s * bc, b * bk + c * cols], count=p, stride_a=sh * q * s * bc,
                  stride_b=q * bk, when=first)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def dw_dot_nest(groups, kg, kgp, bc, hp, r, s, sh, dh, p, q):
    """The bf16 weight gradient on vdpbf16ps: dwt (groups, kgp, r*s*bc) f32 = sum over n and
    output rows p of dy_p (channels x q: NCHW rows, their pixel pairs adjacent) @ xsv_{p,r}
    (q x s*bc in VNNI pairs of pixels, expand_nest's xsv). Rows in tiles of DW_COLS output
    channels (kg of them per group; dwt's padded rows are left alone)."""
    n = tpp.size("N")
    tiles = -(-kg // DW_COLS)
    nest = tpp.LoopNest("ABCd", a=groups, b=tiles, c=r, d=n)
    g, t, i, a = nest.vars
    dy = nest.tensor("dy", (n, groups * kg, p * q), _dt.BF16)
    xsv = nest.tensor("xsv", (n, groups, hp, (q + 1) // 2, 2 * s * bc), _dt.BF16)
    dwt = nest.tensor("dwt", (groups, kgp, r * s * bc), _dt.F32)
    for rows, when in _block_cases(t, tiles, kg, DW_COLS):
        for beta, first in ((0, (a == 0,)), (1, (a > 0,))):
            spec = tpp.make_brgemm(rows, s * bc, q, lda=p * q, ldb=2 * s * bc, ldc=r * s * bc,
                                   dtype_a=_dt.BF16, dtype_b=_dt.BF16, dtype_c=_dt.F32,
                                   beta=beta, vnni_b=True)
            nest.call(spec, dy[a, g * kg + t * DW_COLS, 0], xsv[a, g, i * dh, 0, 0],
                      dwt[g, t * DW_COLS, i * s * bc], count=p, stride_a=q,
                      stride_b=sh * ((q + 1) // 2) * 2 * s * bc, when=when + first)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _untranspose_nest(groups, rows, cols):
    """dwt (groups, cols, rows) f32 = each group's dwT (rows x cols) transposed."""
    nest = tpp.LoopNest("A", a=groups)
    g, = nest.vars
    src = nest.tensor("dwT", (groups, rows, cols), _dt.F32)
    dst = nest.tensor("dwt", (groups, cols, rows), _dt.F32)
    nest.call(tpp.make_unary("transpose", rows, cols), src[g], dst[g])
    return nest.compile()


def weight_grad(xb, dyb, geo, like, dy=None):
    """dwt (groups, Kgp, R*S, bc) f32 (ops.conv's layout for its final transpose) from the
    blocked x (framed by the padding) and the blocked dy (N, G*Kb, P, Q, bk), host data;
    bf16 (dot_dy): from dy (N, K, P, Q) as it is instead (dyb unused), its rows of padded
    output channels left unwritten."""
    n, bc, bk = xb.shape[0], geo.bc, geo.bk
    kb, rs = -(-geo.kg // bk), geo.r * geo.s
    if dot_dy(geo):
        xsv = expand(xb, bc, geo.hp, geo.wp, geo.s, geo.stride[1], geo.q, geo.dtype, True)
        dwt = _host.empty((geo.groups, kb * bk, rs, bc), _dt.F32, like)
        dw_dot_nest(geo.groups, geo.kg, kb * bk, bc, geo.hp, geo.r, geo.s, geo.stride[0],
                    geo.dilation[0], geo.p, geo.q)(
            _host.reshape(_host.contiguous(dy), (n, geo.k, geo.p * geo.q)), xsv,
            _host.reshape(dwt, (geo.groups, kb * bk, rs * bc)), threads=_threads(geo.flops(n)))
        return dwt
    xs = expand(xb, bc, geo.hp, geo.wp, geo.s, geo.stride[1], geo.q, geo.dtype)
    dwT = _host.empty((geo.groups, rs * bc, kb * bk), _dt.F32, like)
    dw_nest(geo.groups, kb, bk, bc, geo.hp, geo.r, geo.s, geo.stride[0], geo.dilation[0],
            geo.p, geo.q, geo.dtype)(xs, dyb, dwT, threads=_threads(geo.flops(n)))
    dwt = _host.empty((geo.groups, kb * bk, rs, bc), _dt.F32, like)
    _untranspose_nest(geo.groups, rs * bc, kb * bk)(
        dwT, _host.reshape(dwt, (geo.groups, kb * bk, rs * bc)), threads=1)
    return dwt


for _cache in (expand_nest, conv_nest, dw_nest, dw_dot_nest, _untranspose_nest,
               _unpadded_w_nest):
    also_clear(_cache.cache_clear)
