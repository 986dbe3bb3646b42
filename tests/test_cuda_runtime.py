"""Calls with CUDA data: the backend follows the data, mixed devices and bad device arrays are
TPPErrors, and (with a GPU) the kernels agree with tpp.core.reference.

The first part needs no GPU: a fake producer with `__cuda_array_interface__` is validated like
any array up to the launch. The second part runs only where cupy sees a GPU."""
import numpy as np
import pytest

import tpp
from tpp.runtime import arrays, device_arrays
from tpp.core import reference
from tpp.core.errors import ArgumentError, TPPError, UnsupportedError
from tpp_cuda import runtime

GPU = pytest.mark.skipif(not runtime.available(), reason="no usable GPU (cupy + a device)")


class FakeDeviceArray:
    """A device array as a producer describes it; nothing is ever dereferenced on the host."""

    def __init__(self, shape, dtype="<f4", ptr=1 << 40, strides=None, readonly=False, mask=None):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dtype,
                                         "data": (ptr, readonly), "version": 3,
                                         "strides": strides}
        if mask is not None:
            self.__cuda_array_interface__["mask"] = mask


def test_a_producers_view_has_element_strides_and_c_order_by_default():
    v = device_arrays.view(FakeDeviceArray((4, 8)), "x")
    assert (v.shape, v.strides, v.dtype, v.readonly) == ((4, 8), (8, 1), np.float32, False)
    v = device_arrays.view(FakeDeviceArray((4, 8), "<f2", strides=(64, 2)), "x")
    assert v.strides == (32, 1) and v.dtype == np.float16
    assert device_arrays.extent(v) == (1 << 40, (1 << 40) + (3 * 32 + 8) * 2)


@pytest.mark.parametrize("fake, message", [
    (FakeDeviceArray((4, 8), strides=(34, 4)), "multiples of the element size"),
    (FakeDeviceArray((4, 8), mask=FakeDeviceArray((4, 8), "|b1")), "masked"),
])
def test_malformed_device_arrays_are_argument_errors(fake, message):
    with pytest.raises(ArgumentError, match=message):
        device_arrays.view(fake, "x")


def test_host_and_device_operands_in_one_call_are_refused():
    add = tpp.binary("add", 4, 8)
    host = np.ones((4, 8), np.float32)
    with pytest.raises(ArgumentError, match=r"different devices \(in0 on the host, in1 on cuda"):
        add(host, FakeDeviceArray((4, 8)))
    with pytest.raises(ArgumentError, match="different devices"):
        tpp.unary("relu", 4, 8)(host, out=FakeDeviceArray((4, 8)))


def test_brgemm_with_host_and_device_blocks_is_refused():
    mm = tpp.brgemm(4, 8, 2)
    with pytest.raises(ArgumentError, match="different devices"):
        mm(np.ones((1, 4, 2), np.float32), FakeDeviceArray((1, 2, 8)),
           FakeDeviceArray((4, 8)))
    mm = tpp.brgemm(4, 8, 2, batch="address")
    with pytest.raises(ArgumentError, match="different devices"):
        mm([FakeDeviceArray((4, 2))], [np.ones((2, 8), np.float32)], np.zeros((4, 8), np.float32))


@pytest.mark.parametrize("call, message", [
    (lambda: tpp.unary("relu", 4, 8)(FakeDeviceArray((4, 9)), out=FakeDeviceArray((4, 8))),
     r"expected shape \(4, 8\)"),
    (lambda: tpp.unary("relu", 4, 8)(FakeDeviceArray((4, 8), "<f2"), out=FakeDeviceArray((4, 8))),
     "expected dtype f32"),
    (lambda: tpp.unary("relu", 4, 8)(FakeDeviceArray((4, 8)),
                                     out=FakeDeviceArray((4, 8), readonly=True)), "read-only"),
    (lambda: tpp.unary("relu", 4, 8)(FakeDeviceArray((4, 8), strides=(64, 8)),
                                     out=FakeDeviceArray((4, 8))), "columns must be contiguous"),
    (lambda: tpp.binary("add", 4, 8)(FakeDeviceArray((4, 8)), FakeDeviceArray((4, 8)),
                                     out=FakeDeviceArray((4, 8), ptr=(1 << 40) + 64)),
     "overlaps"),
    (lambda: tpp.brgemm(4, 8, 2)(FakeDeviceArray((1, 4, 3)), FakeDeviceArray((1, 2, 8)),
                                 FakeDeviceArray((4, 8), ptr=1 << 41)), r"\(count, 4, 2\)"),
])
def test_device_arrays_are_validated_before_any_launch(call, message):
    with pytest.raises(ArgumentError, match=message):
        call()


@pytest.mark.skipif(runtime.available(), reason="a GPU is usable here")
def test_without_a_gpu_device_data_is_unsupported_not_a_crash():
    relu = tpp.unary("relu", 4, 8)
    with pytest.raises(UnsupportedError, match="CUDA|GPU|cupy"):
        relu(FakeDeviceArray((4, 8)))                     # the output would be allocated
    with pytest.raises(UnsupportedError, match="CUDA|GPU|cupy"):
        relu(FakeDeviceArray((4, 8)), out=FakeDeviceArray((4, 8), ptr=1 << 41))


def test_tensors_on_other_devices_are_unsupported():
    torch = pytest.importorskip("torch")
    with pytest.raises(UnsupportedError, match="meta"):
        tpp.unary("relu", 4, 8)(torch.empty((4, 8), device="meta"))


def test_host_only_paths_refuse_device_data_by_name():
    with pytest.raises(UnsupportedError, match="x: data on cuda:0"):
        arrays.as_host_array(FakeDeviceArray((4, 8)), "x", "ops.matmul")


def test_the_cuda_source_of_a_kernel_can_be_shown():
    k = tpp.unary("gelu", 5, 7)
    src = k.dump("cuda")
    assert 'extern "C" __global__' in src and "__fmaf_rn" in src


def test_every_tpp_error_is_a_tpperror():
    assert issubclass(ArgumentError, TPPError) and issubclass(UnsupportedError, TPPError)


# ---------------------------------------------------------------- with a GPU
@pytest.fixture(scope="module")
def cupy():
    return pytest.importorskip("cupy")


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(tpp.core.dtypes.lookup(dtype).numpy)


@GPU
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("op", ["identity", "relu", "gelu", "exp", "tanh", "sigmoid", "abs"])
@pytest.mark.parametrize("m, n", [(1, 1), (7, 45), (64, 64), (129, 257)])
def test_unary_on_cupy_arrays_matches_the_reference(cupy, op, dtype, m, n):
    x = _rand(np.random.default_rng(m * n), (m, n), dtype)
    k = tpp.unary(op, m, n, dtype_in=dtype)
    got = k(cupy.asarray(x))
    assert isinstance(got, cupy.ndarray)
    want = reference.run(k.spec, x)
    np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float32), want.astype(np.float32),
                               rtol=1e-5 if dtype == "f32" else 1e-2, atol=1e-6)


@GPU
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "max", "min"])
@pytest.mark.parametrize("bcast", [None, "row", "col", "scalar"])
def test_binary_with_broadcasts_and_strided_blocks(cupy, op, bcast):
    m, n = 33, 70
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, n + 6)).astype(np.float32)[:, :n]       # ld 76 > n
    shape = {None: (m, n), "row": (n,), "col": (m,), "scalar": ()}[bcast]
    b = rng.standard_normal(shape).astype(np.float32) + 3
    k = tpp.binary(op, m, n, bcast_in1=bcast)
    da = cupy.asarray(np.ascontiguousarray(rng.standard_normal((m, n + 6)), np.float32))
    da[:, :n] = cupy.asarray(a)
    got = k(da[:, :n], cupy.asarray(b))
    np.testing.assert_array_equal(cupy.asnumpy(got), reference.run(k.spec, a, b))


@GPU
def test_compare_and_relu_bitmasks(cupy):
    m, n = 9, 21
    rng = np.random.default_rng(2)
    x = rng.standard_normal((m, n)).astype(np.float32)
    y, mask = tpp.unary("relu", m, n, bitmask=True)(cupy.asarray(x))
    want_y, want_mask = reference.run(tpp.unary("relu", m, n, bitmask=True).spec, x)
    np.testing.assert_array_equal(cupy.asnumpy(y), want_y)
    np.testing.assert_array_equal(cupy.asnumpy(mask), want_mask)
    k = tpp.binary("cmp_gt", m, n)
    np.testing.assert_array_equal(cupy.asnumpy(k(cupy.asarray(x), cupy.asarray(-x))),
                                  reference.run(k.spec, x, -x))


@GPU
@pytest.mark.parametrize("op, axis", [("reduce_sum", 0), ("reduce_sum", 1), ("reduce_max", 1),
                                      ("reduce_absmax", 0), ("reduce_sumsq", 1)])
def test_reductions(cupy, op, axis):
    x = np.random.default_rng(3).standard_normal((37, 300)).astype(np.float32)
    k = tpp.unary(op, 37, 300, axis=axis)
    np.testing.assert_allclose(cupy.asnumpy(k(cupy.asarray(x))), reference.run(k.spec, x),
                               rtol=1e-5, atol=1e-4)


@GPU
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_transform_ops_are_bit_exact(cupy, dtype):
    x = _rand(np.random.default_rng(4), (45, 33), dtype)
    for k in (tpp.unary("transpose", 45, 33, dtype_in=dtype),):
        np.testing.assert_array_equal(cupy.asnumpy(k(cupy.asarray(x))), reference.run(k.spec, x))
    if dtype == "bf16":
        k = tpp.unary("vnni2", 45, 33, dtype_in=dtype)
        np.testing.assert_array_equal(cupy.asnumpy(k(cupy.asarray(x))), reference.run(k.spec, x))


@GPU
def test_dropout_matches_the_reference_stream(cupy):
    x = np.random.default_rng(5).standard_normal((19, 77)).astype(np.float32)
    k = tpp.unary("dropout", 19, 77, p=0.3)
    y, mask = k(cupy.asarray(x), seed=12345)
    want_y, want_mask = reference.run(k.spec, x, seed=12345)
    np.testing.assert_array_equal(cupy.asnumpy(mask), want_mask)
    np.testing.assert_array_equal(cupy.asnumpy(y), want_y)


@GPU
def test_gather_rows_checks_indices_on_the_device(cupy):
    src = np.arange(40, dtype=np.float32).reshape(10, 4)
    idx = np.array([3, 0, 9], np.int64)
    k = tpp.unary("gather_rows", 3, 4)
    np.testing.assert_array_equal(cupy.asnumpy(k(cupy.asarray(src), cupy.asarray(idx))),
                                  src[idx])
    with pytest.raises(ArgumentError, match="row indices"):
        k(cupy.asarray(src), cupy.asarray(np.array([0, 10, 1], np.int64)))


def _brgemm_blocks(rng, spec, count):
    a = _rand(rng, (count, *spec.a_shape), spec.dtype_a.name)
    b = _rand(rng, (count, *spec.b_shape), spec.dtype_b.name)
    return a, b


@GPU
@pytest.mark.parametrize("batch", ["stride", "offset", "address"])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 13, 5), (64, 64, 64), (130, 72, 40)])
def test_brgemm_batch_modes_match_the_reference(cupy, batch, dtype, m, n, k):
    spec = tpp.brgemm(m, n, k, dtype_a=dtype, batch=batch, beta=1, bias="row",
                      activation="relu").spec
    rng = np.random.default_rng(m + n + k)
    count = 3
    a, b = _brgemm_blocks(rng, spec, count)
    c = rng.standard_normal((m, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    dc, dbias = cupy.asarray(c), cupy.asarray(bias)
    kern = tpp.kernel(spec)
    if batch == "stride":
        kern(cupy.asarray(a), cupy.asarray(b), dc, bias=dbias)
    elif batch == "offset":
        offs_a = np.arange(count, dtype=np.int64) * a[0].size
        offs_b = np.arange(count, dtype=np.int64) * b[0].size
        kern(cupy.asarray(a), cupy.asarray(b), dc, bias=dbias, offsets_a=offs_a,
             offsets_b=cupy.asarray(offs_b))
    else:
        kern([cupy.asarray(x) for x in a], [cupy.asarray(x) for x in b], dc, bias=dbias)
    want = reference.run(spec, a, b, c, bias)
    tol = 1e-5 * k * count if dtype == "f32" else 1e-2
    np.testing.assert_allclose(cupy.asnumpy(dc), want, rtol=tol, atol=tol)


@GPU
@pytest.mark.parametrize("layout", [dict(trans_a=True), dict(trans_b=True), dict(vnni_b=True)])
def test_brgemm_layouts_on_torch_cuda_tensors(layout):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    spec = tpp.brgemm(48, 40, 32, dtype_a="bf16", dtype_c="bf16", **layout).spec
    a, b = _brgemm_blocks(np.random.default_rng(6), spec, 2)
    ta = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    tb = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16).cuda()
    c = tpp.kernel(spec)(ta, tb)
    assert isinstance(c, torch.Tensor) and c.device.type == "cuda"
    got = c.float().cpu().numpy()
    np.testing.assert_allclose(got, reference.run(spec, a, b).astype(np.float32), rtol=2e-2,
                               atol=2e-2)


@GPU
def test_launches_follow_the_current_cupy_stream(cupy):
    x = cupy.asarray(np.random.default_rng(7).standard_normal((256, 256)).astype(np.float32))
    k = tpp.unary("exp", 256, 256)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = k(x)
        stream.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(y), np.exp(cupy.asnumpy(x)), rtol=1e-5)
