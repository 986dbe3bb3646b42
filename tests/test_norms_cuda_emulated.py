"""ops.norms on device arrays, without a GPU: layer_norm, rms_norm, softmax (forward and
backward), bias_act_dropout and the residual LayerNorm given 'device' arrays run their loop
nests as generated CUDA code on the CPU emulator (tests/cuda_device_harness.py), compared with
the same operators on the host.

Checked: results equal the host's (up to float reassociation: the CUDA sums are lane-strided),
stay on the device, of the kind the backend allocates; every device step ran as a CUDA loop
nest (the norms' nests, with the weight / bias gradients as per-row terms summed by
ops.blocked.column_sums' nest: the CUDA equations reduce along axis 1 only); mixed host/device
operands are an ArgumentError naming them; a mask that needs broadcasting is refused on the
device; torch CUDA tensors (faked: there is no GPU) reach the CUDA backend.
Shapes are small (one full block of rows plus a few rows past it, odd widths) and shared
between tests, so the emulator compiles few kernels.
"""
import numpy as np
import pytest

import ops
from ops import residual_norm
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError, UnsupportedError

from cuda_device_harness import (HostDevice, available, emulated_cuda, fake_cuda_class,  # noqa: F401
                                 host_of, skip_if_gpu)

pytestmark = pytest.mark.skipif(not available(), reason="g++ or the CUDA headers are missing")

# (leading shape, n): 67 rows of 45 = one block of 64 rows (ops.norms.block_rows) + 3 rows;
# 2 x 19 rows of 300 = one block of 32 + 6 rows
SHAPES = [((67,), 45), ((2, 19), 300)]
# each dtype with one shape (each distinct nest is a g++ build of the emulator: ~1 s)
CASES = [("f32", *SHAPES[0]), ("bf16", *SHAPES[1])]
TOL = {"f32": 2e-5, "bf16": 2e-2}


def _rand(rng, shape, dtype="f32"):
    return rng.standard_normal(shape).astype(np.float32).astype(_dt.lookup(dtype).numpy)


def _dev(*arrays):
    return tuple(None if a is None else HostDevice(a) for a in arrays)


def _close(got, want, tol):
    if want is None:
        assert got is None
        return
    assert isinstance(got, HostDevice), f"the result came back as {type(got).__name__}"
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(host_of(got), np.float32),
                               np.asarray(want, np.float32), rtol=tol, atol=tol)


def _only_nests(emulated):
    assert emulated.launched
    assert {s.family for s in emulated.launched} == {"loopnest"}


# ---------------------------------------------------------------- layer norm
@pytest.mark.parametrize("dtype, lead, n", CASES)
def test_layer_norm_forward_and_backward(emulated_cuda, lead, n, dtype):
    rng = np.random.default_rng(0)
    tol = TOL[dtype]
    x, dy = _rand(rng, (*lead, n), dtype), _rand(rng, (*lead, n), dtype)
    w, b = _rand(rng, (n,), dtype), _rand(rng, (n,), dtype)
    _close(ops.layer_norm(*_dev(x, w, b), eps=1e-4), ops.layer_norm(x, w, b, eps=1e-4), tol)
    want = ops.layer_norm_forward(x, w, b)
    got = ops.layer_norm_forward(*_dev(x, w, b))
    for g, h in zip(got, want):
        _close(g, h, tol)
    _, mean, rstd = got
    _, hmean, hrstd = want
    for need in ((True, True, True), (False, True, False)):
        grads = ops.layer_norm_backward(HostDevice(dy), HostDevice(x), mean, rstd,
                                        HostDevice(w), need=need)
        for g, h in zip(grads, ops.layer_norm_backward(dy, x, hmean, hrstd, w, need=need)):
            _close(g, h, 5 * tol)       # the column sums add 67 / 38 rows
    _only_nests(emulated_cuda)


def test_layer_norm_without_parameters_and_f32_parameters_for_bf16(emulated_cuda):
    rng = np.random.default_rng(1)
    (lead, n), = SHAPES[:1]
    x, dy = _rand(rng, (*lead, n), "bf16"), _rand(rng, (*lead, n), "bf16")
    _close(ops.layer_norm(HostDevice(x)), ops.layer_norm(x), 2e-2)
    w, b = _rand(rng, (n,)), _rand(rng, (n,))
    y, mean, rstd = ops.layer_norm_forward(*_dev(x, w, b))
    yh, hmean, hrstd = ops.layer_norm_forward(x, w, b)
    _close(y, yh, 2e-2)
    for g, h in zip(ops.layer_norm_backward(*_dev(dy, x), mean, rstd, HostDevice(w)),
                    ops.layer_norm_backward(dy, x, hmean, hrstd, w)):
        _close(g, h, 5e-2)


# ---------------------------------------------------------------- rms norm
@pytest.mark.parametrize("dtype, lead, n", CASES)
def test_rms_norm_forward_and_backward(emulated_cuda, lead, n, dtype):
    rng = np.random.default_rng(2)
    tol = TOL[dtype]
    x, dy, w = _rand(rng, (*lead, n), dtype), _rand(rng, (*lead, n), dtype), _rand(rng, (n,), dtype)
    _close(ops.rms_norm(*_dev(x, w)), ops.rms_norm(x, w), tol)
    _close(ops.rms_norm(HostDevice(x), eps=1e-3), ops.rms_norm(x, eps=1e-3), tol)
    y, rstd = ops.rms_norm_forward(*_dev(x, w))
    yh, hrstd = ops.rms_norm_forward(x, w)
    _close(y, yh, tol)
    _close(rstd, hrstd, tol)
    for need in ((True, True), (False, True)):
        for g, h in zip(ops.rms_norm_backward(*_dev(dy, x), rstd, HostDevice(w), need=need),
                        ops.rms_norm_backward(dy, x, hrstd, w, need=need)):
            _close(g, h, 5 * tol)
    _only_nests(emulated_cuda)


# ---------------------------------------------------------------- softmax
@pytest.mark.parametrize("dtype, lead, n", CASES)
def test_softmax_forward_and_backward(emulated_cuda, lead, n, dtype):
    rng = np.random.default_rng(3)
    tol = TOL[dtype]
    x, dy = _rand(rng, (*lead, n), dtype), _rand(rng, (*lead, n), dtype)
    _close(ops.softmax(HostDevice(x)), ops.softmax(x), tol)
    row, block = _rand(rng, (n,)), _rand(rng, (*lead, n), dtype)
    _close(ops.softmax(HostDevice(x), mask=HostDevice(row), scale=0.3),
           ops.softmax(x, mask=row, scale=0.3), tol)
    y = ops.softmax(HostDevice(x), mask=HostDevice(block))
    yh = ops.softmax(x, mask=block)
    _close(y, yh, tol)
    _close(ops.softmax_backward(HostDevice(dy), y), ops.softmax_backward(dy, yh), tol)
    _close(ops.softmax_backward(HostDevice(dy), y, scale=0.3),
           ops.softmax_backward(dy, yh, scale=0.3), tol)
    _only_nests(emulated_cuda)


def test_a_mask_to_broadcast_is_refused_on_the_device(emulated_cuda):
    x = HostDevice(np.zeros((2, 3, 4, 5), np.float32))
    with pytest.raises(UnsupportedError, match=r"ops.softmax.*mask.*\(5,\)"):
        ops.softmax(x, mask=HostDevice(np.zeros((2, 1, 4, 5), np.float32)))


# ---------------------------------------------------------------- bias + activation + dropout
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_bias_act_dropout_forward_and_backward(emulated_cuda, p):
    rng = np.random.default_rng(4)
    (lead, n), = SHAPES[:1]
    x, dy, b = _rand(rng, (*lead, n)), _rand(rng, (*lead, n)), _rand(rng, (n,))
    y, keep = ops.bias_act_dropout(*_dev(x, b), "gelu", p=p, seed=11)
    yh, keeph = ops.bias_act_dropout(x, b, "gelu", p=p, seed=11)
    _close(y, yh, 2e-5)
    if p:
        np.testing.assert_array_equal(host_of(keep), keeph)     # the same counter stream
    for need in ((True, True), (False, True)):
        for g, h in zip(ops.bias_act_dropout_backward(*_dev(dy, x, b), keep, "gelu", p,
                                                      need=need),
                        ops.bias_act_dropout_backward(dy, x, b, keeph, "gelu", p, need=need)):
            _close(g, h, 1e-4)
    _only_nests(emulated_cuda)


def test_residual_layer_norm_forward_and_backward(emulated_cuda):
    rng = np.random.default_rng(5)
    (lead, n), = SHAPES[:1]
    x, res, dy, dh = (_rand(rng, (*lead, n)) for _ in range(4))
    b, w, lb = (_rand(rng, (n,)) for _ in range(3))
    got = residual_norm.residual_layer_norm(*_dev(x, b, res, w, lb), p=0.25, seed=3)
    want = residual_norm.residual_layer_norm(x, b, res, w, lb, p=0.25, seed=3)
    for g, h in zip(got[:4], want[:4]):
        _close(g, h, 2e-5)
    np.testing.assert_array_equal(host_of(got[4]), want[4])
    _, h, mean, rstd, keep = got
    grads = residual_norm.residual_layer_norm_backward(*_dev(dy, dh), h, mean, rstd,
                                                       HostDevice(w), keep, p=0.25)
    for g, hv in zip(grads, residual_norm.residual_layer_norm_backward(
            dy, dh, want[1], want[2], want[3], w, want[4], p=0.25)):
        _close(g, hv, 2e-4)
    _only_nests(emulated_cuda)


def test_no_rows(emulated_cuda):
    """No rows: empty outputs on the device; parameter gradients zeros (the zero TPP)."""
    x = HostDevice(np.zeros((0, 45), np.float32))
    w = HostDevice(np.ones(45, np.float32))
    y, mean, rstd = ops.layer_norm_forward(x, w, w)
    assert isinstance(y, HostDevice) and y.shape == (0, 45) and mean.shape == (0,)
    dx, dw, db = ops.layer_norm_backward(x, x, mean, rstd, w)
    assert dx.shape == (0, 45)
    _close(dw, np.zeros(45, np.float32), 0)
    _close(db, np.zeros(45, np.float32), 0)


# ---------------------------------------------------------------- errors
def test_mixed_host_and_device_operands_are_named(emulated_cuda):
    rng = np.random.default_rng(6)
    x, w = _rand(rng, (5, 45)), _rand(rng, (45,))
    xd, wd = HostDevice(x), HostDevice(w)
    _, mean, rstd = ops.layer_norm_forward(x, w, w)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*weight on the host"):
        ops.layer_norm(xd, w)
    with pytest.raises(ArgumentError, match=r"x on the host.*bias on cuda:0"):
        ops.layer_norm(x, None, wd)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*mean on the host"):
        ops.layer_norm_backward(HostDevice(x), xd, mean, rstd, wd)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*weight on the host"):
        ops.rms_norm(xd, w)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*mask on the host"):
        ops.softmax(xd, mask=w)
    with pytest.raises(ArgumentError, match=r"y on the host.*dy on cuda:0"):
        ops.softmax_backward(xd, x)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*bias on the host"):
        ops.bias_act_dropout(xd, w, "relu")
    assert not emulated_cuda.launched


# ---------------------------------------------------------------- torch drop-ins
torch = pytest.importorskip("torch")


FakeCuda = fake_cuda_class()


@pytest.mark.parametrize("call", [
    lambda ot, x, w: ot.layer_norm(x, (45,), w, w),
    lambda ot, x, w: ot.rms_norm(x, (45,), w),
    lambda ot, x, w: ot.softmax(x, dim=-1),
])
def test_torch_cuda_tensors_reach_the_cuda_backend(call):
    """CUDA tensors take ops.norms' device path (not torch's): without a GPU the CUDA backend
    refuses them, clearly."""
    import ops.torch as ot
    skip_if_gpu()
    with pytest.raises(UnsupportedError, match="CUDA|GPU"):
        call(ot, FakeCuda((2, 3, 45)), FakeCuda((45,)))


@pytest.mark.parametrize("name, call", [
    ("LayerNormFunction", lambda ot, x, w: ot.layer_norm(x, (45,), w, w)),
    ("RMSNormFunction", lambda ot, x, w: ot.rms_norm(x, (45,), w)),
    ("SoftmaxFunction", lambda ot, x, w: ot.softmax(x, dim=-1)),
])
def test_torch_cuda_tensors_that_need_grads_reach_the_tpp_function(monkeypatch, name, call):
    """With autograd: the TPP autograd.Function, not torch's operator (only the routing is
    checked: a CPU-only torch aborts when an error leaves a Function's forward holding CUDA
    tensors that require grad)."""
    import ops.torch as ot
    from ops import torch_norms
    seen = []
    monkeypatch.setattr(getattr(torch_norms, name), "apply",
                        lambda *args: seen.append(args) or args[0])
    x, w = FakeCuda((3, 45), requires_grad=True), FakeCuda((45,), requires_grad=True)
    assert call(ot, x, w) is x and seen and seen[0][0] is x


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_a_norm_module_on_the_host_names_the_cuda_input(module):
    import ops.torch as ot
    layer = getattr(ot, module)(45)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*weight on the host"):
        layer(FakeCuda((4, 45)))
