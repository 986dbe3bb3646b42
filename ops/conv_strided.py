"""The data gradient of a convolution as stride**2 stride-1 sub-convolutions (phase
decomposition): ops.conv's backward-data path on host data (any stride; stride 1 is one
phase).

For y = conv(x, w) with stride (sh, sw), padding (top, left) and dilation (dh, dw), the input
pixel (i, j) receives dy[p, q] w[r, s] exactly where i + top = p*sh + r*dh and
j + left = q*sw + s*dw. Split the input pixels by phase (a, b) = (i mod sh, j mod sw),
i = a + sh*i', j = b + sw*j': phase a receives only the taps r with r*dh = a + top (mod sh),
each from dy's row p = i' + off_r, off_r = (a + top - r*dh) / sh (similarly for the columns),
so each phase's dx is a stride-1 correlation of dy with its sub-filter: no zeros inserted
into dy, no multiply-add wasted (the transposed convolution on a zero-spread dy does
stride**2 times the work), and only the unpadded input's pixels are computed (the
transposed convolution computes the padded input's: at stride 1, 2 cores, batch 4, f32 and
bf16, 3x3 64 @56 ~6% faster this way, 128 @28 ~13%, 256 @14 ~24%, 512 @7 ~37%).

Nest: dy blocked [N][G*Kb][Hd][Wd][bk] inside a zero frame wide enough for every tap's offset
(rows / columns that fall outside dy read zeros); the weight in the data gradient's packed
layout (pack_weight(..., transposed=True): [G*Cb][Kb][R][S][bk][bc], taps flipped); dx blocked
[N][G*Cb][H][W][bc], unpadded. Parallel over (n, group, dx channel block, phase row a, row i');
per block of at most 64 pixels j' of one phase column b, one BRGEMM per tap of the phase
(pixels x bk) @ (bk x bc), batch-reduced over dy's channel blocks, written to every sw-th
pixel of dx's row (ldc = sw*bc); the first tap writes (beta 0), the rest add. A phase with no
tap (stride > kernel extent, e.g. a 1x1 stride-2 layer) is zeroed. A large weight slice per dx
block is summed in chunks of dy's blocks, like ops.conv's forward (ops.conv_chunks;
3x3 512 @7 f32, batch 4, 2 cores: 2.26 -> 2.04 ms). Where a phase column has
more taps than dy has channel blocks (3x3 64 and 128 at stride 1), one BRGEMM per (dy block,
kernel row) takes the row's evenly spaced taps as its batch instead (_fold: 1-5% faster at one
thread, 3x3 64 @56 bf16 5.6 -> 5.3 ms). bf16 accumulates in an f32
copy of dx's blocks, rounded once per pixel block. (3x3/2 128 @56, batch 4, 2 cores, f32:
19.8 ms as the zero-spread transposed convolution, 5.1 ms so.)

Few channels per group (at most MAX_SMALL: the stem's 3) take a second form, below, with the
pixels as the GEMM's columns (the stem's dx: 121 ms zero-spread, 25 ms with the blocked
phases, whose BRGEMMs are 3 columns wide, 6.1 ms so).
"""
from __future__ import annotations

import functools

import tpp
from tpp.core import dtypes as _dt
from tpp.runtime.lru import also_clear

from . import _host
from .conv_chunks import chunk_cases, weight_chunks
from .conv_layout import (PIXELS, Geometry, _size, _threads, _weight_rows_nest, from_blocked,
                          to_blocked)


def _phase_taps(size, pad, k, stride, dil, out):
    """[(phase, count, [(tap, offset)])] for one axis: input positions phase + stride*i'
    (i' < count) read output position i' + offset for each tap; taps reading only outside
    [0, out) are dropped."""
    phases = []
    for a in range(stride):
        count = -(-(size - a) // stride) if a < size else 0
        taps = []
        for t in range(k):
            num = a + pad - t * dil
            if num % stride:
                continue
            off = num // stride
            if off >= out or count - 1 + off < 0:
                continue
            taps.append((t, off))
        phases.append((a, count, taps))
    return phases


def _frame(phases, out):
    """(before, after): dy's zero border along one axis so every tap's reads stay inside."""
    lo = min([off for _, cnt, taps in phases if cnt for _, off in taps] + [0])
    hi = max([cnt - 1 + off for _, cnt, taps in phases if cnt for _, off in taps] + [out - 1])
    return -lo, hi - (out - 1)


def plan(geo: Geometry):
    """The row and column phases of geo's data gradient and dy's frame (top, bottom, left,
    right)."""
    rows = _phase_taps(geo.h, geo.pad[0], geo.r, geo.stride[0], geo.dilation[0], geo.p)
    cols = _phase_taps(geo.w, geo.pad[2], geo.s, geo.stride[1], geo.dilation[1], geo.q)
    return rows, cols, _frame(rows, geo.p) + _frame(cols, geo.q)


def _fold(ctaps, kb):
    """(tap step, dy pixel step, taps) when a kernel row's column taps, largest first, are
    evenly spaced in both and outnumber dy's blocks (one BRGEMM's batch); else None."""
    if len(ctaps) < 2 or kb >= len(ctaps):
        return None
    rev = ctaps[::-1]
    steps = {(rev[x][0] - rev[x + 1][0], rev[x + 1][1] - rev[x][1]) for x in range(len(rev) - 1)}
    if len(steps) != 1:
        return None
    (tap_step, pixel_step), = steps
    return tap_step, pixel_step, len(ctaps)


@functools.lru_cache(maxsize=256)
def _dx_nest(groups, kb, cb, bk, bc, r, s, h, w, hd, wd, sh, sw, rows, cols, ft, fl, dtype,
             fold_taps=True):
    """dxb (N, groups*cb, h, w, bc) from dyb (N, groups*kb, hd, wd, bk) framed by (ft, fl)
    and wbt (groups*cb, kb, r, s, bk, bc) (taps flipped); rows / cols from plan()."""
    n = tpp.size("N")
    vnni = dtype == _dt.BF16
    hmax = max(cnt for _, cnt, _ in rows)
    wmax = max(cnt for _, cnt, _ in cols)
    bq = min(wmax, PIXELS)
    # a large weight slice in chunks of dy's blocks, one after the other (as ops.conv's forward)
    folds = fold_taps and any(_fold(ctaps, kb) for _, cnt, ctaps in cols if cnt)
    chunks = 1 if folds else weight_chunks(kb, r * s * bk * bc * dtype.itemsize)
    loops = dict(a=n, b=groups, c=cb, d=sh, e=hmax, f=-(-wmax // bq))
    if chunks > 1:
        loops["g"] = chunks
    nest = tpp.LoopNest("ABCDEf" if chunks == 1 else "gABCDEf", **loops)
    an, g, c, ph, e, f = nest.vars[:6]
    part = nest.vars[6] if chunks > 1 else 0
    ks = kb // chunks
    dyb = nest.tensor("dyb", (n, groups * kb, hd, wd, bk), dtype)
    wshape = (groups * cb, kb, r, s) + ((bk // 2, 2 * bc) if vnni else (bk, bc))
    wbt = nest.tensor("wbt", wshape, dtype)
    dxb = nest.tensor("dxb", (n, groups * cb, h, w, bc), dtype)
    acc = nest.tensor("acc", (n, groups * cb, h, w, bc), _dt.F32) if vnni else dxb
    blk = g * cb + c
    for a, hcount, rtaps in rows:
        if not hcount:
            continue
        for b, wcount, ctaps in cols:
            if not wcount:
                continue
            full, tail = divmod(wcount, bq)
            cases = ([(bq, (f < full,))] if full else []) + ([(tail, (f == full,))] if tail else [])
            taps = [(i, oi, j, oj, 0) for i, oi in rtaps for j, oj in ctaps]
            fold = _fold(ctaps, kb) if fold_taps else None
            if fold:    # per (block, kernel row) a BRGEMM whose batch is the row's taps
                j, oj = ctaps[-1]       # the largest tap: dy's first pixel, wbt's first
                taps = [(i, oi, j, oj, u) for u in range(kb) for i, oi in rtaps]
            count, stride_a, stride_b = ((fold[2], fold[1] * bk, fold[0] * bk * bc) if fold
                                         else (ks, hd * wd * bk, r * s * bk * bc))
            for pixels, cond in cases:
                when = (ph == a, e < hcount) + cond
                out = (an, blk, a + sh * e, b + sw * f * bq)
                cases_k = chunk_cases(part, chunks)
                if not taps:
                    spec = tpp.make_unary("zero", pixels, bc, ldo=sw * bc, dtype_in=dtype)
                    nest.call(spec, dxb[out], when=when + cases_k[0][0])
                    continue
                for kwhen, first, _ in cases_k:
                    for t, (i, oi, j, oj, u) in enumerate(taps):
                        spec = tpp.make_brgemm(
                            pixels, bc, bk, lda=bk, ldb=2 * bc if vnni else bc, ldc=sw * bc,
                            dtype_a=dtype, dtype_b=dtype, dtype_c=_dt.F32 if vnni else dtype,
                            beta=0 if (t == 0 and first) else 1, vnni_b=vnni)
                        dy_block = u + part * ks     # dy's block (of this chunk's)
                        nest.call(spec, dyb[an, g * kb + dy_block, e + oi + ft,
                                            f * bq + oj + fl],
                                  wbt[blk, dy_block, r - 1 - i, s - 1 - j], acc[out],
                                  count=count, stride_a=stride_a, stride_b=stride_b,
                                  when=when + kwhen)
                if vnni:
                    spec = tpp.make_unary("identity", pixels, bc, ldi=sw * bc, ldo=sw * bc,
                                          dtype_in=_dt.F32, dtype_out=dtype)
                    nest.call(spec, acc[out], dxb[out], when=when + cases_k[-1][0])
    return nest.compile()


also_clear(_dx_nest.cache_clear)


def data_grad(dy, wbt, geo: Geometry, like):
    """dx (N, C, H, W) of like's kind for dy (N, K, P, Q) and the data gradient's packed
    weight data wbt (pack_weight(w, groups, dtype, transposed=True).data)."""
    n = dy.shape[0]
    dt = geo.dtype
    dx = _host.empty((n, geo.c, geo.h, geo.w), dt, like)
    if n == 0:
        return dx
    rows, cols, (ft, fb, fl, fr) = plan(geo)
    hd, wd = geo.p + ft + fb, geo.q + fl + fr
    dgeo = Geometry(geo.k, geo.c, geo.p, geo.q, geo.r, geo.s, geo.groups, (1, 1),
                    (0, 0, 0, 0), geo.dilation, dt)
    dyb = to_blocked(dy, dgeo, frame=(hd, wd), origin=(ft, fl), scratch="conv_dx_dy").data
    bc, bk = geo.bc, geo.bk
    cb, kb = -(-geo.cg // bc), -(-geo.kg // bk)
    dxb = _host.temp("conv_dxb", (n, geo.groups * cb, geo.h, geo.w, bc), dt, like)
    args = [dyb, wbt, dxb]
    if dt == _dt.BF16:
        args.append(_host.temp("conv_dx_acc", tuple(dxb.shape), _dt.F32, like))
    key = lambda ph: tuple((a, cnt, tuple(t)) for a, cnt, t in ph)  # noqa: E731
    nest = _dx_nest(geo.groups, kb, cb, bk, bc, geo.r, geo.s, geo.h, geo.w, hd, wd,
                    geo.stride[0], geo.stride[1], key(rows), key(cols), ft, fl, dt)
    nest(*args, threads=_threads(geo.flops(n)))
    return from_blocked(dxb, geo.c, geo.groups, bc, geo.h, geo.w, dx)


# ------------------------------------------------------------------ few input channels
# The stem's data gradient has 3 channels: the blocked nest's BRGEMMs would be (pixels x 3).
# With pixels as the columns instead, each phase's dx is a (C x pixels) tile:
#   dx_ph (cg x pixels) += W_tap (cg x bk: the weight as [G][C][R*S][K], lda = R*S*Kp)
#                          @ dy (bk x pixels, NCHW rows in a zero frame, ldb = Hd*Wd)
# batch-reduced over dy's channel blocks, written into phase planes
# dxph [N][C][sh][sw][hmax][wmax], then interleaved into dx's rows by transpose TPPs
# ((sw x wmax) -> (wmax x sw), ldo = sw), cropped where H, W are not whole multiples.
MAX_SMALL = 16      # the most channels per group served so


def small(geo) -> bool:
    return geo.cg <= MAX_SMALL and geo.bc <= MAX_SMALL


@functools.lru_cache(maxsize=256)
def _frame_nest(groups, kg, kgp, p, q, hd, wd, ft, fl, dtype):
    """dyf (N, groups*kgp, hd, wd) with dy (N, groups*kg, p, q) at (ft, fl) (dyf zeroed); bf16:
    in VNNI pairs of channels, dyf (N, groups*kgp/2, hd, 2*wd), each image row of channels
    (k, k+1) interleaved by a vnni2 TPP (an odd kg's last pair padded with zero)."""
    n = tpp.size("N")
    if dtype != _dt.BF16:
        nest = tpp.LoopNest("ABC", a=n, b=groups, c=kg)
        a, g, k = nest.vars
        dy = nest.tensor("dy", (n, groups * kg, p, q), dtype)
        dyf = nest.tensor("dyf", (n, groups * kgp, hd, wd), dtype)
        spec = tpp.make_unary("identity", p, q, ldi=q, ldo=wd, dtype_in=dtype)
        nest.call(spec, dy[a, g * kg + k], dyf[a, g * kgp + k, ft, fl])
        return nest.compile()
    pairs, odd = divmod(kg, 2)
    nest = tpp.LoopNest("ABCD", a=n, b=groups, c=pairs + odd, d=p)
    a, g, k, row = nest.vars
    dy = nest.tensor("dy", (n, groups * kg, p, q), dtype)
    dyf = nest.tensor("dyf", (n, groups * kgp // 2, hd, 2 * wd), dtype)
    for channels, when in ((2, (k < pairs,)), (1, (k == pairs,)))[:1 + odd]:
        spec = tpp.make_unary("vnni2", channels, q, ldi=p * q, dtype_in=dtype)
        nest.call(spec, dy[a, g * kg + 2 * k, row], dyf[a, g * (kgp // 2) + k, ft + row, 2 * fl],
                  when=when)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _small_nest(groups, cg, kb, bc, bk, r, s, hd, wd, sh, sw, rows, cols, ft, fl, dtype):
    """dxph (N, groups*cg, sh, sw, hmax, wmax) from dyf (N, groups*kb*bk, hd, wd) and the
    weight's rows wt (groups, bc, r*s, kb*bk) (wt[g, c, tap, k] = w[g*kg + k, c, tap])."""
    n = tpp.size("N")
    vnni = dtype == _dt.BF16
    hmax = max(cnt for _, cnt, _ in rows)
    wmax = max(cnt for _, cnt, _ in cols)
    bq = min(wmax, PIXELS)
    nest = tpp.LoopNest("ABCDe", a=n, b=groups, c=sh, d=hmax, e=-(-wmax // bq))
    an, g, ph, e, f = nest.vars
    # bf16: dyf in VNNI pairs of channels (_frame_nest), for vdpbf16ps
    dyf = nest.tensor("dyf", (n, groups * kb * bk // 2, hd, 2 * wd) if vnni else
                      (n, groups * kb * bk, hd, wd), dtype)
    wt = nest.tensor("wt", (groups, bc, r * s, kb * bk), dtype)
    dxph = nest.tensor("dxph", (n, groups * cg, sh, sw, hmax, wmax), dtype)
    acc = nest.tensor("acc", (n, groups * cg, sh, sw, hmax, wmax), _dt.F32) if vnni else dxph
    plane = sh * sw * hmax * wmax
    for a, hcount, rtaps in rows:
        for b, wcount, ctaps in cols:
            if not (hcount and wcount):
                continue
            full, tail = divmod(wcount, bq)
            cases = ([(bq, (f < full,))] if full else []) + ([(tail, (f == full,))] if tail else [])
            taps = [(i, oi, j, oj) for i, oi in rtaps for j, oj in ctaps]
            for pixels, cond in cases:
                when = (ph == a, e < hcount) + cond
                out = (an, g * cg, a, b, e, f * bq)
                if not taps:
                    spec = tpp.make_unary("zero", cg, pixels, ldo=plane, dtype_in=dtype)
                    nest.call(spec, dxph[out], when=when)
                    continue
                for t, (i, oi, j, oj) in enumerate(taps):
                    spec = tpp.make_brgemm(
                        cg, pixels, bk, lda=r * s * kb * bk, ldb=(2 if vnni else 1) * hd * wd,
                        ldc=plane, dtype_a=dtype, dtype_b=dtype,
                        dtype_c=_dt.F32 if vnni else dtype, beta=0 if t == 0 else 1,
                        vnni_b=vnni)
                    at = (dyf[an, g * (kb * bk // 2), e + oi + ft, 2 * (f * bq + oj + fl)]
                          if vnni else dyf[an, g * kb * bk, e + oi + ft, f * bq + oj + fl])
                    nest.call(spec, wt[g, 0, i * s + j, 0], at, acc[out], count=kb,
                              stride_a=bk, stride_b=bk * hd * wd, when=when)
                if vnni:
                    spec = tpp.make_unary("identity", cg, pixels, ldi=plane, ldo=plane,
                                          dtype_in=_dt.F32, dtype_out=dtype)
                    nest.call(spec, acc[out], dxph[out], when=when)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _interleave_nest(c, sh, sw, hmax, wmax, h, w, dtype):
    """dx (N, c, h, w) from dxph (N, c, sh, sw, hmax, wmax): dx rows are whole
    (h = sh*hmax, w = sw*wmax; else the caller crops a full-size dx)."""
    n = tpp.size("N")
    nest = tpp.LoopNest("ABCD", a=n, b=c, c=sh, d=hmax)
    a, k, ph, e = nest.vars
    dxph = nest.tensor("dxph", (n, c, sh, sw, hmax, wmax), dtype)
    dx = nest.tensor("dx", (n, c, h, w), dtype)
    spec = tpp.make_unary("transpose", sw, wmax, ldi=hmax * wmax, ldo=sw, dtype_in=dtype)
    nest.call(spec, dxph[a, k, ph, 0, e, 0], dx[a, k, e * sh + ph, 0])
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _crop_nest(c, hf, wf, h, w, dtype):
    n = tpp.size("N")
    nest = tpp.LoopNest("AB", a=n, b=c)
    a, k = nest.vars
    src = nest.tensor("src", (n, c, hf, wf), dtype)
    dst = nest.tensor("dst", (n, c, h, w), dtype)
    nest.call(tpp.make_unary("identity", h, w, ldi=wf, ldo=w, dtype_in=dtype), src[a, k],
              dst[a, k])
    return nest.compile()


for _cache in (_frame_nest, _small_nest, _interleave_nest, _crop_nest):
    also_clear(_cache.cache_clear)


def data_grad_small(dy, w, geo: Geometry, like):
    """dx (N, C, H, W) for a layer with few channels per group (small(geo)), host data,
    w (K, C/groups, R, S) C-contiguous."""
    n = dy.shape[0]
    dt = geo.dtype
    dx = _host.empty((n, geo.c, geo.h, geo.w), dt, like)
    if n == 0:
        return dx
    rows, cols, (ft, fb, fl, fr) = plan(geo)
    hd, wd = geo.p + ft + fb, geo.q + fl + fr
    bc, bk = geo.bc, geo.bk
    kb = -(-geo.kg // bk)
    sh, sw = geo.stride
    rs = geo.r * geo.s
    wt = _host.zeros((geo.groups, bc, rs, kb * bk), dt, like)
    _weight_rows_nest(geo.k, geo.cg, rs, geo.groups, kb * bk, bc, False, dt)(
        _host.reshape(w, (geo.k, geo.cg, rs)), wt, threads=1)
    dyf = _host.zeros((n, geo.groups * kb * bk // 2, hd, 2 * wd) if dt == _dt.BF16 else
                      (n, geo.groups * kb * bk, hd, wd), dt, like)
    _frame_nest(geo.groups, geo.kg, kb * bk, geo.p, geo.q, hd, wd, ft, fl, dt)(
        dy, dyf, threads=_threads(64 * _size(dyf)))
    hmax = max(cnt for _, cnt, _ in rows)
    wmax = max(cnt for _, cnt, _ in cols)
    dxph = _host.empty((n, geo.c, sh, sw, hmax, wmax), dt, like)
    args = [dyf, wt, dxph]
    if dt == _dt.BF16:
        args.append(_host.empty(tuple(dxph.shape), _dt.F32, like))
    key = lambda ph: tuple((a, cnt, tuple(t)) for a, cnt, t in ph)  # noqa: E731
    _small_nest(geo.groups, geo.cg, kb, bc, bk, geo.r, geo.s, hd, wd, sh, sw, key(rows),
                key(cols), ft, fl, dt)(*args, threads=_threads(geo.flops(n)))
    hf, wf = sh * hmax, sw * wmax
    whole = (hf, wf) == (geo.h, geo.w)
    out = dx if whole else _host.empty((n, geo.c, hf, wf), dt, like)
    _interleave_nest(geo.c, sh, sw, hmax, wmax, hf, wf, dt)(
        dxph, out, threads=_threads(64 * _size(out)))
    if not whole:
        _crop_nest(geo.c, hf, wf, geo.h, geo.w, dt)(out, dx, threads=_threads(64 * _size(dx)))
    return dx
