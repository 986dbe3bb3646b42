"""ops.conv (conv2d forward / backward from BRGEMM nests) and the ops.torch_conv drop-ins,
against torch.nn.functional.conv2d and its autograd."""
import numpy as np
import pytest

import ops
import tpp
from tpp.core.errors import ArgumentError

torch = pytest.importorskip("torch")
F = torch.nn.functional
tc = pytest.importorskip("ops.torch_conv")

# (N, C, K, H, W, (R, S), stride, padding, dilation, groups)
CASES = [
    (2, 64, 32, 7, 7, (1, 1), 1, 0, 1, 1),        # ResNet-50 1x1 (scaled down)
    (2, 32, 64, 8, 8, (1, 1), 2, 0, 1, 1),        # 1x1 stride-2 projection
    (2, 64, 64, 8, 8, (3, 3), 1, 1, 1, 1),        # 3x3
    (2, 32, 48, 9, 9, (3, 3), 2, 1, 1, 1),        # 3x3 stride 2
    (1, 3, 16, 20, 20, (7, 7), 2, 3, 1, 1),       # the 7x7 stride-2 stem on a small image
    (2, 5, 7, 1, 1, (3, 3), 1, 1, 1, 1),          # 1x1 image, odd channels
    (1, 3, 5, 17, 13, (3, 3), 1, 0, 1, 1),        # odd sizes, no padding
    (2, 70, 66, 5, 3, (3, 1), 1, (1, 0), 1, 1),   # channels past one block, not multiples
    (1, 4, 6, 9, 9, (3, 3), 1, 2, 2, 1),          # dilation
    (1, 3, 4, 11, 10, (2, 3), 3, 1, (2, 1), 1),   # stride 3, rectangular kernel, dilation
    (2, 8, 8, 7, 7, (3, 3), 1, 1, 1, 8),          # depthwise
    (1, 4, 8, 6, 5, (3, 3), 2, 1, 1, 4),          # depthwise, channel multiplier 2
    (2, 6, 4, 5, 6, (3, 3), 1, 1, 1, 2),          # grouped
    (1, 3, 4, 6, 7, (4, 2), 1, "same", 1, 1),     # "same", even kernel (asymmetric)
    (1, 2, 3, 5, 5, (1, 1), 1, 1, 1, 1),          # padding wider than the kernel reach
]


def _ids(case):
    n, c, k, h, w, (r, s), st, p, d, g = case
    return f"n{n}c{c}k{k}_{h}x{w}_{r}x{s}_s{st}_p{p}_d{d}_g{g}".replace(" ", "")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_backward_f32(case):
    n, c, k, h, w, (r, s), stride, padding, dilation, groups = case
    g = torch.Generator().manual_seed(hash(case) % 1000)
    x = torch.randn(n, c, h, w, generator=g)
    wt = torch.randn(k, c // groups, r, s, generator=g) * 0.3
    b = torch.randn(k, generator=g)
    args = (stride, padding, dilation, groups)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, wt, b))
    ref = F.conv2d(xr, wr, br, *args)
    xo, wo, bo = (t.clone().requires_grad_() for t in (x, wt, b))
    y = tc.conv2d(xo, wo, bo, *args)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    dy = torch.randn(ref.shape, generator=g)
    ref.backward(dy)
    y.backward(dy)
    for mine, theirs in ((xo, xr), (wo, wr), (bo, br)):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("case", [
    (2, 6, 10, 6, 7, (3, 3), 1, 1, 1, 1),
    (1, 20, 8, 9, 8, (3, 3), 2, 1, 1, 1),
    (1, 3, 8, 12, 12, (7, 7), 2, 3, 1, 1),
    (2, 6, 10, 6, 7, (1, 1), 1, 0, 1, 1),        # 1x1 stride 1: one row of pixels
], ids=_ids)
def test_bf16(case):
    n, c, k, h, w, (r, s), stride, padding, dilation, groups = case
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, c, h, w, generator=g).bfloat16()
    wt = (torch.randn(k, c // groups, r, s, generator=g) * 0.3).bfloat16()
    b = torch.randn(k, generator=g).bfloat16()
    args = (stride, padding, dilation, groups)
    ref = F.conv2d(x.float(), wt.float(), b.float(), *args)
    y = ops.conv2d(x, wt, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=5e-2, rtol=2e-2)
    dy = torch.randn(ref.shape, generator=g).bfloat16()
    xr, wr, br = (t.float().requires_grad_() for t in (x, wt, b))
    F.conv2d(xr, wr, br, *args).backward(dy.float())
    dx, dw, db = ops.conv2d_backward(dy, x, wt, stride=stride, padding=padding,
                                     dilation=dilation, groups=groups)
    assert dx.dtype == dw.dtype == db.dtype == torch.bfloat16
    for mine, theirs in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        scale = theirs.abs().max().item()
        torch.testing.assert_close(mine.float(), theirs, atol=2e-2 * scale, rtol=2e-2)
    # through autograd (the data gradient's weight turned from the forward's packed one):
    # the same bits as the direct call
    xa, wa, ba = (t.clone().requires_grad_() for t in (x, wt, b))
    grads = torch.autograd.grad(tc.conv2d(xa, wa, ba, *args), (xa, wa, ba), dy)
    for got, want in zip(grads, (dx, dw, db)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_numpy_bias_activation(activation):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 6, 6), np.float32)
    w = rng.standard_normal((9, 5, 3, 3), np.float32) * 0.3
    b = rng.standard_normal(9).astype(np.float32)
    y = ops.conv2d(x, w, b, stride=1, padding=1, activation=activation)
    assert isinstance(y, np.ndarray) and y.shape == (2, 9, 6, 6)
    ref = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), padding=1)
    ref = torch.relu(ref) if activation == "relu" else F.gelu(ref)
    torch.testing.assert_close(torch.from_numpy(y), ref, atol=1e-4, rtol=1e-4)


def test_need_and_new_batch_compiles_nothing():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 4, 3, 3), np.float32)
    kw = dict(stride=2, padding=1)
    x = rng.standard_normal((1, 4, 7, 7), np.float32)
    y = ops.conv2d(x, w, **kw)
    ops.conv2d_backward(y, x, w, **kw)
    before = tpp.cache_info()["compiled"]
    for n in (3, 0):
        x = rng.standard_normal((n, 4, 7, 7), np.float32)
        y = ops.conv2d(x, w, **kw)
        assert y.shape == (n, 8, 4, 4)
        dx, dw, db = ops.conv2d_backward(y, x, w, **kw)
        assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (8,)
        if n == 0:
            assert not dw.any() and not db.any()
    assert tpp.cache_info()["compiled"] == before
    dx, dw, db = ops.conv2d_backward(y, x, w, need=(False, True, False), **kw)
    assert dx is None and db is None and dw is not None


def test_module_drop_in():
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(6, 10, 3, stride=2, padding=1)
    mine = tc.Conv2d(6, 10, 3, stride=2, padding=1)
    mine.load_state_dict(ref.state_dict())
    assert set(mine.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 6, 9, 9)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yo = ref(xr), mine(xo)
    torch.testing.assert_close(yo, yr, atol=1e-4, rtol=1e-4)
    yr.sum().backward()
    yo.sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine.bias.grad, ref.bias.grad, atol=1e-4, rtol=1e-4)
    # unbatched input; torch's own for another padding mode and for float64
    torch.testing.assert_close(mine(x[0]), ref(x[0]), atol=1e-4, rtol=1e-4)
    reflect = tc.Conv2d(6, 4, 3, padding=1, padding_mode="reflect", bias=False)
    ref2 = torch.nn.Conv2d(6, 4, 3, padding=1, padding_mode="reflect", bias=False)
    ref2.load_state_dict(reflect.state_dict())
    torch.testing.assert_close(reflect(x), ref2(x))
    torch.testing.assert_close(tc.conv2d(x.double(), ref.weight.double()),
                               F.conv2d(x.double(), ref.weight.double()))


def test_module_without_autograd():
    """Where nothing needs a gradient (no_grad, inference_mode, frozen parameters and an input
    without grad) Conv2d skips the autograd.Function: same values as torch, no graph; a frozen
    layer still passes the input's gradient on."""
    torch.manual_seed(3)
    ref = torch.nn.Conv2d(6, 70, 3, padding=1)       # 70 filters: a padded bias block
    mine = tc.Conv2d(6, 70, 3, padding=1)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 7, 7)
    with torch.no_grad():
        y = mine(x)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, ref(x), atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(mine(x), ref(x), atol=1e-4, rtol=1e-4)
    for module in (mine, ref):
        module.requires_grad_(False)
    y = mine(x)
    assert y.grad_fn is None
    torch.testing.assert_close(y, ref(x), atol=1e-4, rtol=1e-4)
    xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    mine(xm).square().sum().backward()
    ref(xr).square().sum().backward()
    torch.testing.assert_close(xm.grad, xr.grad, atol=1e-4, rtol=1e-4)
    assert mine.weight.grad is None


@pytest.mark.parametrize("kw", [dict(padding=1), dict(padding=(2, 0)), dict(padding=1, stride=2),
                                dict(padding=2, dilation=2)])
def test_frames_zeroed_whatever_memory_held(monkeypatch, kw):
    """The blocked copies' zero frames are written, not assumed: with every fresh host array
    full of NaN, padded convolutions (forward and both gradients) still equal torch's."""
    from ops import _host

    real = _host.empty

    def poisoned(shape, dtype, like):
        out = real(shape, dtype, like)
        if dtype in (tpp.F32, tpp.BF16):
            out[...] = float("nan")
        return out
    monkeypatch.setattr(_host, "empty", poisoned)
    torch.manual_seed(4)
    x = torch.randn(2, 6, 9, 8, requires_grad=True)
    w = torch.randn(5, 6, 3, 3, requires_grad=True)
    y = tc.conv2d(x, w, None, **kw)
    yr = F.conv2d(x, w, None, **kw)
    torch.testing.assert_close(y, yr, atol=1e-4, rtol=1e-4)
    dy = torch.randn(yr.shape)
    got = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(yr, (x, w), dy)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_only_needed_grads():
    x = torch.randn(1, 3, 5, 5)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    y = tc.conv2d(x, w, None, 1, 1)
    y.sum().backward()
    assert x.grad is None and w.grad is not None


def test_bad_input():
    x = np.zeros((1, 4, 5, 5), np.float32)
    w = np.zeros((8, 4, 3, 3), np.float32)
    bad = [
        lambda: ops.conv2d(x, np.zeros((8, 3, 3, 3), np.float32)),       # channels
        lambda: ops.conv2d(x[0], w),                                     # 3-D
        lambda: ops.conv2d(x.astype(np.float64), w.astype(np.float64)),  # dtype
        lambda: ops.conv2d(x, w.astype(tpp.BF16.numpy)),                 # mixed dtypes
        lambda: ops.conv2d(x, w, stride=0),
        lambda: ops.conv2d(x, w, padding=-1),
        lambda: ops.conv2d(x, w, padding="full"),
        lambda: ops.conv2d(x, w, padding="same", stride=2),
        lambda: ops.conv2d(x, w, groups=3),
        lambda: ops.conv2d(x, np.zeros((8, 4, 7, 7), np.float32)),       # kernel too large
        lambda: ops.conv2d(x, w, np.zeros(7, np.float32)),               # bias shape
        lambda: ops.conv2d(x, w, activation="nope"),
        lambda: ops.conv2d(x, w, padding=10 ** 9),                       # no host holds it
        lambda: ops.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=(0, 10 ** 12)),
        lambda: ops.conv2d(x, w, strides=2),                             # unknown keyword
        lambda: ops.conv2d_backward(np.zeros((1, 8, 4, 4), np.float32), x, w),
        lambda: ops.conv2d_backward(np.zeros((1, 8, 3, 3), np.float32), x, w, need=True),
    ]
    for fn in bad:
        with pytest.raises(ArgumentError):
            fn()


def test_blocked_chain():
    """Two layers on blocked activations: the first writes the second's padding frame."""
    from ops import conv
    torch.manual_seed(3)
    x = torch.randn(2, 5, 9, 8)
    w1 = torch.randn(70, 5, 3, 3) * 0.3
    b1 = torch.randn(70)
    w2 = torch.randn(6, 70, 3, 3) * 0.1
    xb = conv.blocked(x, padding=1)
    h = conv.conv2d_blocked(xb, w1, b1, padding=1, stride=2, activation="relu", out_padding=1)
    y = conv.to_nchw(conv.conv2d_blocked(h, conv.pack_weight(w2, 1, tpp.F32), padding=1))
    ref = F.conv2d(torch.relu(F.conv2d(x, w1, b1, padding=1, stride=2)), w2, padding=1)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ArgumentError):
        conv.conv2d_blocked(xb, w1, padding=0)          # stored frame is 1


def test_module_weight_cache(monkeypatch):
    """Conv2d packs its weight once, repacks after an in-place update (version counter) or a
    new parameter, packs afresh in every training call (ops._host.training_call), and its
    gradients stay right across optimizer steps."""
    from ops import conv
    torch.manual_seed(5)
    mine = tc.Conv2d(6, 8, 3, stride=2, padding=1)
    ref = torch.nn.Conv2d(6, 8, 3, stride=2, padding=1)
    ref.load_state_dict(mine.state_dict())
    calls = []
    real, real_t = conv.pack_weight, conv.pack_transposed
    monkeypatch.setattr(conv, "pack_weight",
                        lambda *a, **k: calls.append(k.get("transposed", False)) or real(*a, **k))
    monkeypatch.setattr(conv, "pack_transposed",
                        lambda *a, **k: calls.append(True) or real_t(*a, **k))
    x = torch.randn(2, 6, 9, 9)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(mine(x), ref(x), atol=1e-4, rtol=1e-4)
    assert calls == [False]
    opt_m = torch.optim.SGD(mine.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        ym, yr = mine(xm), ref(xr)
        torch.testing.assert_close(ym, yr, atol=1e-4, rtol=1e-4)
        dy = torch.randn(yr.shape)
        ym.backward(dy)
        yr.backward(dy)
        torch.testing.assert_close(xm.grad, xr.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)
        opt_m.step()
        opt_r.step()
        opt_m.zero_grad()
        opt_r.zero_grad()
    # one forward and one transposed pack per training step
    assert calls.count(True) == 3 and calls.count(False) == 4
    with torch.no_grad():
        mine.weight.mul_(2)
        ref.weight.mul_(2)
        torch.testing.assert_close(mine(x), ref(x), atol=1e-4, rtol=1e-4)
        mine.weight = torch.nn.Parameter(torch.randn(8, 6, 3, 3))
        ref.weight = torch.nn.Parameter(mine.weight.detach().clone())
        torch.testing.assert_close(mine(x), ref(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine(x), ref(x), atol=1e-4, rtol=1e-4)
    assert calls.count(False) == 6
    # a weight changed in place between forward and backward: torch's usual error
    y = mine(x.clone().requires_grad_())
    with torch.no_grad():
        mine.weight.add_(1)
    with pytest.raises(RuntimeError):
        y.sum().backward()


def test_packed_and_saved_arguments():
    from ops import conv
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 5, 8, 8), np.float32)
    w = rng.standard_normal((7, 5, 3, 3), np.float32)
    dy = rng.standard_normal((2, 7, 4, 4), np.float32)
    kw = dict(stride=2, padding=1)
    y = ops.conv2d(x, w, **kw)
    np.testing.assert_allclose(ops.conv2d(x, w, packed=conv.pack_weight(w, 1, tpp.F32), **kw),
                               y, rtol=1e-5, atol=1e-5)
    geo = conv.geometry(x.shape, w.shape, tpp.F32, 2, 1, 1, 1)
    want = ops.conv2d_backward(dy, x, w, **kw)
    got = ops.conv2d_backward(dy, x, w, packed=conv.pack_weight(w, 1, tpp.F32, transposed=True),
                              xb=conv.to_blocked(x, geo), **kw)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ArgumentError):
        ops.conv2d(x, w, packed=conv.pack_weight(w, 1, tpp.F32, transposed=True), **kw)
    with pytest.raises(ArgumentError):
        ops.conv2d_backward(dy, x, w, packed=conv.pack_weight(w, 1, tpp.F32), **kw)
    with pytest.raises(ArgumentError):
        ops.conv2d_backward(dy, x, w, xb=conv.blocked(x, padding=0), **kw)


def test_bench_conv_tiny(tmp_path, capsys, monkeypatch):
    """tpp-bench conv --tiny: GFLOP/s records of tpp and torch for every layer, pass and
    dtype, with peak fractions and the ratio to torch, the forward verified."""
    import json
    from bench import cli
    from bench.suites import conv as suite
    monkeypatch.setenv("TPP_CACHE_DIR", str(tmp_path / "tpp-cache"))
    threads = torch.get_num_threads()
    path = tmp_path / "out.json"
    try:
        rc = cli.main(["conv", "--tiny", "-q", "--plain", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    out, _ = capsys.readouterr()
    assert rc == 0 and "conv" in out
    records = [r for r in json.loads(path.read_text()) if r["suite"] == "conv"]
    got = {(r["case"].rsplit(" ", 1)[0], r["provider"]): r for r in records}
    for layer in suite.TINY:
        for dtype in ("f32", "bf16"):
            for kind in ("fwd", "train"):
                rec = got[f"{layer} {kind} {dtype}", "tpp"]
                assert rec["unit"] == "GFLOP/s" and rec["median"] > 0
                assert rec["peak_fraction"] is not None
                assert (f"{layer} {kind} {dtype}", "torch") in got
                assert "torch" in rec["ratios"]
                if kind == "fwd":
                    assert rec["extra"]["verified"] is True
    net = {(r["case"], r["provider"]): r for r in records if r["case"].startswith("net ")}
    for dtype in ("f32", "bf16"):       # the small network, converted by optimize
        for kind in ("fwd", "train"):
            rec = net[f"net {kind} {dtype}", "tpp"]
            assert rec["unit"] == "ms" and rec["median"] > 0 and rec["extra"]["gflops"] > 0
            assert "torch" in rec["ratios"] and (f"net {kind} {dtype}", "torch") in net
        assert net[f"net fwd {dtype}", "tpp"]["extra"]["verified"] is True
    call = {r["provider"]: r for r in records if r["case"] == "call"}    # a small layer's call
    assert set(call) == {"tpp", "torch"}
    assert call["tpp"]["unit"] == "us" and call["tpp"]["median"] > 0
    assert "torch" in call["tpp"]["ratios"]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("k, c, r, s, groups", [
    (128, 64, 3, 3, 1), (64, 128, 1, 1, 1), (256, 128, 2, 3, 2), (6, 6, 3, 3, 6),
    (130, 70, 3, 3, 1),      # padded blocks: the two steps whatever the size
])
def test_forward_pack_by_slabs_equals_two_steps(monkeypatch, dtype, k, c, r, s, groups):
    """pack_weight's one-pass form (slabs, for large weights in whole blocks; bf16 blocks
    in VNNI pairs) packs what the two-step form packs, bit for bit, and a convolution on it
    equals torch's."""
    from ops import conv_layout
    dt, tdt = {"f32": (tpp.F32, torch.float32), "bf16": (tpp.BF16, torch.bfloat16)}[dtype]
    torch.manual_seed(k + c)
    w = torch.randn(k, c // groups, r, s).to(tdt)
    monkeypatch.setattr(conv_layout, "SLAB_BYTES", 1 << 60)
    two_steps = conv_layout.pack_weight(w, groups, dt).data
    monkeypatch.setattr(conv_layout, "SLAB_BYTES", 0)
    slabs = conv_layout.pack_weight(w, groups, dt).data
    assert torch.equal(slabs, two_steps)
    x = torch.randn(2, c, 7, 6).to(tdt)
    tol = 1e-4 if dtype == "f32" else 3e-2
    torch.testing.assert_close(
        tc.conv2d(x, w, None, 1, 1, 1, groups).float(),
        F.conv2d(x.float(), w.float(), None, 1, 1, 1, groups), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("k, c, r, s, groups", [
    (10, 6, 3, 3, 1),        # channels short of a block
    (130, 70, 3, 3, 1),      # channels past one block, tails
    (20, 12, 3, 1, 2),       # grouped, rectangular
    (7, 3, 7, 7, 1),         # the stem
    (6, 6, 3, 3, 6),         # depthwise
])
def test_transposed_pack_from_forward_pack(dtype, k, c, r, s, groups):
    """The data gradient's packed weight made from the forward's (one transposed, flipped
    block each; bf16 unpacked and repacked) equals packing the weight afresh, bit for bit."""
    from ops import conv
    dt = tpp.F32 if dtype == "f32" else tpp.BF16
    w = torch.randn(k, c // groups, r, s, generator=torch.Generator().manual_seed(k))
    w = w.bfloat16() if dtype == "bf16" else w
    want = conv.pack_weight(w, groups, dt, transposed=True)
    got = conv.transpose_packed(conv.pack_weight(w, groups, dt))
    assert got.transposed and got.shape == want.shape and got.groups == groups
    assert torch.equal(got.data.view(torch.int16) if dtype == "bf16" else got.data,
                       want.data.view(torch.int16) if dtype == "bf16" else want.data)
    with pytest.raises(ArgumentError):
        conv.transpose_packed(want)
    with pytest.raises(ArgumentError):
        conv.transpose_packed(w)            # the weight itself, not a packed one


def test_geometry_remembered_only_for_plain_arguments():
    """A layer's geometry is remembered between calls, but a bool or float where an int is
    expected is still an error after the int's geometry was remembered."""
    from ops import conv
    geo = conv.geometry((2, 4, 8, 8), (6, 4, 3, 3), tpp.F32, 1, 1, 1, 1)
    assert conv.geometry((2, 4, 8, 8), (6, 4, 3, 3), tpp.F32, 1, 1, 1, 1) is geo
    for bad in (dict(groups=True), dict(stride=(1, True)), dict(padding=1.0),
                dict(dilation=True)):
        kw = dict(stride=1, padding=1, dilation=1, groups=1) | bad
        with pytest.raises(ArgumentError):
            conv.geometry((2, 4, 8, 8), (6, 4, 3, 3), tpp.F32, kw["stride"], kw["padding"],
                          kw["dilation"], kw["groups"])


@pytest.mark.parametrize("kw", [dict(padding=1), dict(groups=2), dict(stride=2, padding=1),
                                dict(packed=True)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_1x1_on_the_blocked_nest(kw, bias):
    """bf16 1x1 layers the GEMM path does not take (padded, grouped; 7x7 images given a packed
    weight) run the blocked nest, a bias-free tile rounded straight from its one BRGEMM (no
    f32 accumulator), a biased one through it: both against torch."""
    from ops import conv
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 8, 7, 7, generator=g).bfloat16()
    groups = kw.get("groups", 1)
    w = (torch.randn(70, 8 // groups, 1, 1, generator=g) * 0.3).bfloat16()
    b = torch.randn(70, generator=g).bfloat16() if bias else None
    args = {k: v for k, v in kw.items() if k != "packed"}
    if kw.get("packed"):
        args["packed"] = conv.pack_weight(w, 1, tpp.BF16)
    assert not conv.serves_pointwise(x, w, args.get("stride", 1), args.get("padding", 0),
                                     groups=groups, forward=True)
    y = ops.conv2d(x, w, b, activation="relu", **args)
    ref = F.relu(F.conv2d(x.float(), w.float(), None if b is None else b.float(),
                          args.get("stride", 1), args.get("padding", 0), 1, groups))
    torch.testing.assert_close(y.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
