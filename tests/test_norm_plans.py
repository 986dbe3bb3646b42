"""ops.norm_plans and ops.norms._planned: a call whose signature a checked call served before
runs the recorded nest directly. Planned results equal the checked ones bit for bit, every argument that is not part
of a signature (the data, eps's value, a weight changed in place) is honoured, and arguments
outside the signature take the checked path (its errors, its autograd)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import ops.norm_plans as plans
import ops.norms as N
from tpp.core.errors import ArgumentError

torch = pytest.importorskip("torch")
import ops.torch_norms as tn  # noqa: E402

F = torch.nn.functional


@pytest.fixture
def counted(monkeypatch):
    """The number of planned calls that ran (ops.norms._planned returning results)."""
    hits = [0]
    real = N._planned

    def planned(*args):
        got = real(*args)
        hits[0] += got is not None
        return got
    monkeypatch.setattr(N, "_planned", planned)
    plans._PLANS.clear()
    yield hits
    plans._PLANS.clear()


def _calls(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 40, generator=g).to(dtype)
    w, b = (torch.randn(40, generator=g).to(dtype) for _ in range(2))
    xn, wn, bn = (t.float().numpy() for t in (x, w, b))
    ln, rms = torch.nn.LayerNorm(40).to(dtype), torch.nn.RMSNorm(40).to(dtype)
    tln, trms = tn.LayerNorm(40).to(dtype), tn.RMSNorm(40).to(dtype)
    for mod in (ln, tln, rms, trms):
        with torch.no_grad():
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
    tln.load_state_dict(ln.state_dict())
    trms.load_state_dict(rms.state_dict())
    return [   # (name, the TPP call, the reference or None)
        ("ln numpy", lambda: N.layer_norm(xn, wn, bn, 1e-3), None),
        ("rms numpy", lambda: N.rms_norm(xn, wn), None),
        ("softmax numpy", lambda: N.softmax(xn), None),
        ("LayerNorm", lambda: tln(x), lambda: ln(x)),
        ("RMSNorm eps None", lambda: trms(x), lambda: rms(x)),
        ("layer_norm int shape", lambda: tn.layer_norm(x, 40, w, None), lambda: F.layer_norm(
            x, (40,), w, None)),
        ("softmax", lambda: tn.softmax(x, -1), lambda: F.softmax(x, -1)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_calls_equal_the_checked_ones(counted, dtype):
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, call, ref in _calls(dtype):
        if dtype == torch.bfloat16 and "numpy" in name:
            continue
        with torch.no_grad():
            before = counted[0]
            checked = call()            # records the plan
            planned = [call(), call()]
            assert counted[0] == before + 2, name
            for got in planned:
                assert type(got) is type(checked) and got.shape == checked.shape
                assert got.dtype == checked.dtype
                np.testing.assert_array_equal(np.asarray(torch.as_tensor(got).float()),
                                              np.asarray(torch.as_tensor(checked).float()))
            if ref is not None:
                torch.testing.assert_close(planned[0].float(), ref().float(), **tol)


def test_planned_calls_follow_their_arguments(counted):
    x = torch.randn(4, 24)
    ln = tn.LayerNorm(24)
    with torch.no_grad():
        ln(x)
        ln(x)
        assert counted[0] == 1
        x2 = torch.randn(4, 24)                 # new data, same signature
        torch.testing.assert_close(ln(x2), F.layer_norm(x2, (24,), ln.weight, ln.bias))
        ln.weight.mul_(3.0)                     # a parameter changed in place
        torch.testing.assert_close(ln(x2), F.layer_norm(x2, (24,), ln.weight, ln.bias))
        ln.eps = 0.5                            # another eps: another signature
        torch.testing.assert_close(ln(x2), F.layer_norm(x2, (24,), ln.weight, ln.bias, 0.5))
        xt = torch.randn(24, 4).t()             # not contiguous: the checked path
        torch.testing.assert_close(ln(xt), F.layer_norm(xt, (24,), ln.weight, ln.bias, 0.5))
        with pytest.raises(ArgumentError):      # a weight of another shape still fails
            tn.layer_norm(x, (24,), torch.ones(23), None)
    # with autograd on, the planned path is never taken: gradients flow
    xg = x.clone().requires_grad_()
    ln(xg).sum().backward()
    ref = xg.detach().clone().requires_grad_()
    F.layer_norm(ref, (24,), ln.weight, ln.bias, 0.5).sum().backward()
    torch.testing.assert_close(xg.grad, ref.grad)


def test_numpy_and_torch_do_not_share_plans(counted):
    x = np.random.default_rng(0).standard_normal((2, 16), dtype=np.float32)
    N.softmax(x)
    N.softmax(x)
    got = N.softmax(torch.from_numpy(x))        # same shape and dtype, another kind
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, torch.softmax(torch.from_numpy(x), -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_forwards_with_statistics_and_backwards(counted, dtype):
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(3, 5, 40, generator=g).to(dtype) for _ in range(2))
    w, b = (torch.randn(40, generator=g).to(dtype) for _ in range(2))
    _, mean, rstd = N.layer_norm_forward(x, w, b)
    _, rrstd = N.rms_norm_forward(x, w)
    probs = N.softmax(x)
    # every `need`, those without dx too (their nests do not read the weight)
    needs3 = [need for need in itertools.product((True, False), repeat=3) if any(need)]
    calls = [lambda: N.layer_norm_forward(x, w, b, 1e-3),
             lambda: N.rms_norm_forward(x, None),
             *(lambda need=need: N.layer_norm_backward(dy, x, mean, rstd, w, need=need)
               for need in needs3),
             lambda: N.layer_norm_backward(dy, x, mean, rstd, None, bias=False),
             *(lambda need=need: N.rms_norm_backward(dy, x, rrstd, w, need=need)
               for need in ((True, True), (True, False), (False, True))),
             lambda: N.softmax_backward(dy, probs)]
    for k, call in enumerate(calls):
        checked = call()
        before = counted[0]
        planned = call()
        assert counted[0] == before + 1, k
        for got, want in zip(planned, checked):
            assert (got is None) == (want is None), k
            if want is not None:
                assert got.shape == want.shape and got.dtype == want.dtype, k
                assert torch.equal(got, want), k


def test_drop_in_training_steps_match_torch(counted):
    g = torch.Generator().manual_seed(2)
    ln, ref = tn.LayerNorm(40), torch.nn.LayerNorm(40)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(40, generator=g))
        ref.load_state_dict(ln.state_dict())
    for step in range(3):
        x = torch.randn(6, 40, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ln(xa) ** 2).sum().backward()
        (ref(xb) ** 2).sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)
        for p, q in zip(ln.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    assert counted[0] >= 4      # the later steps' forward and backward were planned


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("wants", ["parameters", "input"])
def test_drop_in_steps_with_some_gradients_match_torch(counted, module, wants):
    """Training steps where only the parameters (an input that is data) or only the input (a
    frozen norm) want gradients: the backward's nest then reads fewer arrays, and its planned
    calls from the second step on must run it as the first step did."""
    g = torch.Generator().manual_seed(3)
    ours, ref = getattr(tn, module)(40), getattr(torch.nn, module)(40)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(40, generator=g))
        ref.load_state_dict(ours.state_dict())
    for mod in (ours, ref):
        mod.requires_grad_(wants == "parameters")
    for step in range(3):
        x = torch.randn(6, 40, generator=g)
        xa, xb = x.clone().requires_grad_(wants == "input"), x.clone().requires_grad_(
            wants == "input")
        (ours(xa) ** 3).sum().backward()
        (ref(xb) ** 3).sum().backward()
        if wants == "input":
            torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    assert counted[0] >= 4      # the later steps' forward and backward were planned


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_residual_layer_norm_plans(counted, kind):
    """ops.residual_layer_norm without dropout is planned like the norms: the same results bit
    for bit (every output combination), a residual of another shape fails as before, and
    calls with dropout always take the checked path (the seed decides the mask)."""
    import ops.residual_norm as rn
    g = np.random.default_rng(1)
    x, res = (g.standard_normal((6, 48), dtype=np.float32) for _ in range(2))
    b, w, nb = (g.standard_normal(48, dtype=np.float32) for _ in range(3))
    if kind == "torch":
        x, res, b, w, nb = (torch.from_numpy(a) for a in (x, res, b, w, nb))
    for want_h, stats in ((False, False), (True, True)):
        before = counted[0]
        checked = rn.residual_layer_norm(x, b, res, w, nb, 1e-5, want_h=want_h, stats=stats)
        planned = rn.residual_layer_norm(x, b, res, w, nb, 1e-5, want_h=want_h, stats=stats)
        assert counted[0] == before + 1
        for c, p in zip(checked, planned):
            assert (c is None) == (p is None)
            if c is not None:
                assert type(c) is type(p) and c.shape == p.shape
                np.testing.assert_array_equal(np.asarray(p), np.asarray(c))
    with pytest.raises(ArgumentError):
        rn.residual_layer_norm(x, b, res[:5], w, nb, 1e-5)
    before = counted[0]
    first = rn.residual_layer_norm(x, b, res, w, nb, 1e-5, 0.25, 7, want_h=False, stats=False)
    again = rn.residual_layer_norm(x, b, res, w, nb, 1e-5, 0.25, 7, want_h=False, stats=False)
    assert counted[0] == before
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(again[0]))
    np.testing.assert_array_equal(np.asarray(first[4]), np.asarray(again[4]))
