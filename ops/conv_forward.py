"""The forward convolution nest of ops.conv on its blocked layouts, and the step that runs it.

_conv_nest(...) compiles the nest for one layer shape (see ops.conv's module docstring: the
BRGEMM per tap or per folded kernel row, the chunks of a large weight slice, the NCHW output
written tile by tile); _ForwardStep makes every per-shape decision of a forward call once (the
nest, the outputs' shapes, the stem's folded taps, a flat 1x1 layer) and runs it on a call's
arrays, so that a caller that sees the same shapes again (ops.conv_memo) reuses it.
"""
from __future__ import annotations

import functools

import tpp
from tpp.core import dtypes as _dt
from tpp.runtime.lru import also_clear

from . import _host
from . import conv_taps as _taps
from .conv_chunks import chunk_cases, weight_chunks
from .conv_layout import PIXELS, _pad_bias, _threads, from_blocked, nchw_output, write_nchw


# The forward writes an NCHW output from its nest, each tile transposed while in cache, instead
# of leaving the blocked output to from_blocked (batch 4, 2 Zen 4 cores, paired: the stem
# f32/bf16 5-6% faster, the 3x3 and 1x1 layers 0-4%)
NCHW_IN_NEST = True


# ------------------------------------------------------------------ the convolution nest
@functools.lru_cache(maxsize=256)
def _conv_nest(groups, cb, kb, bc, bk, hp, wp, r, s, sh, sw, dh, dw, p, q, dtype,
               has_bias, activation, frame=(0, 0, 0, 0), fold=True, kg=None, chunked=True):
    """yb (N, groups*kb, p, q, bk) = act(conv(xb (N, groups*cb, hp, wp, bc), wb) + bias),
    written inside a frame (top, bottom, left, right) of yb that the nest leaves alone; with
    kg (output channels per group), each finished tile also goes to the NCHW y (N,
    groups*kg, p*q) (conv_layout.write_nchw). chunked: a large weight slice is summed in
    chunks (ops.conv_chunks; for a CPU's L2 cache: False for device data)."""
    n = tpp.size("N")
    vnni = dtype == _dt.BF16
    bq = min(q, PIXELS)
    full, tail = divmod(q, bq)
    # fewer input blocks than kernel columns: per (input block, kernel row) a BRGEMM whose
    # batch is the row's taps (A and B strides uniform in j); else per tap, over the blocks
    fold = fold and 1 < s and cb < s
    # a large weight slice is summed over in chunks of input blocks, each chunk's pass over
    # every tile finished before the next (ops.conv_chunks)
    chunks = weight_chunks(cb, r * s * bc * bk * dtype.itemsize) if chunked and not fold else 1
    # the pixel-block loop is parallel too where there is one row (a flattened 1x1 layer)
    order = ("ABCDE" if p == 1 else "ABCDe") if chunks == 1 else \
        ("fABCDE" if p == 1 else "fABCDe")
    nest = tpp.LoopNest(order, a=n, b=groups, c=kb, d=p, e=full + (tail > 0),
                        **({"f": chunks} if chunks > 1 else {}))
    a, g, k, c, d = nest.vars[:5]
    f = nest.vars[5] if chunks > 1 else 0
    cs = cb // chunks
    b = g * kb + k
    xb = nest.tensor("xb", (n, groups * cb, hp, wp, bc), dtype)
    wshape = (groups * kb, cb, r, s) + ((bc // 2, 2 * bk) if vnni else (bc, bk))
    wb = nest.tensor("wb", wshape, dtype)
    acc_dt = _dt.F32
    bias_t = nest.tensor("bias", (groups * kb * bk,), acc_dt) if has_bias else None
    ft, fb, fl, fr = frame
    yb = nest.tensor("yb", (n, groups * kb, p + ft + fb, q + fl + fr, bk), dtype)
    staged = _staged(dtype, has_bias, r, s)
    acc = nest.tensor("acc", (n, groups * kb, p, q, bk), acc_dt) if staged else yb
    y = None if kg is None else nchw_output(nest, kg, groups, p, q, dtype)
    ah, aw = (0, 0) if staged else (ft, fl)
    cases = ([(bq, (d < full,) if tail else ())] if full else []) + \
        ([(tail, (d == full,))] if tail else [])
    taps = [(u, i, 0) for u in range(cb) for i in range(r)] if fold else \
        [(0, i, j) for i in range(r) for j in range(s)]
    batch = (s, dw * bc, bc * bk) if fold else (cs, hp * wp * bc, r * s * bc * bk)
    x_block = g * cb + f * cs
    for pixels, when in cases:
        for fwhen, first_chunk, last_chunk in chunk_cases(f, chunks):
            for t, (u, i, j) in enumerate(taps):
                last = t == len(taps) - 1 and last_chunk
                spec = tpp.make_brgemm(
                    pixels, bk, bc, lda=sw * bc, ldb=2 * bk if vnni else bk, ldc=bk,
                    dtype_a=dtype, dtype_b=dtype, dtype_c=acc_dt if staged else dtype,
                    beta=0 if (t == 0 and first_chunk) else 1,
                    vnni_b=vnni, bias="row" if (has_bias and last) else None,
                    activation=activation if last else None)
                nest.call(spec, xb[a, x_block + u, c * sh + i * dh, d * bq * sw + j * dw],
                          wb[b, f * cs + u, i, j], acc[a, b, ah + c, aw + d * bq],
                          bias=bias_t[b * bk] if (has_bias and last) else None,
                          count=batch[0], stride_a=batch[1], stride_b=batch[2],
                          when=when + fwhen)
        lwhen = when + chunk_cases(f, chunks)[-1][0]     # the tile is finished
        if staged:
            spec = tpp.make_unary("identity", pixels, bk, dtype_in=acc_dt, dtype_out=dtype)
            nest.call(spec, acc[a, b, c, d * bq], yb[a, b, ft + c, fl + d * bq], when=lwhen)
        if y is not None:
            write_nchw(nest, y, yb[a, b, ft + c, fl + d * bq], y[a, g * kg + k * bk,
                       c * q + d * bq], pixels, k, kb, kg, bk, lwhen)
    return nest.compile()


def _staged(dtype, has_bias, r, s) -> bool:
    """Whether _conv_nest sums a bf16 tile in an f32 accumulator (acc) and rounds it once: when
    several BRGEMM calls add to it (taps) or an f32 bias row joins it. A 1x1 bias-free tile is
    one call, rounded straight from the BRGEMM."""
    return dtype == _dt.BF16 and (r * s > 1 or has_bias)


def _flattened(r, s, sh, sw, hp, wp, p, q, frame) -> bool:
    """Whether the layer runs as one row of hp*wp pixels: a 1x1 stride-1 layer on whole
    images (no padding, no output frame), whose pixel blocks then span image rows (full
    BRGEMMs, a parallel pixel loop)."""
    return (r, s, sh, sw, hp, wp, tuple(frame)) == (1, 1, 1, 1, p, q, (0, 0, 0, 0)) and p > 1


def _flatten(args, p, q):
    """The 5-D arrays of args (xb, yb, acc) viewed as one row of p*q pixels (_flattened)."""
    return [a if len(a.shape) != 5 else
            _host.reshape(a, (a.shape[0], a.shape[1], 1, p * q, a.shape[4])) for a in args]


def _run_conv(args, hp, wp, r, s, sh, sw, p, q, frame, make):
    """make(hp, wp, p, q) called on args (xb, wb[, bias], yb[, acc]), flattened where
    _flattened says so."""
    if _flattened(r, s, sh, sw, hp, wp, p, q, frame):
        return make(1, p * q, 1, p * q), _flatten(args, p, q)
    return make(hp, wp, p, q), args


also_clear(_conv_nest.cache_clear)      # tpp.clear_caches() empties it too


class _ForwardStep:
    """_forward's decisions (the nest, the outputs' shapes, the stem's folded taps, a flat
    1x1 layer) for one batch size, layer, bias presence, activation, frame and kind of data
    (host or device), made once; a call allocates the outputs and runs the nest."""
    __slots__ = ("n", "geo", "has_bias", "frame", "yshape", "acc", "taps", "flat", "kg",
                 "nest", "threads")

    def __init__(self, n, geo, has_bias, activation, frame, host):
        self.n, self.geo, self.has_bias, self.frame = n, geo, has_bias, frame
        bc, bk = geo.bc, geo.bk
        cb, kb = -(-geo.cg // bc), -(-geo.kg // bk)
        p, q = geo.p, geo.q
        fr = tuple(frame or (0, 0, 0, 0))
        self.yshape = (n, geo.groups * kb, p + fr[0] + fr[1], q + fr[2] + fr[3], bk)
        self.taps = taps = _taps.eligible(cb, bc, geo.s, geo.dilation[1]) and host  # the stem
        # bf16 tiles summed over several BRGEMM calls go through an f32 accumulator (the taps
        # nest's one call per tile only with a bias, see conv_taps.conv_nest)
        staged = (_taps.staged_tiles(geo.dtype, has_bias) if taps else
                  _staged(geo.dtype, has_bias, geo.r, geo.s))
        self.acc = (n, geo.groups * kb, p, q, bk) if staged else None
        # an NCHW output is written by the nest itself, tile by tile (conv_layout.write_nchw)
        self.kg = kg = None if frame is not None or not NCHW_IN_NEST else geo.kg
        sh, sw = geo.stride
        self.flat = not taps and _flattened(geo.r, geo.s, sh, sw, geo.hp, geo.wp, p, q, fr)
        self.threads = _threads(geo.flops(n))
        self.nest = None
        if n and taps:
            self.nest = _taps.conv_nest(geo.groups, kb, bc, bk, geo.hp, geo.r, geo.s, sh,
                                        geo.dilation[0], p, q, geo.dtype, has_bias, activation,
                                        fr, kg, _taps.unpadded_depth(geo))
        elif n:
            hp, wp, p_, q_ = (1, p * q, 1, p * q) if self.flat else (geo.hp, geo.wp, p, q)
            self.nest = _conv_nest(geo.groups, cb, kb, bc, bk, hp, wp, geo.r, geo.s, sh, sw,
                                   geo.dilation[0], geo.dilation[1], p_, q_, geo.dtype,
                                   has_bias, activation, fr, kg=kg, chunked=host)

    def __call__(self, xb, wb, bias, like):
        geo, n = self.geo, self.n
        if self.frame is not None:
            y = yb = _host.zeros(self.yshape, geo.dtype, like)
        else:
            y = _host.empty((n, geo.k, geo.p, geo.q), geo.dtype, like)
            yb = _host.temp("conv_yb", self.yshape, geo.dtype, like)     # y's blocks
        if self.nest is None:
            return y
        args = [xb, wb]
        if self.has_bias:
            args.append(_pad_bias(bias, geo.groups, geo.kg, geo.bk, like))
        args.append(yb)
        if self.acc is not None:
            args.append(_host.temp("conv_acc", self.acc, _dt.F32, like))
        if self.taps:
            args[0], args[1], _ = _taps.operands(xb, wb, geo, geo.q)
        elif self.flat:
            args = _flatten(args, geo.p, geo.q)
        if self.kg is not None:
            args.append(_host.reshape(y, (n, geo.k, geo.p * geo.q)))
        self.nest(*args, threads=self.threads)
        if self.frame is None and self.kg is None:
            from_blocked(yb, geo.k, geo.groups, geo.bk, geo.p, geo.q, y)
        return y
