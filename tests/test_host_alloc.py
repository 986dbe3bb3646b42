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
