"""Regression: 16-bit outputs whose row ends in a short tail write exactly their own bytes.

LLVM 22 (llvmlite 0.48-0.50) lowered a one-lane masked store of `trunc <16 x i32> to
<16 x i16>` to a 32-bit `vmovd`, so bf16 outputs with a one-lane remainder (n = 1, 17, 33, 65
on AVX-512; 1, 9, 17 on AVX2) wrote 2 bytes past the row; irx.store_vec stores that lane as a
scalar. Each kernel here writes into a buffer filled with a sentinel byte pattern, through a
view with padded rows and a spare row, and every byte outside the view must survive. Inputs
are small integers so every result is exact in bf16/f16 and can be compared bit for bit.
"""
import numpy as np
import pytest

import tpp
from tpp_cpu import target

SENTINEL = 0xA5A5                 # as uint16: a NaN payload in both bf16 and f16
NS = [1, 2, 3, 9, 15, 17, 33, 65]  # one-lane tails: 1, 17, 33, 65 (16 lanes); 1, 9, 17, 33, 65 (8)
DTYPES = ["bf16", "f16"]
PAD = 3
RNG = np.random.default_rng(179489)


def _isas():
    native = target.host_isa()
    return [native] if native == "avx2" else [native, "avx2"]


@pytest.fixture(params=_isas())
def isa(request, monkeypatch):
    monkeypatch.setenv("TPP_CPU_ISA", request.param)
    return request.param


def _fresh(k):
    """A new kernel object for k's spec, compiled for the ISA selected now."""
    return type(k)(k.spec)


def _ints(shape):
    return RNG.integers(-4, 5, shape).astype(np.float32)


def _guarded(rows, cols, dtype):
    """(view, buffer): a rows x cols view (row pitch cols + PAD) into a sentinel-filled buffer
    with one spare row; cols only (rows=None): a 1-D view followed by PAD elements."""
    np_dtype = tpp.core.dtypes.lookup(dtype).numpy
    if rows is None:
        big = np.full(cols + PAD, SENTINEL, np.uint16)
        return big.view(np_dtype)[:cols], big
    big = np.full((rows + 1, cols + PAD), SENTINEL, np.uint16)
    return big.view(np_dtype)[:rows, :cols], big


def _check(big, view, want, dtype):
    """view holds want (bit-exact) and nothing else in big changed."""
    np_dtype = tpp.core.dtypes.lookup(dtype).numpy
    got_bits = view.view(np.uint16)
    want_bits = np.asarray(want, np.float32).astype(np_dtype).view(np.uint16)
    np.testing.assert_array_equal(got_bits, want_bits)
    outside = np.ones(big.shape, bool)
    outside[tuple(slice(0, s) for s in view.shape)] = False
    bad = np.argwhere(outside & (big != SENTINEL))
    assert bad.size == 0, f"written outside the output at {bad[:4].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
def test_unary_identity(isa, n, dtype):
    m = 3
    k = _fresh(tpp.unary("identity", m, n, dtype_out=dtype))
    x = _ints((m, n))
    out, big = _guarded(m, n, dtype)
    k(x, out=out)
    _check(big, out, x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
def test_binary_add(isa, n, dtype):
    m = 2
    k = _fresh(tpp.binary("add", m, n, dtype_out=dtype))
    x, y = _ints((m, n)), _ints((m, n))
    out, big = _guarded(m, n, dtype)
    k(x, y, out=out)
    _check(big, out, x + y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 9, 17, 65])
def test_reduce_columns(isa, n, dtype):
    m = 5
    k = _fresh(tpp.unary("reduce_sum", m, n, dtype_out=dtype, axis=0))
    x = _ints((m, n))
    out, big = _guarded(None, n, dtype)
    k(x, out=out)
    _check(big, out, x.sum(axis=0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mnk", [(1, 1, 1), (3, 17, 4), (29, 65, 3)], ids=lambda s: "x".join(map(str, s)))
def test_brgemm(isa, mnk, dtype):
    m, n, kk = mnk
    k = _fresh(tpp.brgemm(m, n, kk, dtype_c=dtype))
    a, b = _ints((2, m, kk)), _ints((2, kk, n))
    c, big = _guarded(m, n, dtype)
    k(a, b, c)
    _check(big, c, np.einsum("bmk,bkn->mn", a, b), dtype)
