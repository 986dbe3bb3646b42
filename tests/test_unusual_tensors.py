"""torch tensors that are not plain memory to read as it is.

Tensors with the negative bit set (torch's lazy negation: x.conj().imag of a complex tensor,
torch._neg_view) hold -x in memory. The kernels and nests, which read memory, reject them
(ArgumentError naming .resolve_neg()); the operators and drop-ins copy them resolved and
compute on the values torch means; on the first call and the cached paths alike.

Tensor subclasses (any __torch_function__ object) are torch's to dispatch: the drop-ins hand
them to torch's own operators."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ops  # noqa: E402
import ops.torch as ot  # noqa: E402
import tpp  # noqa: E402
from tpp.core.errors import ArgumentError  # noqa: E402

F = torch.nn.functional


def _neg(t):
    return torch._neg_view(t)


def test_public_route_has_the_bit():
    t = torch.tensor([[1.0 + 2.0j]]).conj().imag
    assert t.is_neg() and t.tolist() == [[-2.0]]
    with pytest.raises(ArgumentError, match="resolve_neg"):
        tpp.unary("identity", 1, 1)(t)
    assert ops.matmul(t, torch.tensor([[3.0]])).tolist() == [[-6.0]]


def test_kernels_and_nests_reject_it():
    x = torch.randn(4, 8)
    relu = tpp.unary("relu", 4, 8)
    relu(x)
    for _ in range(2):      # the checked call, then the one a cached layout would take
        with pytest.raises(ArgumentError, match="negative bit"):
            relu(_neg(x))
    with pytest.raises(ArgumentError, match="negative bit"):
        ops.matmul(x, torch.randn(8, 8), out=_neg(torch.empty(4, 8)))


def test_operators_compute_on_the_resolved_values():
    torch.manual_seed(0)
    x, w = torch.randn(6, 16), torch.randn(16, 16)
    q = torch.randn(1, 2, 5, 16)
    k = torch.randn(3, 6, 3, 3)
    cases = [
        (lambda: ops.softmax(_neg(x)), torch.softmax(-x, -1)),
        (lambda: ops.layer_norm(_neg(x)), F.layer_norm(-x, (16,))),
        (lambda: ops.rms_norm(_neg(x)), F.rms_norm(-x, (16,), eps=1e-6)),
        (lambda: ops.matmul(_neg(x), w), -x @ w),
        (lambda: ops.matmul(x, _neg(w)), x @ -w),
        (lambda: ops.linear(x, _neg(w)), x @ -w.t()),
        (lambda: ops.attention(_neg(q), q, q), F.scaled_dot_product_attention(-q, q, q)),
        (lambda: ops.conv2d(_neg(x.view(1, 6, 4, 4)), k, padding=1),
         F.conv2d(-x.view(1, 6, 4, 4), k, padding=1)),
        (lambda: ops.conv2d(x.view(1, 6, 4, 4), _neg(k), padding=1),
         F.conv2d(x.view(1, 6, 4, 4), -k, padding=1)),
    ]
    for got, want in cases:
        for _ in range(2):  # first call, then the planned / cached one
            torch.testing.assert_close(got(), want, rtol=1e-4, atol=1e-5)


def test_dropins_forward_and_backward():
    torch.manual_seed(0)
    lin, ln, conv = ot.Linear(8, 8), ot.LayerNorm(8), ot.Conv2d(2, 3, 3, padding=1)
    ref_lin, ref_conv = torch.nn.Linear(8, 8), torch.nn.Conv2d(2, 3, 3, padding=1)
    ref_lin.load_state_dict(lin.state_dict())
    ref_conv.load_state_dict(conv.state_dict())
    cases = [
        (lin, ref_lin, (4, 8)), (lin, ref_lin, (2, 3, 8)),
        (ln, lambda t: F.layer_norm(t, (8,), ln.weight, ln.bias), (4, 8)),
        (lambda t: ot.softmax(t, -1), lambda t: torch.softmax(t, -1), (4, 8)),
        (conv, ref_conv, (1, 2, 5, 5)),
        (lambda t: ot.scaled_dot_product_attention(t, t, t),
         lambda t: F.scaled_dot_product_attention(t, t, t), (1, 2, 5, 8)),
    ]
    for ours, ref, shape in cases:
        for _ in range(2):
            x = torch.randn(*shape, requires_grad=True)
            y = ours(_neg(x))
            g = torch.randn_like(y)
            y.backward(g)
            xr = x.detach().clone().requires_grad_()
            yr = ref(-xr)
            yr.backward(g)
            torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            x = torch.randn(*shape)
            torch.testing.assert_close(ours(_neg(x)), ref(-x), rtol=1e-4, atol=1e-5)


class _Subclass(torch.Tensor):
    """A plain torch.Tensor subclass: torch dispatches it through __torch_function__."""


def test_tensor_subclasses_are_torchs_to_dispatch():
    """A tensor subclass (any __torch_function__ object) goes to torch's own operator, as
    torch.nn.functional would dispatch it: torch's result, of the subclass (it crashed on an
    AttributeError, or came back a numpy array)."""
    torch.manual_seed(0)
    x = torch.randn(4, 7)
    xs = x.as_subclass(_Subclass)
    lin, ln, rms = ot.Linear(7, 3), ot.LayerNorm(7), ot.RMSNorm(7)
    conv = ot.Conv2d(2, 3, 3)
    img = torch.randn(1, 2, 5, 5)
    cases = [
        (lambda t: ot.linear(t, lin.weight, lin.bias), lambda t: F.linear(t, lin.weight, lin.bias)),
        (lin, lambda t: F.linear(t, lin.weight, lin.bias)),
        (lambda t: lin(t.view(2, 2, 7)), lambda t: F.linear(t.view(2, 2, 7), lin.weight, lin.bias)),
        (ln, lambda t: F.layer_norm(t, (7,), ln.weight, ln.bias)),
        (lambda t: ot.layer_norm(t, (7,)), lambda t: F.layer_norm(t, (7,))),
        (rms, lambda t: F.rms_norm(t, (7,), rms.weight)),
        (lambda t: ot.softmax(t, -1), lambda t: F.softmax(t, -1)),
    ]
    for ours, ref in cases:
        y = ours(xs)
        assert type(y) is _Subclass
        torch.testing.assert_close(y.as_subclass(torch.Tensor), ref(x), rtol=1e-4, atol=1e-5)
    y = conv(img.as_subclass(_Subclass))
    assert type(y) is _Subclass
    torch.testing.assert_close(y.as_subclass(torch.Tensor), F.conv2d(img, conv.weight, conv.bias),
                               rtol=1e-4, atol=1e-5)


def test_numpy_subclasses_are_read_as_plain_arrays(tmp_path):
    """np.memmap and other ndarray subclasses: every operator reads them as their plain
    ndarray view (they crashed with AttributeError) and returns ndarrays."""
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    mm = np.memmap(tmp_path / "x.dat", dtype=np.float32, mode="w+", shape=x.shape)
    mm[...] = x
    sub = x.view(type("MyArray", (np.ndarray,), {}))
    w = rng.standard_normal((16, 16)).astype(np.float32)
    img = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    for a in (mm, sub):
        calls = [(ops.layer_norm(a), ops.layer_norm(x)), (ops.softmax(a), ops.softmax(x)),
                 (ops.matmul(a, w), ops.matmul(x, w)), (ops.linear(a, w), ops.linear(x, w)),
                 (tpp.unary("relu", 4, 16)(a), np.maximum(x, 0)),
                 (ops.conv2d(a.reshape(img.shape), w[:3].reshape(3, 2, 2, 4), padding=1),
                  ops.conv2d(img * 0 + x.reshape(img.shape), w[:3].reshape(3, 2, 2, 4),
                             padding=1)),
                 (ops.attention(a.reshape(q.shape), q, q), ops.attention(x.reshape(q.shape), q, q))]
        for got, want in calls:
            assert type(got) is np.ndarray
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    del mm


def test_torch_func_transforms_take_torchs_operators():
    """Inside vmap / grad (torch.func) the tensors are wrappers without storage the kernels
    could read (RuntimeError from every drop-in): torch's own operators take the call."""
    from torch.func import grad, vmap
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, 8)
    for ref in (torch.nn.Linear(8, 4), torch.nn.LayerNorm(8), torch.nn.RMSNorm(8)):
        mine = ot.optimize(ref)
        torch.testing.assert_close(vmap(mine)(x), vmap(ref)(x))
        with torch.no_grad():
            torch.testing.assert_close(vmap(mine)(x), vmap(ref)(x))
        torch.testing.assert_close(grad(lambda t: mine(t).square().sum())(x[0]),
                                   grad(lambda t: ref(t).square().sum())(x[0]))
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    img = torch.randn(3, 2, 2, 5, 5)
    torch.testing.assert_close(vmap(ot.optimize(conv))(img), vmap(conv)(img))
    torch.testing.assert_close(vmap(lambda t: ot.softmax(t, -1))(x), torch.softmax(x, -1))
    torch.testing.assert_close(vmap(lambda t: ot.scaled_dot_product_attention(t, t, t))(x),
                               vmap(lambda t: F.scaled_dot_product_attention(t, t, t))(x))


def test_conv2d_padding_torch_refuses_is_refused():
    m = ot.Conv2d(2, 2, 3)
    m.padding = (1, 1, 2, 2)            # ops.conv's 4-tuple: not torch's
    with pytest.raises(RuntimeError, match="padding"):
        m(torch.randn(1, 2, 5, 5))


def test_drop_in_shape_errors_are_caught_as_torchs_are():
    """Where torch raises RuntimeError for a shape that does not fit (IndexError for a dim out
    of range), a drop-in's error is caught by the same except clause."""
    cases = [
        (ot.Linear(4, 5), torch.nn.Linear(4, 5), (torch.randn(3, 6),)),
        (ot.LayerNorm(8), torch.nn.LayerNorm(8), (torch.randn(3, 7),)),
        (ot.RMSNorm(8), torch.nn.RMSNorm(8), (torch.randn(3, 7),)),
        (ot.Conv2d(3, 4, 3), torch.nn.Conv2d(3, 4, 3), (torch.randn(1, 5, 8, 8),)),
    ]
    for ours, theirs, args in cases:
        with pytest.raises(RuntimeError):
            theirs(*args)
        with pytest.raises(RuntimeError) as caught:
            ours(*args)
        assert isinstance(caught.value, ArgumentError)     # and a ValueError, as before
    x = torch.randn(3, 7)
    for dim in (2, -3):
        with pytest.raises(IndexError):
            torch.softmax(x, dim)
        with pytest.raises(IndexError):
            ot.softmax(x, dim)


def test_attention_arguments_torch_refuses_are_refused_as_torch_does():
    """A 1-D attn_mask (torch: IndexError) and an is_causal that is not a bool (torch:
    TypeError) reach torch's own kernel, which raises; they were taken before."""
    import torch.nn.functional as F
    q, k = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 5, 8)
    mask = torch.tensor([True, False, True, True, False])
    for sdpa in (F.scaled_dot_product_attention, ot.scaled_dot_product_attention):
        with pytest.raises(IndexError):
            sdpa(q, k, k, attn_mask=mask)
        for flag in (torch.tensor(True), 1):
            with pytest.raises(TypeError):
                sdpa(q, k, k, is_causal=flag)


def test_what_torch_takes_or_refuses_by_kind_and_value():
    """Not a tensor: a TypeError (and an ArgumentError), as torch's. A non-finite attention
    scale: torch's own result (it computes one), not a refusal."""
    for call in (lambda: ot.linear([1.0] * 4, torch.randn(3, 4)),
                 lambda: ot.layer_norm([1.0], (1,)), lambda: ot.rms_norm([1.0], (1,)),
                 lambda: ot.softmax([1.0], 0), lambda: ot.LayerNorm(4)([1.0] * 4)):
        with pytest.raises(TypeError) as caught:
            call()
        assert isinstance(caught.value, ArgumentError)
    import torch.nn.functional as F
    q = torch.randn(1, 2, 3, 8)
    for scale in (float("nan"), float("inf")):
        torch.testing.assert_close(ot.scaled_dot_product_attention(q, q, q, scale=scale),
                                   F.scaled_dot_product_attention(q, q, q, scale=scale),
                                   equal_nan=True)
