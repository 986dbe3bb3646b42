"""The data side of ops.conv: a layer's geometry, the blocked layouts of activations and
weights, and the loop nests that convert NCHW arrays and torch-layout weights to and from them.

Activations are [N][G*Cb][Hp][Wp][bc] with the padding stored as a zero border (so no filter
tap needs border cases), weights [G*Kb][Cb][R][S][bc][bk] (VNNI pairs [bc/2][2*bk] for bf16),
outputs [N][G*Kb][P][Q][bk]; channels are zero-padded per group to whole blocks of at most
BLOCK. Every conversion is a nest of transpose / identity / vnni2 primitives.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import tpp
from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError
from tpp.runtime.lru import also_clear

from . import _host

BLOCK = 64                  # channels per block (at most)
PIXELS = 64                 # output pixels per BRGEMM (at most)
_SERIAL_FLOPS = 4e6         # smaller problems run on one thread


# ------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Geometry:
    """One layer's static shape: everything a nest is compiled for (all but the batch)."""
    c: int
    k: int
    h: int
    w: int
    r: int
    s: int
    groups: int
    stride: tuple      # (sh, sw)
    pad: tuple         # (top, bottom, left, right)
    dilation: tuple    # (dh, dw)
    dtype: _dt.DType

    @property
    def cg(self):
        return self.c // self.groups

    @property
    def kg(self):
        return self.k // self.groups

    @property
    def bc(self):
        return block(self.cg, self.dtype)

    @property
    def bk(self):
        return block(self.kg, self.dtype)

    @property
    def hp(self):
        return self.h + self.pad[0] + self.pad[1]

    @property
    def wp(self):
        return self.w + self.pad[2] + self.pad[3]

    @property
    def p(self):
        return (self.hp - self.dilation[0] * (self.r - 1) - 1) // self.stride[0] + 1

    @property
    def q(self):
        return (self.wp - self.dilation[1] * (self.s - 1) - 1) // self.stride[1] + 1

    def flops(self, n):
        return 2.0 * n * self.k * self.p * self.q * self.cg * self.r * self.s


def block(channels: int, dtype) -> int:
    """Channels per block: min(64, channels), even for bf16 (VNNI pairs)."""
    b = min(BLOCK, channels)
    return b + (b % 2) if dtype == _dt.BF16 else b


def _pair(v, what):
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ArgumentError(f"{what}: expected an int or a pair, got {v!r}")
        vals = tuple(checks.as_int(x) for x in v)
    else:
        vals = (checks.as_int(v),) * 2
    if any(x is None for x in vals) or isinstance(v, bool):
        raise ArgumentError(f"{what}: expected an int or a pair of ints, got {v!r}")
    return vals


def _padding(padding, r, s, dilation, stride):
    """(top, bottom, left, right) from an int, a pair, a 4-tuple, "same" or "valid"."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise ArgumentError("padding='same' is not supported for strided convolutions")
            th, tw = dilation[0] * (r - 1), dilation[1] * (s - 1)
            return (th // 2, th - th // 2, tw // 2, tw - tw // 2)
        raise ArgumentError(f"padding: expected an int, a pair, 'same' or 'valid', got "
                            f"{padding!r}")
    if isinstance(padding, (tuple, list)) and len(padding) == 4:
        vals = tuple(checks.as_int(x) for x in padding)
        if any(x is None or x < 0 for x in vals):
            raise ArgumentError(f"padding: expected non-negative ints, got {padding!r}")
        return vals
    ph, pw = _pair(padding, "padding")
    if ph < 0 or pw < 0:
        raise ArgumentError(f"padding must be non-negative, got {padding!r}")
    return (ph, ph, pw, pw)


def geometry(x_shape, w_shape, dtype, stride, padding, dilation, groups) -> Geometry:
    """The layer's Geometry after validating the shapes and hyper-parameters (remembered for
    plain int / str arguments: a layer's every call asks for it, ~10 us of Python each)."""
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if all(_plain(v) for v in (x_shape, w_shape, stride, padding, dilation, groups)):
        return _remembered(x_shape, w_shape, dtype, stride, padding, dilation, groups)
    return _geometry(x_shape, w_shape, dtype, stride, padding, dilation, groups)


def _plain(v) -> bool:
    """An int, a str or a tuple of ints, exactly (no bools or floats, which compare equal to
    ints and so would share a cache entry)."""
    t = type(v)
    return t is int or t is str or (t is tuple and all(type(e) is int for e in v))


@functools.lru_cache(maxsize=1024)
def _remembered(*args) -> Geometry:
    return _geometry(*args)


also_clear(_remembered.cache_clear)     # tpp.clear_caches() empties it too


def _geometry(x_shape, w_shape, dtype, stride, padding, dilation, groups) -> Geometry:
    if len(x_shape) != 4:
        raise ArgumentError(f"x: expected a 4-D (N, C, H, W) array, got shape {x_shape}")
    if len(w_shape) != 4:
        raise ArgumentError(f"weight: expected a 4-D (K, C/groups, R, S) array, got shape "
                            f"{w_shape}")
    g = checks.as_int(groups)
    if g is None or g < 1 or isinstance(groups, bool):
        raise ArgumentError(f"groups must be a positive int, got {groups!r}")
    stride = _pair(stride, "stride")
    dilation = _pair(dilation, "dilation")
    if min(stride) < 1 or min(dilation) < 1:
        raise ArgumentError(f"stride and dilation must be >= 1, got {stride}, {dilation}")
    _, c, h, w = x_shape
    k, cg, r, s = w_shape
    if min(k, cg, r, s) < 1:
        raise ArgumentError(f"weight: empty shape {w_shape}")
    if c != cg * g or k % g:
        raise ArgumentError(f"x has {c} channels and the weight {w_shape} with groups={g}: "
                            f"expected C = {cg}*groups and K divisible by groups")
    if h < 1 or w < 1:
        raise ArgumentError(f"x: empty image {x_shape}")
    pad = _padding(padding, r, s, dilation, stride)
    geo = Geometry(c, k, h, w, r, s, g, stride, pad, dilation, dtype)
    if geo.p < 1 or geo.q < 1:
        raise ArgumentError(f"the kernel {r}x{s} (dilation {dilation}) is larger than the "
                            f"padded input {geo.hp}x{geo.wp}")
    frame = x_shape[0] * max(c * geo.hp * geo.wp, k * geo.p * geo.q) * dtype.itemsize
    if frame > MAX_FRAME_BYTES:     # (exact ints: a padding of 10**9 is 10**18 pixels)
        raise ArgumentError(f"padding {pad} (top, bottom, left, right) makes a padded input "
                            f"of {geo.hp}x{geo.wp} pixels or an output of {geo.p}x{geo.q}: "
                            f"{frame} bytes, more than a host can hold")
    return geo


MAX_FRAME_BYTES = 1 << 47   # 128 TiB: no allocation of a padded input or output beyond it


# ------------------------------------------------------------------ layout objects
@dataclass(frozen=True, eq=False)
class BlockedActivation:
    """Activations [N][groups*Cb][H + top + bottom][W + left + right][bc], channels of each
    group zero-padded to Cb blocks of bc, the frame `pad` zero: what the conv nests read (and,
    without a frame, what they write)."""
    data: object
    channels: int
    h: int
    w: int
    groups: int
    bc: int
    pad: tuple = (0, 0, 0, 0)

    @property
    def n(self):
        return self.data.shape[0]


@dataclass(frozen=True, eq=False)
class BlockedWeight:
    """A conv weight packed for one use: [G*Kb][Cb][R][S][bc][bk] (bf16: [bc/2][2*bk])."""
    data: object
    shape: tuple          # the (K, C/groups, R, S) weight it packs
    groups: int
    transposed: bool      # the flipped, transposed weight of the data gradient


def _check_xb(xb, x, geo):
    """xb if it is the BlockedActivation of x (this layer's frame and blocks) the forward
    read, on x's device; else an ArgumentError."""
    if isinstance(xb, BlockedActivation) and (_host.on_device(x) or _host.on_device(xb.data)):
        _host.same_device(x=x, xb=xb.data)
    if (not isinstance(xb, BlockedActivation) or tuple(xb.pad) != geo.pad
            or xb.bc != geo.bc or xb.groups != geo.groups or xb.n != x.shape[0]
            or (xb.channels, xb.h, xb.w) != (geo.c, geo.h, geo.w)):
        raise ArgumentError("xb: expected the BlockedActivation of x that the forward "
                            "read (ops.conv.to_blocked(x, geometry))")
    return xb


def _threads(flops):
    return 1 if flops < _SERIAL_FLOPS else None


def _block_cases(inner, nb, total, bsize):
    """[(channels, when)] for block `inner` of a group of `total` channels in nb blocks."""
    tail = total - (nb - 1) * bsize
    if tail == bsize:
        return [(bsize, ())]
    cases = [(tail, (inner == nb - 1,))]
    if nb > 1:
        cases.insert(0, (bsize, (inner < nb - 1,)))
    return cases


def nchw_output(nest, kg, groups, p, q, dtype):
    """The NCHW output tensor y (N, groups*kg, p*q) of a forward nest that writes its finished
    tiles straight into it (write_nchw) instead of leaving the blocked output to
    from_blocked: each tile is transposed while it is in cache, and the blocked output is
    never read back from memory."""
    return nest.tensor("y", (tpp.size("N"), groups * kg, p * q), dtype)


def write_nchw(nest, y, tile, at, pixels, kvar, kb, kg, bk, when):
    """The calls moving a finished tile (pixels x bk, row-major: channels of output-channel
    block kvar of kb, of kg per group) into y at `at` (y's element of the tile's first channel
    and pixel): one transpose, leaving out a last block's padded channels."""
    for cols, guard in _block_cases(kvar, kb, kg, bk):
        spec = tpp.make_unary("transpose", pixels, cols, ldi=bk, ldo=y.tensor.shape[2],
                              dtype_in=y.tensor.dtype)
        nest.call(spec, tile, at, when=tuple(when) + guard)


# ------------------------------------------------------------------ conversion nests
@functools.lru_cache(maxsize=256)
def _to_blocked_nest(groups, cg, h, w, bc, hb, wb, oh, ow, sh, sw, dtype, border=False):
    """x (N, groups*cg, h, w) -> xb (N, groups*Cb, hb, wb, bc): pixel (i, j) at
    (oh + i*sh, ow + j*sw); border: the nest also zeroes the frame around the image (whole
    channel blocks, stride 1), else xb's unwritten elements are zeroed by the caller."""
    n = tpp.size("N")
    nb = -(-cg // bc)
    nest = tpp.LoopNest("ABCD", a=n, b=groups, c=nb, d=h)
    a, g, b, c = nest.vars
    x = nest.tensor("x", (n, groups * cg, h, w), dtype)
    xb = nest.tensor("xb", (n, groups * nb, hb, wb, bc), dtype)
    for rows, when in _block_cases(b, nb, cg, bc):
        spec = tpp.make_unary("transpose", rows, w, ldi=h * w, ldo=sw * bc, dtype_in=dtype)
        nest.call(spec, x[a, g * cg + b * bc, c, 0], xb[a, g * nb + b, oh + c * sh, ow],
                  when=when)
    if border:      # (rows, row-length in elements, first row, first column) of each strip
        strips = [(oh, wb * bc, 0, 0), (hb - oh - h, wb * bc, oh + h, 0),
                  (h, ow * bc, oh, 0), (h, (wb - ow - w) * bc, oh, ow + w)]
        for rows, length, row, col in strips:
            if rows and length:
                spec = tpp.make_unary("zero", rows, length, ldo=wb * bc, dtype_in=dtype)
                nest.call(spec, xb[a, g * nb + b, row, col], when=(c == 0,))
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _from_blocked_nest(groups, kg, bk, pb, qb, oh, ow, p, q, dtype):
    """yb (N, groups*Kb, pb, qb, bk) -> y (N, groups*kg, p, q), y[.., i, j] from
    yb[.., oh + i, ow + j]."""
    n = tpp.size("N")
    nb = -(-kg // bk)
    nest = tpp.LoopNest("ABCD", a=n, b=groups, c=nb, d=p)
    a, g, b, c = nest.vars
    yb = nest.tensor("yb", (n, groups * nb, pb, qb, bk), dtype)
    y = nest.tensor("y", (n, groups * kg, p, q), dtype)
    for cols, when in _block_cases(b, nb, kg, bk):
        spec = tpp.make_unary("transpose", q, cols, ldi=bk, ldo=p * q, dtype_in=dtype)
        nest.call(spec, yb[a, g * nb + b, oh + c, ow], y[a, g * kg + b * bk, c, 0], when=when)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _weight_rows_nest(k, cg, rs, groups, kgp, cgp, backward, dtype):
    """Step 1 of packing w (k, cg, R, S): forward, wt (groups, cgp, rs, kgp) with
    wt[g, c, t, kk] = w[g*kg + kk, c, t] (a transpose of each output channel's row);
    backward, wt (groups, kgp, rs, cgp) with wt[g, kk, t, c] = w[g*kg + kk, c, t]."""
    kg = k // groups
    if backward:
        nest = tpp.LoopNest("AB", a=groups, b=kg)
        g, a = nest.vars
        w = nest.tensor("w", (k, cg, rs), dtype)
        wt = nest.tensor("wt", (groups, kgp, rs, cgp), dtype)
        spec = tpp.make_unary("transpose", cg, rs, ldi=rs, ldo=cgp, dtype_in=dtype)
        nest.call(spec, w[g * kg + a], wt[g, a])
    else:
        # blocks of up to BLOCK output channels, each a (rows, cg*rs) -> (cg*rs, rows)
        # transpose (one element at a time, with ldo=kgp, is ~10x slower on large weights)
        kb = -(-kg // BLOCK)
        nest = tpp.LoopNest("AB", a=groups, b=kb)
        g, a = nest.vars
        w = nest.tensor("w", (k, cg, rs), dtype)
        wt = nest.tensor("wt", (groups, cgp, rs, kgp), dtype)
        for rows, when in _block_cases(a, kb, kg, BLOCK):
            spec = tpp.make_unary("transpose", rows, cg * rs, ldi=cg * rs, ldo=kgp,
                                  dtype_in=dtype)
            nest.call(spec, w[g * kg + a * BLOCK], wt[g, 0, 0, a * BLOCK], when=when)
    return nest.compile()


@functools.lru_cache(maxsize=256)
def _weight_blocks_nest(groups, rowsp, colsp, r, s, brow, bcol, flip, dtype):
    """Step 2: wt (groups, rowsp, r*s, colsp) -> wb (groups*Cb, Rb, r, s, brow, bcol) with
    block [g*Cb + cb, rb, i, j] = wt[g, rb*brow:, tap, cb*bcol:], tap (i, j) or, flipped,
    (r-1-i, s-1-j); bf16 blocks in VNNI-2 pairs."""
    cb, rb = colsp // bcol, rowsp // brow
    nest = tpp.LoopNest("ABCDE", a=groups, b=cb, c=rb, d=r, e=s)
    g, j, b, c, d = nest.vars
    wt = nest.tensor("wt", (groups, rowsp, r * s, colsp), dtype)
    vnni = dtype == _dt.BF16
    shape = (groups * cb, rb, r, s) + ((brow // 2, 2 * bcol) if vnni else (brow, bcol))
    wb = nest.tensor("wb", shape, dtype)
    tap = ((r - 1 - c) * s + (s - 1 - d)) if flip else (c * s + d)
    op = "vnni2" if vnni else "identity"
    spec = tpp.make_unary(op, brow, bcol, ldi=r * s * colsp, dtype_in=dtype)
    nest.call(spec, wt[g, b * brow, tap, j * bcol], wb[g * cb + j, b, c, d])
    return nest.compile()


# The forward packing of a large weight without padded blocks goes by slabs: per output
# block, all its input channels' filters transposed at once ((bk, bc*rs) -> a (bc*rs, bk)
# slab, in cache) and each tap's (bc, bk) rows copied out of it (bf16: as VNNI pairs), one
# pass over w instead of two over a weight-sized intermediate (pack_weight's two steps).
# 2 cores, one process, interleaved: f32 3x3 512 1.06-1.09 -> 0.53-0.62 ms, 3x3 256 0.115 ->
# 0.082, 1x1 2048x512 0.25 -> 0.12; bf16 3x3 512 0.48 -> 0.29, 3x3 256 0.071 -> 0.061, 1x1
# 2048x512 0.138 -> 0.112; under 1 MiB the two ways are level (3x3 128: 0.04-0.06 ms).
SLAB_BYTES = 1 << 20


@functools.lru_cache(maxsize=256)
def _weight_slab_nest(k, cg, rs, groups, bk, bc, dtype):
    """w (k, cg*rs) -> wb (groups*Kb, Cb, rs, bc, bk) through slabs (groups*Kb, bc*rs, bk),
    one per output block (its parallel loop's own), for channel counts in whole blocks."""
    kg = k // groups
    kb, cb = kg // bk, cg // bc
    nest = tpp.LoopNest("ABc", a=groups, b=kb, c=cb)
    g, i, j = nest.vars
    w = nest.tensor("w", (k, cg * rs), dtype)
    slabs = nest.tensor("slabs", (groups * kb, bc * rs, bk), dtype)
    wb = nest.tensor("wb", (groups * kb, cb, rs) + ((bc // 2, 2 * bk) if dtype == _dt.BF16
                                                     else (bc, bk)), dtype)
    nest.call(tpp.make_unary("transpose", bk, bc * rs, ldi=cg * rs, ldo=bk, dtype_in=dtype),
              w[g * kg + i * bk, j * bc * rs], slabs[g * kb + i, 0, 0])
    vnni = dtype == _dt.BF16
    copy = tpp.make_unary("vnni2" if vnni else "identity", bc, bk, ldi=rs * bk,
                          ldo=2 * bk if vnni else bk, dtype_in=dtype)
    for t in range(rs):     # slab row c*rs + t is channel c of tap t
        nest.call(copy, slabs[g * kb + i, t, 0], wb[g * kb + i, j, t])
    return nest.compile()


also_clear(_weight_slab_nest.cache_clear)


@functools.lru_cache(maxsize=256)
def _pointwise_t_nest(k, cg, groups, bk, bc, dtype):
    """w (k, cg) of a 1x1 layer -> wbt (groups*Cb, Kb, 1, 1, bk, bc) (bf16: VNNI-2 pairs of
    rows), the data gradient's packed weight, for channel counts in whole blocks: block
    [g*Cb + c, b] = w[g*kg + b*bk:, c*bc:] as it is (pack_weight's two steps, a transpose of
    every row and a copy of every block, took 0.37 ms for 2048 x 512 f32 in a training step,
    this one copy ~0.15)."""
    kg = k // groups
    kb, cb = kg // bk, cg // bc
    nest = tpp.LoopNest("ABC", a=groups, b=cb, c=kb)
    g, j, i = nest.vars
    vnni = dtype == _dt.BF16
    w = nest.tensor("w", (k, cg), dtype)
    wbt = nest.tensor("wbt", (groups * cb, kb, 1, 1) + ((bk // 2, 2 * bc) if vnni else (bk, bc)),
                      dtype)
    spec = tpp.make_unary("vnni2" if vnni else "identity", bk, bc, ldi=cg, dtype_in=dtype)
    nest.call(spec, w[g * kg + i * bk, j * bc], wbt[g * cb + j, i, 0, 0])
    return nest.compile()


also_clear(_pointwise_t_nest.cache_clear)


@functools.lru_cache(maxsize=256)
def _vector_nest(groups, length, lengthp, dtype_in, dtype_out, pad):
    """pad: v (groups*length,) -> vp (groups*lengthp,) (zeroed by the caller), converting;
    else the inverse (vp -> v)."""
    nest = tpp.LoopNest("A", a=groups)
    a, = nest.vars
    src = nest.tensor("src", (groups * (length if pad else lengthp),), dtype_in)
    dst = nest.tensor("dst", (groups * (lengthp if pad else length),), dtype_out)
    spec = tpp.make_unary("identity", 1, length, dtype_in=dtype_in, dtype_out=dtype_out)
    if pad:
        nest.call(spec, src[a * length], dst[a * lengthp])
    else:
        nest.call(spec, src[a * lengthp], dst[a * length])
    return nest.compile()


# ------------------------------------------------------------------ public conversions
class ToBlocked:
    """to_blocked's decisions for one batch size and layout (to_blocked_step), run on any x of
    that shape: a call allocates the BlockedActivation and runs the conversion nest."""
    __slots__ = ("shape", "dtype", "zeroed", "nest", "threads", "fields")

    def __init__(self, shape, dtype, zeroed, nest, threads, fields):
        self.shape, self.dtype, self.zeroed, self.nest = shape, dtype, zeroed, nest
        self.threads, self.fields = threads, fields

    def __call__(self, x, scratch: str | None = None) -> BlockedActivation:
        """scratch: into the thread's scratch array of that name (_host.temp), for a caller
        that is done with it within its call; else into a fresh array."""
        xb = _host.temp(scratch, self.shape, self.dtype, x, self.zeroed)
        if self.nest is not None:
            self.nest(x, xb, threads=self.threads)
        return BlockedActivation(xb, *self.fields)


def to_blocked_step(n, geo: Geometry, scatter=(1, 1), frame=None, origin=None) -> ToBlocked:
    """The ToBlocked of to_blocked(x, geo, ...) for x of batch size n."""
    bc = geo.bc
    nb = -(-geo.cg // bc)
    hb, wb = frame or (geo.hp, geo.wp)
    oh, ow = origin or (geo.pad[0], geo.pad[2])
    # zeroed only where something is left unwritten: by the nest where that is the frame
    # alone, else (padded channels, scattered pixels) all of xb first
    dense = scatter == (1, 1) and nb * bc == geo.cg
    border = dense and (hb, wb) != (geo.h, geo.w)
    shape = (n, geo.groups * nb, hb, wb, bc)
    nest = _to_blocked_nest(geo.groups, geo.cg, geo.h, geo.w, bc, hb, wb, oh, ow, scatter[0],
                            scatter[1], geo.dtype, border) if n else None
    return ToBlocked(shape, geo.dtype, not dense, nest, _threads(64 * math.prod(shape)),
                     (geo.c, geo.h, geo.w, geo.groups, bc,
                      (oh, hb - oh - geo.h, ow, wb - ow - geo.w)))


def to_blocked(x, geo: Geometry, *, scatter=(1, 1), frame=None, origin=None,
               scratch=None) -> BlockedActivation:
    """x (N, C, H, W) as a BlockedActivation for geo (its padding as the frame). `scatter`
    spaces the pixels (the transposed convolution's zero insertion); frame (hb, wb) and origin
    (oh, ow) override the padded frame; scratch: see ToBlocked.__call__."""
    return to_blocked_step(x.shape[0], geo, scatter, frame, origin)(x, scratch)


def from_blocked(yb, channels, groups, bk, p, q, out, origin=(0, 0)):
    """out (N, channels, p, q) from the blocked yb (N, groups*Kb, pb, qb, bk)."""
    n = yb.shape[0]
    if n:
        nest = _from_blocked_nest(groups, channels // groups, bk, yb.shape[2], yb.shape[3],
                                  origin[0], origin[1], p, q, _host.dtype_of(yb, "yb"))
        nest(yb, out, threads=_threads(64 * n * channels * p * q))
    return out


@functools.lru_cache(maxsize=256)
def _turn_nest(groups, kb, cb, r, s, bc, bk, dtype):
    """wbt (groups*cb, kb, r, s, bk, bc) = every block of wb (groups*kb, cb, r, s, bc, bk)
    transposed, its tap flipped: the data gradient's packed weight from the forward's. bf16
    blocks are VNNI pairs on both sides: each is unpacked (vnni2_inv) into `flat`, transposed
    into `turned` and packed again (vnni2), block by block in cache."""
    nest = tpp.LoopNest("ABCDE", a=groups, b=kb, c=cb, d=r, e=s)
    g, k, c, i, j = nest.vars
    vnni = dtype == _dt.BF16
    wb = nest.tensor("wb", (groups * kb, cb, r, s) + ((bc // 2, 2 * bk) if vnni else (bc, bk)),
                     dtype)
    wbt = nest.tensor("wbt", (groups * cb, kb, r, s) + ((bk // 2, 2 * bc) if vnni else
                                                        (bk, bc)), dtype)
    src, dst = wb[g * kb + k, c, i, j], wbt[g * cb + c, k, r - 1 - i, s - 1 - j]
    if not vnni:
        nest.call(tpp.make_unary("transpose", bc, bk, dtype_in=dtype), src, dst)
        return nest.compile()
    flat = nest.tensor("flat", (groups * kb, cb, r, s, bc, bk), dtype)
    turned = nest.tensor("turned", (groups * kb, cb, r, s, bk, bc), dtype)
    at = (g * kb + k, c, i, j)
    nest.call(tpp.make_unary("vnni2_inv", bc, bk, dtype_in=dtype), src, flat[at])
    nest.call(tpp.make_unary("transpose", bc, bk, dtype_in=dtype), flat[at], turned[at])
    nest.call(tpp.make_unary("vnni2", bk, bc, dtype_in=dtype), turned[at], dst)
    return nest.compile()


def transpose_packed(wb: BlockedWeight, scratch=None) -> BlockedWeight:
    """The data gradient's packed weight (pack_weight(w, ..., transposed=True)) made from the
    forward's packed weight of the same w: one transpose per block (bf16: unpack, transpose,
    repack), where packing w afresh reads it with strides of a whole filter (see
    pack_transposed). scratch: as ToBlocked.__call__'s."""
    if not isinstance(wb, BlockedWeight) or wb.transposed:
        raise ArgumentError(f"transpose_packed: expected a forward packed weight "
                            f"(pack_weight(w, groups, dtype)), got {wb!r}")
    k, cg, r, s = wb.shape
    dtype = _host.dtype_of(wb.data, "packed")
    kg = k // wb.groups
    bc, bk = block(cg, dtype), block(kg, dtype)
    cb, kb = -(-cg // bc), -(-kg // bk)
    shape = (wb.groups * cb, kb, r, s) + ((bk // 2, 2 * bc) if dtype == _dt.BF16 else (bk, bc))
    wbt = _host.temp(scratch, shape, dtype, wb.data)
    args = [wb.data, wbt]
    if dtype == _dt.BF16:
        tiles = (wb.groups * kb, cb, r, s)
        if _host.on_device(wb.data):
            args += [_host.empty(tiles + shape, dtype, wb.data)
                     for shape in ((bc, bk), (bk, bc))]
        else:
            args += [_host.scratch(name, tiles + shape, dtype) for name, shape in
                     (("conv_turn_flat", (bc, bk)), ("conv_turn_turned", (bk, bc)))]
    _turn_nest(wb.groups, kb, cb, r, s, bc, bk, dtype)(
        *args, threads=_threads(64 * k * cg * r * s))
    return BlockedWeight(wbt, wb.shape, wb.groups, True)


def pack_transposed(w, groups, dtype, forward=None, scratch=None) -> BlockedWeight:
    """pack_weight(w, groups, dtype, transposed=True), from `forward` (w's forward packed
    weight) when there is one: turning its blocks is faster than reading w with strides of a
    whole filter (2 cores, interleaved: 3x3 512 f32 0.80 against 0.97 ms, bf16 0.44-0.49
    against 0.55-0.62; 3x3 256 f32 0.050 / 0.121, bf16 0.058 / 0.096)."""
    return transpose_packed(forward, scratch) if forward is not None else \
        pack_weight(w, groups, dtype, transposed=True, scratch=scratch)


def pack_weight(w, groups, dtype, *, transposed=False, scratch=None) -> BlockedWeight:
    """w (K, C/groups, R, S) packed for the forward nest ([G*Kb][Cb][R][S][bc][bk]) or, with
    transposed=True, flipped and transposed for the data gradient ([G*Cb][Kb][R][S][bk][bc]).
    scratch: as ToBlocked.__call__'s."""
    k, cg, r, s = w.shape
    kg = k // groups
    bc, bk = block(cg, dtype), block(kg, dtype)
    cgp, kgp = -(-cg // bc) * bc, -(-kg // bk) * bk
    rs = r * s
    w3 = _host.reshape(_host.contiguous(w), (k, cg, rs))
    # every core for large weights, wt zeroed only for padded blocks (3x3 512 @7 bf16
    # train step, 2 cores, batch 4: 12.5-16 -> 10.6-13.7 ms, a busy machine)
    threads = _threads(64 * k * cg * rs)
    if (not transposed and (cgp, kgp) == (cg, kg)
            and k * cg * rs * dtype.itemsize >= SLAB_BYTES and not _host.on_device(w)):
        kb = kg // bk
        slabs = _host.scratch("conv_pack_slabs", (groups * kb, bc * rs, bk), dtype)
        block_shape = (bc // 2, 2 * bk) if dtype == _dt.BF16 else (bc, bk)
        wb = _host.empty((groups * kb, cg // bc, rs) + block_shape, dtype, w)
        _weight_slab_nest(k, cg, rs, groups, bk, bc, dtype)(
            _host.reshape(w3, (k, cg * rs)), slabs, wb, threads=threads)
        return BlockedWeight(_host.reshape(wb, (groups * kb, cg // bc, r, s) + block_shape),
                             (k, cg, r, s), groups, False)
    zero = (cgp, kgp) != (cg, kg)       # zeroed: padding
    if transposed and rs == 1 and (cgp, kgp) == (cg, kg):
        # a 1x1 weight's data-gradient blocks are w's own (bk x bc) blocks: one copy each
        vnni = dtype == _dt.BF16
        wb = _host.empty((groups * (cg // bc), kg // bk, 1, 1) +
                         ((bk // 2, 2 * bc) if vnni else (bk, bc)), dtype, w)
        _pointwise_t_nest(k, cg, groups, bk, bc, dtype)(_host.reshape(w3, (k, cg)), wb,
                                                        threads=threads)
        return BlockedWeight(wb, (k, cg, r, s), groups, True)
    rows, cols = (kgp, cgp) if transposed else (cgp, kgp)
    brow, bcol = (bk, bc) if transposed else (bc, bk)
    wt = _host.temp("conv_pack_rows", (groups, rows, rs, cols), dtype, w, zero)
    _weight_rows_nest(k, cg, rs, groups, kgp, cgp, transposed, dtype)(w3, wt, threads=threads)
    nest = _weight_blocks_nest(groups, rows, cols, r, s, brow, bcol, transposed, dtype)
    shape = (groups * (cols // bcol), rows // brow, r, s) + \
        ((brow // 2, 2 * bcol) if dtype == _dt.BF16 else (brow, bcol))
    wb = _host.temp(scratch, shape, dtype, w)
    nest(wt, wb, threads=threads)
    return BlockedWeight(wb, (k, cg, r, s), groups, transposed)


def _pad_bias(bias, groups, kg, bk, like):
    """bias (groups*kg,) as the nests read it: f32, each group's kg values padded with zeros
    to whole blocks of bk; an f32 bias that needs no padding is read as it is."""
    kgp = -(-kg // bk) * bk
    dt = _host.dtype_of(bias, "bias")
    if kgp == kg and dt == _dt.F32:
        return _host.contiguous(bias)
    bp = _host.zeros((groups * kgp,), _dt.F32, like)
    _vector_nest(groups, kg, kgp, dt, _dt.F32, True)(_host.contiguous(bias), bp, threads=1)
    return bp


def _size(a):
    return math.prod(a.shape)
