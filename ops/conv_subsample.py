"""Strided pixel selection on NCHW arrays for 1x1 strided layers (ResNet's downsampling
projections), so that ops.conv_pointwise runs them as GEMMs on the selected pixels:

    subsample  xs (N, C, P, Q) = x[:, :, ::sh, ::sw] (the first P rows, Q columns)
    scatter    dx (N, C, H, W) = zero but dx[:, :, sh*p, sw*q] = dxs[:, :, p, q]

A TPP reads and writes rows of consecutive elements, so a column stride goes through a
transpose: per (image, block of BLOCK channels, output row p), x's row sh*p (channels x W) is
transposed into a (W x channels) scratch, whose every sw-th row is transposed back into xs's row
p (ldi = sw*channels); scatter is the reverse, through a scratch whose other rows stay zero.
The scratch is indexed by (channel block, row) and the images are the inner, serial loop, so
each thread reuses its own piece (cache-resident) and no two threads share one.
"""
from __future__ import annotations

import functools

import tpp
from tpp.runtime.lru import also_clear

from . import _host
from .conv_layout import BLOCK, _block_cases, _size, _threads


@functools.lru_cache(maxsize=256)
def _nest(c, h, w, p, q, sh, sw, dtype, gather):
    """gather: xs (N, c, p, q) from x (N, c, h, w); else dx (N, c, h, w) rows sh*p from dxs
    (N, c, p, q) (dx's other rows left to the caller). Scratch t (nb, p, w, BLOCK)."""
    n = tpp.size("N")
    nb = -(-c // BLOCK)
    nest = tpp.LoopNest("ABc", a=nb, b=p, c=n)
    b, i, a = nest.vars
    full = nest.tensor("full", (n, c, h, w), dtype)
    part = nest.tensor("part", (n, c, p, q), dtype)
    t = nest.tensor("t", (nb, p, w, BLOCK), dtype)
    for rows, when in _block_cases(b, nb, c, BLOCK):
        row, piece, scratch = full[a, b * BLOCK, i * sh, 0], part[a, b * BLOCK, i, 0], t[b, i]
        if gather:      # x's row -> (w x rows) -> every sw-th row of it -> xs's row
            nest.call(tpp.make_unary("transpose", rows, w, ldi=h * w, ldo=BLOCK,
                                     dtype_in=dtype), row, scratch, when=when)
            nest.call(tpp.make_unary("transpose", q, rows, ldi=sw * BLOCK, ldo=p * q,
                                     dtype_in=dtype), scratch, piece, when=when)
        else:           # dxs's row -> every sw-th row of the (zero) scratch -> dx's row
            nest.call(tpp.make_unary("transpose", rows, q, ldi=p * q, ldo=sw * BLOCK,
                                     dtype_in=dtype), piece, scratch, when=when)
            nest.call(tpp.make_unary("transpose", w, rows, ldi=BLOCK, ldo=h * w,
                                     dtype_in=dtype), scratch, row, when=when)
    return nest.compile()


also_clear(_nest.cache_clear)


def subsample(x, sh, sw, p, q):
    """x[:, :, ::sh, ::sw] cut to (N, C, p, q), C-contiguous (host data)."""
    n, c, h, w = x.shape
    dt = _host.dtype_of(x, "x")
    xs = _host.empty((n, c, p, q), dt, x)
    if n:
        t = _host.empty((-(-c // BLOCK), p, w, BLOCK), dt, x)
        _nest(c, h, w, p, q, sh, sw, dt, True)(x, xs, t, threads=_threads(64 * _size(xs)))
    return xs


def scatter(dxs, sh, sw, h, w):
    """(N, C, h, w) zeros with dxs (N, C, p, q) at every (sh*i, sw*j) (host data)."""
    n, c, p, q = dxs.shape
    dt = _host.dtype_of(dxs, "dxs")
    dx = _host.zeros((n, c, h, w), dt, dxs)
    if n:
        t = _host.zeros((-(-c // BLOCK), p, w, BLOCK), dt, dxs)
        _nest(c, h, w, p, q, sh, sw, dt, False)(dx, dxs, t, threads=_threads(64 * _size(dx)))
    return dx
