"""The operators on device arrays, without a GPU: ops.matmul, ops.linear, ops.pack_*, the MLP
and ops.blocked given 'device' arrays run their loop nests as generated CUDA code on the CPU
emulator (tests/cuda_device_harness.py), and are compared with the same operator on the host.

Checked: results equal the host's (up to float reassociation), stay on the device, of the kind
the backend allocates; every step ran as CUDA code (no host fallback: the nests launched are
recorded); a PackedWeight packed on the device is reused without recompiling; mixed
host/device operands are an ArgumentError naming them; torch CUDA tensors (faked: there is no
GPU) reach the CUDA backend, which says it cannot run them.
Shapes are small and shared between tests, so the emulator compiles few kernels.
"""
import numpy as np
import pytest

import ops
import tpp
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError, UnsupportedError

from cuda_device_harness import (CaiOnly, HostDevice, available, emulated_cuda,  # noqa: F401
                                 fake_cuda_class, host_of)

pytestmark = pytest.mark.skipif(not available(), reason="g++ or the CUDA headers are missing")

K, N = 40, 80           # f32 weights: two panels of 64 columns, the second 16 wide
KB, NB = 37, 48         # bf16 weights: an odd K (a VNNI pad row), one panel


def _rand(rng, shape, dtype="f32"):
    return rng.standard_normal(shape).astype(np.float32).astype(_dt.lookup(dtype).numpy)


def _close(got, want, tol=2e-5):
    assert not isinstance(got, np.ndarray), "the result came back on the host"
    np.testing.assert_allclose(np.asarray(host_of(got), np.float32),
                               np.asarray(want, np.float32), rtol=tol, atol=tol)


def _nests(launched):
    return [s for s in launched if s.family == "loopnest"]


# ---------------------------------------------------------------- packing
@pytest.mark.parametrize("dtype, k, n", [("f32", K, N), ("bf16", KB, NB)])
def test_packing_on_the_device_matches_the_host(emulated_cuda, dtype, k, n):
    rng = np.random.default_rng(0)
    w = _rand(rng, (n, k), dtype)
    for pack, arg in ((ops.pack_nk, w), (ops.pack_kn, np.ascontiguousarray(w.T))):
        want = pack(arg)
        got = pack(HostDevice(arg))
        assert isinstance(got.data, HostDevice) and got.device == tpp.runtime.device.Device("cuda")
        assert (got.k, got.n, got.bn, got.dtype) == (want.k, want.n, want.bn, want.dtype)
        np.testing.assert_array_equal(host_of(got.data), want.data)   # padding included
    assert len(_nests(emulated_cuda.launched)) == 2


def test_a_transposed_device_view_is_copied_by_a_tpp(emulated_cuda):
    rng = np.random.default_rng(1)
    w = _rand(rng, (N, K))
    got = ops.pack_kn(HostDevice(w).T)                 # (K, N) with unit row stride
    np.testing.assert_array_equal(host_of(got.data), ops.pack_kn(w.T).data)
    assert emulated_cuda.launched[0].op == "transpose"


# ---------------------------------------------------------------- matmul / linear
@pytest.mark.parametrize("m", [70, 5])
def test_matmul_f32_with_bias_and_activation_and_a_runtime_m(emulated_cuda, m):
    rng = np.random.default_rng(2)
    a, b, bias = _rand(rng, (m, K)), _rand(rng, (K, N)), _rand(rng, (N,))
    want = ops.matmul(a, b, bias=bias, activation="relu")
    got = ops.matmul(HostDevice(a), HostDevice(b), bias=HostDevice(bias), activation="relu")
    assert isinstance(got, HostDevice) and got.shape == (m, N)
    _close(got, want)


def test_a_packed_weight_is_reused_across_calls_and_sizes(emulated_cuda):
    rng = np.random.default_rng(3)
    w, bias = _rand(rng, (N, K)), _rand(rng, (N,))
    packed = ops.pack_nk(HostDevice(w))
    compiled = len(emulated_cuda.compiled)
    for m in (70, 9, 64):
        x = _rand(rng, (m, K))
        _close(ops.linear(HostDevice(x), packed, HostDevice(bias), "relu"),
               ops.linear(x, w, bias, "relu"))
    assert len(emulated_cuda.compiled) == compiled + 1     # one nest, compiled once
    out = HostDevice(np.zeros((9, N), np.float32))
    x = _rand(rng, (9, K))
    assert ops.matmul(HostDevice(x), packed, out=out, bias=HostDevice(bias),
                      activation="relu") is out
    _close(out, ops.linear(x, w, bias, "relu"))


@pytest.mark.parametrize("out_dtype", [None, "f32"])
def test_matmul_bf16_with_out_dtype(emulated_cuda, out_dtype):
    rng = np.random.default_rng(4)
    a, b = _rand(rng, (21, KB), "bf16"), _rand(rng, (KB, NB), "bf16")
    want = ops.matmul(a, b, out_dtype=out_dtype)
    got = ops.matmul(HostDevice(a), HostDevice(b), out_dtype=out_dtype)
    assert got.dtype == want.dtype
    _close(got, want, tol=1e-2)


def test_linear_keeps_leading_dimensions_and_takes_bare_interface_objects(emulated_cuda):
    rng = np.random.default_rng(5)
    x, w, bias = _rand(rng, (2, 3, K)), _rand(rng, (N, K)), _rand(rng, (N,))
    want = ops.linear(x, w, bias, "relu")
    got = ops.linear(HostDevice(x), HostDevice(w), HostDevice(bias), "relu")
    assert isinstance(got, HostDevice) and got.shape == (2, 3, N)
    _close(got, want)
    # a producer known only through __cuda_array_interface__: the output is the backend's
    got = ops.linear(CaiOnly(x), CaiOnly(w), CaiOnly(bias), "relu")
    assert tuple(got.__cuda_array_interface__["shape"]) == (2, 3, N)
    np.testing.assert_allclose(np.asarray(tpp.runtime.arrays.to_host(
        tpp.runtime.arrays.as_array(got, "y"))).reshape(2, 3, N), want, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- the MLP
@pytest.mark.parametrize("dtype, k, n, tol", [("f32", K, N, 1e-4), ("bf16", KB, NB, 3e-2)])
def test_mlp_forward_and_backward(emulated_cuda, dtype, k, n, tol):
    rng = np.random.default_rng(6)
    x, w, b = _rand(rng, (2, 35, k), dtype), _rand(rng, (n, k), dtype), _rand(rng, (n,), dtype)
    dy = _rand(rng, (2, 35, n), dtype)
    y_h, saved_h = ops.mlp_forward(x, w, b, "gelu")
    y_d, saved_d = ops.mlp_forward(HostDevice(x), HostDevice(w), HostDevice(b), "gelu")
    _close(y_d, y_h, tol)
    assert y_d.shape == (2, 35, n) and y_d.dtype == y_h.dtype
    for got, want in zip(ops.mlp_backward(HostDevice(dy), saved_d),
                         ops.mlp_backward(dy, saved_h)):
        assert got.shape == want.shape and got.dtype == want.dtype
        _close(got, want, tol)
    if dtype == "f32":
        _close(ops.mlp(HostDevice(x), HostDevice(w), HostDevice(b), "gelu"), y_h)
        # no rows: the weight gradient is zeros (written by the zero TPP)
        from ops.mlp import weight_grad
        dw = weight_grad(HostDevice(np.zeros((0, n), np.float32)),
                         HostDevice(np.zeros((0, k), np.float32)))
        _close(dw, np.zeros((n, k)))


def test_blocked_helpers_on_the_device(emulated_cuda):
    rng = np.random.default_rng(7)
    x = _rand(rng, (70, N))
    sums = HostDevice(np.zeros(N, np.float32))
    ops.blocked.column_sums(HostDevice(x), sums)
    _close(sums, x.sum(axis=0), tol=1e-4)
    out = HostDevice(np.zeros((70, N), np.float32))
    ops.blocked.map_rows("relu", [HostDevice(x)], out)
    _close(out, np.maximum(x, 0))
    xt = HostDevice(np.zeros((N, 70), np.float32))
    ops.blocked.transpose(HostDevice(x), xt)
    _close(xt, x.T)


# ---------------------------------------------------------------- errors
def test_mixed_host_and_device_operands_are_named(emulated_cuda):
    rng = np.random.default_rng(8)
    a, b, bias = _rand(rng, (6, K)), _rand(rng, (K, N)), _rand(rng, (N,))
    with pytest.raises(ArgumentError, match=r"a on cuda:0.*b on the host"):
        ops.matmul(HostDevice(a), ops.pack_kn(b))
    with pytest.raises(ArgumentError, match=r"a on the host.*b on cuda:0"):
        ops.matmul(a, ops.pack_kn(HostDevice(b)))
    with pytest.raises(ArgumentError, match=r"bias on the host"):
        ops.matmul(HostDevice(a), HostDevice(b), bias=bias)
    with pytest.raises(ArgumentError, match=r"different devices"):
        ops.linear(a, ops.pack_kn(b), HostDevice(bias))
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*weight on the host"):
        ops.mlp_forward(HostDevice(a), b.T, None, "gelu")
    with pytest.raises(ArgumentError, match=r"different devices"):
        ops.matmul(HostDevice(a), HostDevice(b), out=np.zeros((6, N), np.float32))




# ---------------------------------------------------------------- torch drop-ins
torch = pytest.importorskip("torch")


FakeCuda = fake_cuda_class()


def test_torch_cuda_tensors_reach_the_cuda_backend():
    """Without a GPU (no cupy here either) the CUDA backend refuses them, clearly."""
    import ops.torch as ot
    from tpp_cuda import runtime
    if runtime.available():
        pytest.skip("a GPU is visible: tests/test_cuda_runtime.py runs the real thing")
    x, w, b = FakeCuda((4, K)), FakeCuda((N, K)), FakeCuda((N,))
    for call in (lambda: ot.linear(x, w, b, "relu"), lambda: ops.linear(x, w, b),
                 lambda: ot.linear(FakeCuda((4, K), requires_grad=True), w, b)):
        with pytest.raises(UnsupportedError, match="CUDA|GPU"):
            call()
    layer = ot.Linear(K, N)
    with pytest.raises(ArgumentError, match=r"input on cuda:0.*weight on the host"):
        layer(x)


def test_a_moved_linear_is_packed_again_on_its_device():
    import ops.torch as ot
    layer = ot.Linear(K, N)
    layer(torch.randn(3, K))
    assert layer.packed_weight().device.is_host
    layer.to("meta")                 # no backend runs meta tensors: the repack says so
    with pytest.raises(UnsupportedError, match="meta"):
        layer.packed_weight()
