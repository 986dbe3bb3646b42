"""The forward nest with a kernel row's taps as the BRGEMM batch (fewer input blocks than
kernel columns, ops.conv_forward._conv_nest): bias and activation on the last kernel row, strides,
dilation, padded input blocks, against torch."""
import pytest
import torch
import torch.nn.functional as F

import ops
import ops.conv_forward as conv_forward

CASES = [   # n, c, k, h, w, (r, s), stride, padding, dilation
    (2, 96, 20, 7, 9, (3, 3), 1, 1, 1),         # two input blocks (one padded), 3 columns
    (1, 128, 16, 9, 8, (3, 5), 2, 2, (1, 2)),   # two blocks, 5 columns, stride and dilation
    (2, 16, 70, 6, 6, (2, 3), 1, (1, 0), 1),    # one block, output blocks past 64
]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_folded_taps_forward(case, dtype):
    n, c, k, h, w, (r, s), stride, padding, dilation = case
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, c, h, w, generator=g)
    wt = torch.randn(k, c, r, s, generator=g) * 0.1
    b = torch.randn(k, generator=g)
    if dtype == "bf16":
        x, wt, b = x.bfloat16(), wt.bfloat16(), b.bfloat16()
    ref = F.relu(F.conv2d(x.float(), wt.float(), b.float(), stride, padding, dilation))
    y = ops.conv2d(x, wt, b, stride=stride, padding=padding, dilation=dilation,
                   activation="relu")
    tol = 1e-4 if dtype == "f32" else 2e-2
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_unfolded_matches_folded():
    x = torch.randn(1, 80, 6, 7)
    wt = torch.randn(8, 80, 3, 3)
    y = ops.conv2d(x, wt, padding=1)
    orig, unfolded = conv_forward._conv_nest, []
    conv_forward._conv_nest = lambda *a, **kw: unfolded.append(1) or orig(*a, **kw, fold=False)
    try:
        y0 = ops.conv2d(x, wt, padding=1)
    finally:
        conv_forward._conv_nest = orig
    assert unfolded
    torch.testing.assert_close(y, y0, atol=1e-4, rtol=1e-5)


DX_CASES = [   # n, c, k, h, w, (r, s), stride, padding, dilation: dy blocks fewer than taps
    (2, 24, 20, 9, 11, (3, 5), 1, 2, 1),        # 5 column taps, one dy block
    (1, 20, 100, 11, 12, (5, 5), 2, 2, 1),      # stride 2: 2-3 taps per phase, two blocks
    (1, 18, 8, 13, 12, (3, 3), (1, 2), 2, 2),   # dilation, stride 2 in W
]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("case", DX_CASES)
def test_folded_taps_data_grad(case, dtype):
    n, c, k, h, w, (r, s), stride, padding, dilation = case
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, c, h, w, generator=g)
    wt = torch.randn(k, c, r, s, generator=g) * 0.1
    if dtype == "bf16":
        x, wt = x.bfloat16(), wt.bfloat16()
    xr = x.float().requires_grad_()
    ref = F.conv2d(xr, wt.float(), None, stride, padding, dilation)
    dy = torch.randn(ref.shape, generator=g).to(x.dtype)
    ref.backward(dy.float())
    dx, _, _ = ops.conv2d_backward(dy, x, wt, stride=stride, padding=padding,
                                   dilation=dilation, need=(True, False, False))
    tol = 1e-4 if dtype == "f32" else 2e-2
    scale = xr.grad.abs().max().item()
    torch.testing.assert_close(dx.float(), xr.grad, atol=tol * scale, rtol=tol)
