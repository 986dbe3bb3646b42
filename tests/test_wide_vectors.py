"""The AVX-512 generators' logic, run on a host without AVX-512.

The generators emit the same IR for any lane count; on AVX-512 they use 16 f32 lanes. Here
that 16-lane IR is compiled for the host (LLVM splits each vector in two), so tails, 16-bit
bitmask bytes, broadcasts and tile shapes of the AVX-512 path are checked against the
reference even where only AVX2 can run. The AVX-512 instruction selection itself is checked in
test_codegen.py by reading the assembly.
"""
import numpy as np
import pytest

import tpp
from support import run_checked, sixteen_lane_code
from tpp_cpu import target


@pytest.fixture
def sixteen_lanes(monkeypatch):
    if target.current().lanes == 16:
        pytest.skip("this host runs the 16-lane code natively")
    return sixteen_lane_code(monkeypatch)


SHAPES = [(1, 1), (3, 16), (17, 37), (33, 100)]
CASES = [
    ("unary", "relu", dict(bitmask=True)), ("unary", "gelu", {}), ("unary", "exp", {}),
    ("unary", "dropout", dict(p=0.4)), ("unary", "relu_inv", dict(bitmask=True)),
    ("unary", "tanh_inv", {}), ("unary", "identity", dict(bcast="col")),
    ("unary", "reduce_sum", dict(axis=0)), ("unary", "reduce_max", dict(axis=1)),
    ("unary", "transpose", {}), ("unary", "gather_rows", {}),
    ("binary", "add", dict(bcast_in1="row")), ("binary", "muladd", {}),
    ("binary", "cmp_lt", {}), ("binary", "max", dict(bcast_in0="scalar")),
]


@pytest.mark.parametrize("family, op, params", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_sixteen_lane_code_matches_reference(sixteen_lanes, family, op, params, shape, dtype):
    m, n = shape
    if family == "unary":
        spec = tpp.core.spec.make_unary(op, m, n, dtype_in=dtype, **params)
    else:
        spec = tpp.core.spec.make_binary(op, m, n, dtype_in0=dtype, **params)
    run_checked(tpp.Kernel(spec), seed=7 if op == "dropout" else None)


def test_vnni2_with_sixteen_lanes(sixteen_lanes):
    for m, n in [(1, 1), (5, 17), (32, 40)]:
        run_checked(tpp.Kernel(tpp.core.spec.make_unary("vnni2", m, n, dtype_in="bf16")))
        run_checked(tpp.Kernel(tpp.core.spec.make_unary("vnni2_inv", m, n, dtype_in="f16")))


BRGEMM_CASES = [   # (m, n, k, count, spec options): tails in m, n and odd k, every code path
    (17, 37, 9, 3, dict()),
    (33, 20, 8, 2, dict(dtype_a="bf16", vnni_b=True, bias="row", activation="relu",
                        bitmask=True)),
    (5, 16, 7, 4, dict(trans_a=True, beta=1, bias="row", activation="gelu")),
    (3, 33, 5, 2, dict(trans_b=True, dtype_c="bf16", activation="tanh")),
    (29, 50, 3, 1, dict(dtype_a="f16", vnni_b=True, beta=1, activation="sigmoid")),
]


@pytest.mark.parametrize("m, n, k, count, options", BRGEMM_CASES, ids=lambda v: str(v))
def test_brgemm_sixteen_lane_code_matches_reference(sixteen_lanes, m, n, k, count, options):
    """The 16-lane BRGEMM tiles (up to 4 vectors, 32-register blocking, 16-bit mask bytes)."""
    spec = tpp.make_brgemm(m, n, k, **options)
    rng = np.random.default_rng(m * n * k)

    def data(shape, dtype):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)

    a = data((count, *spec.a_shape), spec.dtype_a)
    b = data((count, *spec.b_shape), spec.dtype_b)
    extra, kw = [], {}
    c = data((m, n), spec.dtype_c)
    if spec.beta:
        extra.append(c.copy())
    if spec.bias:
        kw["bias"] = data(n, spec.dtype_c)
        extra.append(kw["bias"])
    got = tpp.BrgemmKernel(spec)(a, b, c, **kw)
    want = tpp.core.reference.run(spec, a, b, *extra)
    if spec.bitmask:
        got, mask = got
        want, want_mask = want
        pre = tpp.core.reference.run(spec.replace(activation=None, bitmask=False), a, b, *extra)
        clear = np.abs(pre) > 1e-4
        bits = tpp.core.reference.unpack_mask(mask, n)
        np.testing.assert_array_equal(bits[clear], tpp.core.reference.unpack_mask(want_mask, n)[clear])
    rtol = {"f32": 2e-5, "bf16": 2 ** -7, "f16": 2 ** -10}[spec.dtype_c.name]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=1e-5 * np.sqrt(k * count))
