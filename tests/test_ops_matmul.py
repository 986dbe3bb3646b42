"""ops.matmul / ops.linear / packing / blocked helpers / one MLP layer, against numpy and torch.

References are computed in float64 on exactly the values the kernels read (bf16 inputs are
drawn in f32 and rounded first), so the only differences are the library's own roundings.

Tolerance (_assert_gemm). An output element is z = sum_k a_ik b_kj (+ bias_j), summed in f32
(products of bf16 values are exact in f32). Whatever the order, the summation error is at most
gamma_{K+1} * (|a| @ |b| + |bias|)_ij with gamma_n = n*u/(1 - n*u), u = 2^-24: a worst-case
bound, so the check never flakes, yet a dropped or doubled K chunk, a wrong panel or a shifted
row is off by O(|a| @ |b|), thousands of times more. The activation multiplies that error by
at most its slope (1.13 for gelu) and adds its own relative error (1e-6, tests/support.py); a
bf16 output then rounds to nearest: half an ulp, 2^-8 relative.

Shapes are few on purpose: every distinct problem compiles one loop nest (0.1 to 1.5 s here).
Sizes 65, 70, 130, 200 leave row and column remainders (bm = bn = 64); K = 1100 with an f32
output and blocking kc = 512 runs three chunks: first (beta 0), middle (beta 1), and a 76-deep
last chunk with the epilogue (the default keeps K whole up to 8192).
"""
import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ops
import tpp
from ops import blocked
from support import assert_matches
from tpp.core.errors import ArgumentError, TPPError

matmul_mod = importlib.import_module("ops.matmul")   # `ops.matmul` is the function
packing_mod = importlib.import_module("ops.packing")

BF16 = tpp.BF16.numpy
TORCH_NAME = {"f32": "float32", "bf16": "bfloat16"}
U = 2.0 ** -24
SLOPE = {None: 1.0, "relu": 1.0, "gelu": 1.13, "sigmoid": 0.25, "tanh": 1.0}
ACT_REL = {None: 0.0, "relu": 0.0, "gelu": 1e-6, "sigmoid": 1e-6, "tanh": 1e-6}
OUT_REL = {"f32": 0.0, "bf16": 2.0 ** -8}
ACTS = (None, "relu", "gelu", "sigmoid", "tanh")


def _np(dtype):
    return tpp.core.dtypes.lookup(dtype).numpy


def _data(rng, shape, dtype, scale=1.0):
    """Normal values of the given scale, exactly representable in dtype."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(_np(dtype))


def _f64(x):
    if isinstance(x, torch.Tensor):
        x = x.float().numpy()
    return np.asarray(x).astype(np.float64)


def _act64(z, act):
    if act is None:
        return z
    t = torch.from_numpy(z)
    return {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "sigmoid": torch.sigmoid,
            "tanh": torch.tanh}[act](t).numpy()


def _assert_gemm(got, a, b, bias=None, act=None, dtype_out="f32"):
    """got == act(a @ b + bias) within the bound of the module docstring."""
    a64, b64 = _f64(a), _f64(b)
    k = a64.shape[1]
    z = a64 @ b64
    mag = np.abs(a64) @ np.abs(b64)
    if bias is not None:
        z = z + _f64(bias)
        mag = mag + np.abs(_f64(bias))
    want = _act64(z, act)
    n_ops = k + 1
    acc = n_ops * U / (1 - n_ops * U) * mag
    err_f32 = SLOPE[act] * acc + ACT_REL[act] * np.abs(want) + 1e-30
    bound = err_f32 + OUT_REL[dtype_out] * (np.abs(want) + err_f32)
    g = _f64(got)
    assert g.shape == want.shape, (g.shape, want.shape)
    assert np.isfinite(g).all()
    err = np.abs(g - want)
    bad = err > bound
    assert not bad.any(), (f"{bad.sum()} of {g.size} elements off, first at "
                           f"{np.argwhere(bad)[:3].tolist()}: got {g[bad][:3]} want "
                           f"{want[bad][:3]} (bound {bound[bad][:3]})")


def _problem(seed, m, n, k, dtype, bias_dtype=None):
    """a (m, k) and b (k, n) scaled so that a @ b is O(1), and a bias."""
    rng = np.random.default_rng(seed)
    s = k ** -0.25
    a, b = _data(rng, (m, k), dtype, s), _data(rng, (k, n), dtype, s)
    bias = None if bias_dtype is None else _data(rng, (n,), bias_dtype, 0.5)
    return a, b, bias


# --- matmul against numpy --------------------------------------------------------------------

# (m, n, k, dtype, out_dtype, bias, activation, blocking)
MATMUL_CASES = [
    (1, 70, 65, "f32", None, False, None, None),             # a single row
    (65, 1, 130, "f32", None, True, "relu", None),           # a single column
    (70, 65, 1, "f32", None, True, "sigmoid", None),         # K = 1
    (130, 200, 100, "f32", None, False, None, None),         # remainders both ways, 12 tiles
    (65, 70, 1100, "f32", None, True, "gelu", ops.Blocking(64, 512)),  # 3 chunks: 512 x 2 + 76
    (65, 70, 1100, "f32", None, True, "gelu", None),         # the default: K whole
    (3, 5, 1300, "f32", None, False, "tanh", ops.Blocking(64, 512)),    # 3 chunks, tiny tiles
    (70, 130, 200, "bf16", None, True, "relu", None),        # bf16 in, bf16 out
    (33, 20, 67, "bf16", None, False, "gelu", None),         # odd K: a padded VNNI pair
    (65, 70, 1100, "bf16", "f32", True, "tanh", ops.Blocking(64, 512)),  # bf16 -> f32, chunks
    (50, 70, 100, "f32", None, True, None, ops.Blocking(7, 33)),     # 33, 33, 33, 1
    (5, 9, 4, "f32", None, False, "relu", ops.Blocking(1, 1)),       # every K step a chunk
    (40, 30, 130, "f32", None, False, None, ops.Blocking(16, 100)),  # first + last, no middle
    (19, 66, 131, "bf16", "f32", True, "sigmoid", ops.Blocking(5, 64)),  # bf16, odd last chunk
    (20, 10, 30, "bf16", None, False, None, ops.Blocking(1000, 1000)),   # bm > M: remainder kernels only; kc clamped to K
]


@pytest.mark.parametrize("m,n,k,dtype,out_dtype,has_bias,act,blocking", MATMUL_CASES)
def test_matmul_matches_numpy(m, n, k, dtype, out_dtype, has_bias, act, blocking):
    dt_out = out_dtype or dtype
    a, b, bias = _problem(m * 7919 + n * 31 + k, m, n, k, dtype, dt_out if has_bias else None)
    y = ops.matmul(a, b, bias=bias, activation=act, out_dtype=out_dtype, blocking=blocking)
    assert isinstance(y, np.ndarray) and y.dtype == _np(dt_out) and y.shape == (m, n)
    _assert_gemm(y, a, b, bias, act, dt_out)


def test_every_row_count_is_covered_once_by_the_remainder_pieces():
    """One packed weight, every M from 0 to 75: the rows past the whole 64-row blocks run as
    at most one kernel each of 8, 4, 2 and 1 rows (ops.matmul.REMAINDER_PIECES), each row once."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    packed = ops.pack_nk(w)
    for m in range(76):
        x = rng.standard_normal((m, 24)).astype(np.float32)
        np.testing.assert_allclose(ops.linear(x, packed, bias, "relu"),
                                   np.maximum(x @ w.T + bias, 0), rtol=1e-5, atol=1e-5)
    plan, = packed.plans.values()
    assert {k.m for k in plan.nest.spec.kernel_specs()} == {64, 8, 4, 2, 1}


@pytest.mark.parametrize("act", ACTS)
def test_matmul_bias_and_each_activation(act):
    a, b, bias = _problem(5, 65, 70, 130, "f32", "f32")
    _assert_gemm(ops.matmul(a, b, bias=bias, activation=act), a, b, bias, act)


def test_matmul_out_is_written_in_place():
    a, b, bias = _problem(1, 130, 200, 100, "f32")
    out = np.full((130, 200), np.nan, np.float32)
    y = ops.matmul(a, b, out=out)
    assert y is out
    _assert_gemm(out, a, b)
    # bf16 in, both output dtypes; the out buffer decides nothing, out_dtype does
    a, b, bias = _problem(2, 70, 130, 200, "bf16", "bf16")
    out = np.zeros((70, 130), BF16)
    assert ops.matmul(a, b, out, bias, "relu") is out
    _assert_gemm(out, a, b, bias, "relu", "bf16")
    a, b, bias = _problem(3, 65, 70, 1100, "bf16", "f32")
    out = np.full((65, 70), np.nan, np.float32)
    assert ops.matmul(a, b, out, bias, "tanh", out_dtype="f32") is out
    _assert_gemm(out, a, b, bias, "tanh", "f32")


def test_matmul_strided_views_and_torch():
    a, b, _ = _problem(4, 130, 200, 100, "f32")
    wide = np.zeros((130, 150), np.float32)
    wide[:, 10:110] = a
    bt = np.ascontiguousarray(b.T)                      # b given as a transposed view
    y = ops.matmul(wide[:, 10:110], bt.T)
    _assert_gemm(y, a, b)
    yt = ops.matmul(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(yt, torch.Tensor) and yt.dtype == torch.float32
    np.testing.assert_array_equal(yt.numpy(), y)


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 150), n=st.integers(1, 150), k=st.integers(1, 150),
       kind=st.sampled_from([("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32")]),
       act=st.sampled_from(ACTS), has_bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_matmul_hypothesis(m, n, k, kind, act, has_bias, seed):
    dtype, dt_out = kind
    a, b, bias = _problem(seed, m, n, k, dtype, dt_out if has_bias else None)
    y = ops.matmul(a, b, bias=bias, activation=act, out_dtype=dt_out)
    _assert_gemm(y, a, b, bias, act, dt_out)


def test_choose_blocking():
    f32, bf = tpp.F32, tpp.BF16
    # 64 rows whatever M is (one nest serves every M); K chunks depend on K only
    assert ops.choose_blocking(1, f32) == ops.Blocking(64, 1)
    assert ops.choose_blocking(8192, f32) == ops.Blocking(64, 8192)
    assert ops.choose_blocking(8193, f32) == ops.Blocking(64, 4096)
    assert ops.choose_blocking(1100, bf) == ops.Blocking(64, 1100)   # bf16 out: K whole


# --- linear and packed-weight reuse ----------------------------------------------------------

def test_linear_2d_3d_raw_and_packed(monkeypatch):
    rng = np.random.default_rng(11)
    w = _data(rng, (65, 70), "f32", 70 ** -0.25)       # (N, K) like nn.Linear
    x = _data(rng, (2, 3, 70), "f32", 70 ** -0.25)
    bias = _data(rng, (65,), "f32")
    want_b = w.T
    y3 = ops.linear(x, w, bias, "gelu")
    assert y3.shape == (2, 3, 65)
    _assert_gemm(y3.reshape(6, 65), x.reshape(6, 70), want_b, bias, "gelu")
    y2 = ops.linear(x.reshape(6, 70), w, bias, "gelu")
    assert y2.shape == (6, 65)
    np.testing.assert_array_equal(y2, y3.reshape(6, 65))

    pw = ops.pack_nk(w)
    assert isinstance(pw, ops.PackedWeight) and (pw.k, pw.n) == (70, 65)
    snapshot = pw.data.copy()

    def no_packing(*args, **kwargs):
        raise AssertionError("a PackedWeight was packed again")
    for mod in (matmul_mod, packing_mod, ops):
        monkeypatch.setattr(mod, "pack_nk", no_packing)
        monkeypatch.setattr(mod, "pack_kn", no_packing)
    for _ in range(2):
        np.testing.assert_array_equal(ops.linear(x, pw, bias, "gelu"), y3)
        np.testing.assert_array_equal(ops.linear(x.reshape(6, 70), pw, bias, "gelu"), y2)
        np.testing.assert_array_equal(ops.matmul(x.reshape(6, 70), pw, None, bias, "gelu"), y2)
    np.testing.assert_array_equal(pw.data, snapshot)     # and never written


def test_linear_torch_matches_functional_linear():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 70) * 70 ** -0.25
    w = torch.randn(65, 70) * 70 ** -0.25
    bias = torch.randn(65)
    y = ops.linear(x, ops.pack_nk(w), bias, "gelu")
    assert isinstance(y, torch.Tensor) and y.shape == (2, 3, 65)
    want = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), w.double(),
                                                                bias.double()))
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_linear_bf16_and_single_vector():
    rng = np.random.default_rng(12)
    w = _data(rng, (20, 67), "bf16", 67 ** -0.25)
    x = _data(rng, (33, 67), "bf16", 67 ** -0.25)
    y = ops.linear(x, w, None, "gelu")
    assert y.dtype == BF16
    _assert_gemm(y, x, w.T, None, "gelu", "bf16")
    v = ops.linear(x[0], w)                              # x (K,) -> (N,)
    assert v.shape == (20,)
    _assert_gemm(v[None], x[:1], w.T, None, None, "bf16")


# --- packed layout ---------------------------------------------------------------------------

def _expected_panels(b, bn, vnni):
    """The documented layout, element by element: f32 (Nb, K, bn) and bf16 VNNI-2
    (Nb, ceil(K/2), 2*bn), columns past N and the odd K's pad row zero."""
    k, n = b.shape
    nb = -(-n // bn)
    if not vnni:
        out = np.zeros((nb, k, bn), b.dtype)
        for c in range(nb):
            for j in range(min(bn, n - c * bn)):
                out[c, :, j] = b[:, c * bn + j]
        return out
    out = np.zeros((nb, (k + 1) // 2, 2 * bn), b.dtype)
    for c in range(nb):
        for p in range((k + 1) // 2):
            for t in range(2):
                if 2 * p + t < k:
                    for j in range(min(bn, n - c * bn)):
                        out[c, p, 2 * j + t] = b[2 * p + t, c * bn + j]
    return out


@pytest.mark.parametrize("dtype,k,n,bn,bn_eff", [
    ("f32", 5, 70, None, 64), ("f32", 3, 40, 16, 16), ("f32", 4, 7, 100, 7),
    ("bf16", 5, 70, None, 64), ("bf16", 7, 40, 16, 16), ("bf16", 1, 3, None, 3),
    ("bf16", 6, 33, 32, 32)])
def test_packed_layout(dtype, k, n, bn, bn_eff):
    rng = np.random.default_rng(k * 100 + n)
    b = _data(rng, (k, n), dtype) + np.asarray(3.0, _np(dtype))   # no zeros in b itself
    want = _expected_panels(b, bn_eff, dtype == "bf16")
    pk = ops.pack_kn(b, bn=bn)
    pn = ops.pack_nk(np.ascontiguousarray(b.T), bn=bn)
    for p in (pk, pn):
        assert (p.k, p.n, p.bn, p.dtype) == (k, n, bn_eff, tpp.core.dtypes.lookup(dtype))
        assert p.vnni == (dtype == "bf16") and p.blocks == want.shape[0]
        assert p.data.dtype == want.dtype and p.data.shape == want.shape
        np.testing.assert_array_equal(p.data.view(np.uint16 if dtype == "bf16" else np.uint32),
                                      want.view(np.uint16 if dtype == "bf16" else np.uint32))
    # the padding (columns past N, the odd K's second half of a pair) is exactly zero
    last = n - (want.shape[0] - 1) * bn_eff
    if dtype == "f32":
        assert not pk.data[-1, :, last:].any()
    else:
        assert not pk.data[-1, :, 2 * last:].astype(np.float32).any()
        if k % 2:
            assert not pk.data[:, -1, 1::2].astype(np.float32).any()


def test_packed_torch_in_torch_out():
    w = torch.randn(9, 6)
    p = ops.pack_nk(w)
    assert isinstance(p.data, torch.Tensor)
    np.testing.assert_array_equal(p.data.numpy(), _expected_panels(w.numpy().T.copy(), 9, False))
    wb = w.bfloat16()
    pb = ops.pack_kn(wb.T)                  # a transposed view packs too
    assert pb.data.dtype == torch.bfloat16
    np.testing.assert_array_equal(pb.data.float().numpy(),
                                  _expected_panels(wb.T.float().numpy(), 9, True))


# --- thread counts ---------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k,dtype,has_bias,act", [
    (130, 200, 100, "f32", False, None),      # 12 tiles, 5.2 MFLOP: runs parallel
    (65, 70, 1100, "f32", True, "gelu"),      # 3 K chunks, a barrier after each
    (70, 130, 200, "bf16", True, "relu"),
])
def test_thread_counts_give_identical_results(m, n, k, dtype, has_bias, act):
    a, b, bias = _problem(21, m, n, k, dtype, dtype if has_bias else None)
    assert 2.0 * m * n * k >= matmul_mod._SERIAL_FLOPS or dtype == "bf16"
    pw = ops.pack_kn(b)
    results = []
    try:
        for threads in (1, 2, 3):
            tpp.set_num_threads(threads)
            assert tpp.get_num_threads() == threads
            results.append(ops.matmul(a, pw, bias=bias, activation=act))
    finally:
        tpp.set_num_threads(None)
    _assert_gemm(results[0], a, b, bias, act, dtype)
    for r in results[1:]:
        assert r.tobytes() == results[0].tobytes()


# --- blocked helpers -------------------------------------------------------------------------

@pytest.mark.parametrize("m,n", [(130, 70), (1, 65), (64, 1)])
def test_blocked_map_rows(m, n):
    rng = np.random.default_rng(m + n)
    z = _data(rng, (m, n), "f32")
    g = _data(rng, (m, n), "f32")
    y = np.full((m, n), np.nan, np.float32)
    assert blocked.map_rows("gelu", [z], y) is y
    assert_matches(y, _act64(z.astype(np.float64), "gelu"), "gelu", "f32")
    blocked.map_rows("add", [z, g], y)
    np.testing.assert_array_equal(y, z + g)
    blocked.map_rows("relu_inv", [g, z], y)
    np.testing.assert_array_equal(y, np.where(z > 0, g, 0))
    blocked.map_rows("leaky_relu", [z], y, alpha=0.25)
    np.testing.assert_array_equal(y, np.where(z > 0, z, np.float32(0.25) * z))
    yb = np.zeros((m, n), BF16)
    blocked.map_rows("identity", [z], yb)                 # f32 -> bf16 rounding
    np.testing.assert_array_equal(yb, z.astype(BF16))


@pytest.mark.parametrize("m,n", [(130, 70), (1, 65), (65, 1), (200, 129)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_blocked_transpose(m, n, dtype):
    x = _data(np.random.default_rng(m * n), (m, n), dtype)
    out = np.zeros((n, m), _np(dtype))
    assert blocked.transpose(x, out) is out
    np.testing.assert_array_equal(out, x.T)


@pytest.mark.parametrize("m,n", [(130, 70), (1, 65), (200, 1)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_blocked_column_sums(m, n, dtype):
    x = _data(np.random.default_rng(m + 3 * n), (m, n), dtype)
    out = np.full((n,), np.nan, np.float32)
    assert blocked.column_sums(x, out) is out
    x64 = x.astype(np.float64)
    bound = m * U / (1 - m * U) * np.abs(x64).sum(axis=0)
    assert (np.abs(out - x64.sum(axis=0)) <= bound).all()


def test_blocked_errors():
    x = np.zeros((5, 4), np.float32)
    with pytest.raises(ArgumentError, match=r"input 1: shape \(5, 3\)"):
        blocked.map_rows("add", [x, np.zeros((5, 3), np.float32)], np.zeros((5, 4), np.float32))
    with pytest.raises(ArgumentError, match="out: expected a 2-D array"):
        blocked.map_rows("relu", [x], np.zeros(20, np.float32))
    with pytest.raises(ArgumentError, match=r"out: expected shape \(4, 5\)"):
        blocked.transpose(x, np.zeros((5, 4), np.float32))
    with pytest.raises(ArgumentError, match=r"out: expected shape \(4,\)"):
        blocked.column_sums(x, np.zeros(5, np.float32))
    with pytest.raises(ArgumentError, match="expected f32, bf16 or f16 data"):
        blocked.transpose(x.astype(np.float64), np.zeros((4, 5)))


# --- one MLP layer against torch autograd ----------------------------------------------------

# f32: only the summation order differs (observed <= 3e-6 on these O(1)-O(10) values).
# bf16: both sides round z, y, dz and the results to bf16; here at the same points (observed:
# equal but for one gelu ulp), elsewhere (another ISA, another torch kernel) a rounding may
# flip: two bf16 ulps (2^-7 relative each), torch's own bf16 rtol, and 1e-2 near zero.
MLP_TOL = {"f32": dict(rtol=2e-5, atol=2e-5), "bf16": dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("act", ACTS)
def test_mlp_forward_backward_against_torch(act, has_bias, dtype):
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(7)
    k, n = 70, 65                                         # remainders of 64 everywhere
    x = (torch.randn(2, 35, k, generator=g) * k ** -0.25).to(tdt)     # 3-D: M = 70
    w = (torch.randn(n, k, generator=g) * k ** -0.25).to(tdt)
    b = torch.randn(n, generator=g).to(tdt) if has_bias else None
    dy = torch.randn(2, 35, n, generator=g).to(tdt)

    y, saved = ops.mlp_forward(x, w, b, act)
    dx, dw, db = ops.mlp_backward(dy, saved)
    assert y.dtype == dx.dtype == dw.dtype == tdt
    assert (y.shape, dx.shape, dw.shape) == ((2, 35, n), x.shape, w.shape)
    assert (db is None) == (not has_bias)

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = b.clone().requires_grad_() if has_bias else None
    yr = torch.nn.functional.linear(xr, wr, br)
    if act is not None:
        yr = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "sigmoid": torch.sigmoid,
              "tanh": torch.tanh}[act](yr)
    yr.backward(dy)
    tol = MLP_TOL[dtype]
    torch.testing.assert_close(y, yr.detach(), **tol)
    torch.testing.assert_close(dx, xr.grad, **tol)
    torch.testing.assert_close(dw, wr.grad, **tol)
    if has_bias:
        assert db.dtype == tdt and db.shape == (n,)
        torch.testing.assert_close(db, br.grad, **tol)

    # inference: the fused epilogue gives the forward's y (bf16: z is not rounded first)
    yi = ops.mlp(x, w, b, act)
    assert yi.shape == y.shape and yi.dtype == tdt
    if dtype == "f32":
        torch.testing.assert_close(yi, y, rtol=2e-6, atol=1e-6)
    else:
        torch.testing.assert_close(yi, y, rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(ops.mlp(x, w, b, act, packed=ops.pack_nk(w)), yi,
                               rtol=0, atol=0)


def test_mlp_backward_selected_gradients_numpy():
    rng = np.random.default_rng(3)
    x = _data(rng, (5, 7), "f32")
    w = _data(rng, (3, 7), "f32")
    b = _data(rng, (3,), "f32")
    dy = _data(rng, (5, 3), "f32")
    y, saved = ops.mlp_forward(x, w, b, "relu")
    assert isinstance(y, np.ndarray)
    dx, dw, db = ops.mlp_backward(dy, saved, need_x=False, need_b=False)
    assert dx is None and db is None
    dz = np.where(x.astype(np.float64) @ w.T + b > 0, dy, 0)
    _assert_gemm(dw, dz.T, x)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("m", [1, 255, 256, 600])
def test_weight_grad_steps_of_m(m, dtype):
    """dw = dz.T @ x sums M in 256-row steps (the first writes dw, the later add, the tail has
    a count of its own): one step, a tail alone, exactly one full step, two full steps and a
    tail; f32 sums, a bf16 result rounded once. Numpy and torch arrays."""
    wg = importlib.import_module("ops.mlp").weight_grad
    rng = np.random.default_rng(m)
    n, k = 70, 130                          # remainders of 64 both ways
    dz, x = _data(rng, (m, n), dtype, m ** -0.25), _data(rng, (m, k), dtype, m ** -0.25)
    dw = wg(dz, x)
    assert dw.dtype == _np(dtype) and dw.shape == (n, k)
    _assert_gemm(dw, dz.T, x, dtype_out=dtype)
    tdw = wg(torch.from_numpy(dz.astype(np.float32)).to(getattr(torch, TORCH_NAME[dtype])),
             torch.from_numpy(x.astype(np.float32)).to(getattr(torch, TORCH_NAME[dtype])))
    assert isinstance(tdw, torch.Tensor)
    assert np.array_equal(tdw.float().numpy(), dw.astype(np.float32))


# --- errors ----------------------------------------------------------------------------------

def _f(*shape):
    return np.ones(shape, np.float32)


def _b(*shape):
    return np.ones(shape, BF16)


def _readonly(arr):
    arr.flags.writeable = False
    return arr


def _dy_wrong(shape):
    _, saved = ops.mlp_forward(_f(5, 7), _f(3, 7), None, "relu")
    return lambda: ops.mlp_backward(_f(*shape), saved)


ERRORS = [
    ("dtype mismatch", lambda: ops.matmul(_f(5, 7), _b(7, 3)), "input is f32 but the weight is bf16"),
    ("K mismatch", lambda: ops.matmul(_f(5, 7), _f(6, 3)), "input has 7 columns, but the weight has K = 6"),
    ("1-D a", lambda: ops.matmul(_f(7), _f(7, 3)), r"a: expected a 2-D \(M, K\) array, got shape \(7,\)"),
    ("3-D b", lambda: ops.matmul(_f(5, 7), _f(1, 7, 3)), r"b: expected a non-empty 2-D \(K, N\) array"),
    ("empty K", lambda: ops.matmul(_f(5, 0), _f(0, 3)), r"b: expected a non-empty 2-D .*\(0, 3\)"),
    ("bad activation", lambda: ops.matmul(_f(5, 7), _f(7, 3), activation="swish"), "activation must be one of .*'swish'"),
    ("unhashable activation", lambda: ops.matmul(_f(5, 7), _f(7, 3), activation=["relu"]), r"activation must be one of .*\['relu'\]"),
    ("f32 in, bf16 out", lambda: ops.matmul(_f(5, 7), _f(7, 3), out_dtype="bf16"), "out_dtype bf16 with f32 inputs"),
    ("f16 out", lambda: ops.matmul(_b(5, 7), _b(7, 3), out_dtype="f16"), "out_dtype f16 with bf16 inputs"),
    ("unknown out_dtype", lambda: ops.matmul(_f(5, 7), _f(7, 3), out_dtype="f99"), "unknown dtype 'f99'"),
    ("bm 0", lambda: ops.matmul(_f(5, 7), _f(7, 3), blocking=ops.Blocking(0, 4)), "blocking.bm must be a positive int, got 0"),
    ("kc negative", lambda: ops.matmul(_f(5, 7), _f(7, 3), blocking=ops.Blocking(4, -1)), "blocking.kc must be a positive int, got -1"),
    ("bm float", lambda: ops.matmul(_f(5, 7), _f(7, 3), blocking=ops.Blocking(4.0, 4)), "blocking.bm must be a positive int, got 4.0"),
    ("kc bool", lambda: ops.matmul(_f(5, 7), _f(7, 3), blocking=ops.Blocking(4, True)), "blocking.kc must be a positive int, got True"),
    ("blocking tuple", lambda: ops.matmul(_f(5, 7), _f(7, 3), blocking=(4, 4)), r"blocking must be an ops.Blocking, got \(4, 4\)"),
    ("blocking list", lambda: ops.matmul(_f(5, 7), _f(7, 3), blocking=[4, 4]), r"blocking must be an ops.Blocking, got \[4, 4\]"),
    ("kc < K, bf16 out", lambda: ops.matmul(_b(5, 8), _b(8, 3), blocking=ops.Blocking(4, 4)), "blocking.kc < K needs an f32 output"),
    ("odd kc, bf16", lambda: ops.matmul(_b(5, 8), _b(8, 3), out_dtype="f32", blocking=ops.Blocking(4, 3)), "blocking.kc must be even for bf16.*got 3"),
    ("bias length", lambda: ops.matmul(_f(5, 7), _f(7, 3), bias=_f(4)), r"bias: expected shape \(3,\), got \(4,\)"),
    ("bias 2-D", lambda: ops.matmul(_f(5, 7), _f(7, 3), bias=_f(1, 3)), r"bias: expected shape \(3,\), got \(1, 3\)"),
    ("bias f64", lambda: ops.matmul(_f(5, 7), _f(7, 3), bias=np.zeros(3)), "bias: expected f32, got float64"),
    ("bias f32, bf16 out", lambda: ops.matmul(_b(5, 7), _b(7, 3), bias=_f(3)), "bias: expected bf16, got float32"),
    ("bias bf16, f32 out", lambda: ops.matmul(_b(5, 7), _b(7, 3), bias=_b(3), out_dtype="f32"), "bias: expected f32, got bfloat16"),
    ("out shape", lambda: ops.matmul(_f(5, 7), _f(7, 3), out=_f(5, 4)), r"expected shape \(5, 3\), got \(5, 4\)"),
    ("out dtype", lambda: ops.matmul(_f(5, 7), _f(7, 3), out=np.zeros((5, 3))), "expected f32, got float64"),
    ("out bf16 for f32 out", lambda: ops.matmul(_b(5, 7), _b(7, 3), out=_b(5, 3), out_dtype="f32"), "expected f32, got bfloat16"),
    ("out read-only", lambda: ops.matmul(_f(5, 7), _f(7, 3), out=_readonly(_f(5, 3))), "read-only"),
    ("out strided", lambda: ops.matmul(_f(5, 7), _f(7, 3), out=_f(5, 6)[:, ::2]), "C-contiguous"),
    ("f64 a", lambda: ops.matmul(np.ones((5, 7)), _f(7, 3)), "a: expected f32, bf16 or f16 data, got float64"),
    ("f64 b", lambda: ops.matmul(_f(5, 7), np.ones((7, 3))), "b: expected f32, bf16 or f16 data, got float64"),
    ("f16 weight", lambda: ops.matmul(_f(5, 7).astype(np.float16), _f(7, 3).astype(np.float16)), "weights must be f32 or bf16, got f16"),
    ("int input", lambda: ops.linear(np.ones((5, 7), np.int32), _f(3, 7)), "x: expected f32, bf16 or f16 data, got int32"),
    ("not an array", lambda: ops.matmul(_f(5, 7), "b"), "b: expected an array"),
    ("linear K mismatch", lambda: ops.linear(_f(5, 7), _f(3, 6)), r"x: expected shape \(\.\.\., 6\), got \(5, 7\)"),
    ("linear 1-D weight", lambda: ops.linear(_f(5, 7), _f(7)), r"weight: expected a non-empty 2-D \(N, K\) array"),
    ("pack bn 0", lambda: ops.pack_kn(_f(7, 3), bn=0), "bn must be a positive int, got 0"),
    ("mlp bad activation", lambda: ops.mlp_forward(_f(5, 7), _f(3, 7), None, "elu"), "activation must be one of"),
    ("mlp bias length", lambda: ops.mlp_forward(_f(5, 7), _f(3, 7), _f(4)), r"bias: expected shape \(3,\), got \(4,\)"),
    ("mlp 3-D weight", lambda: ops.mlp(_f(5, 7), _f(1, 3, 7)), r"weight: expected \(N, K\)"),
    ("dy columns", _dy_wrong((5, 4)), r"dy: expected shape \(\.\.\., 3\), got \(5, 4\)"),
    ("dy rows", _dy_wrong((4, 3)), "dy: 4 rows, the forward had 5"),
]


@pytest.mark.parametrize("fn,match", [(f, m) for _, f, m in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors(fn, match):
    with pytest.raises(TPPError, match=match):
        fn()


def test_error_dy_dtype():
    _, saved = ops.mlp_forward(_f(5, 7), _f(3, 7), None, "relu")
    with pytest.raises(ArgumentError, match="dy is bf16, the forward ran in f32"):
        ops.mlp_backward(_b(5, 3), saved)
    with pytest.raises(ArgumentError, match="dy: expected f32, bf16 or f16 data, got float64"):
        ops.mlp_backward(np.zeros((5, 3)), saved)


def test_out_overlapping_an_input_is_refused():
    # the nest reads a, the weight and the bias while it writes out: a shared buffer would
    # silently corrupt the result (it did, before this check)
    a = _data(np.random.default_rng(9), (70, 70), "f32")
    b = _data(np.random.default_rng(10), (70, 70), "f32")
    with pytest.raises(ArgumentError, match="out must not overlap a, the weight or the bias"):
        ops.matmul(a, b, out=a)
    pw = ops.pack_kn(b)
    with pytest.raises(ArgumentError, match="must not overlap"):
        ops.matmul(a, pw, out=pw.data.reshape(-1)[:70 * 70].reshape(70, 70))
    buf = np.zeros((71, 70), np.float32)
    with pytest.raises(ArgumentError, match="must not overlap"):
        ops.matmul(a, b, out=buf[1:], bias=buf[1])
    ops.matmul(a, b, out=buf[:70], bias=buf[70])         # adjacent, not overlapping: fine
    _assert_gemm(buf[:70], a, b, np.zeros(70))
    np.testing.assert_array_equal(a, _data(np.random.default_rng(9), (70, 70), "f32"))


def test_cached_plan_still_checks_the_weight():
    # a plan is looked up after the first call; a weight with another K (bf16: 7 and 8 rows
    # pack to the same (1, 4, 6) panels) or dtype must still be refused, not silently used
    rng = np.random.default_rng(13)
    a = _data(rng, (5, 7), "bf16")
    _assert_gemm(ops.matmul(a, b7 := _data(rng, (7, 3), "bf16")), a, b7, dtype_out="bf16")
    with pytest.raises(ArgumentError, match="input has 7 columns, but the weight has K = 8"):
        ops.matmul(a, _data(rng, (8, 3), "bf16"))
    af = a.astype(np.float32)
    ops.matmul(af, b7.astype(np.float32))
    with pytest.raises(ArgumentError, match="input is f32 but the weight is bf16"):
        ops.matmul(af, b7)
