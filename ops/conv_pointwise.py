"""1x1 convolutions as GEMMs on the NCHW data itself (ops.conv's fast path: no blocked layout).

A 1x1, stride-1, unpadded, ungrouped convolution of x (N, C, H, W) by w (K, C, 1, 1) is, per
image n, a row-major GEMM over the image's HW pixels:
    forward     y_n  (K x HW) = act(w (K x C) . x_n (C x HW) + bias)
    data grad   dx_n (C x HW) = w^T (C x K) . dy_n (K x HW)          (w read transposed)
    weight grad dw   (K x C)  = sum_n dy_n (K x HW) . x_n^T (HW x C)
    bias grad   db   (K,)     = sum over n and pixels of dy
so these layers run on the NCHW arrays as they are: nothing is converted to or from ops.conv's
blocked layout (for 1x1 layers that conversion cost as much as the convolution).

Forward nest: parallel over (image, block of BK output channels, block of BQ pixels); per
block one BRGEMM (BK x BQ) over all C input channels (lda = C, ldb = ldc = HW) with the
activation in its epilogue; a bias is one value per output channel, i.e. per row of the
block: the BRGEMM's "col" bias, added in the same epilogue (a replicate_col TPP writing it into
the block for a beta-1 BRGEMM cost an extra pass over each block: 64->256 @56 f32 with bias,
batch 4, 2 SPR cores, 199 -> ~260 GFLOP/s, level with no bias).
Data gradient: the same nest over dy with the weight read transposed (trans_a: a k step
reads BC consecutive weights of one row of w), no bias.
Weight gradient: the contraction runs over the pixels, the contiguous dimension of both dy
and x, so x is first transposed (transpose TPPs, one (BC x BQ) block at a time) into a
per-thread scratch xt (N, HW, C) kept between calls; then per block of dw (BK x BC; the
blocks in parallel) BRGEMMs of dy (BK x STEP pixels, lda = HW) by xt (STEP x BC) over STEP
pixels at a time (the operands of a step stay in cache across the block's register tiles),
summed over the steps and images into an f32 dw (the first step writes, beta 0).
Bias gradient: a reduce_sum TPP over each (BK x HW) block of dy (per image and channel
block), then a column sum over the images (ops.blocked.column_sums).

Block sizes (measured on the ResNet-50 1x1 layers, 64->256 and 256->64 at 56x56, 256->1024
and 1024->256 at 14x14, 512->2048 at 7x7; AMD Zen 4, AVX-512, f32): BK = 64 output channels
and BQ = 64 pixels per forward / data-gradient block; all of C in one BRGEMM (chunking C in
the nest, 64 to 256 at a time, was within +-3%). STEP = 256 pixels per weight-gradient step
(64: -10 to -15%, 128: -0 to -5%, 512: mixed). Weight gradient vs the blocked path (2 cores):
64->256 @56 171 against 104 GFLOP/s, 256->64 @56 ~165 against ~98, 256->1024 @14 ~200
against ~170.

Strided 1x1 layers (ResNet's downsampling projections) run the same nests on x[:, :, ::sh,
::sw] (ops.conv_subsample: a transposed copy, ~10% of the GEMM's time) and scatter the data
gradient back into a zeroed dx: 256->512 @56/2 and 512->1024 @28/2 (batch 4, 2 cores),
forward + backward ~20% faster than the blocked path, the backward ~30%.

bf16 (_vnni_gemm_nest): vdpbf16ps reads B in VNNI pairs, so x (forward) or dy (data
gradient) is packed per (image, pixel block) by a vnni2 TPP into a scratch block that every
output-channel block of it then reads from cache; the weight gradient packs its transposed
operand the same way. Against the blocked path, which converts x to the blocked layout, writes
an f32 accumulator, converts it to bf16 and the output back to NCHW (batch 4, 2 Zen 4 cores,
forward): 64->256 @56 177 -> 296 GFLOP/s, 256->64 @56 157 -> 238, 256->512 @56/2 196 -> 278,
256->1024 @14 308 -> 327; training steps 1.2-1.3x torch's (oneDNN) where they were 0.66-0.77x.
Host data only (device arrays: the blocked path). Compilation:
one nest per (C, K, H*W, dtype, bias, activation); the batch N is a runtime size.
"""
from __future__ import annotations

import functools
import math

import tpp
from tpp.core import dtypes as _dt
from tpp.runtime.lru import also_clear

from . import _host, blocked
from . import conv_subsample as _subsample
from .conv_layout import Geometry, _threads

BK = 64        # output channels (forward) / input channels (data gradient) per block
BQ = 64        # pixels per block
WBK = 64       # rows (output channels) of a weight-gradient block
WBC = 64       # columns (input channels) of a weight-gradient block
STEP = 256     # pixels per weight-gradient step
MIN_LANE_USE = 0.9   # the forward's least share of used lanes in its pixel vectors (eligible)
STRIDED = True       # strided 1x1 layers too, on their selected pixels (ops.conv_subsample)
MIN_DX_PIXELS = 257  # the fewest output pixels per image whose data gradient is a GEMM here


def eligible(geo, forward=False, data_grad=False) -> bool:
    """Whether a layer's Geometry is one the GEMM path serves: a 1x1 kernel, no padding,
    groups 1, f32 or bf16 (any stride; dilation does not matter for a 1x1 kernel). The forward also
    needs output images whose pixels fill most of the 16-lane vectors of its blocks' rows
    (P*Q at least 90% of a whole number of vectors): at 7x7 (49 pixels: 4 vectors, 77% used) the
    blocked forward, pixels as rows, ran ~20% faster (512->2048, 2 cores) given a packed
    weight (ops.conv takes it there only then: packing per call costs more). The data gradient
    (data_grad=True) needs images of at least MIN_DX_PIXELS output pixels: on smaller ones
    ops.conv's blocked data gradient, packing its weight as well, measured faster (2 Zen 5
    cores, batch 4, interleaved: f32 512->2048 @7 1.30 -> 1.14 ms, 1024->256 @14 1.13 ->
    1.02, 1024->2048 @14/2 4.63 -> 2.73, bf16 2048->512 @7 1.05 -> 0.64; AVX2 code f32
    512->2048 @7 4.2 -> 2.6 ms), and on 28x28 (784) and 56x56 slower (f32 64->256 @56 1.21
    against 2.34 ms, 128->512 @28 0.96 against 1.44: the conversions of larger images)."""
    if not (geo.groups == 1 and geo.r == 1 and geo.s == 1 and geo.dtype in (_dt.F32, _dt.BF16)
            and tuple(geo.pad) == (0, 0, 0, 0) and (STRIDED or geo.stride == (1, 1))):
        return False
    hw = geo.p * geo.q
    if data_grad:
        return hw >= MIN_DX_PIXELS
    return not forward or hw >= MIN_LANE_USE * 16 * -(-hw // 16)


def _dense(geo):
    """The stride-1 layer on a strided layer's selected pixels (ops.conv_subsample)."""
    return Geometry(geo.c, geo.k, geo.p, geo.q, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1),
                    geo.dtype)


# ------------------------------------------------------------------ nests
@functools.lru_cache(maxsize=256)
def _gemm_nest(c, k, hw, dtype, has_bias, activation, transposed):
    """y (N, k, hw) = act(w . x + bias) for x (N, c, hw), w (k, c) (transposed: w (c, k),
    read transposed), bias (k,) f32. bf16: see _vnni_gemm_nest."""
    if dtype == _dt.BF16:
        return _vnni_gemm_nest(c, k, hw, has_bias, activation, transposed)
    n = tpp.size("N")
    kcases, nkb = blocked.split(k, BK)
    qcases, nqb = blocked.split(hw, BQ)
    nest = tpp.LoopNest("ABC", a=n, b=nkb, c=nqb)
    a, b, q = nest.vars
    x, w, bias, y = _operands(nest, n, c, k, hw, dtype, has_bias, transposed)
    for rows, kg in kcases:
        for cols, qg in qcases:
            _block(nest, rows, cols, c, k, hw, dtype, has_bias, activation, transposed,
                   w, bias, x[a, 0, q * BQ], hw, y, a, b, q, kg(b) + qg(q))
    return nest.compile()


def _operands(nest, n, c, k, hw, dtype, has_bias, transposed):
    """The GEMM nests' tensors: x (N, c, hw), w (k, c) (transposed: (c, k)), bias (k,) of
    the data's dtype or None, y (N, k, hw)."""
    return (nest.tensor("x", (n, c, hw), dtype),
            nest.tensor("w", (c, k) if transposed else (k, c), dtype),
            nest.tensor("bias", (k,), dtype) if has_bias else None,
            nest.tensor("y", (n, k, hw), dtype))


def _block(nest, rows, cols, c, k, hw, dtype, has_bias, activation, transposed, w, bias,
           x_block, ldb, y, a, b, q, when):
    """The call of one (rows x cols) output block y[a, b*BK, q*BQ]: the BRGEMM over all c
    reading x_block (bf16: VNNI pairs, ldb of a pair row), the bias (one value per row)
    and the activation in its epilogue."""
    spec = tpp.make_brgemm(rows, cols, c, lda=k if transposed else c, ldb=ldb, ldc=hw,
                           dtype_a=dtype, dtype_b=dtype, dtype_c=dtype, trans_a=transposed,
                           vnni_b=dtype == _dt.BF16, bias="col" if has_bias else None,
                           activation=activation)
    nest.call(spec, w[0, b * BK] if transposed else w[b * BK, 0], x_block,
              y[a, b * BK, q * BQ], bias=bias[b * BK] if has_bias else None, when=when)


@functools.lru_cache(maxsize=256)
def _vnni_gemm_nest(c, k, hw, has_bias, activation, transposed):
    """The bf16 _gemm_nest. vdpbf16ps wants B in VNNI pairs (two consecutive channels of a
    pixel side by side), so per (image, pixel block) a vnni2 TPP first packs the block's
    (c x BQ) columns of x into xv (N, pixel blocks, ceil(c/2), 2*BQ) (an odd c's last pair
    padded with zero), and every output-channel block of that pixel block then reads it while
    it is in cache: the parallel loops are (image, pixel block), the channel blocks run inside.
    The bias of a bf16 layer is bf16, added to the f32 sums in the epilogue (one rounding,
    as the blocked path does); an f32 bias given with bf16 data is rounded to bf16 first
    (torch rejects that mix)."""
    n = tpp.size("N")
    bf16 = _dt.BF16
    kcases, nkb = blocked.split(k, BK)
    qcases, nqb = blocked.split(hw, BQ)
    nest = tpp.LoopNest("ACb", a=n, b=nkb, c=nqb)
    a, b, q = nest.vars
    x, w, bias, y = _operands(nest, n, c, k, hw, bf16, has_bias, transposed)
    xv = nest.tensor("xv", (n, nqb, (c + 1) // 2, 2 * BQ), bf16)
    for cols, qg in qcases:
        pack = tpp.make_unary("vnni2", c, cols, ldi=hw, ldo=2 * BQ, dtype_in=bf16)
        nest.call(pack, x[a, 0, q * BQ], xv[a, q], when=(b == 0,) + qg(q))
        for rows, kg in kcases:
            _block(nest, rows, cols, c, k, hw, bf16, has_bias, activation, transposed, w,
                   bias, xv[a, q], 2 * BQ, y, a, b, q, kg(b) + qg(q))
    return nest.compile()


def _run_gemm(x, w, bias, y, c, k, hw, dtype, activation, transposed, threads):
    """The _gemm_nest of these arrays (bf16: with its VNNI scratch)."""
    args = [x, w] + ([convert(bias, dtype)] if bias is not None else []) + [y]
    if dtype == _dt.BF16:
        nqb = -(-hw // BQ)
        args.append(_host.scratch("conv_pointwise_vnni", (x.shape[0], nqb, (c + 1) // 2,
                                                         2 * BQ), dtype))
    _gemm_nest(c, k, hw, dtype, bias is not None, activation, transposed)(*args,
                                                                           threads=threads)


@functools.lru_cache(maxsize=256)
def _transpose_nest(c, hw, dtype):
    """xt (N, hw, c) = each image of x (N, c, hw) transposed; bf16 also xv (N, ceil(hw/2),
    2c) = xt in VNNI pairs of pixels (the weight gradient's B), each block packed right after
    it is transposed (the last pair of an odd hw padded with zero)."""
    n = tpp.size("N")
    ccases, ncb = blocked.split(c, WBC)
    qcases, nqb = blocked.split(hw, BQ)
    nest = tpp.LoopNest("ABC", a=n, b=nqb, c=ncb)
    a, q, b = nest.vars
    x = nest.tensor("x", (n, c, hw), dtype)
    xt = nest.tensor("xt", (n, hw, c), dtype)
    xv = nest.tensor("xv", (n, (hw + 1) // 2, 2 * c), dtype) if dtype == _dt.BF16 else None
    for rows, cg in ccases:
        for cols, qg in qcases:
            when = cg(b) + qg(q)
            spec = tpp.make_unary("transpose", rows, cols, ldi=hw, ldo=c, dtype_in=dtype)
            nest.call(spec, x[a, b * WBC, q * BQ], xt[a, q * BQ, b * WBC], when=when)
            if xv is not None:
                spec = tpp.make_unary("vnni2", cols, rows, ldi=c, ldo=2 * c, dtype_in=dtype)
                nest.call(spec, xt[a, q * BQ, b * WBC], xv[a, q * (BQ // 2), 2 * b * WBC],
                          when=when)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _dw_nest(c, k, hw, dtype):
    """dw (k, c) f32 = sum over n of dy_n (k, hw) . xt_n (hw, c) (bf16: xt as the VNNI xv
    of _transpose_nest, (N, ceil(hw/2), 2c))."""
    n = tpp.size("N")
    vnni = dtype == _dt.BF16
    kcases, nkb = blocked.split(k, WBK)
    ccases, ncb = blocked.split(c, WBC)
    scases, nsteps = blocked.split(hw, STEP)
    nest = tpp.LoopNest("ABcd", a=nkb, b=ncb, c=n, d=nsteps)
    i, j, a, s = nest.vars
    dy = nest.tensor("dy", (n, k, hw), dtype)
    if vnni:
        xv = nest.tensor("xv", (n, (hw + 1) // 2, 2 * c), dtype)
        right = xv[a, s * (STEP // 2), 2 * j * WBC]
    else:
        xt = nest.tensor("xt", (n, hw, c), dtype)
        right = xt[a, s * STEP, j * WBC]
    dw = nest.tensor("dw", (k, c), _dt.F32)
    for rows, kg in kcases:
        for cols, cg in ccases:
            for depth, sg in scases:
                for beta, first in ((0, (a == 0, s == 0)), (1, (a + s > 0,))):
                    spec = tpp.make_brgemm(rows, cols, depth, lda=hw, ldb=2 * c if vnni else c,
                                           ldc=c, dtype_a=dtype, dtype_b=dtype,
                                           dtype_c=_dt.F32, beta=beta, vnni_b=vnni)
                    nest.call(spec, dy[a, i * WBK, s * STEP], right, dw[i * WBK, j * WBC],
                              when=kg(i) + cg(j) + sg(s) + first)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _rowsum_nest(k, hw, dtype):
    """sums (N, k) f32 = dy (N, k, hw) summed over the pixels."""
    n = tpp.size("N")
    kcases, nkb = blocked.split(k, BK)
    nest = tpp.LoopNest("AB", a=n, b=nkb)
    a, b = nest.vars
    dy = nest.tensor("dy", (n, k, hw), dtype)
    sums = nest.tensor("sums", (n, k), _dt.F32)
    for rows, kg in kcases:
        spec = tpp.make_unary("reduce_sum", rows, hw, dtype_in=dtype, dtype_out=_dt.F32,
                              axis=1)
        nest.call(spec, dy[a, b * BK, 0], sums[a, b * BK], when=kg(b))
    return nest.compile()


for _cache in (_gemm_nest, _transpose_nest, _dw_nest, _rowsum_nest):
    also_clear(_cache.cache_clear)     # tpp.clear_caches() empties them too


# ------------------------------------------------------------------ the passes
def _flat(a):
    """(N, C, H, W) -> (N, C, H*W), a view."""
    n, c, h, w = a.shape
    return _host.reshape(a, (n, c, h * w))


def forward(x, w, bias, activation, geo):
    """act(conv2d(x, w) + bias) (N, K, H, W) for an eligible geo; x, w C-contiguous host
    data, bias (K,) or None."""
    if geo.stride != (1, 1):
        x, geo = _subsample.subsample(x, *geo.stride, geo.p, geo.q), _dense(geo)
    n, hw = x.shape[0], geo.h * geo.w
    y = _host.empty((n, geo.k, geo.h, geo.w), geo.dtype, x)
    if n == 0:
        return y
    _run_gemm(_flat(x), _host.reshape(w, (geo.k, geo.c)), bias, _flat(y), geo.c, geo.k, hw,
              geo.dtype, activation, False, _threads(geo.flops(n)))
    return y


def convert(v, dtype):
    """v (any shape; host data) as a contiguous array of dtype: v itself when it is one."""
    v = _host.contiguous(v)
    if _host.dtype_of(v, "v") == dtype:
        return v
    shape = tuple(v.shape)
    size = math.prod(shape)
    out = _host.empty((1, size), dtype, v)
    blocked.map_rows("identity", [_host.reshape(v, (1, size))], out)
    return _host.reshape(out, shape)


def data_grad(dy, w, geo):
    """dx (N, C, H, W) = the data gradient for dy (N, K, P, Q)."""
    if geo.stride != (1, 1):
        return _subsample.scatter(data_grad(dy, w, _dense(geo)), *geo.stride, geo.h, geo.w)
    n, hw = dy.shape[0], geo.h * geo.w
    dx = _host.empty((n, geo.c, geo.h, geo.w), geo.dtype, dy)
    if n:
        _run_gemm(_flat(dy), _host.reshape(w, (geo.k, geo.c)), None, _flat(dx), geo.k, geo.c,
                  hw, geo.dtype, None, True, _threads(geo.flops(n)))
    return dx


def weight_grad(dy, x, geo):
    """dw (K, C, 1, 1) f32 = sum over images and pixels of dy x^T. The smaller of x and dy
    is the one transposed: with K < C, dw^T (C, K) = sum x dy^T is computed and transposed
    (a (C, K) transpose, small next to the images)."""
    if geo.stride != (1, 1):
        x, geo = _subsample.subsample(x, *geo.stride, geo.p, geo.q), _dense(geo)
    n, hw = x.shape[0], geo.h * geo.w
    if n == 0:
        return _host.zeros((geo.k, geo.c, 1, 1), _dt.F32, x)
    threads = _threads(geo.flops(n))
    dw = _host.empty((geo.k, geo.c, 1, 1), _dt.F32, x)
    dw2 = _host.reshape(dw, (geo.k, geo.c))
    rows, cols, a, b = geo.k, geo.c, _flat(dy), _flat(x)
    if geo.k < geo.c:
        rows, cols, a, b = geo.c, geo.k, b, a
    bt = [_host.scratch("conv_pointwise_t", (n, hw, cols), geo.dtype)]
    if geo.dtype == _dt.BF16:      # and its VNNI pairs, which the weight-gradient GEMM reads
        bt.append(_host.scratch("conv_pointwise_vnni", (n, (hw + 1) // 2, 2 * cols), geo.dtype))
    _transpose_nest(cols, hw, geo.dtype)(b, *bt, threads=threads)
    out = dw2 if rows == geo.k else _host.empty((rows, cols), _dt.F32, x)
    _dw_nest(cols, rows, hw, geo.dtype)(a, bt[-1], out, threads=threads)
    if out is not dw2:
        blocked.transpose(out, dw2)
    return dw


def bias_grad(dy, geo):
    """db (K,) f32 = dy summed over the images and pixels."""
    n, hw = dy.shape[0], geo.p * geo.q
    db = _host.zeros((geo.k,), _dt.F32, dy)
    if n:
        sums = _host.empty((n, geo.k), _dt.F32, dy)
        _rowsum_nest(geo.k, hw, geo.dtype)(_flat(dy), sums,
                                           threads=_threads(2.0 * n * geo.k * hw))
        blocked.column_sums(sums, db)
    return db
