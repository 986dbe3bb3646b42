"""ops.conv's 1x1 fast path (ops.conv_pointwise: GEMMs on the NCHW data, no blocked layout),
forward and gradients against torch.nn.functional.conv2d."""
import numpy as np
import pytest

import ops
import tpp

torch = pytest.importorskip("torch")
F = torch.nn.functional
tc = pytest.importorskip("ops.torch_conv")
from ops import conv  # noqa: E402

# (N, C, K, H, W, bias)
CASES = [
    (1, 5, 7, 7, 5, True),        # odd channels and image
    (3, 5, 7, 7, 5, False),
    (3, 17, 33, 1, 1, True),      # 1x1 image
    (1, 17, 33, 3, 1, False),
    (3, 70, 130, 9, 9, True),     # channels past one block (and K < C, K > C below)
    (2, 130, 20, 8, 9, True),     # pixels past one block, K < C (dw computed transposed)
]


def _ids(case):
    return "n{}c{}k{}_{}x{}_{}".format(*case[:5], "bias" if case[5] else "nobias")


@pytest.fixture
def no_blocked(monkeypatch):
    """Make every blocked-layout conversion and weight packing raise: the fast path must not
    need them (the forward and the data gradient served at every image size, however few
    pixels its vectors hold)."""
    monkeypatch.setattr(ops.conv_pointwise, "MIN_LANE_USE", 0.0)
    monkeypatch.setattr(ops.conv_pointwise, "MIN_DX_PIXELS", 0)
    def boom(*args, **kwargs):
        raise AssertionError("the blocked path was taken")
    for name in ("to_blocked", "to_blocked_step", "from_blocked", "pack_weight"):
        monkeypatch.setattr(conv, name, boom)


def _data(case, seed=0):
    n, c, k, h, w, has_bias = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g)
    wt = torch.randn(k, c, 1, 1, generator=g) / c ** 0.5
    b = torch.randn(k, generator=g) if has_bias else None
    dy = torch.randn(n, k, h, w, generator=g)
    return x, wt, b, dy


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_and_gradients(case, no_blocked):
    x, wt, b, dy = _data(case)
    leaves = [t for t in (x, wt, b) if t is not None]
    ref_in = [t.clone().requires_grad_() for t in leaves]
    my_in = [t.clone().requires_grad_() for t in leaves]
    ref = F.conv2d(*ref_in)
    y = tc.conv2d(*my_in)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    want = torch.autograd.grad(ref, ref_in, dy)
    got = torch.autograd.grad(y, my_in, dy)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=1e-4)
    # the numpy operators, one gradient at a time
    xn, wn, dyn = x.numpy(), wt.numpy(), dy.numpy()
    expected = (want[0], want[1], dy.sum((0, 2, 3)))
    for k in range(3):
        need = tuple(j == k for j in range(3))
        out = ops.conv2d_backward(dyn, xn, wn, need=need)
        assert [o is None for o in out] == [not v for v in need]
        torch.testing.assert_close(torch.from_numpy(out[k]), expected[k], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_bias_activation(activation, no_blocked):
    x, wt, b, _ = _data((3, 17, 33, 7, 5, True), seed=1)
    y = ops.conv2d(x.numpy(), wt.numpy(), b.numpy(), activation=activation)
    ref = F.conv2d(x, wt, b)
    ref = torch.relu(ref) if activation == "relu" else F.gelu(ref)
    torch.testing.assert_close(torch.from_numpy(y), ref, atol=1e-4, rtol=1e-4)


def test_module_and_new_batch_compiles_nothing(no_blocked):
    torch.manual_seed(2)
    ref = torch.nn.Conv2d(12, 20, 1)
    mine = tc.Conv2d(12, 20, 1)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(2, 12, 5, 6)

    def step(x):
        xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, yo = ref(xr), mine(xo)
        torch.testing.assert_close(yo, yr, atol=1e-4, rtol=1e-4)
        dy = torch.randn(yr.shape)
        yr.backward(dy)
        yo.backward(dy)
        torch.testing.assert_close(xo.grad, xr.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.bias.grad, ref.bias.grad, atol=1e-4, rtol=1e-4)
        for p in (*ref.parameters(), *mine.parameters()):
            p.grad = None

    step(x)
    before = tpp.cache_info()["compiled"]
    for n in (3, 1, 5):
        step(torch.randn(n, 12, 5, 6))
    assert tpp.cache_info()["compiled"] == before
    xn = np.zeros((0, 12, 5, 6), np.float32)
    wn = mine.weight.detach().numpy()
    assert ops.conv2d(xn, wn).shape == (0, 20, 5, 6)
    dx, dw, db = ops.conv2d_backward(np.zeros((0, 20, 5, 6), np.float32), xn, wn)
    assert dx.shape == xn.shape and not dw.any() and not db.any()
    assert tpp.cache_info()["compiled"] == before


def test_packed_and_xb_still_accepted():
    """packed= and xb= made for a 1x1 layer are checked, then unused (the GEMMs read the
    weight and x as they are): the results are the same."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 9, 4, 5), np.float32)
    w = rng.standard_normal((6, 9, 1, 1), np.float32)
    dy = rng.standard_normal((2, 6, 4, 5), np.float32)
    y = ops.conv2d(x, w)
    np.testing.assert_allclose(ops.conv2d(x, w, packed=conv.pack_weight(w, 1, tpp.F32)), y,
                               rtol=1e-6, atol=1e-6)
    geo = conv.geometry(x.shape, w.shape, tpp.F32, 1, 0, 1, 1)
    want = ops.conv2d_backward(dy, x, w)
    got = ops.conv2d_backward(dy, x, w, packed=conv.pack_weight(w, 1, tpp.F32, transposed=True),
                              xb=conv.to_blocked(x, geo))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(tpp.core.errors.ArgumentError):
        ops.conv2d(x, w, packed=conv.pack_weight(w, 1, tpp.F32, transposed=True))
    with pytest.raises(tpp.core.errors.ArgumentError):
        ops.conv2d_backward(dy, x, w, xb=conv.blocked(x, padding=1))


@pytest.mark.parametrize("case, stride", [
    ((2, 70, 130, 9, 7, True), 2),         # odd image, channels past one block
    ((1, 5, 7, 8, 8, False), (3, 2)),
    ((1, 130, 20, 11, 10, True), 3),       # K < C: dw computed transposed
], ids=str)
def test_strided_on_selected_pixels(case, stride, no_blocked):
    """Strided 1x1 layers (downsampling projections) run as GEMMs on x[:, :, ::sh, ::sw]
    (ops.conv_subsample), dx scattered back into zeros."""
    x, wt, b, _ = _data(case)
    leaves = [t for t in (x, wt, b) if t is not None]
    ref_in = [t.clone().requires_grad_() for t in leaves]
    my_in = [t.clone().requires_grad_() for t in leaves]
    ref = F.conv2d(*ref_in, stride=stride)
    assert conv.serves_pointwise(x, wt, stride, forward=False)
    y = tc.conv2d(*my_in, stride=stride)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    for mine, theirs in zip(torch.autograd.grad(y, my_in, dy),
                            torch.autograd.grad(ref, ref_in, dy)):
        torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kw", [dict(padding=1), dict(groups=3), dict(stride=2, padding=1)])
def test_other_1x1_layers_take_the_blocked_path(kw):
    """Padded and grouped 1x1 layers stay on the blocked nests (bf16 ones do not)."""
    x, w0, b, _ = _data((2, 6, 9, 7, 7, True), seed=3)
    wt = w0[:, : 6 // kw.get("groups", 1)].contiguous()
    assert not conv.serves_pointwise(x, wt, **kw)
    torch.testing.assert_close(tc.conv2d(x, wt, b, **kw), F.conv2d(x, wt, b, **kw),
                               atol=1e-4, rtol=1e-4)
    big = torch.zeros(1, 6, 17, 17)     # 289 pixels: the data gradient is a GEMM too
    assert conv.serves_pointwise(big.bfloat16(), w0.bfloat16(), forward=False)
    assert conv.serves_pointwise(big, w0, forward=False)


def test_forward_path_by_image_size():
    """The GEMM forward serves images whose pixels fill its vectors (56x56); 7x7 (49 pixels)
    runs the blocked forward (and data gradient: test_small_images_blocked_data_grad)."""
    x, w, b, _ = _data((1, 8, 4, 7, 7, True))
    assert not conv.serves_pointwise(x, w, forward=False)
    assert not conv.serves_pointwise(x, w)
    assert conv.serves_pointwise(torch.zeros(1, 8, 56, 56), w)
    torch.testing.assert_close(tc.conv2d(x, w, b), F.conv2d(x, w, b), atol=1e-4, rtol=1e-4)
    mod = tc.Conv2d(8, 4, 1)
    with torch.no_grad():
        mod.weight.copy_(w)
        mod.bias.copy_(b)
        torch.testing.assert_close(mod(x), F.conv2d(x, w, b), atol=1e-4, rtol=1e-4)
    assert mod._tpp_packs.forward is not None      # the module's packed weight, used


def _close_bf16(mine, theirs):
    """A bf16 result against the f32 reference of the same (bf16) inputs: within a few bf16
    roundings of the result's scale."""
    assert mine.dtype == torch.bfloat16
    scale = max(theirs.abs().max().item(), 1e-3)
    torch.testing.assert_close(mine.float(), theirs, atol=1e-2 * scale, rtol=1e-2)


@pytest.mark.parametrize("case, stride", [(c, 1) for c in CASES] + [
    ((2, 70, 130, 9, 7, True), 2), ((1, 130, 20, 11, 10, True), 3)], ids=str)
def test_bf16_forward_and_gradients(case, stride, no_blocked):
    """bf16 layers on the GEMM path too (x or dy packed in VNNI pairs per pixel block, odd
    channel and pixel counts padded with zero pairs): forward, and dx, dw, db in bf16."""
    x, wt, b, dy = _data(case)
    x, wt = x.bfloat16(), wt.bfloat16()
    b = b.bfloat16() if b is not None else None
    leaves = [t for t in (x, wt, b) if t is not None]
    ref_in = [t.float().requires_grad_() for t in leaves]
    my_in = [t.clone().requires_grad_() for t in leaves]
    ref = F.conv2d(*ref_in, stride=stride)
    y = tc.conv2d(*my_in, stride=stride)
    _close_bf16(y, ref.detach())
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    for mine, theirs in zip(torch.autograd.grad(y, my_in, dy),
                            torch.autograd.grad(ref, ref_in, dy.float())):
        _close_bf16(mine, theirs)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_bf16_bias_activation(activation, no_blocked):
    x, wt, b, _ = _data((3, 17, 33, 7, 5, True), seed=1)
    x, wt, b = x.bfloat16(), wt.bfloat16(), b.bfloat16()
    y = ops.conv2d(x, wt, b, activation=activation)
    ref = F.conv2d(x.float(), wt.float(), b.float())
    _close_bf16(y, torch.relu(ref) if activation == "relu" else F.gelu(ref))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("case, stride", [
    ((2, 70, 130, 7, 7, True), 1),          # 49 pixels, channels past one block
    ((1, 130, 20, 9, 8, False), 2),         # strided: 5x4 output pixels, K < C
    ((2, 5, 66, 16, 16, True), 1),          # 256 pixels: the most the blocked way takes
    ((2, 8, 6, 7, 7, True), 1),             # whole channel blocks: the weight packed in
    ((1, 128, 192, 9, 9, False), 2),        #   one copy per block (_pointwise_t_nest)
], ids=str)
def test_small_images_blocked_data_grad(case, stride, dtype, monkeypatch):
    """1x1 layers whose images have at most 256 output pixels take ops.conv's blocked data
    gradient (conv_pointwise.MIN_DX_PIXELS), the weight and bias gradients still GEMMs; with
    the forward's packed weight (Conv2d) or packing their own, against torch."""
    x, wt, b, _ = _data(case, seed=4)
    if dtype == "bf16":
        x, wt, b = x.bfloat16(), wt.bfloat16(), None if b is None else b.bfloat16()
    assert not conv.serves_pointwise(x, wt, stride, forward=False)
    def boom(*args, **kwargs):
        raise AssertionError("a blocked weight gradient")
    monkeypatch.setattr(ops.conv_dw, "brgemm_nest", boom)
    monkeypatch.setattr(ops.conv_dw, "weight_grad", boom)
    leaves = [t for t in (x, wt, b) if t is not None]
    ref_in = [t.float().clone().requires_grad_() for t in leaves]
    ref = F.conv2d(*ref_in, stride=stride)
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).to(x.dtype)
    want = torch.autograd.grad(ref, ref_in, dy.float())

    def close(mine, theirs):
        if dtype == "bf16":
            _close_bf16(mine, theirs)
        else:
            torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=1e-4)
    mod = tc.Conv2d(case[1], case[2], 1, stride=stride, bias=b is not None,
                    dtype=x.dtype)
    with torch.no_grad():
        mod.weight.copy_(wt)
        if b is not None:
            mod.bias.copy_(b)
    for conv2d in (lambda t: tc.conv2d(t, *leaves[1:], stride=stride), mod):
        xin = x.clone().requires_grad_()
        y = conv2d(xin)
        params = [xin] + ([mod.weight] + ([mod.bias] if b is not None else [])
                          if conv2d is mod else [])
        for mine, theirs in zip(torch.autograd.grad(y, params, dy), want):
            close(mine, theirs)
    packed = conv.pack_weight(wt, 1, conv._dt.lookup(dtype), transposed=True)
    dx = ops.conv2d_backward(dy, x, wt, stride=stride, need=(True, False, False),
                             packed=packed)[0]
    close(dx, want[0])


def test_data_grad_path_by_output_pixels():
    w = torch.zeros(8, 4, 1, 1)
    assert not conv.serves_pointwise(torch.zeros(1, 4, 16, 16), w, forward=False)   # 256
    assert conv.serves_pointwise(torch.zeros(1, 4, 1, 257), w, forward=False)
    assert not conv.serves_pointwise(torch.zeros(1, 4, 34, 34), w, 3, forward=False)  # 144
    assert conv.serves_pointwise(torch.zeros(1, 4, 34, 34), w, forward=False)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("shape, groups", [((192, 128, 1, 1), 1), ((12, 4, 1, 1), 2)])
def test_1x1_data_grad_pack_is_the_turned_forward_pack(shape, groups, dtype):
    """A 1x1 weight in whole channel blocks is packed for the data gradient by one copy per
    block: the same array as the forward's packed weight with its blocks turned."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    dt = conv._dt.lookup(dtype)
    if dtype == "bf16":
        w = w.bfloat16()
    direct = conv.pack_weight(w, groups, dt, transposed=True)
    turned = conv.transpose_packed(conv.pack_weight(w, groups, dt))
    assert direct.transposed and direct.data.shape == turned.data.shape
    assert torch.equal(torch.as_tensor(direct.data), torch.as_tensor(turned.data))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_1x1_module_trains_over_steps(dtype):
    """Conv2d 1x1 on 7x7 images (the blocked data gradient, its packed weight made in each
    training step): gradients equal torch's over three steps."""
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(64, 128, 1).to(dtype)
    mine = tc.Conv2d(64, 128, 1, dtype=dtype)
    mine.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mine)]
    for _ in range(3):
        x = torch.randn(2, 64, 7, 7).to(dtype)
        xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xr).float().square().mean().backward()
        mine(xm).float().square().mean().backward()
        for theirs, ours in ((xr.grad, xm.grad), (ref.weight.grad, mine.weight.grad),
                             (ref.bias.grad, mine.bias.grad)):
            if dtype == torch.bfloat16:
                _close_bf16(ours, theirs.float())
            else:
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
        for opt in opts:
            opt.step()
            opt.zero_grad()
