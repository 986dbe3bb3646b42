"""Sums split for the caches. Weight slices summed in chunks of input blocks
(ops.conv_chunks): the forward nest (ops.conv._conv_nest) and the data gradient's
(ops.conv_strided._dx_nest) split a large weight slice into chunks, the first chunk writing
each tile, the last applying the bias and activation (and, for bf16, rounding the f32
accumulator); the weight gradient (ops.conv_dw.brgemm_nest) sums runs of output rows and splits
few blocks in halves. Against torch, with a middle chunk (three or more), row runs with a
tail, strides, dilation, groups and padded channel blocks."""
import pytest
import torch
import torch.nn.functional as F

import ops
import ops.conv as conv
import ops.conv_chunks as conv_chunks
import ops.conv_dw as conv_dw
import ops.conv_strided as strided
import tpp
from ops.conv_chunks import WEIGHT_CHUNK_BYTES, weight_chunks

@pytest.fixture(autouse=True)
def chunk_small_slices(monkeypatch):
    """Every slice over one block is chunked (WEIGHT_SLICE_BYTES 0), so that small layers
    take the chunked nests; the nest caches emptied before and after."""
    monkeypatch.setattr(conv_chunks, "WEIGHT_SLICE_BYTES", 0)
    tpp.clear_caches()
    yield
    monkeypatch.undo()
    tpp.clear_caches()


# n, c, k, h, w, (r, s), stride, padding, dilation, groups; 3x3 weights of 64 x 64 blocks take
# 147 KiB (f32) per input block, so 130 channels (3 blocks, the last of 2 channels) sum in 3
# chunks and 200 (4 blocks) in 4 (f32) or 2 (bf16)
CASES = [
    (2, 130, 70, 6, 5, (3, 3), 1, 1, 1, 1),
    (1, 200, 200, 7, 6, (3, 3), 2, 1, 1, 1),
    (1, 260, 24, 7, 5, (3, 3), 1, 2, 2, 2),
    (2, 200, 130, 5, 5, (3, 3), (1, 2), (1, 0), 1, 1),
]


def _data(case, dtype, seed):
    n, c, k, h, w, (r, s), stride, padding, dilation, groups = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g)
    wt = torch.randn(k, c // groups, r, s, generator=g) * 0.05
    b = torch.randn(k, generator=g)
    if dtype == "bf16":
        x, wt, b = x.bfloat16(), wt.bfloat16(), b.bfloat16()
    return x, wt, b, dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


def _close(got, ref, dtype):
    tol = 1e-4 if dtype == "f32" else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_weight_chunks(monkeypatch):
    block = 64 * 1024
    per = WEIGHT_CHUNK_BYTES // block      # blocks per chunk at most
    assert weight_chunks(per, block) == 1
    assert weight_chunks(2 * per, block) == 2
    assert weight_chunks(7, WEIGHT_CHUNK_BYTES // 2) == 7    # 7 is prime: one block a chunk
    assert weight_chunks(3, WEIGHT_CHUNK_BYTES + 1) == 3     # one block over the budget
    assert weight_chunks(1, 10 * WEIGHT_CHUNK_BYTES) == 1
    monkeypatch.undo()      # the real threshold: a slice that fits is not chunked
    slice_bytes = conv_chunks.WEIGHT_SLICE_BYTES
    assert weight_chunks(8, slice_bytes // 8) == 1
    assert weight_chunks(8, slice_bytes // 8 + 1) > 1


def test_cases_are_chunked():
    # the forward nest of the first case has the chunk loop outermost
    nest = conv._conv_nest(1, 3, 2, 64, 64, 8, 7, 3, 3, 1, 1, 1, 1, 6, 5, conv._dt.F32,
                           True, "relu")
    assert nest.spec.order.startswith("f")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_chunked_forward(case, dtype):
    x, wt, b, kw = _data(case, dtype, 11)
    ref = F.relu(F.conv2d(x.float(), wt.float(), b.float(), **kw))
    _close(ops.conv2d(x, wt, b, activation="relu", **kw), ref, dtype)
    _close(ops.conv2d(x, wt, None, **kw), F.conv2d(x.float(), wt.float(), None, **kw), dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_chunked_data_grad(case, dtype):
    x, wt, _, kw = _data(case, dtype, 12)
    xr = x.float().requires_grad_()
    y = F.conv2d(xr, wt.float(), None, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    if dtype == "bf16":
        dy = dy.bfloat16()
    y.backward(dy.float())
    dx, _, _ = ops.conv2d_backward(dy, x, wt, need=(True, False, False), **kw)
    _close(dx, xr.grad, dtype)


def test_dx_nest_chunked():
    # 200 dy channels (4 blocks of 64) per dx block: the data gradient's nest is chunked
    rows, cols, _ = strided.plan(conv.geometry((1, 64, 6, 6), (200, 64, 3, 3), conv._dt.F32,
                                               1, 1, 1, 1))
    key = lambda ph: tuple((a, cnt, tuple(t)) for a, cnt, t in ph)  # noqa: E731
    nest = strided._dx_nest(1, 4, 1, 64, 64, 3, 3, 6, 6, 8, 8, 1, 1, key(rows), key(cols),
                            1, 1, conv._dt.F32)
    assert nest.spec.order.startswith("g")


def test_chunked_matches_unchunked(monkeypatch):
    # the same forward and data gradient with chunking switched off (a budget above any slice)
    x, wt, b, kw = _data(CASES[0], "f32", 13)
    y = ops.conv2d(x, wt, b, activation="relu", **kw)
    dy = torch.randn(y.shape)
    dx = ops.conv2d_backward(dy, x, wt, need=(True, False, False), **kw)[0]
    monkeypatch.setattr(conv_chunks, "WEIGHT_SLICE_BYTES", 1 << 40)
    tpp.clear_caches()
    try:
        y1 = ops.conv2d(x, wt, b, activation="relu", **kw)
        dx1 = ops.conv2d_backward(dy, x, wt, need=(True, False, False), **kw)[0]
    finally:
        monkeypatch.undo()
        tpp.clear_caches()
    torch.testing.assert_close(y, y1, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dx, dx1, atol=1e-4, rtol=1e-5)


# the weight gradient's BRGEMMs over runs of output rows (ops.conv_dw.DW_CALL_BYTES), a block's
# rows in halves where blocks are few (DW_MIN_ITEMS): n, c, k, h, w, (r, s), stride,
# padding, dilation, groups, the call budget in bytes (None: the default)
DW_CASES = [
    (1, 64, 64, 40, 40, (3, 3), 1, 1, 1, 1, None),      # runs of 6 rows and a tail of 4; halves
    (2, 70, 96, 13, 11, (3, 3), 2, 1, 1, 1, 4096),      # one row a call, stride 2, padded blocks
    (1, 130, 40, 9, 10, (3, 3), 1, 2, 2, 1, 11000),     # runs of 2 rows and a tail, dilation
    (2, 64, 128, 12, 12, (1, 3), 1, (0, 1), 1, 2, 6000),    # groups, one-row kernel
]


@pytest.mark.parametrize("case", DW_CASES)
def test_weight_grad_row_runs(case, monkeypatch):
    n, c, k, h, w, (r, s), stride, padding, dilation, groups, budget = case
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(n, c, h, w, generator=g)
    wt = (torch.randn(k, c // groups, r, s, generator=g) * 0.05).requires_grad_()
    y = F.conv2d(x, wt, None, **kw)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    if budget is not None:
        monkeypatch.setattr(conv_dw, "DW_CALL_BYTES", budget)
        tpp.clear_caches()
    try:
        dw = ops.conv2d_backward(dy, x, wt.detach(), need=(False, True, False), **kw)[1]
    finally:
        monkeypatch.undo()
        tpp.clear_caches()
    _close(dw, wt.grad, "f32")
