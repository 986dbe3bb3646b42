"""ops.conv's strided data gradient (ops.conv_strided: phase decomposition, blocked and, for
few channels, pixels-as-columns) and the few-input-channel nests (ops.conv_taps: the stem's
forward and weight gradient), against torch's conv2d and its autograd."""
import numpy as np
import pytest

import ops
import tpp
from ops import conv_strided, conv_taps
from ops.conv_layout import geometry
from tpp.core import dtypes as _dt

torch = pytest.importorskip("torch")
F = torch.nn.functional

# (N, C, K, H, W, (R, S), stride, padding, dilation, groups)
CASES = [
    (2, 20, 24, 9, 9, (3, 3), 2, 1, 1, 1),          # 3x3/2, blocked phases
    (1, 3, 16, 23, 21, (7, 7), 2, 3, 1, 1),         # the stem, odd image: cropped phases
    (2, 3, 8, 16, 16, (7, 7), 2, 3, 1, 1),          # the stem, whole phases
    (1, 18, 10, 13, 11, (3, 3), 3, 0, 1, 1),        # stride 3, no padding
    (1, 4, 6, 12, 9, (3, 3), 2, 3, 2, 1),           # dilation with stride, padding 3
    (1, 20, 12, 11, 12, (3, 3), 2, 3, 2, 1),        # the same, blocked
    (1, 70, 66, 9, 7, (3, 1), (2, 3), (1, 0), 1, 1),  # two channel blocks, rectangular
    (1, 24, 8, 10, 9, (2, 5), (3, 2), (0, 3, 1, 2), (1, 2), 1),  # 4-tuple padding
    (2, 32, 64, 8, 8, (1, 1), 2, 0, 1, 1),          # 1x1/2: phases without taps
    (1, 20, 20, 7, 8, (1, 1), 3, 1, 1, 1),          # 1x1/3, padded
    (1, 6, 6, 10, 10, (3, 3), 2, 1, 1, 6),          # depthwise, strided
    (1, 40, 16, 9, 9, (3, 3), 2, 1, 1, 2),          # grouped, blocked
    (1, 6, 10, 12, 12, (3, 5), 2, 1, (2, 1), 2),    # grouped, few channels
    (1, 8, 8, 7, 7, (5, 5), (3, 2), 2, (1, 2), 1),  # column dilation (no folded taps)
    (1, 4, 16, 9, 9, (3, 3), 1, 1, 1, 1),           # stride 1, folded taps (forward, dw)
    (1, 16, 32, 9, 9, (3, 3), 2, 1, 1, 1),          # 16 channels: general nests, small dx
    (1, 8, 8, 9, 8, (3, 3), 2, 1, 1, 8),            # depthwise, folded taps
]


def _ids(case):
    n, c, k, h, w, (r, s), st, p, d, g = case
    return f"n{n}c{c}k{k}_{h}x{w}_{r}x{s}_s{st}_p{p}_d{d}_g{g}".replace(" ", "")


def _reference(x, w, b, dy, stride, padding, dilation, groups):
    """torch's y, dx, dw, db in f32 (a 4-tuple padding as an explicit F.pad)."""
    xr, wr, br = (t.float().clone().requires_grad_() for t in (x, w, b))
    xin, pad = xr, padding
    if isinstance(padding, tuple) and len(padding) == 4:
        xin, pad = F.pad(xr, (padding[2], padding[3], padding[0], padding[1])), 0
    y = F.conv2d(xin, wr, br, stride, pad, dilation, groups)
    if dy is None:
        return y
    y.backward(dy.float())
    return y, xr.grad, wr.grad, br.grad


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_strided_against_torch(case, dtype):
    n, c, k, h, w, (r, s), stride, padding, dilation, groups = case
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(hash(case) % 1000)
    x = torch.randn(n, c, h, w, generator=g).to(tdt)
    wt = (torch.randn(k, c // groups, r, s, generator=g) * 0.3).to(tdt)
    b = torch.randn(k, generator=g).to(tdt)
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    ref = _reference(x, wt, b, None, stride, padding, dilation, groups)
    dy = torch.randn(ref.shape, generator=g).to(tdt)
    ref, dxr, dwr, dbr = _reference(x, wt, b, dy, stride, padding, dilation, groups)
    y = ops.conv2d(x, wt, b, **kw)
    dx, dw, db = ops.conv2d_backward(dy, x, wt, **kw)
    assert dx.dtype == dw.dtype == db.dtype == y.dtype == tdt
    for mine, theirs in ((y, ref), (dx, dxr), (dw, dwr), (db, dbr)):
        scale = theirs.abs().max().item()
        tol = (2e-2 * scale, 2e-2) if dtype == "bf16" else (1e-5 * scale + 1e-5, 1e-4)
        torch.testing.assert_close(mine.float(), theirs, atol=tol[0], rtol=tol[1])


def test_paths_taken():
    """The stem takes the few-channel nests, a wide strided layer the blocked phases."""
    stem = geometry((1, 3, 224, 224), (64, 3, 7, 7), _dt.F32, 2, 3, 1, 1)
    wide = geometry((1, 128, 56, 56), (128, 128, 3, 3), _dt.F32, 2, 1, 1, 1)
    assert conv_taps.serves(stem) and conv_strided.small(stem)
    grouped = geometry((1, 128, 56, 56), (128, 8, 3, 3), _dt.F32, 2, 1, 1, 16)
    assert not conv_taps.serves(grouped) and conv_strided.small(grouped)
    assert not conv_taps.serves(wide) and not conv_strided.small(wide)
    rows, cols, frame = conv_strided.plan(wide)
    assert [len(t) for _, _, t in rows] == [1, 2] and frame == (0, 1, 0, 1)


@pytest.mark.parametrize("c", [3, 20])
def test_new_batch_compiles_nothing(c):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, c, 7, 7), np.float32)
    kw = dict(stride=2, padding=3)
    x = rng.standard_normal((1, c, 13, 12), np.float32)
    y = ops.conv2d(x, w, **kw)
    ops.conv2d_backward(y, x, w, **kw)
    before = tpp.cache_info()["compiled"]
    for n in (3, 0):
        x = rng.standard_normal((n, c, 13, 12), np.float32)
        y = ops.conv2d(x, w, **kw)
        dx, dw, db = ops.conv2d_backward(y, x, w, **kw)
        assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (8,)
        if n == 0:
            assert not dw.any() and not db.any()
    assert tpp.cache_info()["compiled"] == before


@pytest.mark.parametrize("c, k, r, groups", [(3, 16, 7, 1), (8, 8, 3, 8), (5, 10, 5, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_unpadded_taps_forward(c, k, r, groups, bias, monkeypatch):
    """bf16 layers with an odd channel count per group (the stem's 3, depthwise 1) pair the
    kernel row's (tap, channel) values instead of padding each tap's channels to an even
    block: the same result as the padded form, the bias and output frame alike."""
    g = torch.Generator().manual_seed(c + k)
    x = torch.randn(2, c, 13, 11, generator=g).bfloat16()
    wt = (torch.randn(k, c // groups, r, r, generator=g) * 0.3).bfloat16()
    b = torch.randn(k, generator=g).bfloat16() if bias else None
    kw = dict(stride=2, padding=r // 2, groups=groups, activation="relu")
    geo = geometry(tuple(x.shape), tuple(wt.shape), _dt.BF16, 2, r // 2, 1, groups)
    assert conv_taps.unpadded_depth(geo) == r * (c // groups) + (r * (c // groups)) % 2
    assert conv_taps.unpadded_depth(geometry((1, 4, 8, 8), (4, 4, 3, 3), _dt.BF16, 1, 1, 1,
                                             1)) is None        # even channels: no padding
    y = ops.conv2d(x, wt, b, **kw)
    ref = F.relu(F.conv2d(x.float(), wt.float(), None if b is None else b.float(), 2, r // 2,
                          1, groups))
    torch.testing.assert_close(y.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
    monkeypatch.setattr(conv_taps, "unpadded_depth", lambda geo: None)
    torch.testing.assert_close(y.float(), ops.conv2d(x, wt, b, **kw).float(),
                               atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
