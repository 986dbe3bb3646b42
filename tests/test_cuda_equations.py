"""Equations on CUDA (tpp_cuda.equation), run on the CPU emulator: a warp per row, reductions
by warp shuffles, the same element-wise code as the CPU backend. Checked against independent
numpy formulas and against the CPU kernel of the same equation."""
from __future__ import annotations

import numpy as np
import pytest

import tpp
from tpp.core.errors import UnsupportedError
from tpp_cuda import equation as cuda_eq
from tpp_cuda import generators

import cuda_emulator

pytestmark = pytest.mark.skipif(not cuda_emulator.available(),
                                reason="g++ or the CUDA headers are missing")

RNG = np.random.default_rng(3)


def _run(kernel, arrays: dict, outputs: dict, seed=None):
    """Launch the CUDA source of kernel.spec on the emulator: arrays (inputs by name, params
    as one-value f32 arrays) and outputs (preallocated, by name)."""
    spec = kernel.spec
    name = generators.kernel_name(spec)
    mod = cuda_emulator.EmulatedModule({name: generators.source(spec)})
    args = [arrays[o.name] if o.role == "in" else outputs[o.name] for o in spec.operands()]
    if seed is not None:
        args.append(seed)
    mod.launch(name, generators.launch(spec), args)
    return outputs


def _layer_norm(m, n, dtype="f32"):
    eq = tpp.equation(m, n)
    x = eq.input("x", dtype=dtype)
    g, b, eps = eq.input("g", bcast="row"), eq.input("b", bcast="row"), eq.param("eps")
    mu = eq.mean(x, axis=1)
    xc = x - mu
    rstd = eq.rsqrt(eq.mean(xc * xc, axis=1) + eps)
    return eq.compile(xc * rstd * g + b, mu=mu, rstd=rstd)


@pytest.mark.parametrize("m,n", [(1, 1), (3, 33), (9, 64), (5, 100)])
def test_layer_norm_matches_numpy_and_the_cpu(m, n):
    k = _layer_norm(m, n)
    x = RNG.standard_normal((m, n)).astype(np.float32)
    g, b = RNG.standard_normal(n).astype(np.float32), RNG.standard_normal(n).astype(np.float32)
    eps = np.full(1, 1e-5, np.float32)
    outs = _run(k, dict(x=x, g=g, b=b, eps=eps),
                dict(out=np.full((m, n), 7.0, np.float32), mu=np.zeros(m, np.float32),
                     rstd=np.zeros(m, np.float32)))
    x64 = x.astype(np.float64)
    mu = x64.mean(1, keepdims=True)
    rstd = 1 / np.sqrt(((x64 - mu) ** 2).mean(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(outs["out"], (x64 - mu) * rstd * g + b, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(outs["mu"], mu[:, 0], rtol=1e-5, atol=1e-6)
    cpu = k(x=x, g=g, b=b, eps=1e-5)
    np.testing.assert_allclose(outs["out"], cpu.out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs["rstd"], cpu.rstd, rtol=1e-6)


def test_softmax_bf16_in_and_out():
    m, n = 6, 70
    eq = tpp.equation(m, n)
    x = eq.input("x", dtype="bf16")
    e = eq.exp(x - eq.max(x, axis=1))
    k = eq.compile(e / eq.sum(e, axis=1))
    xa = (RNG.standard_normal((m, n)) * 3).astype(tpp.BF16.numpy)
    out = np.zeros((m, n), tpp.BF16.numpy)
    _run(k, dict(x=xa), dict(out=out))
    z = np.exp(xa.astype(np.float64) - xa.astype(np.float64).max(1, keepdims=True))
    np.testing.assert_allclose(out.astype(np.float32), z / z.sum(1, keepdims=True),
                               rtol=1e-2, atol=1e-3)
    np.testing.assert_array_equal(out, k(x=xa))      # rounding to bf16 hides the sum order


def test_bitmask_in_and_out_and_per_row_outputs():
    m, n = 4, 21
    eq = tpp.equation(m, n)
    x, keep = eq.input("x"), eq.mask("keep")
    y = eq.where(keep, x * 2.0, 0.0)
    k = eq.compile(y, pos=x > 0.0, rowsum=eq.sum(y, axis=1))
    xa = RNG.standard_normal((m, n)).astype(np.float32)
    keep_bits = np.packbits(RNG.random((m, n)) > 0.3, axis=1, bitorder="little")
    outs = _run(k, dict(x=xa, keep=keep_bits),
                dict(out=np.zeros((m, n), np.float32), pos=np.zeros_like(keep_bits),
                     rowsum=np.zeros(m, np.float32)))
    cpu = k(x=xa, keep=keep_bits)
    np.testing.assert_array_equal(outs["out"], cpu.out)
    np.testing.assert_array_equal(outs["pos"], cpu.pos)
    np.testing.assert_allclose(outs["rowsum"], cpu.rowsum, rtol=1e-6, atol=1e-6)


def test_reductions_over_rows_are_unsupported_on_cuda():
    eq = tpp.equation(3, 4)
    x = eq.input("x")
    k = eq.compile(x - eq.sum(x, axis=0))
    assert not cuda_eq.supported(k.spec)
    with pytest.raises(UnsupportedError, match="axis 1"):
        generators.source(k.spec)


def test_dump_cuda_source():
    src = _layer_norm(4, 64).dump("cuda")
    assert "__shfl_xor_sync" in src and "__fsqrt_rn" in src


def test_operand_names_that_are_c_keywords_compile():
    """Operand names are the user's (eq.input("do")): the CUDA source must not use them bare."""
    eq = tpp.equation(3, 5)
    x, y, k = eq.input("do"), eq.input("int", bcast="row"), eq.param("i")
    kernel = eq.compile(x * y + k, max=eq.max(x, axis=1))
    a = RNG.standard_normal((3, 5)).astype(np.float32)
    row = RNG.standard_normal(5).astype(np.float32)
    got = _run(kernel, {"do": a, "int": row, "i": np.full(1, 0.5, np.float32)},
               {"out": np.zeros((3, 5), np.float32), "max": np.zeros(3, np.float32)})
    np.testing.assert_allclose(got["out"], a * row + 0.5, rtol=1e-6)
    np.testing.assert_array_equal(got["max"], a.max(axis=1))
