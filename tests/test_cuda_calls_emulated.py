"""The whole CUDA call path without a GPU: tpp.Kernel / tpp.BrgemmKernel with device arrays,
through tpp.runtime.device_arrays, the lds variants, output allocation, the offset and address tables
and the launch arguments, down to the generated kernel, run by the CPU emulator.

The "device" is host memory: a `HostDevice` array exposes `__cuda_array_interface__` over a
numpy buffer, and the runtime's compile/allocate/copy entry points are replaced by emulator-
backed ones (monkeypatch), so every address the kernel receives is a host address it can use.
What is not exercised here: cupy and NVRTC themselves (tests/test_cuda_runtime.py, on a GPU).
"""
import numpy as np
import pytest

import tpp
from tpp.runtime import arrays
from tpp.core import reference
from tpp.runtime.device_arrays import CudaView
from tpp_cuda import generators, runtime

from cuda_emulator import EmulatedModule, available

pytestmark = pytest.mark.skipif(not available(), reason="g++ or the CUDA headers are missing")


class HostDevice:
    """A 'device' array over host memory (shares the numpy array's buffer)."""

    def __init__(self, host: np.ndarray):
        self.host = host
        self.dtype = host.dtype
        self.shape = host.shape
        base = host.__array_interface__
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": base["typestr"],
                                         "data": (host.ctypes.data, False), "version": 3,
                                         "strides": host.strides}

    def __getitem__(self, index):
        return HostDevice(self.host[index])


# every spec the tests below launch (with the lds the calls imply), compiled as one module
def _specs():
    b = tpp.brgemm
    return [
        tpp.unary("gelu", 5, 37).spec, tpp.unary("gelu", 5, 37, ldi=40, ldo=41).spec,
        tpp.unary("relu", 9, 21, bitmask=True).spec,
        tpp.binary("add", 6, 19, bcast_in1="row").spec,
        tpp.binary("muladd", 4, 10).spec,
        tpp.unary("dropout", 7, 45, p=0.25).spec,
        tpp.unary("reduce_sum", 11, 70, axis=1).spec,
        tpp.unary("transpose", 13, 9, dtype_in="bf16").spec,
        tpp.unary("gather_rows", 3, 8).spec, tpp.unary("scatter_rows", 3, 8).spec,
        b(20, 24, 16, dtype_a="bf16", beta=1, bias="row", activation="relu", bitmask=True).spec,
        b(20, 24, 16, dtype_a="bf16", batch="offset").spec,
        b(20, 24, 16, dtype_a="bf16", batch="address", dtype_c="bf16").spec,
        b(9, 7, 5, batch="stride", lda=8).spec,
        b(9, 7, 5, batch="stride", trans_b=True).spec,
    ]


@pytest.fixture(scope="module")
def module():
    specs = _specs()
    return EmulatedModule({generators.kernel_name(s): generators.source(s) for s in specs})


class _EmulatedFunction:
    def __init__(self, module, spec):
        self.module, self.spec = module, spec
        self.name = generators.kernel_name(spec)
        assert self.name in module.kernels, f"add {spec.key()} to _specs()"
        self.geometry = generators.launch(spec)

    def launch(self, args, torch_stream=False):
        self.module.launch(self.name, self.geometry, [int(a) for a in args])


@pytest.fixture
def device(monkeypatch, module):
    """Route the runtime to the emulator; returns the launches made, for inspection."""
    launched = []

    def function(spec, device):
        launched.append(spec)
        return _EmulatedFunction(module, spec)

    def keep(host):
        return HostDevice(np.ascontiguousarray(host))
    monkeypatch.setattr(runtime, "function", function)
    monkeypatch.setattr(runtime, "empty",
                        lambda shape, dtype, device, like_torch: keep(np.empty(shape, dtype.numpy)))
    monkeypatch.setattr(runtime, "to_device", lambda host, device, like_torch: keep(host))
    host_of = arrays.to_host
    monkeypatch.setattr(arrays, "to_host", lambda a: a.obj.host if isinstance(a, CudaView)
                        else host_of(a))
    return launched


def _rand(rng, shape, dtype="f32"):
    return rng.standard_normal(shape).astype(np.float32).astype(tpp.core.dtypes.lookup(dtype).numpy)


def test_unary_allocates_its_output_on_the_device(device):
    x = _rand(np.random.default_rng(0), (5, 37))
    k = tpp.unary("gelu", 5, 37)
    y = k(HostDevice(x))
    assert isinstance(y, HostDevice)
    np.testing.assert_allclose(y.host, reference.run(k.spec, x), rtol=2e-5, atol=1e-7)


def test_strided_blocks_compile_the_lds_they_have(device):
    rng = np.random.default_rng(1)
    x_buf, y_buf = _rand(rng, (5, 40)), np.full((5, 41), 7.0, np.float32)
    k = tpp.unary("gelu", 5, 37)
    k(HostDevice(x_buf)[:, :37], out=HostDevice(y_buf)[:, :37])
    assert (device[-1].ldi, device[-1].ldo) == (40, 41)
    np.testing.assert_allclose(y_buf[:, :37], reference.run(k.spec, x_buf[:, :37]), rtol=2e-5,
                               atol=1e-7)
    assert (y_buf[:, 37:] == 7.0).all()


def test_bitmask_broadcast_inplace_and_seed_arguments(device):
    rng = np.random.default_rng(2)
    x = _rand(rng, (9, 21))
    k = tpp.unary("relu", 9, 21, bitmask=True)
    y, mask = k(HostDevice(x))
    want_y, want_mask = reference.run(k.spec, x)
    np.testing.assert_array_equal(y.host, want_y)
    np.testing.assert_array_equal(mask.host, want_mask)

    a, row = _rand(rng, (6, 19)), _rand(rng, (19,))
    k = tpp.binary("add", 6, 19, bcast_in1="row")
    np.testing.assert_array_equal(k(HostDevice(a), HostDevice(row)).host,
                                  reference.run(k.spec, a, row))

    a, b, c = (_rand(rng, (4, 10)) for _ in range(3))
    want = reference.run(tpp.binary("muladd", 4, 10).spec, a, b, c)
    tpp.binary("muladd", 4, 10)(HostDevice(a), HostDevice(b), out=HostDevice(c))
    np.testing.assert_array_equal(c, want)

    x = _rand(rng, (7, 45))
    k = tpp.unary("dropout", 7, 45, p=0.25)
    y, mask = k(HostDevice(x), seed=-5)            # a negative seed crosses as its 64-bit pattern
    want_y, want_mask = reference.run(k.spec, x, seed=-5)
    np.testing.assert_array_equal(mask.host, want_mask)
    np.testing.assert_array_equal(y.host, want_y)


def test_reduction_transpose_gather_scatter(device):
    rng = np.random.default_rng(3)
    x = _rand(rng, (11, 70))
    k = tpp.unary("reduce_sum", 11, 70, axis=1)
    np.testing.assert_allclose(k(HostDevice(x)).host, reference.run(k.spec, x), rtol=1e-5,
                               atol=1e-5)
    x = _rand(rng, (13, 9), "bf16")
    k = tpp.unary("transpose", 13, 9, dtype_in="bf16")
    np.testing.assert_array_equal(k(HostDevice(x)).host, reference.run(k.spec, x))
    src, idx = _rand(rng, (10, 8)), np.array([4, 0, 9], np.int64)
    np.testing.assert_array_equal(tpp.unary("gather_rows", 3, 8)(HostDevice(src),
                                                                 HostDevice(idx)).host, src[idx])
    dst = np.zeros((10, 8), np.float32)
    tpp.unary("scatter_rows", 3, 8)(HostDevice(src[:3]), HostDevice(idx), out=HostDevice(dst))
    np.testing.assert_array_equal(dst[idx], src[:3])
    with pytest.raises(tpp.ArgumentError, match="row indices"):
        tpp.unary("gather_rows", 3, 8)(HostDevice(src), HostDevice(idx + 1))


def _brgemm_inputs(rng, spec, count):
    a = _rand(rng, (count, *spec.a_shape), spec.dtype_a.name)
    b = _rand(rng, (count, *spec.b_shape), spec.dtype_b.name)
    return a, b


def _close(got, want, k, count):
    tol = 2e-6 * k * count + 1e-2 * (got.dtype != np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)


def test_brgemm_stride_with_epilogue_and_bitmask(device):
    rng = np.random.default_rng(4)
    kern = tpp.brgemm(20, 24, 16, dtype_a="bf16", beta=1, bias="row", activation="relu",
                      bitmask=True)
    a, b = _brgemm_inputs(rng, kern.spec, 3)
    c, bias = _rand(rng, (20, 24)), _rand(rng, (24,))
    want_c, want_mask = reference.run(kern.spec, a, b, c, bias)
    _, mask = kern(HostDevice(a), HostDevice(b), HostDevice(c), bias=HostDevice(bias))
    _close(c, want_c, 16, 3)
    np.testing.assert_array_equal(mask.host, want_mask)


def test_brgemm_offset_tables_from_host_or_device(device):
    rng = np.random.default_rng(5)
    kern = tpp.brgemm(20, 24, 16, dtype_a="bf16", batch="offset")
    a, b = _brgemm_inputs(rng, kern.spec, 4)
    offs_a = np.array([3, 1, 0, 2], np.int64) * a[0].size
    offs_b = np.array([3, 1, 0, 2], np.int64) * b[0].size
    c = kern(HostDevice(a), HostDevice(b), offsets_a=offs_a, offsets_b=HostDevice(offs_b),
             count=3)
    want = reference.run(kern.spec, a[[3, 1, 0]], b[[3, 1, 0]])
    _close(c.host, want, 16, 3)


def test_brgemm_address_tables_and_bf16_output(device):
    rng = np.random.default_rng(6)
    kern = tpp.brgemm(20, 24, 16, dtype_a="bf16", batch="address", dtype_c="bf16")
    a, b = _brgemm_inputs(rng, kern.spec, 2)
    c = kern([HostDevice(x) for x in a], [HostDevice(x) for x in b])
    _close(c.host, reference.run(kern.spec, a, b), 16, 2)


def test_brgemm_strided_a_and_transposed_b_in_f32(device):
    rng = np.random.default_rng(7)
    kern = tpp.brgemm(9, 7, 5)
    a_buf = _rand(rng, (2, 9, 8))                       # lda 8 > k = 5
    a = a_buf[:, :, :5]
    b = _rand(rng, (2, 5, 7))
    c = kern(HostDevice(a_buf)[:, :, :5], HostDevice(b))
    assert device[-1].lda == 8
    _close(c.host, reference.run(kern.spec, a, b), 5, 2)
    kern = tpp.brgemm(9, 7, 5, trans_b=True)
    bt = _rand(rng, (2, 7, 5))
    _close(kern(HostDevice(a_buf[:, :, :5].copy()), HostDevice(bt)).host,
           reference.run(kern.spec, a, bt), 5, 2)
