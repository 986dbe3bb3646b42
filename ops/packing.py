"""Weights packed once into the blocked layout the GEMM nests read.

A (K, N) operand B is stored as N-blocks of `bn` columns, each block a dense panel:

    f32    (Nb, K, bn)               panel[c][k][j]        = B[k, c*bn + j]
    bf16   (Nb, ceil(K/2), 2*bn)     VNNI-2 pairs: [c][p][2j+t] = B[2p+t, c*bn + j]

with Nb = ceil(N / bn) and the columns past N zero. Packing runs the identity, transpose and
vnni2 TPPs block by block; a PackedWeight is then reused by every call (nothing is repacked).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tpp
from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError

from . import _host


@dataclass(frozen=True, eq=False)
class PackedWeight:
    data: object        # numpy array or torch tensor, layout above
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
    def blocks(self) -> int:
        return self.data.shape[0]

    def __repr__(self):
        return f"<PackedWeight K={self.k} N={self.n} bn={self.bn} {self.dtype}>"


def default_bn(n: int) -> int:
    """Columns per panel: 64 (four AVX-512 or eight AVX2 vectors), or all of a narrower N."""
    return n if n < 64 else 64


def _check_bn(bn, n):
    """Columns per panel as a Python int: bn (any integral value >= 1), at most n."""
    value = checks.as_int(bn)
    if value is None or value < 1:
        raise ArgumentError(f"bn must be a positive int, got {bn!r}")
    return min(value, n)


def pack_kn(b, *, bn: int | None = None, **unknown) -> PackedWeight:
    """Pack B given as a (K, N) array (the right operand of x @ B)."""
    _host.reject_unknown(pack_kn, unknown)
    b = _host.host(b, "b")
    if b.ndim != 2 or 0 in b.shape:
        raise ArgumentError(f"b: expected a non-empty 2-D (K, N) array, got shape "
                            f"{tuple(b.shape)}")
    b = _host.contiguous(b)     # a transposed view (w.T) too: the TPPs read unit-stride rows
    dt = _host.dtype_of(b, "b")
    k, n = b.shape
    bn = _check_bn(default_bn(n) if bn is None else bn, n)
    out = _alloc(k, n, bn, dt, b)
    for c in range(out.shape[0]):
        cols = min(bn, n - c * bn)
        src = b[:, c * bn:c * bn + cols]
        if dt == _dt.BF16:
            tpp.unary("vnni2", k, cols, dtype_in="bf16")(src, out=out[c][:, :2 * cols])
        else:
            tpp.unary("identity", k, cols, dtype_in=dt)(src, out=out[c][:, :cols])
    return PackedWeight(out, k, n, bn, dt)


def pack_nk(w, *, bn: int | None = None, **unknown) -> PackedWeight:
    """Pack B = w.T given w as an (N, K) array (torch.nn.Linear's weight layout)."""
    _host.reject_unknown(pack_nk, unknown)
    w = _host.host(w, "weight")
    if w.ndim != 2 or 0 in w.shape:
        raise ArgumentError(f"weight: expected a non-empty 2-D (N, K) array, got shape "
                            f"{tuple(w.shape)}")
    w = _host.contiguous(w)
    dt = _host.dtype_of(w, "weight")
    n, k = w.shape
    bn = _check_bn(default_bn(n) if bn is None else bn, n)
    out = _alloc(k, n, bn, dt, w)
    scratch = _host.empty((k, bn), dt, w) if dt == _dt.BF16 else None
    for c in range(out.shape[0]):
        rows = min(bn, n - c * bn)
        src = w[c * bn:c * bn + rows, :]
        if dt == _dt.BF16:
            tpp.unary("transpose", rows, k, dtype_in="bf16")(src, out=scratch[:, :rows])
            tpp.unary("vnni2", k, rows, dtype_in="bf16")(scratch[:, :rows],
                                                         out=out[c][:, :2 * rows])
        else:
            tpp.unary("transpose", rows, k, dtype_in=dt)(src, out=out[c][:, :rows])
    return PackedWeight(out, k, n, bn, dt)


def _alloc(k, n, bn, dt, like):
    blocks = -(-n // bn)
    if dt == _dt.BF16:
        return _host.zeros((blocks, (k + 1) // 2, 2 * bn), dt, like)
    if dt != _dt.F32:
        raise ArgumentError(f"weights must be f32 or bf16, got {dt}")
    return _host.zeros((blocks, k, bn), dt, like)
