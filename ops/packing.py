"""Weights packed once into the blocked layout the GEMM nests read.

A (K, N) operand B is stored as N-blocks of `bn` columns, each block a dense panel:

    f32    (Nb, K, bn)               panel[c][k][j]        = B[k, c*bn + j]
    bf16   (Nb, ceil(K/2), 2*bn)     VNNI-2 pairs: [c][p][2j+t] = B[2p+t, c*bn + j]

with Nb = ceil(N / bn) and the columns past N zero. Packing is one loop nest of identity,
transpose, vnni2 and zero TPPs (one panel per parallel iteration), run where the weight lives:
on the host, or on a GPU for device weights (the packed data is then a device array of the
weight's kind); a PackedWeight is then reused by every call (nothing is repacked).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import tpp
from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError
from tpp.runtime.lru import also_clear

from . import _host, autotune
from .blocked import split


@dataclass(frozen=True, eq=False)
class PackedWeight:
    data: object        # numpy array, torch tensor or device array (ops._host), layout above
    k: int
    n: int
    bn: int
    dtype: _dt.DType
    # the operators' validated plans for calls on this weight (ops.matmul._plan), cleared by
    # tpp.clear_caches()
    plans: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def vnni(self) -> bool:
        return self.dtype == _dt.BF16

    @property
    def device(self):
        """The tpp.runtime.device.Device where the packed data lives."""
        return _host.device_of(self.data)

    @property
    def blocks(self) -> int:
        return self.data.shape[0]

    def __repr__(self):
        return f"<PackedWeight K={self.k} N={self.n} bn={self.bn} {self.dtype}>"


TILE_PANELS = (384, 256, 192, 128)    # panel widths for bf16 weights on a matrix unit
TILE_PANEL_BYTES = 1280 << 10          # the most bytes of one such panel (K x bn bf16)


def default_bn(n: int, tiles: bool = False, k: int | None = None) -> int:
    """Columns per panel: 64 (four AVX-512 or eight AVX2 vectors), or all of a narrower N.
    tiles (bf16 weights multiplied on a matrix unit, tpp.has_matrix_unit): the widest of
    TILE_PANELS that cuts N into equal panels and (k given) whose K x bn panel fits in
    TILE_PANEL_BYTES, else the narrowest that cuts N, else 64. A call's C is then rows x bn:
    its tile configuration and A's rows (in L1 across the panel's 2x2 tile blocks) serve more
    columns; equal panels keep the threads' static split even (384 as 256 + 128 ran one
    thread on twice the other's work); a panel much over 1 MB no longer stays in the L2
    cache while the row blocks use it. ops.linear bf16, x (4096, K), 2 threads, Sapphire
    Rapids, GFLOP/s at bn 64 / 192 / 256 / 384: K 384 N 1536 1341 / - / 1813 / ~1830, K 384
    N 1152 1383 / 1727-1886 / - / 2064-2166; ms at bn 192 / 256 / 384: K 768 N 2304 8.5 /
    8.5 / 8.0, K 3072 N 768 9.3 / 12.2 / - (128: 9.8), K 1536 N 384 2.6 / - / 2.5."""
    if n < 64:
        return n
    if tiles:
        fits = [bn for bn in TILE_PANELS if n % bn == 0]
        for bn in fits:
            if k is None or k * bn * 2 <= TILE_PANEL_BYTES:
                return bn
        if fits:
            return fits[-1]
    return 64


def _check_bn(bn, n):
    """Columns per panel as a Python int: bn (any integral value >= 1), at most n."""
    value = checks.as_int(bn)
    if value is None or value < 1:
        raise ArgumentError(f"bn must be a positive int, got {bn!r}")
    return min(value, n)


def pack_kn(b, *, bn: int | None = None, **unknown) -> PackedWeight:
    """Pack B given as a (K, N) array (the right operand of x @ B), on B's device."""
    _host.reject_unknown(pack_kn, unknown)
    b = _host.host(b, "b", device=True)
    if b.ndim != 2 or 0 in b.shape:
        raise ArgumentError(f"b: expected a non-empty 2-D (K, N) array, got shape "
                            f"{tuple(b.shape)}")
    b = _host.contiguous(b)     # a transposed view (w.T) too: the TPPs read unit-stride rows
    k, n = b.shape
    return _pack(b, k, n, bn, _host.dtype_of(b, "b"), "kn")


def pack_nk(w, *, bn: int | None = None, **unknown) -> PackedWeight:
    """Pack B = w.T given w as an (N, K) array (torch.nn.Linear's weight layout), on w's
    device."""
    _host.reject_unknown(pack_nk, unknown)
    w = _host.host(w, "weight", device=True)
    if w.ndim != 2 or 0 in w.shape:
        raise ArgumentError(f"weight: expected a non-empty 2-D (N, K) array, got shape "
                            f"{tuple(w.shape)}")
    w = _host.contiguous(w)
    n, k = w.shape
    return _pack(w, k, n, bn, _host.dtype_of(w, "weight"), "nk")


def _pack(src, k, n, bn, dt, source) -> PackedWeight:
    """The PackedWeight of a C-contiguous (K, N) ("kn") or (N, K) ("nk") array, by
    _pack_nest on the array's device (the nest writes every element, padding included)."""
    if dt not in (_dt.F32, _dt.BF16):
        raise ArgumentError(f"weights must be f32 or bf16, got {dt}")
    if bn is None:      # a width ops.tune found faster for this weight shape, else the default
        tiles = dt == _dt.BF16 and not _host.on_device(src) and tpp.has_matrix_unit(dt)
        bn = autotune.lookup_bn(n, k, dt) or default_bn(n, tiles, k)
    bn = _check_bn(bn, n)
    blocks = -(-n // bn)
    shape = (blocks, (k + 1) // 2, 2 * bn) if dt == _dt.BF16 else (blocks, k, bn)
    out = _host.empty(shape, dt, src)
    args = (src, out)
    if dt == _dt.BF16 and source == "nk":
        args += (_host.empty((blocks, k, bn), dt, src),)
    threads = 1 if k * n < _SERIAL_ELEMENTS else None
    _pack_nest(k, n, bn, dt, source).call(args, threads)
    return PackedWeight(out, k, n, bn, dt)


_SERIAL_ELEMENTS = 1 << 16      # smaller weights are packed on one thread


@functools.lru_cache(maxsize=256)
def _pack_nest(k, n, bn, dt, source):
    """The nest packing a (K, N) "kn" or (N, K) "nk" source into `out` (the layout above),
    one panel per iteration of its parallel loop over the N blocks: identity (f32 "kn"),
    transpose (f32 "nk"), vnni2 (bf16 "kn", which zeroes the pad row of an odd K) or
    transpose into a (blocks, K, bn) scratch tensor and vnni2 from it (bf16 "nk"); the
    narrower last panel is zeroed first (its columns past N)."""
    vnni = dt == _dt.BF16
    cases, blocks = split(n, bn)
    nest = tpp.LoopNest("A", a=blocks)
    (c,) = nest.vars
    src = nest.tensor("src", (k, n) if source == "kn" else (n, k), dt)
    out = nest.tensor("out", (blocks, (k + 1) // 2, 2 * bn) if vnni else (blocks, k, bn), dt)
    scratch = nest.tensor("scratch", (blocks, k, bn), dt) if vnni and source == "nk" else None
    rows_out, width = ((k + 1) // 2, 2 * bn) if vnni else (k, bn)
    for cols, guard in cases:
        when = guard(c)
        if cols < bn:
            nest.call(tpp.make_unary("zero", rows_out, width, dtype_in=dt,
                                     dtype_out=dt), out[c], when=when)
        if source == "kn":
            op, ldo = ("vnni2", 2 * bn) if vnni else ("identity", bn)
            nest.call(tpp.make_unary(op, k, cols, ldi=n, ldo=ldo, dtype_in=dt, dtype_out=dt),
                      src[0, c * bn], out[c], when=when)
            continue
        transpose = tpp.make_unary("transpose", cols, k, ldi=k, ldo=bn, dtype_in=dt,
                                   dtype_out=dt)
        nest.call(transpose, src[c * bn, 0], scratch[c] if vnni else out[c], when=when)
        if vnni:
            nest.call(tpp.make_unary("vnni2", k, cols, ldi=bn, ldo=2 * bn, dtype_in=dt,
                                     dtype_out=dt), scratch[c], out[c], when=when)
    return nest.compile()


also_clear(_pack_nest.cache_clear)   # tpp.clear_caches() empties it too
