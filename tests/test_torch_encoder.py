"""ops.torch.TransformerEncoderLayer against torch.nn.TransformerEncoderLayer with the same
state_dict (forward, input and parameter gradients; norm_first, batch_first, relu/gelu, masks,
unbatched, bias=False, training with and without dropout, double backward, fallbacks), and the
fused residual-norm operator (ops.residual_norm) and autograd Functions against torch
recomputations with the same dropout masks. Small shapes: the file runs in well under a
minute on two cores."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import ops.residual_norm as rn          # noqa: E402
import ops.torch as ot                  # noqa: E402
import ops.torch_encoder as te          # noqa: E402

E, H, FF, N, L = 32, 4, 64, 3, 7
TOL = dict(rtol=1e-4, atol=1e-4)


def pair(**kw):
    """(torch layer, ours) with the same state_dict, in eval mode."""
    kw = {"dropout": 0.1, **kw}
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(E, H, FF, **kw).eval()
    ours = ot.TransformerEncoderLayer(E, H, FF, **kw).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def src(batch_first, n=N, length=L, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, length, E) if batch_first else (length, n, E), generator=g)


def compare(ref, ours, x, *args, served=True, **kw):
    """Forward, input and parameter gradients equal (and the fused path taken if served)."""
    assert ours.tpp_serves(x, *args, **kw) is served
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yo = ref(xr, *args, **kw), ours(xo, *args, **kw)
    torch.testing.assert_close(yo, yr, **TOL)
    dy = torch.randn_like(yr)
    yr.backward(dy)
    yo.backward(dy)
    torch.testing.assert_close(xo.grad, xr.grad, **TOL)
    for (name, pr), po in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(po.grad, pr.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    ref.zero_grad()
    ours.zero_grad()
    with torch.no_grad():
        got = ours(x, *args, **kw)
        # torch's own no-grad fast path (torch._transformer_encoder_layer_fwd) gives NaN for
        # float masks on torch 2.x CPU: the reference is its ordinary forward
        fast = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            expect = ref(x, *args, **kw)
        finally:
            torch.backends.mha.set_fastpath_enabled(fast)
        torch.testing.assert_close(got, expect, **TOL)


# each of norm_first, batch_first both ways, and each activation with each norm placement
@pytest.mark.parametrize("norm_first,batch_first,activation",
                         [(False, False, "relu"), (False, True, "gelu"), (True, False, "gelu"),
                          (True, True, "relu")])
def test_matches_torch(norm_first, batch_first, activation):
    ref, ours = pair(norm_first=norm_first, batch_first=batch_first, activation=activation)
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[0, -2:] = True
    compare(ref, ours, src(batch_first), src_key_padding_mask=pad)


def test_module_activations_and_state_dict():
    ref, ours = pair(activation=torch.nn.GELU(), batch_first=True)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert isinstance(ours, torch.nn.TransformerEncoderLayer)
    compare(ref, ours, src(True))
    back = torch.nn.TransformerEncoderLayer(E, H, FF, activation=torch.nn.GELU(),
                                            batch_first=True)
    back.load_state_dict(ours.state_dict())
    for a, b in zip(back.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("kind", ["bool2", "float2", "bool3", "float3", "causal", "mixed"])
def test_masks(kind):
    ref, ours = pair(batch_first=True, norm_first=kind in ("float2", "causal"))
    g = torch.Generator().manual_seed(3)
    pad = None
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    kw = {}
    if kind == "bool2":
        mask = torch.rand(L, L, generator=g) < 0.3
        mask.fill_diagonal_(False)
    elif kind == "float2":
        mask = torch.randn(L, L, generator=g)
    elif kind == "bool3":
        mask = torch.rand(N * H, L, L, generator=g) < 0.3
        mask[:, torch.arange(L), torch.arange(L)] = False
    elif kind == "float3":
        mask = torch.randn(N * H, L, L, generator=g)
    elif kind == "causal":
        mask = F._canonical_mask(mask=causal, mask_name="m", other_type=None, other_name="",
                                 target_type=torch.float32, check_other=False)
        kw["is_causal"] = True
    else:                               # bool src_mask, float padding mask
        mask = causal
        pad = torch.zeros(N, L)
        pad[1, -3:] = float("-inf")
    compare(ref, ours, src(True), mask, pad, **kw)


def test_unbatched_and_no_bias():
    ref, ours = pair(batch_first=False, bias=False)
    assert ours.linear1.bias is None and ours.norm1.bias is None
    x = src(True, n=1)[0]                                   # (L, E)
    pad = torch.zeros(L, dtype=torch.bool)
    pad[-1] = True
    compare(ref, ours, x, src_key_padding_mask=pad)


def test_training_without_dropout_matches_torch():
    ref, ours = pair(dropout=0.0, batch_first=True)
    ref.train()
    ours.train()
    compare(ref, ours, src(True))


def test_training_dropout_reproducible_and_random():
    _, ours = pair(dropout=0.25, batch_first=True, norm_first=True)
    ours.train()
    x = src(True).requires_grad_()
    torch.manual_seed(5)
    y1 = ours(x)
    torch.manual_seed(5)
    y2 = ours(x)
    y3 = ours(x)
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, y3)
    y1.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())
    # eval mode turns the dropouts off: torch's eval results
    ref, ours2 = pair(dropout=0.25, batch_first=True, norm_first=True)
    ours2.train()
    ours2.eval()
    compare(ref, ours2, src(True))


def test_double_backward():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ref, ours = pair(batch_first=True)
    x = src(True)
    grads = []
    for m in (ref, ours):
        xi = x.clone().requires_grad_()
        with sdpa_kernel(SDPBackend.MATH):  # torch's CPU flash kernel has no double backward
            g, = torch.autograd.grad((m(xi) ** 2).sum(), xi, create_graph=True)
            g2, = torch.autograd.grad(g.pow(2).sum(), xi)
        grads.append((g, g2))
    torch.testing.assert_close(grads[1][0], grads[0][0], **TOL)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-3, atol=1e-3)


def test_fallbacks_run_torch():
    ref, ours = pair(activation=lambda t: t.sigmoid(), batch_first=True)
    assert ours.unsupported_reason() is not None
    compare(ref, ours, src(True), served=False)
    ref, ours = pair(batch_first=True)
    compare(ref.double(), ours.double(), src(True).double(), served=False)
    ref, ours = pair(batch_first=True)
    hooked = []
    ours.linear1.register_forward_hook(lambda *a: hooked.append(1))
    ref.linear1.register_forward_hook(lambda *a: None)
    compare(ref, ours, src(True), served=False)
    assert hooked
    with pytest.raises(Exception):       # torch's own error: is_causal needs a mask
        ours.train()(src(True), is_causal=True)


def test_bf16_close_to_torch():
    ref, ours = pair(batch_first=True)
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = src(True).to(torch.bfloat16)
    assert ours.tpp_serves(x)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).float(), ref(x).float(), rtol=0.05, atol=0.1)


def test_packed_weights_follow_updates():
    ref, ours = pair(batch_first=True)
    x = src(True)
    with torch.no_grad():
        ours(x)
        for p in (ref.linear1.weight, ours.linear1.weight):
            p.mul_(0.5)
        torch.testing.assert_close(ours(x), ref(x), **TOL)
    import copy
    clone = copy.deepcopy(ours)
    assert clone._tpp_packed == {}


# ---------------------------------------------------------------- the fused pieces
def _bits(keep, n):
    return te._keep_bool(keep, n)


# (67, 520): blocks of 63 rows, which the backward's rows of 520 columns take in pairs and
# one row (tpp_cpu.equation's row groups), then 4 rows past the last block
@pytest.mark.parametrize("m,n", [(37, 48), (67, 520)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_residual_layer_norm_operator(p, m, n):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    b, w, lb = (torch.randn(n, generator=g) for _ in range(3))
    y, h, mean, rstd, keep = rn.residual_layer_norm(x, b, r, w, lb, 1e-5, p, seed=3)
    keepb = _bits(keep, n) if p else torch.ones(m, n, dtype=torch.bool)
    if p:
        assert 0.6 < keepb.float().mean() < 0.8
    leaves = [t.clone().requires_grad_() for t in (x, b, r, w, lb)]
    xs, bs, rs, ws, lbs = leaves
    hh = rs + torch.where(keepb, (xs + bs) / (1 - p), 0.0)
    yy = F.layer_norm(hh, (n,), ws, lbs, 1e-5)
    torch.testing.assert_close(h, hh.detach())
    torch.testing.assert_close(y, yy.detach())
    dy, dh = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    # with dh and without (then, and without dropout, the rows of 520 run in pairs)
    for cot in (dh, None):
        for leaf in leaves:
            leaf.grad = None
        (yy * dy + (0.0 if cot is None else hh * cot)).sum().backward(retain_graph=True)
        got = rn.residual_layer_norm_backward(dy, cot, h, mean, rstd, w, keep, p)
        for a, leaf in zip(got, (xs, bs, rs, ws, lbs)):
            torch.testing.assert_close(a, leaf.grad, **TOL)
    # numpy in, numpy out; same seed, same result; h alone
    yn, *_ = rn.residual_layer_norm(x.numpy(), b.numpy(), r.numpy(), w.numpy(), lb.numpy(),
                                    1e-5, p, seed=3, want_h=False, stats=False)
    assert isinstance(yn, np.ndarray)
    np.testing.assert_allclose(yn, y.numpy(), rtol=1e-6, atol=1e-6)
    h2, keep2 = rn.bias_dropout_residual(x, b, r, p, seed=3)
    torch.testing.assert_close(h2, h)


def test_autograd_functions_with_dropout():
    g = torch.Generator().manual_seed(1)
    m, n, p = 20, 40, 0.4
    x, b, r = (torch.randn(m, n, generator=g), torch.randn(n, generator=g),
               torch.randn(m, n, generator=g))
    w, lb = torch.randn(n, generator=g), torch.randn(n, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, b, r, w, lb)]
    y, h = te.ResidualNormFunction.apply(*leaves, 1e-5, p, 11)
    (y.sum() + (h * h).sum()).backward()
    _, _, _, _, keep = rn.residual_layer_norm(x, b, r, w, lb, 1e-5, p, seed=11)
    ref = [t.clone().requires_grad_() for t in (x, b, r, w, lb)]
    hh = ref[2] + te._torch_dropout(ref[0] + ref[1], keep, p)
    (F.layer_norm(hh, (n,), ref[3], ref[4], 1e-5).sum() + (hh * hh).sum()).backward()
    for a, e in zip(leaves, ref):
        torch.testing.assert_close(a.grad, e.grad, **TOL)

    xs, bs, rs = (t.clone().requires_grad_() for t in (x, b, r))
    out = te.BiasDropoutResidualFunction.apply(xs, bs, rs, p, 11)
    keep = rn.bias_dropout_residual(x, b, r, p, seed=11)[1]
    torch.testing.assert_close(out, r + te._torch_dropout(x + b, keep, p))
    out.backward(h.detach())
    torch.testing.assert_close(rs.grad, h.detach())
    torch.testing.assert_close(xs.grad, te._torch_dropout(h.detach(), keep, p))
    torch.testing.assert_close(bs.grad, xs.grad.sum(0), **TOL)

    xs, bs = x.clone().requires_grad_(), b.clone().requires_grad_()
    out = te.BiasActDropoutFunction.apply(xs, bs, "gelu", p, 11)
    keep = ot._ops.bias_act_dropout(x, b, "gelu", p, 11)[1]
    xr, br = x.clone().requires_grad_(), b.clone().requires_grad_()
    expect = te._torch_dropout(F.gelu(xr + br), keep, p)
    torch.testing.assert_close(out, expect.detach(), **TOL)
    out.backward(r)
    expect.backward(r)
    torch.testing.assert_close(xs.grad, xr.grad, **TOL)
    torch.testing.assert_close(bs.grad, br.grad, **TOL)
