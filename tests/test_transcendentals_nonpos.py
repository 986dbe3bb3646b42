"""exp_nonpos (tpp.core.transcendentals): e^x for x <= 0, the exp of softmax and attention.

Checked: the relative error stays within the bound tpp.core.mathlib states on a dense sample of
[-104, 0] (and on (0, 44], where it is still e^x), results that would be subnormal (x below
EXP_NONPOS_DEAD) are exactly +0 and those just above it normal, the special values (-inf -> 0,
+-0 -> 1, NaN -> NaN, tiny negatives -> 1, x < -87.3365 -> 0), the coefficients still match the fit that made them, the
expansion is cheaper than exp's (IR nodes and x86 loop body), its derivative is itself, and the
emulated CUDA rendering gives the CPU's bits.
"""
import os
import sys

import numpy as np
import pytest

import tpp
from tpp.core import expr as X
from tpp.core import mathlib, transcendentals
from tpp.core.autodiff import grad
from tpp.core.mathlib_coeffs import EXP_NONPOS_P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import measure_transcendentals as measure  # noqa: E402

TINY = 2.0 ** -126
DEAD = transcendentals.EXP_NONPOS_DEAD


@pytest.fixture(scope="module")
def f():
    return measure.kernel("exp_nonpos")


def _check(f, x, bound=None):
    x = np.asarray(x, np.float32)
    y = f(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    flushed = x < np.float32(DEAD)
    assert (want[flushed] < TINY).all() and (want[~flushed & ~np.isnan(x)] >= TINY).all()
    normal = ~flushed
    rel = np.abs(y[normal] / want[normal] - 1.0)
    assert rel.max(initial=0.0) <= (bound or mathlib.PRIMS["exp_nonpos"].bound), \
        (rel.max(), x[normal][rel.argmax()])
    assert (y[flushed] == 0.0).all() and not np.signbit(y[flushed]).any()
    return rel.max(initial=0.0)


def test_dense_nonpositive_range(f):
    _check(f, np.linspace(-104.0, 0.0, 4_000_001, dtype=np.float32))
    rng = np.random.default_rng(7)
    _check(f, -rng.uniform(0.0, 104.0, 1_000_000).astype(np.float32))
    # every f32 in [-1, 0] with a small exponent, and every f32 of some binades
    _check(f, -np.arange(0, 0x3F800000, 97, dtype=np.uint32).view(np.float32))


def test_subnormal_results_exhaustive(f):
    """Every f32 in [-104, -87.3]: +0 where e^x is below 2^-126, relatively accurate above."""
    assert DEAD == mathlib.PRIMS["exp_nonpos"].flush_below
    lo, hi = np.array([87.3, 104.0], np.float32).view(np.uint32)
    _check(f, -np.arange(lo, hi + 1, dtype=np.uint32).view(np.float32))


def test_positive_arguments_up_to_44(f):
    _check(f, np.linspace(0.0, mathlib.PRIMS["exp_nonpos"].domain[1], 1_000_001,
                          dtype=np.float32))


def test_special_values(f):
    x = np.array([-np.inf, -0.0, 0.0, np.nan, -np.nan, -1e-45, -TINY, -1e-30, -1e-8,
                  -104.0, -103.0, -1e30, -3.4028235e38, -87.5, -88.0], np.float32)
    y = f(x)
    assert y[0] == 0.0 and y[1] == 1.0 and y[2] == 1.0
    assert np.isnan(y[3]) and np.isnan(y[4])
    assert (y[5:9] == 1.0).all()                    # e^x rounds to 1 for |x| < 2^-25
    assert y[9] == 0.0 and y[10] == 0.0 and y[11] == 0.0 and y[12] == 0.0
    assert y[13] == 0.0 and y[14] == 0.0                # e^x subnormal: flushed to +0
    edge = f(np.array([DEAD, np.nextafter(np.float32(DEAD), np.float32(-100))], np.float32))
    assert edge[0] >= TINY and edge[1] == 0.0
    assert not np.signbit(y[:3]).any()
    nan_payloads = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x7FFFFFFF],
                            np.uint32).view(np.float32)
    assert np.isnan(f(nan_payloads)).all()


def test_matches_exp_within_both_bounds(f):
    x = np.linspace(-80.0, 0.0, 100_001, dtype=np.float32)
    e = measure.kernel("exp")(x).astype(np.float64)
    y = f(x).astype(np.float64)
    both = mathlib.PRIMS["exp"].bound + mathlib.PRIMS["exp_nonpos"].bound
    assert np.abs(y / e - 1.0).max() <= both


def test_stated_bound_is_within_1e6():
    assert mathlib.PRIMS["exp_nonpos"].bound <= 1e-6


def test_coefficients_match_the_fit():
    fitted = measure.fit_exp_nonpos()
    assert fitted[0] == 1.0 and len(fitted) == len(EXP_NONPOS_P) == 6
    np.testing.assert_allclose(EXP_NONPOS_P, fitted, rtol=2.0 ** -22, atol=2.0 ** -40)


def _ops(node):
    """The IR operations of an expansion (constants and the input not counted)."""
    return [n for n in X.topological([node]) if n.op not in ("const", "input")]


def test_fewer_operations_than_exp():
    x = X.input("x")
    mine = _ops(mathlib.PRIMS["exp_nonpos"].expand(x))
    theirs = _ops(mathlib.PRIMS["exp"].expand(x))
    assert len(mine) <= len(theirs) - 4, ([n.op for n in mine], [n.op for n in theirs])


def test_x86_loop_body():
    """11 vector operations per vector with AVX-512's masks (the compare of x against -87.34,
    the shifter fma and sub, one Cody-Waite fma, 5 Horner fmas, a shift and a multiply; the
    zeroing of dead lanes folds into masked moves), 13 on AVX2 (two vandnps), against exp's
    15."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_vecmath as tv
    import llvmlite.binding as llvm

    def body(name):
        mod = measure.module(name, 8)
        tm = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
            opt=3)
        lines = tv.loop_body(tm.emit_assembly(llvm.parse_assembly(str(mod))))
        return [ln for ln in lines if ln.split()[0] not in (
            "addq", "cmpq", "vmovups", "vmovaps") and not ln.startswith("j")]

    mine, theirs = body("exp_nonpos"), body("exp")
    most = 11 if llvm.get_host_cpu_features().get("avx512vl") else 13
    assert len(mine) <= most and len(mine) < len(theirs), (mine, theirs)


def test_derivative_is_itself():
    x, dy = X.input("x"), X.input("dy")
    e = X.prim("exp_nonpos", x)
    assert grad(e, [x], [dy]) == [dy * e]


def test_equation_matches_reference_and_emulated_cuda():
    """An equation with exp_nonpos: the CPU kernel within the bound of the numpy reference,
    and the CUDA rendering (on the emulator) bit-identical to the CPU's."""
    m, n = 5, 67
    eq = tpp.equation(m, n)
    x = eq.input("x")
    k = eq.compile(X.prim("exp_nonpos", x))
    rng = np.random.default_rng(11)
    xa = (-rng.exponential(20.0, (m, n))).astype(np.float32)
    xa[0, :6] = [-np.inf, -0.0, 0.0, np.nan, -104.0, -87.5]
    cpu = np.asarray(k(x=xa))
    want = np.exp(xa.astype(np.float64))
    ok = want >= TINY
    assert np.abs(cpu[ok] / want[ok] - 1).max() <= mathlib.PRIMS["exp_nonpos"].bound
    assert cpu[0, 0] == 0.0 and cpu[0, 1] == 1.0 and cpu[0, 2] == 1.0 and np.isnan(cpu[0, 3])
    import cuda_emulator
    if not cuda_emulator.available():
        pytest.skip("g++ or the CUDA headers are missing")
    from tpp_cuda import generators
    spec = k.spec
    name = generators.kernel_name(spec)
    mod = cuda_emulator.EmulatedModule({name: generators.source(spec)})
    out = np.full((m, n), 7.0, np.float32)
    mod.launch(name, generators.launch(spec), [xa, out])
    nan = np.isnan(cpu)
    assert (np.isnan(out) == nan).all()
    assert (out[~nan].view(np.uint32) == cpu[~nan].view(np.uint32)).all()
