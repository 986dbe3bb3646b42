"""ops._host's large torch outputs: advised to transparent huge pages like numpy's arrays."""
import numpy as np
import pytest

from ops import _host

torch = pytest.importorskip("torch")


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(_host, "_MADVISE", [lambda addr, n, advice: calls.append((addr, n, advice))])
    return calls


def test_advice_covers_whole_huge_pages_inside_the_block(recorded):
    page = _host.HUGE_PAGE
    _host.advise_huge_pages(page + 100, 3 * page)          # [page+100, 4*page+100)
    assert recorded == [(2 * page, 2 * page, 14)]
    recorded.clear()
    _host.advise_huge_pages(page + 1, page)                # no whole page inside: no call
    assert recorded == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_empty_large_is_advised_and_usable(recorded, dtype):
    rows = _host.ADVISE_BYTES // (64 * torch.tensor([], dtype=dtype).element_size()) + 1
    t = _host.torch_empty(rows, 64, dtype=dtype)
    assert t.shape == (rows, 64) and t.dtype == dtype and t.is_contiguous()
    assert len(recorded) == 1
    addr, n, _ = recorded[0]
    assert addr % _host.HUGE_PAGE == 0 and n % _host.HUGE_PAGE == 0
    assert t.data_ptr() <= addr and addr + n <= t.data_ptr() + t.numel() * t.element_size()
    t.fill_(2)
    t.resize_(3, 5)                  # still an ordinary, resizable torch tensor
    assert float(t.sum()) == 30.0


def test_small_outputs_are_not_advised(recorded):
    t = _host.torch_empty(16, 16, dtype=torch.float32)
    assert t.shape == (16, 16) and recorded == []


def test_zeros_and_empty_of_torch_like_use_it(recorded):
    like = torch.ones(1)
    shape = (_host.ADVISE_BYTES // 4 // 128 + 1, 128)
    z = _host.zeros(shape, _host._dt.F32, like)
    e = _host.empty(shape, _host._dt.F32, like)
    assert isinstance(z, torch.Tensor) and isinstance(e, torch.Tensor)
    assert not z.any() and len(recorded) == 2


def test_like_on_another_device_uses_its_new_empty():
    class Like:
        is_cpu = False

        def new_empty(self, sizes, dtype):
            return ("new_empty", sizes, dtype)
    assert _host.torch_empty(2, 3, dtype=torch.float32, like=Like()) == \
        ("new_empty", (2, 3), torch.float32)


def test_real_madvise_is_harmless():
    _host._MADVISE.clear()
    t = _host.torch_empty(_host.ADVISE_BYTES // 4 + 1024, dtype=torch.float32)
    t.fill_(1.0)
    assert float(t[-1]) == 1.0
    np.testing.assert_equal(t[:8].numpy(), np.ones(8, np.float32))


def test_matmul_advises_only_large_torch_outputs(recorded):
    import ops
    w = torch.randn(1024, 64)
    small = ops.matmul(torch.randn(8, 64), w.T)
    assert small.shape == (8, 1024) and recorded == []
    rows = _host.ADVISE_BYTES // (4 * 1024) + 1
    x = torch.randn(rows, 64)
    big = ops.matmul(x, w.T)
    assert len(recorded) == 1
    torch.testing.assert_close(big, x @ w.T, rtol=1e-4, atol=1e-4)


def test_scratch_is_kept_per_name_shape_and_dtype():
    from tpp.core import dtypes
    import tpp
    a = _host.scratch("t_scratch", (3, 5), dtypes.F32)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags.c_contiguous
    assert _host.scratch("t_scratch", (3, 5), dtypes.F32) is a
    assert _host.scratch("t_other", (3, 5), dtypes.F32) is not a
    b = _host.scratch("t_scratch", (5, 3), dtypes.F32)
    assert b is not a and b.shape == (5, 3)
    c = _host.scratch("t_scratch", (5, 3), dtypes.BF16)
    assert c is not b and c.dtype == dtypes.BF16.numpy
    tpp.clear_caches()
    assert _host.scratch("t_scratch", (5, 3), dtypes.BF16) is not c


def test_scratch_over_the_limit_is_fresh(monkeypatch):
    from tpp.core import dtypes
    monkeypatch.setattr(_host, "SCRATCH_KEEP_BYTES", 64)
    a = _host.scratch("t_big", (4, 5), dtypes.F32)
    assert _host.scratch("t_big", (4, 5), dtypes.F32) is not a


def test_scratch_in_other_threads_is_their_own():
    import threading
    from tpp.core import dtypes
    mine = _host.scratch("t_thread", (2, 2), dtypes.F32)
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(_host.scratch("t_thread", (2, 2),
                                                                      dtypes.F32)))
    t.start()
    t.join()
    assert theirs[0] is not mine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_like_views_host_memory_as_torch(dtype):
    from tpp.core import dtypes
    dt = dtypes.F32 if dtype == "float32" else dtypes.BF16
    arr = np.arange(6, dtype=np.float32).astype(dt.numpy).reshape(2, 3)
    assert _host.like(arr, arr) is arr
    t = _host.like(arr, torch.zeros(1))
    assert isinstance(t, torch.Tensor) and t.dtype == getattr(torch, dtype) and t.shape == (2, 3)
    t[0, 0] = 7
    assert float(arr[0, 0]) == 7.0


def test_host_arrays_start_at_64_byte_boundaries():
    """Every host array the operators allocate for numpy callers starts on a cache line (a
    64-byte AMX tile row or AVX-512 load from it never straddles two), whatever numpy's
    own placement (a zero-size array has no data to place)."""
    import numpy as np
    from ops import _host
    from tpp.core import dtypes
    assert _host.np_empty(5, np.float32).shape == (5,)
    for shape in ((0,), (1,), (3, 5), (64, 64), (7, 33, 9), (1 << 20,)):
        for dt in (np.float32, dtypes.BF16.numpy, np.uint8):
            a = _host.np_empty(shape, dt)
            assert a.shape == shape and a.dtype == np.dtype(dt) and a.flags.c_contiguous
            assert a.flags.writeable and (a.size == 0 or a.ctypes.data % 64 == 0)
            z = _host.np_zeros(shape, dt)
            assert (z.size == 0 or z.ctypes.data % 64 == 0) and not z.view(np.uint8).any()
    like = np.ones(3, np.float32)
    assert _host.empty((5, 7), dtypes.BF16, like).ctypes.data % 64 == 0
    assert _host.zeros((5, 7), dtypes.F32, like).ctypes.data % 64 == 0
    assert _host.scratch("align-test", (9, 9), dtypes.F32).ctypes.data % 64 == 0


def test_temp_is_the_scratch_of_the_callers_kind():
    from tpp.core import dtypes
    import tpp
    x = torch.zeros(2)
    t = _host.temp("t_temp", (3, 4), dtypes.F32, x)
    assert isinstance(t, torch.Tensor) and t.shape == (3, 4) and t.dtype == torch.float32
    t.fill_(5.0)
    again = _host.temp("t_temp", (3, 4), dtypes.F32, x, zero=True)
    assert again.data_ptr() == t.data_ptr() and not again.any()       # the same memory, zeroed
    arr = _host.temp("t_temp", (3, 4), dtypes.F32, np.zeros(2))
    assert type(arr) is np.ndarray and arr.ctypes.data == t.data_ptr()
    assert arr.ctypes.data % _host.ALIGN == 0
    tpp.clear_caches()
