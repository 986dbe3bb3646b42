"""ops.conv2d on device arrays, without a GPU: conv2d, conv2d_backward and the blocked-layout
helpers (ops.conv.blocked / conv2d_blocked / to_nchw / pack_weight) given 'device' arrays run
their loop nests (the NCHW <-> blocked conversions, the weight packing, the BRGEMM nests) as
generated CUDA code on the CPU emulator (tests/cuda_device_harness.py), compared with the same
operators on the host.

Checked: results equal the host's (up to float reassociation), stay on the device, of the kind
the backend allocates; every device step ran as a CUDA loop nest or the zero TPP (the device
allocations that must start at zero); mixed host/device operands are an ArgumentError naming
them; torch CUDA tensors (faked: there is no GPU) reach the CUDA backend.
Shapes are tiny (each distinct nest is a g++ build of the emulator, and the emulator runs one
OS thread per CUDA thread).
"""
import numpy as np
import pytest

import ops
from ops import conv as oc
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError, UnsupportedError

from cuda_device_harness import (HostDevice, available, emulated_cuda, fake_cuda_class,  # noqa: F401
                                 host_of, skip_if_gpu)

pytestmark = pytest.mark.skipif(not available(), reason="g++ or the CUDA headers are missing")

# (N, C, K, H, W, (R, S), stride, padding, dilation, groups)
# one image size and channel count where the case allows, so the cases share their
# conversion and packing nests (each distinct nest or zero kernel is a g++ build: ~2 s)
CASES = {
    "1x1": (2, 4, 6, 6, 6, (1, 1), 1, 0, 1, 1),
    "3x3": (1, 4, 6, 6, 6, (3, 3), 1, 1, 1, 1),
    "3x3s2": (2, 4, 6, 6, 6, (3, 3), 2, 1, 1, 1),
    "dilated": (1, 4, 6, 6, 6, (3, 3), 1, 2, 2, 1),
    "depthwise": (1, 6, 6, 6, 6, (3, 3), 1, 1, 1, 6),
}
TOL = {"f32": 1e-4, "bf16": 3e-2}


def _rand(rng, shape, dtype="f32", scale=1.0):
    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    return a.astype(_dt.lookup(dtype).numpy)


def _data(case, dtype, seed=0):
    n, c, k, h, w, (r, s), _, _, _, groups = case
    rng = np.random.default_rng(seed)
    return (_rand(rng, (n, c, h, w), dtype), _rand(rng, (k, c // groups, r, s), dtype, 0.3),
            _rand(rng, (k,), dtype))


def _hyper(case):
    stride, padding, dilation, groups = case[6:]
    return dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


def _close(got, want, tol):
    if want is None:
        assert got is None
        return
    assert isinstance(got, HostDevice), f"the result came back as {type(got).__name__}"
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(host_of(got), np.float32),
                               np.asarray(want, np.float32), rtol=tol, atol=tol)


def _only_device_kernels(emulated):
    assert emulated.launched
    assert {s.family for s in emulated.launched} <= {"loopnest", "unary"}
    assert {getattr(s, "op", "zero") for s in emulated.launched
            if s.family == "unary"} <= {"zero"}


# ---------------------------------------------------------------- forward
@pytest.mark.parametrize("name", list(CASES))
def test_forward_f32(emulated_cuda, name):
    case = CASES[name]
    x, w, b = _data(case, "f32")
    hyper = _hyper(case)
    act = "relu" if name in ("3x3", "depthwise") else None
    bias = b if name != "dilated" else None
    want = ops.conv2d(x, w, bias, activation=act, **hyper)
    got = ops.conv2d(HostDevice(x), HostDevice(w), None if bias is None else HostDevice(b),
                     activation=act, **hyper)
    _close(got, want, TOL["f32"])
    _only_device_kernels(emulated_cuda)


def test_forward_bf16(emulated_cuda):
    case = CASES["3x3"]
    x, w, b = _data(case, "bf16", seed=1)
    hyper = _hyper(case)
    want = ops.conv2d(x, w, b, activation="relu", **hyper)
    _close(ops.conv2d(*map(HostDevice, (x, w, b)), activation="relu", **hyper), want,
           TOL["bf16"])
    # an f32 bias with bf16 data
    b32 = b.astype(np.float32)
    _close(ops.conv2d(*map(HostDevice, (x, w, b32)), **hyper), ops.conv2d(x, w, b32, **hyper),
           TOL["bf16"])
    _only_device_kernels(emulated_cuda)


# ---------------------------------------------------------------- backward
@pytest.mark.parametrize("name", ["3x3s2", "depthwise"])
def test_backward_f32(emulated_cuda, name):
    case = CASES[name]
    x, w, _ = _data(case, "f32", seed=2)
    hyper = _hyper(case)
    dy = _rand(np.random.default_rng(3), ops.conv2d(x, w, **hyper).shape)
    want = ops.conv2d_backward(dy, x, w, **hyper)
    got = ops.conv2d_backward(*map(HostDevice, (dy, x, w)), **hyper)
    for g, h in zip(got, want):
        _close(g, h, 5 * TOL["f32"])
    # one gradient alone, and the blocked x and packed weight a forward made (reused)
    xb = oc.to_blocked(HostDevice(x), oc.geometry(x.shape, w.shape, _dt.F32, **hyper))
    packed = oc.pack_weight(HostDevice(w), hyper["groups"], _dt.F32, transposed=True)
    dx, dw, db = ops.conv2d_backward(*map(HostDevice, (dy, x, w)), need=(True, True, False),
                                     packed=packed, xb=xb, **hyper)
    assert db is None
    _close(dx, want[0], 5 * TOL["f32"])
    _close(dw, want[1], 5 * TOL["f32"])
    _only_device_kernels(emulated_cuda)


# ---------------------------------------------------------------- blocked chains
def test_blocked_chain(emulated_cuda):
    """blocked -> conv2d_blocked (packed weight, output framed for the next layer) ->
    conv2d_blocked -> to_nchw, all on the device."""
    case = CASES["3x3"]
    x, w, b = _data(case, "f32", seed=4)
    w2 = _rand(np.random.default_rng(5), (case[2], case[2], 1, 1), scale=0.3)

    def chain(x, w, b, w2):
        xb = oc.blocked(x, padding=1)
        hb = oc.conv2d_blocked(xb, oc.pack_weight(w, 1, _dt.F32), b, padding=1,
                               activation="relu")
        return oc.to_nchw(oc.conv2d_blocked(hb, w2))

    _close(chain(*map(HostDevice, (x, w, b, w2))), chain(x, w, b, w2), TOL["f32"])
    _only_device_kernels(emulated_cuda)


# ---------------------------------------------------------------- errors
def test_mixed_host_and_device_operands_are_named(emulated_cuda):
    case = CASES["1x1"]
    x, w, b = _data(case, "f32")
    xd, wd, bd = map(HostDevice, (x, w, b))
    dy = np.zeros((case[0], case[2], case[3], case[4]), np.float32)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*weight on the host"):
        ops.conv2d(xd, w)
    with pytest.raises(ArgumentError, match=r"x on the host.*weight on cuda:0"):
        ops.conv2d(x, wd, b)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*bias on the host"):
        ops.conv2d(xd, wd, b)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*dy on the host"):
        ops.conv2d_backward(dy, xd, wd)
    with pytest.raises(ArgumentError, match=r"weight on cuda:0.*packed on the host"):
        ops.conv2d(xd, wd, packed=oc.pack_weight(w, 1, _dt.F32))
    with pytest.raises(ArgumentError, match=r"weight on cuda:0.*packed on the host"):
        ops.conv2d_backward(HostDevice(dy), xd, wd,
                            packed=oc.pack_weight(w, 1, _dt.F32, transposed=True))
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*xb on the host"):
        ops.conv2d_backward(HostDevice(dy), xd, wd, xb=oc.to_blocked(x, oc.geometry(
            x.shape, w.shape, _dt.F32, 1, 0, 1, 1)))
    with pytest.raises(ArgumentError, match=r"xb on the host.*weight on cuda:0"):
        oc.conv2d_blocked(oc.blocked(x), wd)
    assert not emulated_cuda.launched


# ---------------------------------------------------------------- torch drop-ins
torch = pytest.importorskip("torch")


FakeCuda = fake_cuda_class()


def test_torch_cuda_tensors_reach_the_cuda_backend():
    """CUDA tensors take ops.conv's device path (not torch's): without a GPU the CUDA backend
    refuses them, clearly."""
    import ops.torch as ot
    skip_if_gpu()
    x, w, b = FakeCuda((1, 4, 5, 5)), FakeCuda((6, 4, 3, 3)), FakeCuda((6,))
    for call in (lambda: ot.conv2d(x, w, b, padding=1), lambda: ops.conv2d(x, w, b),
                 lambda: ops.conv2d_backward(FakeCuda((1, 6, 3, 3)), x, w)):
        with pytest.raises(UnsupportedError, match="CUDA|GPU"):
            call()


def test_torch_cuda_tensors_that_need_grads_reach_the_tpp_function(monkeypatch):
    import ops.torch as ot
    from ops import torch_conv
    seen = []
    monkeypatch.setattr(torch_conv.Conv2dFunction, "apply",
                        lambda *args: seen.append(args) or args[0])
    x = FakeCuda((1, 4, 5, 5), requires_grad=True)
    w = FakeCuda((6, 4, 3, 3), requires_grad=True)
    assert ot.conv2d(x, w) is x and seen and seen[0][0] is x


def test_a_conv_module_on_the_host_names_the_cuda_input():
    import ops.torch as ot
    layer = ot.Conv2d(4, 6, 3)
    with pytest.raises(ArgumentError, match=r"x on cuda:0.*weight on the host"):
        layer(FakeCuda((1, 4, 5, 5)))
