"""Elementwise unary ops, their backward ops and binary ops against tpp.core.reference, for every
element-wise op of the op table (tpp.core.optable) with each of its parameter variants."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tpp
from support import RNG, run_checked

SHAPES = [(1, 1), (1, 17), (16, 16), (17, 17), (100, 100), (3, 8), (9, 24)] + \
    [tuple(int(v) for v in RNG.integers(1, 101, 2)) for _ in range(2)]
DTYPES = ["f32", "bf16", "f16"]

# parameter variants tested besides the defaults
VARIANTS = {"relu": [{"bitmask": True}], "relu_inv": [{"bitmask": True}],
            "leaky_relu": [{"alpha": 0.2}], "leaky_relu_inv": [{"alpha": 0.2}],
            "elu": [{"alpha": 0.5}], "elu_inv": [{"alpha": 0.5}],
            "gelu": [{"approximate": "tanh"}], "gelu_inv": [{"approximate": "tanh"}],
            "dropout": [{"p": 0.3}], "dropout_inv": [{"p": 0.25}]}


def _cases(kind):
    return [(name, params) for name, info in tpp.UNARY_OPS.items() if info.kind == kind
            for params in [{}] + VARIANTS.get(name, [])]


UNARY_MAP = _cases("map")
UNARY_INV = _cases("map_inv")
BINARY = [name for name, info in tpp.BINARY_OPS.items() if info.expr is not None]


def test_every_elementwise_op_of_the_table_is_tested():
    tested = {name for name, _ in UNARY_MAP + UNARY_INV} | set(BINARY)
    table = {name for name, info in list(tpp.UNARY_OPS.items()) + list(tpp.BINARY_OPS.items())
             if info.expr is not None}
    assert tested == table


def _id(case):
    op, params = case
    return op + "".join(f"-{k}={v}" for k, v in params.items())


def _seed(op):
    return 42 if tpp.make_unary(op, 1, 1).scalars else None


@pytest.mark.parametrize("case", UNARY_MAP + UNARY_INV, ids=_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_unary_shapes_and_lds(case, shape):
    op, params = case
    m, n = shape
    pad = 3 + n % 5
    run_checked(tpp.unary(op, m, n, **params), seed=_seed(op))
    run_checked(tpp.unary(op, m, n, ldi=n + pad, ldo=n + pad + 1, **params),
                pad_in=pad, pad_out=pad + 1, seed=_seed(op))


@pytest.mark.parametrize("case", UNARY_MAP + UNARY_INV, ids=_id)
@pytest.mark.parametrize("dtype_in", DTYPES)
@pytest.mark.parametrize("dtype_out", DTYPES)
def test_unary_dtypes(case, dtype_in, dtype_out):
    op, params = case
    run_checked(tpp.unary(op, 7, 37, dtype_in=dtype_in, dtype_out=dtype_out, **params),
                seed=_seed(op))
    run_checked(tpp.unary(op, 1, 1, dtype_in=dtype_in, dtype_out=dtype_out, **params),
                seed=_seed(op))
    run_checked(tpp.unary(op, 17, 16, ldi=19, ldo=21, dtype_in=dtype_in, dtype_out=dtype_out,
                          **params), pad_in=3, pad_out=5, seed=_seed(op))


@pytest.mark.parametrize("case", [c for c in UNARY_MAP if c[0] != "zero"
                                  and tpp.UNARY_OPS[c[0]].bcast is None], ids=_id)
@pytest.mark.parametrize("bcast", ["row", "col", "scalar"])
def test_unary_broadcast(case, bcast):
    op, params = case
    run_checked(tpp.unary(op, 5, 19, bcast=bcast, **params), seed=_seed(op))


def test_replicate_col():
    k = tpp.unary("replicate_col", 4, 21)
    col = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(k(col), np.repeat(col[:, None], 21, axis=1))


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_binary_shapes_and_lds(op, shape):
    m, n = shape
    run_checked(tpp.binary(op, m, n))
    run_checked(tpp.binary(op, m, n, ldi0=n + 2, ldi1=n + 2, ldo=n + 5), pad_in=2, pad_out=5)


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("dtype_in", DTYPES)
@pytest.mark.parametrize("dtype_out", DTYPES)
def test_binary_dtypes(op, dtype_in, dtype_out):
    other = DTYPES[(DTYPES.index(dtype_in) + 1) % 3]
    if op.startswith("cmp_"):
        if dtype_out != "f32":
            pytest.skip("compare ops write a bitmask")
        dtype_out = None
    run_checked(tpp.binary(op, 6, 29, dtype_in0=dtype_in, dtype_in1=other, dtype_out=dtype_out))
    run_checked(tpp.binary(op, 1, 1, dtype_in0=dtype_in, dtype_in1=dtype_in, dtype_out=dtype_out))
    run_checked(tpp.binary(op, 17, 16, ldi0=18, ldi1=20, ldo=17, dtype_in0=other,
                           dtype_in1=dtype_in, dtype_out=dtype_out), pad_in=2, pad_out=1)


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("b0", [None, "row", "col", "scalar"])
@pytest.mark.parametrize("b1", [None, "row", "col", "scalar"])
def test_binary_broadcast(op, b0, b1):
    run_checked(tpp.binary(op, 5, 23, bcast_in0=b0, bcast_in1=b1))


def test_compare_with_nan_and_equal_values():
    a = np.array([[1.0, np.nan, 2.0, -0.0, np.inf, 3.0, 5.0, 1.0, 0.5]], np.float32)
    b = np.array([[1.0, 1.0, np.nan, 0.0, np.inf, 2.0, 6.0, np.nan, 0.5]], np.float32)
    for op in ("gt", "ge", "lt", "le", "eq", "ne"):
        k = tpp.binary(f"cmp_{op}", 1, 9)
        want = getattr(np, {"gt": "greater", "ge": "greater_equal", "lt": "less",
                            "le": "less_equal", "eq": "equal", "ne": "not_equal"}[op])(a, b)
        np.testing.assert_array_equal(tpp.core.reference.unpack_mask(k(a, b), 9), want)


def test_max_min_propagate_nan():
    a = np.array([[np.nan, 1.0, 2.0]], np.float32)
    b = np.array([[1.0, np.nan, 1.0]], np.float32)
    assert np.isnan(tpp.binary("max", 1, 3)(a, b)[0, :2]).all()
    assert np.isnan(tpp.binary("min", 1, 3)(a, b)[0, :2]).all()


def test_relu_specials():
    x = np.array([[-0.0, 0.0, np.nan, -np.inf, np.inf, -1.0, 1e-45, -1e-45]], np.float32)
    y, mask = tpp.unary("relu", 1, 8, bitmask=True)(x)
    np.testing.assert_array_equal(
        y, np.array([[0.0, 0.0, np.nan, 0.0, np.inf, 0.0, 1e-45, 0.0]], np.float32))
    assert not np.signbit(y[0, 0])
    np.testing.assert_array_equal(tpp.core.reference.unpack_mask(mask, 8)[0],
                                  [0, 0, 0, 0, 1, 0, 1, 0])


def test_dropout_keeps_the_right_fraction_and_depends_on_seed():
    k = tpp.unary("dropout", 64, 64, p=0.3)
    x = np.ones((64, 64), np.float32)
    y1, m1 = k(x, seed=1)
    y2, m2 = k(x, seed=2)
    kept = tpp.core.reference.unpack_mask(m1, 64).mean()
    assert abs(kept - 0.7) < 0.03
    assert not np.array_equal(m1, m2)
    np.testing.assert_allclose(np.unique(y1), [0.0, 1 / 0.7], rtol=1e-6)
    back = tpp.unary("dropout_inv", 64, 64, p=0.3)(x, m1)
    np.testing.assert_array_equal(back, y1)


def test_in_place_elementwise():
    x = RNG.standard_normal((9, 20)).astype(np.float32)
    want = tpp.core.reference.run(tpp.unary("exp", 9, 20).spec, x)
    tpp.unary("exp", 9, 20)(x, out=x)
    np.testing.assert_allclose(x, want, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(UNARY_MAP + UNARY_INV), m=st.integers(1, 40), n=st.integers(1, 70),
       pad=st.integers(0, 9), dtype_in=st.sampled_from(DTYPES), dtype_out=st.sampled_from(DTYPES))
def test_unary_hypothesis(case, m, n, pad, dtype_in, dtype_out):
    op, params = case
    k = tpp.unary(op, m, n, ldi=n + pad, dtype_in=dtype_in, dtype_out=dtype_out, **params)
    run_checked(k, pad_in=pad, pad_out=pad, seed=_seed(op))


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(BINARY), m=st.integers(1, 40), n=st.integers(1, 70),
       b0=st.sampled_from([None, "row", "col", "scalar"]),
       b1=st.sampled_from([None, "row", "col", "scalar"]), dtype=st.sampled_from(DTYPES))
def test_binary_hypothesis(op, m, n, b0, b1, dtype):
    run_checked(tpp.binary(op, m, n, bcast_in0=b0, bcast_in1=b1, dtype_in0=dtype))


@pytest.mark.parametrize("pad", [0, 1, 4])
def test_large_outputs_take_the_streaming_path_correctly(pad):
    from tpp_cpu.irx import STREAM_BYTES
    n = 2048
    assert n * n * 4 >= STREAM_BYTES
    x = RNG.standard_normal((n, n)).astype(np.float32)
    k = tpp.binary("add", n, n, bcast_in1="row", ldo=n + pad)
    big = np.full((n + 1, n + pad), 7.0, np.float32)
    row = RNG.standard_normal(n).astype(np.float32)
    k(x, row, out=big[:n, :n])
    np.testing.assert_array_equal(big[:n, :n], x + row)
    assert (big[n:] == 7.0).all() and (big[:n, n:] == 7.0).all()
    if pad == 0:
        assert "vmovntps" in k.dump("asm")


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("op,n,heavy", [("gelu", 1024, True), ("gelu_inv", 100, True),
                                        ("exp", 16, True), ("relu", 1024, False),
                                        ("gelu", 7, False)])
def test_heavy_maps_prefetch_rows_ahead_on_eager_targets(op, n, heavy, eager):
    """A map of irx.MAP_PREFETCH_OPS vector operations or more (a transcendental) prefetches
    its block inputs at least irx.MAP_AHEAD_BYTES ahead where the target asks for eager
    prefetch (Intel's cores); a light one, a block without full vectors (7 columns) or a
    target without eager prefetch does not. (Results: every test above, on this host's
    target.)"""
    import dataclasses

    from tpp_cpu import eltwise
    from tpp_cpu.target import current
    spec = tpp.unary(op, 9, n).spec
    module = eltwise.generate(spec, dataclasses.replace(current(), eager_prefetch=eager), "p")
    assert ("llvm.prefetch" in str(module)) == (heavy and eager)
