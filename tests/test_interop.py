"""Calls with torch tensors and other array objects: zero copy, results of the caller's kind."""
import numpy as np
import pytest

import tpp

torch = pytest.importorskip("torch")


def test_torch_in_torch_out_zero_copy():
    x = torch.randn(6, 21, generator=torch.Generator().manual_seed(0))
    k = tpp.unary("gelu", 6, 21)
    y = k(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    want = torch.from_numpy(tpp.core.reference.run(k.spec, x.numpy()))
    torch.testing.assert_close(y, want, rtol=1e-6, atol=0)
    # torch's own gelu is less exact (about 3e-5 relative on the negative side)
    torch.testing.assert_close(y, torch.nn.functional.gelu(x), rtol=1e-4, atol=1e-6)
    out = torch.empty(6, 21)
    assert k(x, out=out) is out


def test_torch_bf16_strided_views():
    base = torch.randn(5, 40).to(torch.bfloat16)
    x = base[:, 3:30]                       # ld 40 from the strides
    k = tpp.binary("mul", 5, 27, dtype_in0="bf16", dtype_out="f32")
    y = k(x, x)
    torch.testing.assert_close(y, (x.float() * x.float()), rtol=0, atol=0)


def test_torch_relu_mask_and_backward_match_autograd():
    x = torch.randn(7, 19, requires_grad=True)
    y, mask = tpp.unary("relu", 7, 19, bitmask=True)(x.detach())
    torch.relu(x).backward(torch.ones(7, 19))
    g = tpp.unary("relu_inv", 7, 19, bitmask=True)(torch.ones(7, 19), mask)
    torch.testing.assert_close(g, x.grad)


def test_non_cpu_tensors_are_refused():
    x = torch.empty(4, 8, device="meta")
    with pytest.raises(tpp.UnsupportedError, match="meta"):
        tpp.unary("relu", 4, 8)(x)


def test_dtype_mismatch_names_torch_dtype():
    with pytest.raises(tpp.ArgumentError, match="expected dtype f32, got torch.float64"):
        tpp.unary("relu", 2, 2)(torch.zeros(2, 2, dtype=torch.float64))


def test_objects_with_array_interface_and_dlpack():
    class Wrapped:
        def __init__(self, a):
            self.__array_interface__ = a.__array_interface__
            self._a = a
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(tpp.unary("negate", 3, 4)(Wrapped(a)), -a)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    class DL:
        def __dlpack__(self, **kw):
            return t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return t.__dlpack_device__()
    np.testing.assert_array_equal(tpp.unary("negate", 3, 4)(DL()), -a)


def test_dtype_lookup_remembers_only_what_it_found():
    """lookup answers numpy and torch dtypes from a table after the first time, the same
    DType; an unknown dtype stays an error every time (nothing remembered for it)."""
    from tpp.core import dtypes
    from tpp.core.errors import SpecError
    for _ in range(2):
        assert dtypes.lookup(torch.float32) is tpp.F32
        assert dtypes.lookup(torch.bfloat16) is tpp.BF16
        assert dtypes.lookup(np.dtype(np.float32)) is tpp.F32
        assert dtypes.lookup("bf16") is tpp.BF16
        with pytest.raises(SpecError, match="unknown dtype"):
            dtypes.lookup(torch.float64)
        with pytest.raises(SpecError, match="unknown dtype"):
            dtypes.lookup(np.dtype(">f4"))
    assert torch.float64 not in dtypes._SEEN and "bf16" not in dtypes._SEEN
