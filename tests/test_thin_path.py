"""The thin checked path: what follows from an array's signature (type, shape, strides, dtype,
device) is computed once per signature and remembered; what depends on the array itself
(address, writability, autograd state) is checked on every call. So a call whose arrays share
their signatures with an earlier, valid call must still refuse a read-only or grad-requiring
output, an overlap, a bad count. Also: byte spans and addresses computed without numpy's
helpers agree with numpy's on every kind of view."""
import numpy as np
import pytest

import tpp
from tpp.runtime import arrays
from tpp.core.errors import ArgumentError

rng = np.random.default_rng(21)


def _f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def _byte_bounds(a):
    f = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds
    return f(a)


# ------------------------------------------------------------------ spans and addresses
def _views():
    base = np.arange(6 * 8 * 4, dtype=np.float32).reshape(6, 8, 4)
    return [base, base[1:5, ::2], base[::-1], base[:, ::-3, 1:], base.transpose(2, 0, 1),
            base[2], base[2, 3], base[..., 0], base[:, 1:2, ::-1], base.T[::2],
            np.float32(3) * np.ones((1, 1), np.float32), base.view(np.uint8)[:, :, ::-5]]


@pytest.mark.parametrize("k", range(12))
def test_extent_and_address_agree_with_numpy(k):
    arr = _views()[k]
    assert arrays.address(arr) == arr.ctypes.data
    assert arrays.extent(arr) == tuple(_byte_bounds(arr))


def test_address_of_read_only_and_zero_size_arrays():
    ro = np.zeros((4, 4), np.float32)
    ro.flags.writeable = False
    for arr in (ro, np.zeros(0, np.float32), np.zeros((3, 0), np.float32)[1:],
                np.zeros((5, 4), np.float32)[::2, ::-1]):
        assert arrays.address(arr) == arr.ctypes.data


@pytest.mark.parametrize("shape,strides", [((0,), (4,)), ((3, 0), (16, 4)), ((0, 5), (-20, 4)),
                                           ((2, 0, 3), (0, 12, 4))])
def test_zero_size_arrays_span_nothing(shape, strides):
    assert arrays.span(shape, [s // 4 for s in strides], 4) == (0, 0)
    empty = np.lib.stride_tricks.as_strided(np.zeros(64, np.float32)[32:], shape, strides)
    lo, hi = arrays.extent(empty)
    assert lo == hi
    assert not arrays.overlap(empty, np.zeros(64, np.float32))


def test_spans_with_negative_strides():
    assert arrays.span((3, 4), (-4, 1), 4) == (-32, 16)
    x = np.zeros(40, np.float32)
    rev = x[19::-1]                       # elements 19 .. 0
    assert arrays.overlap(rev, x[:1]) and arrays.overlap(rev, x[19:20])
    assert not arrays.overlap(rev, x[20:])


def test_torch_extent_and_signature():
    torch = pytest.importorskip("torch")
    t = torch.zeros(6, 8)[1:, ::2]
    lo, hi = arrays.extent(t)
    assert lo == t.data_ptr() and hi == t.data_ptr() + ((4 * 8 + 3 * 2) + 1) * 4
    assert arrays.signature(t) is not None
    assert arrays.signature(torch.zeros(3, 3).to_sparse()) is None     # never cached


def test_signatures_tell_apart_what_layouts_read():
    a = np.zeros((4, 4), np.float32)
    assert arrays.signature(a) == arrays.signature(np.ones((4, 4), np.float32))
    for other in (a.astype(">f4"), a.astype(np.float64), a[:, ::-1], a.T, a.reshape(2, 8),
                  np.zeros((8, 4), np.float32)[::2]):
        assert arrays.signature(other) != arrays.signature(a)
    assert arrays.signature(None) == ()
    assert arrays.signature([1.0, 2.0]) is None and arrays.signatures(a, [1.0]) is None
    assert arrays.layout(a, "a") is arrays.layout(np.ones((4, 4), np.float32), "b")


def test_signature_caches_are_bounded():
    k = tpp.unary("relu", 1, 4)
    for n in range(arrays.CACHE_LIMIT + 20):        # as many distinct row strides
        x = np.zeros((2, 4 + n), np.float32)[:, :4]
        k(x[:1], out=np.zeros((1, 4), np.float32))
        arrays.layout(x, "x")
    assert len(arrays._LAYOUTS) <= arrays.CACHE_LIMIT
    assert len(k._plans) <= arrays.CACHE_LIMIT


def test_a_known_signature_is_not_checked_again(monkeypatch):
    """O(1) per call: the second call with the same signatures computes no layout."""
    relu = tpp.unary("relu", 8, 8)
    mm = tpp.brgemm(8, 8, 8)
    xs, ys = np.zeros((8, 16), np.float32)[:, :8], np.zeros((8, 16), np.float32)[:, :8]
    a, b, c = _f32(2, 8, 8), _f32(2, 8, 8), np.zeros((8, 8), np.float32)
    relu(xs, out=ys), mm(a, b, c)

    def fail(*args):
        raise AssertionError("layout computed again")
    monkeypatch.setattr(arrays, "_compute_layout", fail)
    relu(np.ones((8, 16), np.float32)[:, :8], out=ys)
    np.testing.assert_allclose(mm(a, b, c), a[0] @ b[0] + a[1] @ b[1], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ per-call checks still made
def _strided(shape, ld):
    return np.zeros((shape[0], ld), np.float32)[:, :shape[1]]


def test_kernel_checked_path_checks_every_call():
    relu = tpp.unary("relu", 4, 4)
    x, y = _strided((4, 4), 8), _strided((4, 4), 8)
    x[...] = _f32(4, 4)
    relu(x, out=y)                                  # the plan for these signatures
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    ro = _strided((4, 4), 8)
    ro.flags.writeable = False
    with pytest.raises(ArgumentError, match="read-only"):
        relu(x, out=ro)
    buf = np.zeros((5, 8), np.float32)
    with pytest.raises(ArgumentError, match="overlaps"):
        relu(buf[:4, :4], out=buf[1:, :4])          # shifted rows of the same memory
    before = x.copy()
    assert relu(x, out=x) is x                      # in place onto the identical view
    np.testing.assert_array_equal(x, np.maximum(before, 0))
    transpose = tpp.unary("transpose", 4, 4)
    sq = _strided((4, 4), 8)
    transpose(_strided((4, 4), 8), out=sq)
    with pytest.raises(ArgumentError, match="overlaps"):
        transpose(sq, out=sq)                       # not element-wise: no writing in place


def test_kernel_fast_path_checks_every_call():
    add = tpp.binary("add", 4, 4)
    a, b = _f32(4, 4), _f32(4, 4)
    add(a, b, out=np.empty((4, 4), np.float32))
    assert add(a, b, out=b) is b                    # in place onto an input
    ro = np.zeros((4, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ArgumentError, match="read-only"):
        add(a, b, out=ro)
    buf = np.zeros(17, np.float32)
    with pytest.raises(ArgumentError, match="overlaps"):
        add(buf[:16].reshape(4, 4), b, out=buf[1:].reshape(4, 4))


def test_brgemm_planned_call_checks_every_call():
    mm = tpp.brgemm(4, 4, 4)
    a, b = _f32(1, 4, 4), _f32(1, 4, 4)
    mm(a, b, np.zeros((4, 4), np.float32))          # the plan for these signatures
    buf = np.zeros((2, 4, 4), np.float32)
    buf[:1] = a
    with pytest.raises(ArgumentError, match="overlap"):
        mm(buf[:1], b, buf[0])                      # same signatures, c inside a
    with pytest.raises(ArgumentError, match="overlap"):
        mm(a, buf[1:], buf[1])                      # c inside b
    ro = np.zeros((4, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ArgumentError, match="read-only"):
        mm(a, b, ro)
    with pytest.raises(ArgumentError, match="count"):
        mm(a, b, np.zeros((4, 4), np.float32), count=2)
    with pytest.raises(ArgumentError, match="count"):
        mm(a, b, np.zeros((4, 4), np.float32), count=-1)
    with pytest.raises(ArgumentError, match="blocks"):
        mm(_f32(2, 4, 4)[:1], _f32(3, 4, 4)[:2], np.zeros((4, 4), np.float32))
    c = np.full((4, 4), 7, np.float32)
    assert mm(a, b, c, count=0) is c                # nothing to add: beta=0 writes zeros
    np.testing.assert_array_equal(c, 0)
    np.testing.assert_allclose(mm(a, b, buf[1]), a[0] @ b[0], rtol=1e-5, atol=1e-5)


def test_brgemm_planned_call_with_bias_and_bitmask():
    mm = tpp.brgemm(4, 8, 4, bias="row", activation="relu", bitmask=True)
    a, b, bias = _f32(2, 4, 4), _f32(2, 4, 8), _f32(8)
    want = np.maximum(a[0] @ b[0] + a[1] @ b[1] + bias, 0)
    for _ in range(2):                              # checked, then planned
        c, mask = mm(a, b, bias=bias)
        np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)
    c = np.zeros((4, 8), np.float32)
    for _ in range(2):
        out, m = mm(a, b, c, bias=bias, mask=np.zeros_like(mask))
        assert out is c
    with pytest.raises(ArgumentError, match="overlap each other"):
        inside_c = c.reshape(-1).view(np.uint8)[:mask.size].reshape(mask.shape)
        mm(a, b, c, bias=bias, mask=inside_c)
    with pytest.raises(ArgumentError, match="overlap"):
        mm(a, b, c, bias=c[0], mask=np.zeros_like(mask))


def test_torch_outputs_that_require_grad_are_refused_on_every_call():
    torch = pytest.importorskip("torch")
    relu = tpp.unary("relu", 4, 4)
    mm = tpp.brgemm(4, 4, 4)
    x, a, b = torch.randn(4, 4), torch.randn(1, 4, 4), torch.randn(1, 4, 4)
    relu(x, out=torch.zeros(4, 4)), mm(a, b, torch.zeros(4, 4))   # plans for these signatures
    for call in (lambda out: relu(x, out=out), lambda out: mm(a, b, out)):
        with pytest.raises(ArgumentError, match="requires grad"):
            call(torch.zeros(4, 4, requires_grad=True))
        with torch.no_grad():
            call(torch.zeros(4, 4, requires_grad=True))   # allowed where autograd is off


def test_torch_and_numpy_views_of_one_buffer_are_not_the_identical_array():
    torch = pytest.importorskip("torch")
    relu = tpp.unary("relu", 4, 4)
    x = _strided((4, 4), 8)
    with pytest.raises(ArgumentError, match="overlaps"):
        relu(torch.from_numpy(x), out=x)


# ------------------------------------------------------------------ ops.linear's thin path
def _linear_case(kind, m=3, k=8, n=80):
    """(x, w, b) of numpy arrays or torch tensors; n > 64: the nest, not a direct kernel."""
    x, w, b = _f32(m, k), _f32(n, k), _f32(n)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        x, w, b = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b)
    return x, w, b


def _want(x, w, b):
    x, w, b = (np.asarray(t) for t in (x, w, b))
    return x @ w.T + b


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_linear_thin_path_skips_the_checked_way(kind, monkeypatch):
    """A second call of a kind the weight's plan validated goes straight to the plan: neither
    _plan nor _host.host runs, and the result is the checked path's."""
    import importlib

    import ops
    matmul = importlib.import_module("ops.matmul")    # (ops.matmul is the function)
    x, w, b = _linear_case(kind)
    pw = ops.pack_nk(w)
    first = ops.linear(x, pw, b)

    def fail(*args, **kw):
        raise AssertionError("the checked way was taken")
    monkeypatch.setattr(matmul, "_plan", fail)
    monkeypatch.setattr(matmul._host, "host", fail)
    again = ops.linear(x, pw, b)
    assert type(again) is type(x) and again is not first
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
    np.testing.assert_allclose(np.asarray(again), _want(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_linear_thin_path_falls_back_to_the_checked_way(kind):
    """What the thin path does not take goes the checked way, which copies, reshapes or
    explains: non-contiguous or 3-D inputs, a non-contiguous bias, wrong shapes and dtypes."""
    import ops
    x, w, b = _linear_case(kind)
    pw = ops.pack_nk(w)
    ops.linear(x, pw, b)                            # the plan for f32 with a bias
    if kind == "torch":
        import torch
        wide, wide_b = torch.zeros(3, 16), torch.zeros(160)
        other_dtype = x.to(torch.bfloat16)
    else:
        wide, wide_b = np.zeros((3, 16), np.float32), np.zeros(160, np.float32)
        other_dtype = x.astype(np.float64)
    wide[:, ::2] = x
    xs = wide[:, ::2]                               # row stride 16: copied, then computed
    wide_b[::2] = b
    bs = wide_b[::2]
    np.testing.assert_allclose(np.asarray(ops.linear(xs, pw, b)), _want(x, w, b),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ops.linear(x, pw, bs)), _want(x, w, b),
                               rtol=1e-5, atol=1e-5)
    x3 = x.reshape(1, 3, 8)
    y3 = ops.linear(x3, pw, b)
    assert tuple(y3.shape) == (1, 3, 80)
    np.testing.assert_allclose(np.asarray(y3).reshape(3, 80), _want(x, w, b), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ArgumentError, match=r"expected shape \(\.\.\., 8\)"):
        ops.linear(x[:, :7], pw, b)
    with pytest.raises(ArgumentError, match="bias: expected shape"):
        ops.linear(x, pw, b[:79])
    with pytest.raises(ArgumentError):
        ops.linear(other_dtype, pw, b)


def test_linear_thin_path_checks_torch_devices():
    torch = pytest.importorskip("torch")
    import ops
    from tpp.core.errors import UnsupportedError
    x, w, b = _linear_case("torch")
    pw = ops.pack_nk(w)
    ops.linear(x, pw, b)
    with pytest.raises(UnsupportedError, match="meta"):
        ops.linear(torch.empty(3, 8, device="meta"), pw, b)
    with pytest.raises(UnsupportedError, match="meta"):
        ops.linear(x, pw, torch.empty(80, device="meta"))
