"""ops.norms (LayerNorm, RMSNorm, softmax, bias+activation+dropout from equations) and the
ops.torch_norms drop-ins, against torch: forward and backward, f32 and bf16."""
from __future__ import annotations

import numpy as np
import pytest

import ops.norms as N
import tpp
from tpp.core.errors import ArgumentError

torch = pytest.importorskip("torch")
import ops.torch_norms as tn  # noqa: E402

F = torch.nn.functional
# 520: a vector tail and blocks of 63 rows (odd: a row past the last pair of a grouped
# backward, tpp_cpu.equation's row groups)
COLS = [1, 3, 17, 64, 70, 520, 768, 1024, 4096]
ROWS = [1, 3, 64, 130]
TOL = {"f32": dict(rtol=1e-4, atol=1e-4), "bf16": dict(rtol=2e-2, atol=2e-2)}


def _data(shape, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=np.float32) + np.float32(offset))


def _t(a, grad=False):
    return torch.from_numpy(np.array(a, copy=True)).requires_grad_(grad)


def _close(got, want, tol=TOL["f32"], scale=1.0):
    got = torch.as_tensor(np.asarray(got, np.float32) if isinstance(got, np.ndarray) else got)
    want = torch.as_tensor(want).float()
    torch.testing.assert_close(got.float(), want, rtol=tol["rtol"],
                               atol=tol["atol"] * max(1.0, scale))


def _ln_torch(x, w, b, dy, eps=1e-5):
    xt, wt, bt = _t(x, True), _t(w, True), _t(b, True)
    y = F.layer_norm(xt, xt.shape[-1:], wt, bt, eps)
    y.backward(_t(dy))
    return y.detach(), xt.grad, wt.grad, bt.grad


@pytest.mark.parametrize("n", COLS)
def test_layer_norm_rms_norm_softmax_vs_torch(n):
    w, b = _data(n, 1), _data(n, 2)
    for m in ROWS if n <= 1024 else (1, 3, 64):
        x, dy = _data((m, n), m, offset=0.5), _data((m, n), m + 7)
        # layer norm
        y, mean, rstd = N.layer_norm_forward(x, w, b)
        dx, dw, db = N.layer_norm_backward(dy, x, mean, rstd, w)
        ty, tdx, tdw, tdb = _ln_torch(x, w, b, dy)
        # n = 1: var = 0, rstd = 1/sqrt(eps); y = b up to rstd's rounding (as torch's form)
        big = 1e3 if n == 1 else 1.0
        _close(y, ty, scale=big)
        _close(dx, tdx, scale=big * max(1.0, float(tdx.abs().max())))
        _close(dw, tdw, scale=np.sqrt(m) * big)
        _close(db, tdb, scale=np.sqrt(m))
        _close(mean, x.mean(1))
        # rms norm
        y, rstd = N.rms_norm_forward(x, w, eps=1e-6)
        dx, dw = N.rms_norm_backward(dy, x, rstd, w)
        xt, wt = _t(x, True), _t(w, True)
        ty = F.rms_norm(xt, (n,), wt, 1e-6)
        ty.backward(_t(dy))
        _close(y, ty.detach())
        _close(dx, xt.grad, scale=float(xt.grad.abs().max()))
        _close(dw, wt.grad, scale=np.sqrt(m))
        # softmax
        y = N.softmax(x)
        dx = N.softmax_backward(dy, y)
        xt = _t(x, True)
        ty = torch.softmax(xt, -1)
        ty.backward(_t(dy))
        _close(y, ty.detach(), TOL["f32"])
        _close(dx, xt.grad)


def test_no_affine_and_3d_and_torch_tensors():
    x = _data((2, 5, 48), 3)
    dy = _data((2, 5, 48), 4)
    y, mean, rstd = N.layer_norm_forward(x, None, None, eps=1e-3)
    assert y.shape == x.shape and mean.shape == (2, 5) and mean.dtype == np.float32
    dx, dw, db = N.layer_norm_backward(dy, x, mean, rstd, None, bias=False)
    assert dw is None and db is None
    xt = _t(x, True)
    ty = F.layer_norm(xt, (48,), None, None, 1e-3)
    ty.backward(_t(dy))
    _close(y, ty.detach())
    _close(dx, xt.grad)
    # weight without bias; torch tensors in, torch tensors out
    w = _data(48, 5)
    yt = N.layer_norm(torch.from_numpy(x), torch.from_numpy(w))
    assert isinstance(yt, torch.Tensor)
    _close(yt, F.layer_norm(torch.from_numpy(x), (48,), torch.from_numpy(w)))
    # non-contiguous input: copied
    xs = np.asfortranarray(x[0])
    _close(N.rms_norm(xs, None, eps=1e-5), F.rms_norm(torch.from_numpy(x[0]), (48,), None, 1e-5))


@pytest.mark.parametrize("n", [17, 520, 768])
def test_bf16(n):
    bf = tpp.BF16.numpy
    x = _data((64, n), 1, offset=1.0).astype(bf)
    dy = _data((64, n), 2).astype(bf)
    w, b = _data(n, 3).astype(bf), _data(n, 4).astype(bf)
    y, mean, rstd = N.layer_norm_forward(x, w, b)
    assert y.dtype == bf and mean.dtype == np.float32
    dx, dw, db = N.layer_norm_backward(dy, x, mean, rstd, w)
    assert dx.dtype == bf and dw.dtype == bf
    xt, wt, bt = (_t(a.astype(np.float32)).bfloat16().requires_grad_() for a in (x, w, b))
    ty = F.layer_norm(xt, (n,), wt, bt)
    ty.backward(_t(dy.astype(np.float32)).bfloat16())
    tol = TOL["bf16"]
    _close(y.astype(np.float32), ty.detach(), tol, scale=4)
    # the gradients against f32 math on the same bf16 values (torch's bf16 backward rounds
    # its intermediates to bf16; ours keeps them in f32 and rounds once)
    _, fdx, fdw, fdb = _ln_torch(*(a.astype(np.float32) for a in (x, w, b, dy)))
    _close(dx.astype(np.float32), fdx, tol, scale=4)
    _close(dw.astype(np.float32), fdw, tol, scale=4)
    _close(db.astype(np.float32), fdb, tol, scale=4)
    _close(dx.astype(np.float32), xt.grad, tol, scale=8)
    # f32 weight with bf16 data
    y32w = N.layer_norm(x, w.astype(np.float32), b.astype(np.float32))
    _close(y32w.astype(np.float32), ty.detach(), tol, scale=4)
    ys = N.softmax(x)
    _close(ys.astype(np.float32), torch.softmax(xt.detach(), -1), tol)
    yr = N.rms_norm(x, w)
    _close(yr.astype(np.float32), F.rms_norm(xt.detach(), (n,), wt.detach(), 1e-6), tol,
           scale=4)


def test_softmax_mask_and_scale():
    m, n = 130, 70
    x, dy = _data((m, n), 1), _data((m, n), 2)
    block = np.where(_data((m, n), 3) > 1.0, -np.inf, 0.0).astype(np.float32)
    row = _data(n, 4)
    for mask in (None, block, row):
        for scale in (None, 0.125):
            y = N.softmax(x, mask=mask, scale=scale)
            dx = N.softmax_backward(dy, y, scale=scale)
            xt = _t(x, True)
            z = xt * scale if scale is not None else xt
            ty = torch.softmax(z + (0 if mask is None else _t(mask)), -1)
            ty.backward(_t(dy))
            _close(y, ty.detach())
            _close(dx, xt.grad)
    # a (B, 1, S, S) attention mask broadcast over heads: expanded
    x4 = _data((2, 3, 8, 8), 5)
    causal = np.triu(np.full((8, 8), -np.inf, np.float32), 1)[None, None]
    mask = np.broadcast_to(causal, (2, 1, 8, 8))
    _close(N.softmax(x4, mask=mask, scale=0.5),
           torch.softmax(_t(x4) * 0.5 + _t(mask), -1))
    with pytest.raises(ArgumentError, match="mask"):
        N.softmax(x, mask=np.zeros((3, n), np.float32))


@pytest.mark.parametrize("magnitude", [1e9, 1e20, 1e30])
def test_softmax_of_huge_scaled_logits_is_finite(magnitude):
    """x * scale - max rounded before exp: an unrounded fma left up to half an ulp of a
    ~1e9 maximum above 0, past exp's non-positive domain (NaN where torch is finite)."""
    x = _data((9, 40), 6)
    y = N.softmax(x, scale=magnitude)
    _close(y, torch.softmax(_t(x) * magnitude, -1))
    assert np.isfinite(y).all()


def test_bias_act_dropout():
    m, n = 130, 70
    x, b, dy = _data((m, n), 1), _data(n, 2), _data((m, n), 3)
    for act, fn in (("gelu", F.gelu), ("relu", torch.relu), (None, lambda t: t),
                    ("tanh", torch.tanh), ("silu", F.silu)):
        y, keep = N.bias_act_dropout(x, b, act)
        assert keep is None
        dx, db = N.bias_act_dropout_backward(dy, x, b, None, act)
        xt, bt = _t(x, True), _t(b, True)
        ty = fn(xt + bt)
        ty.backward(_t(dy))
        _close(y, ty.detach())
        _close(dx, xt.grad)
        _close(db, bt.grad, scale=np.sqrt(m))
    p = 0.25
    y, keep = N.bias_act_dropout(x, b, "gelu", p=p, seed=11)
    assert keep.shape == (m, (n + 7) // 8) and keep.dtype == np.uint8
    kept = np.unpackbits(keep, axis=1, bitorder="little")[:, :n].astype(bool)
    assert 0.65 < kept.mean() < 0.85
    y2, keep2 = N.bias_act_dropout(x, b, "gelu", p=p, seed=11)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(keep, keep2)
    assert not np.array_equal(keep, N.bias_act_dropout(x, b, "gelu", p=p, seed=12)[1])
    xt, bt = _t(x, True), _t(b, True)
    ty = F.gelu(xt + bt) * _t(kept.astype(np.float32)) / (1 - p)
    ty.backward(_t(dy))
    _close(y, ty.detach())
    dx, db = N.bias_act_dropout_backward(dy, x, b, keep, "gelu", p=p)
    _close(dx, xt.grad)
    _close(db, bt.grad, scale=np.sqrt(m))


def test_new_row_count_compiles_nothing():
    n = 96
    x, w, b = _data((64, n)), _data(n, 1), _data(n, 2)
    y, mean, rstd = N.layer_norm_forward(x, w, b)
    N.layer_norm_backward(x, x, mean, rstd, w)
    N.softmax(x)
    before = tpp.cache_info()["compiled"]
    for m in (1, 3, 130, 1000):
        x = _data((m, n), m)
        y, mean, rstd = N.layer_norm_forward(x, w, b)
        N.layer_norm_backward(x, x, mean, rstd, w)
        N.softmax(x)
    assert tpp.cache_info()["compiled"] == before


def test_empty_rows():
    x = np.zeros((0, 8), np.float32)
    w = np.ones(8, np.float32)
    y, mean, rstd = N.layer_norm_forward(x, w, w)
    assert y.shape == (0, 8) and mean.shape == (0,)
    dx, dw, db = N.layer_norm_backward(x, x, mean, rstd, w)
    assert dx.shape == (0, 8) and np.all(dw == 0) and np.all(db == 0)


def test_bad_inputs():
    x = _data((4, 8))
    w = np.ones(8, np.float32)
    with pytest.raises(ArgumentError, match="weight"):
        N.layer_norm(x, np.ones(7, np.float32))
    with pytest.raises(ArgumentError, match="f32 or bf16"):
        N.layer_norm(x.astype(np.float64))
    with pytest.raises(ArgumentError, match="f32 or bf16"):
        N.rms_norm(x.astype(np.int32))
    with pytest.raises(ArgumentError, match="eps"):
        N.layer_norm(x, eps=-1.0)
    with pytest.raises(ArgumentError, match="eps"):
        N.rms_norm(x, eps=float("nan"))
    with pytest.raises(ArgumentError, match="wrong_keyword|accept"):
        N.softmax(x, wrong_keyword=1)
    with pytest.raises(ArgumentError, match="dy"):
        N.softmax_backward(x[:2], x)
    with pytest.raises(ArgumentError, match="mean"):
        N.layer_norm_backward(x, x, np.zeros(3, np.float32), np.zeros(4, np.float32), w)
    with pytest.raises(ArgumentError, match="activation"):
        N.bias_act_dropout(x, w, "swish")
    with pytest.raises(ArgumentError, match="p must"):
        N.bias_act_dropout(x, w, p=1.0)
    with pytest.raises(ArgumentError, match="keep"):
        N.bias_act_dropout_backward(x, x, w, None, p=0.5)
    with pytest.raises(ArgumentError, match="n"):
        N.layer_norm(np.zeros((3, 0), np.float32))


# ---------------------------------------------------------------- drop-ins
def test_layernorm_module_matches_torch():
    torch.manual_seed(0)
    ours = tn.LayerNorm((4, 16), eps=1e-4)
    ref = torch.nn.LayerNorm((4, 16), eps=1e-4)
    assert repr(ours).endswith(repr(ref)[len("LayerNorm"):])
    with torch.no_grad():
        ours.weight.uniform_()
        ours.bias.uniform_()
    ref.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == ["weight", "bias"]
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 4, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, ty = ours(x), ref(x2)
    torch.testing.assert_close(y, ty, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    ty.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-4)
    nb = tn.LayerNorm(8, bias=False)
    assert nb.bias is None and list(nb.state_dict()) == ["weight"]
    na = tn.LayerNorm(8, elementwise_affine=False)
    xs = torch.randn(5, 8)
    torch.testing.assert_close(na(xs), F.layer_norm(xs, (8,)), rtol=1e-4, atol=1e-5)
    bf = tn.LayerNorm(32, dtype=torch.bfloat16)
    assert bf(torch.randn(3, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_rmsnorm_module_and_functionals():
    ours, ref = tn.RMSNorm(24), torch.nn.RMSNorm(24)
    with torch.no_grad():
        ours.weight.uniform_()
    ref.load_state_dict(ours.state_dict())
    assert repr(ours) == repr(ref)
    x = torch.randn(3, 7, 24, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, ty = ours(x), ref(x2)
    torch.testing.assert_close(y, ty, rtol=1e-4, atol=1e-5)
    y.sum().backward()
    ty.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    # functional layer_norm / rms_norm / softmax
    w = torch.randn(24, requires_grad=True)
    xs = torch.randn(10, 24)
    torch.testing.assert_close(tn.layer_norm(xs, (24,), w, None, 1e-5),
                               F.layer_norm(xs, (24,), w, None, 1e-5), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tn.rms_norm(xs, [24], w), F.rms_norm(xs, [24], w),
                               rtol=1e-4, atol=1e-5)
    s = torch.randn(4, 5, 6, requires_grad=True)
    s2 = s.detach().clone().requires_grad_()
    for dim in (-1, 1, 0):
        p, tp = tn.softmax(s, dim), F.softmax(s2, dim)
        torch.testing.assert_close(p, tp, rtol=1e-5, atol=1e-6)
        g = torch.randn_like(p)
        gs = torch.autograd.grad(p, s, g)[0]
        torch.testing.assert_close(gs, torch.autograd.grad(tp, s2, g)[0], rtol=1e-4, atol=1e-5)
    assert tn.softmax(s.detach(), -1, dtype=torch.float64).dtype == torch.float64


def test_rmsnorm_default_eps_is_torchs_for_bf16():
    """eps=None: torch takes f32's epsilon (its computation type's) for bf16 input too, not
    bf16's 0.0078, which on rows of mean square ~1e-2 shrinks the output by ~30%."""
    torch.manual_seed(0)
    x = (torch.randn(6, 64) * 0.1).bfloat16()
    ref = torch.nn.RMSNorm(64).bfloat16()
    ours = tn.RMSNorm(64).bfloat16()
    ours.load_state_dict(ref.state_dict())
    for _ in range(2):      # the checked call, then the planned one
        torch.testing.assert_close(ours(x), ref(x), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(tn.rms_norm(x, (64,)), F.rms_norm(x, (64,)),
                                   rtol=2e-2, atol=2e-2)
    xg = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    g = torch.randn(6, 64).bfloat16()
    tn.rms_norm(xg, (64,)).backward(g)
    F.rms_norm(xr, (64,)).backward(g)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=3e-2, atol=3e-2)


def test_layer_norm_over_one_feature_is_its_bias_exactly():
    """Over one column x - mean is 0: y is the bias exactly (torch's too), not the bias plus
    the rounding of mean * rstd (~ulp(x) / sqrt(eps), 3e-3 at x = 100, eps = 1e-6)."""
    from ops.residual_norm import residual_layer_norm
    x = torch.tensor([[100.3], [20.7], [-3.1], [0.9], [1e4]])
    w, b = torch.tensor([1.7]), torch.tensor([0.25])
    for eps in (1e-5, 1e-6):
        assert torch.equal(tn.layer_norm(x, (1,), eps=eps), torch.zeros(5, 1))
        assert torch.equal(tn.layer_norm(x, (1,), w, b, eps), torch.full((5, 1), 0.25))
    y = residual_layer_norm(x.numpy(), None, (2 * x).numpy(), w.numpy(), b.numpy(), 1e-6)[0]
    assert np.array_equal(y, np.full((5, 1), 0.25, np.float32))
    xg = x.clone().requires_grad_()
    tn.layer_norm(xg, (1,), w, b, 1e-6).backward(torch.randn(5, 1))
    assert torch.equal(xg.grad, torch.zeros(5, 1))
    xb = x.bfloat16()
    assert torch.equal(tn.layer_norm(xb, (1,), eps=1e-6), torch.zeros(5, 1, dtype=torch.bfloat16))


def test_dropin_fallbacks_and_double_backward():
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(tn.layer_norm(x, (8,)), F.layer_norm(x, (8,)))
    torch.testing.assert_close(tn.softmax(x.half(), -1), F.softmax(x.half(), -1))
    assert tn.softmax(torch.tensor(2.0), 0).item() == 1.0
    # create_graph: the backward is differentiable again (torch ops)
    xf = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = tn.layer_norm(xf, (8,), w, None)
    g, = torch.autograd.grad((y ** 2).sum(), xf, create_graph=True)
    xr = xf.detach().clone().requires_grad_()
    gr, = torch.autograd.grad((F.layer_norm(xr, (8,), w, None) ** 2).sum(), xr,
                              create_graph=True)
    torch.testing.assert_close(g, gr, rtol=1e-4, atol=1e-4)
    g.sum().backward()
    assert xf.grad is not None
    with pytest.raises(ArgumentError, match="normalized_shape"):
        tn.layer_norm(torch.randn(3, 8), (7,))
    with pytest.raises(ArgumentError, match="weight"):
        tn.rms_norm(torch.randn(3, 8), (8,), torch.randn(7))


def test_layer_norm_backward_equations():
    """One equation: dx reading each row twice (its per-row sums, then dx: the gradient's sum
    of c * (x - mean) over a row, zero by the mean's definition, is not computed, _zero_sums),
    dweight and dbias folded into the second pass; the same without dx."""
    from tpp.core import dtypes
    from tpp.core import expr as X

    import ops.norm_graphs as G
    f32 = dtypes.F32
    spec, = G._ln_backward(32, 1024, f32, f32, True, True, (True, True, True))
    assert [o[0] for o in spec.outputs] == ["dx", "dweight", "dbias"]
    levels = {}
    for nd in X.topological(spec.nodes):
        below = max((levels[a] for a in nd.args), default=0)
        levels[nd] = below + (nd.op in X.REDUCTIONS)
    assert levels[spec.nodes[0]] == 1
    alone, = G._ln_backward(32, 1024, f32, f32, True, True, (False, True, True))
    assert [o[0] for o in alone.outputs] == ["dweight", "dbias"]


# ---------------------------------------------------------------- the bench suite
def test_bench_norm_suite_tiny(tmp_path, capsys, monkeypatch):
    """tpp-bench norm --tiny: every case for tpp and torch, the copy yardstick, ratios and
    copy fractions in the records (no speed asserted: a shared machine's figures)."""
    import json
    import os

    from bench import cli
    from bench.records import SCHEMA
    for var in cli.THREAD_ENV:       # main() pins threads: put the variables back afterwards
        monkeypatch.setenv(var, os.environ.get(var, ""))
        if not os.environ[var]:
            monkeypatch.delenv(var)
    threads = torch.get_num_threads()
    path = tmp_path / "norm.json"
    try:
        rc = cli.main(["norm", "--tiny", "-q", "--plain", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
        tpp.set_num_threads(None)
    assert rc == 0
    assert "norm" in capsys.readouterr().out
    records = json.loads(path.read_text())
    for r in records:
        assert set(r) == set(SCHEMA)
    norm = [r for r in records if r["suite"] == "norm"]
    cases = {(r["case"], r["provider"]) for r in norm}
    for op in ("layer_norm", "rms_norm", "softmax"):
        for kind in ("fwd", "fwd+bwd"):
            assert (f"{op} {kind}", "tpp") in cases and (f"{op} {kind}", "torch") in cases
    assert ("copy", "numpy") in cases
    for name in ("bias+gelu", "bias+gelu+dropout", "softmax"):
        assert (f"fused {name}", "tpp") in cases and (f"fused {name}", "chain") in cases
    for r in norm:
        assert r["unit"] == "GB/s" and r["extra"]["threads"] == 1
        if r["case"].startswith("fused"):
            assert r["provider"] != "tpp" or set(r["ratios"]) == {"chain"}
            continue
        assert r["extra"]["malloc"] in ("steady", "glibc default")
        if r["provider"] == "tpp":
            assert set(r["ratios"]) == {"torch"} and r["extra"]["verified"] is True
            assert 0 < r["extra"]["copy_fraction"]
