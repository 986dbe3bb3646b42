"""bf16 outputs of a long K (ops.matmul_longk): f32 sums over K chunks, one rounding to bf16.

Checked with test_ops_matmul's bound (summation error of f32 sums plus half a bf16 ulp), on
K just above LONG_K (three whole chunks and a 28-deep tail) and at 4096; the plan is the
chunked one exactly when the heuristic would have kept a longer-than-LONG_K K whole; every
path of the plain _Plan (thin calls, out=, numpy and torch, bias and activation) holds, and
bad input fails as on the whole-K path.
"""
import importlib

import numpy as np
import pytest
import torch

import ops
from test_ops_matmul import _assert_gemm, _problem
from tpp.core.errors import ArgumentError

matmul_mod = importlib.import_module("ops.matmul")
longk = importlib.import_module("ops.matmul_longk")

K_TAIL = longk.LONG_K + 28          # 3 chunks of KC and a tail of 28


def _plan(a, packed, bias, act, blocking=None):
    return matmul_mod._plan(a, packed, None, bias is not None, act, blocking, "a")


@pytest.mark.parametrize("k, act, bias", [(K_TAIL, "gelu", True), (4096, None, False)])
def test_long_k_bf16_matches_the_f64_reference(k, act, bias):
    a, b, bv = _problem(11, 70, 65, k, "bf16", "bf16" if bias else None)
    packed = ops.pack_kn(b)
    assert isinstance(_plan(a, packed, bv, act), longk.LongKPlan)
    got = ops.matmul(a, packed, bias=bv, activation=act)
    assert got.dtype == a.dtype and got.shape == (70, 65)
    _assert_gemm(got, a, b, bv, act, "bf16")


def test_torch_linear_thin_path_and_out():
    a, b, bv = _problem(12, 5, 33, 4096, "bf16", "bf16")
    x, w, bias = (torch.from_numpy(t.view(np.int16)).view(torch.bfloat16) for t in
                  (a, np.ascontiguousarray(b.T), bv))
    packed = ops.pack_nk(w)
    first = ops.linear(x, packed, bias, "relu")
    again = ops.linear(x, packed, bias, "relu")           # the weight's plan: thin_call
    assert isinstance(first, torch.Tensor) and first.dtype == torch.bfloat16
    assert torch.equal(first, again)
    _assert_gemm(first, a, b, bv, "relu", "bf16")
    out = torch.full((5, 33), 7.0, dtype=torch.bfloat16)
    r = ops.matmul(x, ops.pack_kn(w.T.contiguous()), out=out)
    assert r is out
    _assert_gemm(out, a, b, None, None, "bf16")
    # 3-D input: rows of the leading dimensions
    y3 = ops.linear(x.reshape(1, 5, 4096), packed, bias, "relu")
    assert y3.shape == (1, 5, 33) and torch.equal(y3[0], first)


def test_where_the_chunked_plan_is_taken():
    a, b, _ = _problem(13, 4, 9, longk.LONG_K, "bf16")
    packed = ops.pack_kn(b)
    assert isinstance(_plan(a, packed, None, None), matmul_mod._Plan)     # K = LONG_K: whole
    a2, b2, _ = _problem(13, 4, 9, longk.LONG_K + 2, "bf16")
    p2 = ops.pack_kn(b2)
    assert isinstance(_plan(a2, p2, None, None), longk.LongKPlan)
    # a blocking given keeps its meaning (K whole here), as does an f32 output
    whole = ops.Blocking(64, longk.LONG_K + 2)
    assert isinstance(_plan(a2, p2, None, None, whole), matmul_mod._Plan)
    f32 = matmul_mod._plan(a2, p2, "f32", False, None, None, "a")
    assert isinstance(f32, matmul_mod._Plan)
    got = ops.matmul(a2, p2, blocking=whole)
    _assert_gemm(got, a2, b2, None, None, "bf16")


def test_bad_input_fails_as_on_the_whole_k_path():
    a, b, bv = _problem(14, 6, 10, 4096, "bf16", "bf16")
    packed = ops.pack_kn(b)
    with pytest.raises(ArgumentError, match="bias: expected bf16"):
        ops.matmul(a, packed, bias=bv.astype(np.float32))
    with pytest.raises(ArgumentError):
        ops.matmul(a, packed, bias=bv[:5])
    with pytest.raises(ArgumentError):
        ops.matmul(a, packed, out=np.empty((6, 10), np.float32))        # bf16 out expected
    with pytest.raises(ArgumentError):
        ops.matmul(a, packed, out=np.empty((6, 11), a.dtype))
    overlap = np.empty((6, 4096), a.dtype)
    overlap[:] = a
    with pytest.raises(ArgumentError):
        ops.matmul(overlap, packed, out=overlap[:, :10])                 # out overlaps a


def test_bad_input_after_good_calls():
    """The weight's cached plan (ops.linear's thin path) checks as the first call did."""
    a, b, bv = _problem(15, 6, 10, 4096, "bf16", "bf16")
    w = np.ascontiguousarray(b.T)
    packed = ops.pack_nk(w)
    ops.linear(a, packed, bv)
    ops.linear(a, packed, bv)                                   # thin path
    with pytest.raises(ArgumentError, match="bias: expected bf16"):
        ops.linear(a, packed, bv.astype(np.float32))
    with pytest.raises(ArgumentError):
        ops.linear(a[:, :100], packed, bv)                       # K mismatch
    with pytest.raises(ArgumentError):
        ops.linear(a.astype(np.float32), packed, bv)             # dtype mismatch

