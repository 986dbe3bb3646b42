"""The bf16 weight gradient on the dot instruction (ops.conv_dw) against torch, over the
f32 test's layer set (strides, dilations, groups, odd sizes, channels past one block)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ops
import ops.conv_dw as conv_dw
import tpp
from tpp.core import dtypes as _dt

from test_ops_conv import CASES, _ids

EXTRA = [
    (2, 130, 70, 9, 8, (3, 3), 2, 1, 1, 1),       # blocks of 64 and tails, stride 2, even Q
    (1, 16, 16, 8, 9, (3, 3), 2, 1, 1, 1),        # odd padded width, stride 2
    (1, 8, 12, 10, 11, (3, 5), (1, 3), 2, (2, 1), 1),   # stride 3 in W only, dilation in H
    (2, 64, 16, 6, 7, (3, 3), 1, 1, 1, 1),        # 9 work items: input blocks in halves
    (1, 96, 8, 5, 5, (1, 3), 2, (0, 1), 1, 1),    # halves, a padded input block, stride 2
]


@pytest.mark.parametrize("flat", [False, True], ids=["rows", "flat"])
@pytest.mark.parametrize("case", CASES + EXTRA, ids=_ids)
def test_weight_grad_bf16(case, flat, monkeypatch):
    """Both formulations (rows of pixels as the depth; each tap's pixels gathered) on
    every case, whichever conv_dw.flat_serves would pick."""
    monkeypatch.setattr(conv_dw, "FLAT", flat)
    n, c, k, h, w, (r, s), stride, padding, dilation, groups = case
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, c, h, w, generator=g).bfloat16()
    wt = (torch.randn(k, c // groups, r, s, generator=g) * 0.3).bfloat16()
    args = (stride, padding, dilation, groups)
    xr, wr = (t.float().requires_grad_() for t in (x, wt))
    ref = F.conv2d(xr, wr, None, *args)
    dy = torch.randn(ref.shape, generator=g).bfloat16()
    ref.backward(dy.float())
    _, dw, _ = ops.conv2d_backward(dy, x, wt, stride=stride, padding=padding,
                                   dilation=dilation, groups=groups, need=(False, True, False))
    assert dw.dtype == torch.bfloat16 and dw.shape == wt.shape
    scale = wr.grad.abs().max().item()
    torch.testing.assert_close(dw.float(), wr.grad, atol=1e-2 * scale, rtol=1e-2)


def test_serves_bf16_host_only():
    from ops.conv_layout import geometry
    geo = geometry((1, 8, 6, 6), (8, 8, 3, 3), _dt.BF16, 1, 1, 1, 1)
    assert conv_dw.serves(geo, True) and not conv_dw.serves(geo, False)
    assert not conv_dw.serves(geometry((1, 8, 6, 6), (8, 8, 3, 3), _dt.F32, 1, 1, 1, 1), True)


def test_numpy_bf16_empty_batch():
    bf = tpp.BF16.numpy
    x = np.zeros((0, 6, 5, 5), bf)
    w = np.ones((4, 6, 3, 3), bf)
    dy = np.zeros((0, 4, 5, 5), bf)
    _, dw, _ = ops.conv2d_backward(dy, x, w, padding=1, need=(False, True, False))
    assert dw.shape == w.shape and not np.asarray(dw, np.float32).any()


def test_flat_rule():
    """Gathered taps for small images with short or odd rows, rows of pixels otherwise."""
    from ops.conv_layout import geometry
    def geo(h, r=3):
        return geometry((4, 64, h, h), (64, 64, r, r), _dt.BF16, 1, r // 2, 1, 1)
    assert conv_dw.flat_serves(geo(7)) and conv_dw.flat_serves(geo(14))
    assert conv_dw.flat_serves(geo(7, 1)) and conv_dw.flat_serves(geo(15))
    assert not conv_dw.flat_serves(geo(28)) and not conv_dw.flat_serves(geo(56))
    assert not conv_dw.flat_serves(geo(17))             # 289 pixels
    assert [conv_dw.flat_depth(p) for p in (1, 7, 32, 33, 49, 196)] == [2, 8, 32, 64, 64, 224]


def test_flat_ignores_nonfinite_padding():
    """The gathered depth past P*Q is zero in both operands: garbage left in fresh memory
    (NaN bit patterns) never reaches the sums."""
    import ops._host as host
    real_empty = host.empty

    def nan_empty(shape, dtype, like):
        out = real_empty(shape, dtype, like)
        if hasattr(out, "fill_"):
            out.view(torch.int16).fill_(-1) if out.dtype == torch.bfloat16 else out.fill_(float("nan"))
        return out
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 7, 7, generator=g).bfloat16()
    wt = torch.randn(64, 64, 3, 3, generator=g).bfloat16()
    dy = torch.randn(2, 64, 7, 7, generator=g).bfloat16()
    xr = x.float().requires_grad_()
    wr = wt.float().requires_grad_()
    F.conv2d(xr, wr, None, 1, 1).backward(dy.float())
    try:
        host.empty = nan_empty
        conv_dw.FLAT = True
        _, dw, _ = ops.conv2d_backward(dy, x, wt, padding=1, need=(False, True, False))
    finally:
        host.empty, conv_dw.FLAT = real_empty, None
    assert torch.isfinite(dw.float()).all()
    scale = wr.grad.abs().max().item()
    torch.testing.assert_close(dw.float(), wr.grad, atol=1e-2 * scale, rtol=1e-2)
