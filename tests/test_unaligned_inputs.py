"""Inputs at any address: the memory-bound kernels load 64-byte vectors of unaligned blocks as
two 32-byte halves (tpp_cpu.irx.by_input_alignment chooses at run time, in the kernel); the
results must not depend on which body ran, and the choice must be made where it is meant to.

numpy places large arrays at 16 bytes past a 64-byte boundary, torch at the boundary: both
bodies run in ordinary use, so each is checked here against the other bit for bit, on 16-lane
code (AVX-512's width, emulated on an AVX2 host).
"""
import numpy as np
import pytest

import ops
import tpp
from support import sixteen_lane_code

OFFSETS = (0, 4, 16, 48)          # bytes past a 64-byte boundary
SHAPES = ((5, 32), (3, 64), (7, 37), (4, 100))   # pitches a multiple of 64 bytes and not


def _at(values, offset):
    """A copy of values starting `offset` bytes past a 64-byte boundary."""
    nbytes = values.nbytes
    buf = np.empty(nbytes + 128, np.uint8)
    start = -buf.ctypes.data % 64 + offset
    out = buf[start:start + nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


@pytest.fixture
def wide(monkeypatch):
    return sixteen_lane_code(monkeypatch)


def _norm_results(x, dy, w, b):
    y, mean, rstd = ops.norms.layer_norm_forward(x, w, b)
    dx, dw, db = ops.norms.layer_norm_backward(dy, x, mean, rstd, w)
    r, rr = ops.norms.rms_norm_forward(x, w)
    rdx, rdw = ops.norms.rms_norm_backward(dy, x, rr, w)
    s = ops.norms.softmax(x)
    return (ops.norms.layer_norm(x, w, b), y, mean, rstd, dx, dw, db, r, rr, rdx, rdw, s,
            ops.norms.softmax_backward(dy, s))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_norms_give_the_same_bits_at_every_alignment(wide, shape):
    rng = np.random.default_rng(3)
    x, dy = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    w, b = (rng.standard_normal(shape[1], dtype=np.float32) for _ in range(2))
    want = _norm_results(_at(x, 0), _at(dy, 0), _at(w, 0), _at(b, 0))
    mean = x.mean(1, keepdims=True)      # (a pitch not of whole lines takes halves throughout)
    formula = (x - mean) / np.sqrt(((x - mean) ** 2).mean(1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(want[0], formula, rtol=1e-5, atol=1e-5)
    for offset in OFFSETS[1:]:
        got = _norm_results(_at(x, offset), _at(dy, 64 - offset), _at(w, offset), b)
        for g, e in zip(got, want):
            np.testing.assert_array_equal(g, e, err_msg=f"inputs {offset} bytes off")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_binary_maps_give_the_same_bits_at_every_alignment(wide, shape):
    rng = np.random.default_rng(4)
    a, c = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    add = tpp.binary("add", *shape)
    want = add(_at(a, 0), _at(c, 0))
    np.testing.assert_array_equal(want, a + c)
    for offset in OFFSETS[1:]:
        np.testing.assert_array_equal(add(_at(a, offset), _at(c, 0)), want)
        np.testing.assert_array_equal(add(_at(a, offset), _at(c, offset)), want)


def test_strided_views_of_unaligned_rows(wide):
    """Blocks with a leading dimension past n, their rows at changing alignments."""
    rng = np.random.default_rng(5)
    big = rng.standard_normal((9, 53), dtype=np.float32)
    x = big[:, 3:40]        # pitch 212 bytes, every row somewhere else in its line
    w = rng.standard_normal(37, dtype=np.float32)
    y = ops.norms.layer_norm(x, w, w)
    want = ops.norms.layer_norm(np.ascontiguousarray(x), w, w)
    np.testing.assert_allclose(y, want, rtol=0, atol=0)


def _ir(kernel, isa):
    return kernel.dump("ir", isa=isa)


def test_light_kernels_have_a_halves_body_heavy_ones_do_not():
    half = "load volatile <8 x float>"
    ln = ops.norms._BUILDERS["ln_fwd"](32, 1024, tpp.F32, tpp.F32, True, True)[0]
    softmax = ops.norms._BUILDERS["sm_fwd"](32, 1024, tpp.F32, None, None, False)[0]
    ln_kernel, softmax_kernel = tpp.kernel(ln), tpp.kernel(softmax)
    assert half in _ir(ln_kernel, "avx512")
    assert half not in _ir(softmax_kernel, "avx512")      # exp-bound: whole vectors always
    assert "volatile" not in _ir(ln_kernel, "avx2")        # 32-byte vectors: nothing to split
    assert half in _ir(tpp.binary("add", 8, 64), "avx512")
    assert half not in _ir(tpp.unary("exp", 8, 64), "avx512")   # one input: whole vectors
    bf16 = ops.norms._BUILDERS["ln_fwd"](32, 1024, tpp.BF16, tpp.BF16, True, True)[0]
    assert "volatile" not in _ir(tpp.kernel(bf16), "avx512")  # 16 bf16 are 32 bytes


def test_the_halves_body_is_in_the_assembly():
    """LLVM keeps the halves apart (ymm load + vinsertf64x4), not one merged zmm load."""
    spec = ops.norms._BUILDERS["rms_fwd"](32, 1024, tpp.F32, tpp.F32, True)[0]
    asm = tpp.kernel(spec).dump("asm", isa="avx512")
    assert "vinsertf64x4" in asm
