"""Accuracy / special-value / codegen tests for tpp_cpu.vecmath (the transcendental expansions
of tpp.core.transcendentals, rendered to LLVM IR by tpp_cpu.expr_llvm); each stays within the bound
that tpp.core.mathlib states.

A small self-contained harness JIT-compiles ``void f(float* in, float* out, i64 n)``
that applies one vecmath function to n floats, W lanes at a time (n must be a
multiple of W; the harness pads).  Run this file as a script to print the
error table and the instruction counts used in vecmath's docstring.
"""
import ctypes
import functools
import math
import os
import re
import sys

import numpy as np
import pytest

import llvmlite.binding as llvm
import llvmlite.ir as ir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tpp.core import mathlib  # noqa: E402
from tpp_cpu import vecmath as vm  # noqa: E402

llvm.initialize_native_target()
llvm.initialize_native_asmprinter()

F32 = np.float32
I64 = ir.IntType(64)
TINY = 2.0 ** -126          # smallest normal float32
SUB_TOL = 4 * 2.0 ** -149   # allowed absolute error where the true result is subnormal
REL_TOL = 1e-6

# ops whose subnormal results are -0.0 below a threshold (tpp.core.transcendentals)
FLUSHED = {name: p.flush_below for name, p in mathlib.PRIMS.items()
           if p.flush_below is not None}

FUNCS = ["exp", "sigmoid", "tanh", "erf", "erfc", "gelu", "gelu_grad",
         "gelu_tanh", "gelu_tanh_grad"]


# ---------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def target_machine(cpu=None, features=None):
    if cpu is None:
        cpu = llvm.get_host_cpu_name()
        features = llvm.get_host_cpu_features().flatten()
    return llvm.Target.from_default_triple().create_target_machine(
        cpu=cpu, features=features or "", opt=3)


def build_ir(fn, W):
    """W lanes per iteration; W=0 means plain scalar ``float`` values."""
    mod = ir.Module(name="vecmath_%s_%d" % (fn.__name__, W))
    mod.triple = llvm.get_process_triple()
    f32 = ir.FloatType()
    vty = ir.VectorType(f32, W) if W else f32
    f = ir.Function(mod, ir.FunctionType(ir.VoidType(), [f32.as_pointer(), f32.as_pointer(), I64]),
                    name="f")
    src, dst, n = f.args
    entry, loop, done = (f.append_basic_block(s) for s in ("entry", "loop", "exit"))
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_signed(">", n, ir.Constant(I64, 0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    v = b.load(b.bitcast(b.gep(src, [i]), vty.as_pointer()), align=4)
    r = fn(b, v)
    assert r.type == vty
    b.store(r, b.bitcast(b.gep(dst, [i]), vty.as_pointer()), align=4)
    i2 = b.add(i, ir.Constant(I64, max(W, 1)))
    i.add_incoming(i2, b.block)     # fn may have branched: the back edge leaves from b.block
    b.cbranch(b.icmp_signed("<", i2, n), loop, done)
    b.position_at_end(done)
    b.ret_void()
    return mod


def optimized(fn, W, tm):
    mod = llvm.parse_assembly(str(build_ir(fn, W)))
    mod.verify()
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    mod.verify()
    return mod


_ENGINES = []


@functools.lru_cache(maxsize=None)
def kernel(name, W):
    tm = target_machine()
    mod = optimized(getattr(vm, name), W, tm)
    ee = llvm.create_mcjit_compiler(mod, tm)
    ee.finalize_object()
    _ENGINES.append(ee)   # keep the code alive
    cf = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        ee.get_function_address("f"))

    def call(x):
        x = np.ascontiguousarray(x, dtype=F32)
        n = len(x)
        m = -(-n // max(W, 1)) * max(W, 1)
        buf = np.zeros(m, F32)
        buf[:n] = x
        out = np.empty(m, F32)
        cf(buf.ctypes.data, out.ctypes.data, m)
        return out[:n]
    return call


def asm(name, W, tm=None):
    tm = tm or target_machine()
    return tm.emit_assembly(optimized(getattr(vm, name), W, tm))


def loop_body(text):
    """Instruction lines of the (single) loop of f."""
    lines = [ln.strip() for ln in text.splitlines()]
    labels = {}
    for k, ln in enumerate(lines):
        m = re.match(r"^(\.LBB\d+_\d+):", ln)
        if m:
            labels[m.group(1)] = k
    for k, ln in enumerate(lines):
        m = re.match(r"^j\w+\s+(\.LBB\d+_\d+)$", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < k:
            body = lines[labels[m.group(1)] + 1:k + 1]
            return [ln for ln in body if ln and not ln.startswith((".", "#"))
                    and not ln.endswith(":")]
    raise AssertionError("no loop found")


def count_instructions(name, W=8):
    """(arithmetic/logic instructions, register copies, constant reloads) in the
    loop body of the W-lane kernel, not counting the input load, the store and
    the loop control."""
    body = loop_body(asm(name, W))
    ops = moves = reloads = 0
    for ln in body:
        op = ln.split()[0]
        if op in ("addq", "cmpq", "subq", "incq", "decq") or op.startswith("j"):
            continue
        if op in ("vmovups", "vmovaps", "vmovdqa", "vmovdqu", "vbroadcastss"):
            if "%rsp" in ln or "%rip" in ln or "LCPI" in ln:
                reloads += 1        # constant spilled for lack of registers
            elif "(" not in ln:
                moves += 1          # register copy (FMA is destructive)
            continue                # else: the input load or the output store
        ops += 1
    return ops, moves, reloads


# ---------------------------------------------------------------------------
# references (float64 / long double)
# ---------------------------------------------------------------------------
_erf = np.frompyfunc(math.erf, 1, 1)
_erfc = np.frompyfunc(math.erfc, 1, 1)
SQRT1_2 = math.sqrt(0.5)
INV_SQRT2PI = 1.0 / math.sqrt(2 * math.pi)


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def ref_exp(x):
    return np.exp(_f64(x))


def ref_sigmoid(x):
    x = _f64(x)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def ref_tanh(x):
    return np.tanh(_f64(x))


def ref_erf(x):
    return np.asarray(_erf(_f64(x)), dtype=np.float64)


def ref_erfc(x):
    return np.asarray(_erfc(_f64(x)), dtype=np.float64)


def _Phi(x):
    return 0.5 * np.asarray(_erfc(-_f64(x) * SQRT1_2), dtype=np.float64)


def ref_gelu(x):
    x = _f64(x)
    with np.errstate(invalid="ignore"):
        r = x * _Phi(x)
    return np.where(x == -np.inf, -0.0, r)


def _gelu_grad_root():
    x = -0.75
    for _ in range(40):
        f = _Phi(x) + x * np.exp(-x * x / 2) * INV_SQRT2PI
        fp = np.exp(-x * x / 2) * INV_SQRT2PI * (2 - x * x)
        x = float(x - f / fp)
    return x


X0_GELU = _gelu_grad_root()


def ref_gelu_grad(x):
    x = _f64(x)
    with np.errstate(invalid="ignore", over="ignore"):
        r = _Phi(x) + x * np.exp(-x * x / 2) * INV_SQRT2PI
    # next to the zero: Taylor series f(x0 + d) = sum_k phi(x0) P_k(x0) d^k / k!,
    # f' = phi (2 - x^2),  P_{k+1} = P_k' - x P_k  (avoids the cancellation)
    d = x - X0_GELU
    near = np.abs(d) < 1e-3
    if near.any():
        P = np.polynomial.Polynomial([2.0, 0.0, -1.0])
        X = np.polynomial.Polynomial([0.0, 1.0])
        phi0 = math.exp(-X0_GELU ** 2 / 2) * INV_SQRT2PI
        acc = np.zeros(near.sum())
        dn = d[near]
        for k in range(1, 12):
            acc += phi0 * P(X0_GELU) * dn ** k / math.factorial(k)
            P = P.deriv() - X * P
        r = r.copy()
        r[near] = acc
    return np.where(x == -np.inf, -0.0, np.where(x == np.inf, 1.0, r))


def _sig_ld(v):
    """sigmoid(v) and 1 - sigmoid(v) in long double, stable."""
    e = np.exp(-np.abs(v))
    s = np.where(v >= 0, 1 / (1 + e), e / (1 + e))
    c = np.where(v >= 0, e / (1 + e), 1 / (1 + e))
    return s, c


def _tanh_v(x):
    k0 = np.sqrt(np.longdouble(2) / np.longdouble(np.pi))
    k1 = np.longdouble("0.044715")
    v = 2 * k0 * (x + k1 * x ** 3)
    dv = 2 * k0 * (1 + 3 * k1 * x * x)
    return v, dv


def ref_gelu_tanh(x):
    xl = np.asarray(x, dtype=np.longdouble)
    fin = np.isfinite(xl)
    xs = np.where(fin, xl, 0)
    v, _ = _tanh_v(xs)
    s, _ = _sig_ld(v)
    r = np.asarray(xs * s, dtype=np.float64)
    return np.where(fin, r, np.where(xl > 0, np.inf, np.where(xl < 0, -0.0, np.nan)))


def ref_gelu_tanh_grad(x):
    xl = np.asarray(x, dtype=np.longdouble)
    fin = np.isfinite(xl)
    xs = np.where(fin, xl, 0)
    v, dv = _tanh_v(xs)
    s, c = _sig_ld(v)
    r = np.asarray(s * (1 + xs * c * dv), dtype=np.float64)
    return np.where(fin, r, np.where(xl > 0, 1.0, np.where(xl < 0, -0.0, np.nan)))


REFS = {n: globals()["ref_" + n] for n in FUNCS}


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------
def ulp_sweep(c, k=600):
    """k float32 neighbours on each side of float32(c)."""
    c = F32(c)
    i = np.array([c]).view(np.int32)[0]
    ii = np.arange(-k, k + 1, dtype=np.int64)
    if c >= 0:
        bits = i + ii
    else:
        bits = i - ii
    bits = bits[(bits > -2 ** 31) & (bits < 2 ** 31)]
    return bits.astype(np.int32).view(F32)


def window(c, half, n=4001):
    return np.linspace(c - half, c + half, n).astype(F32)


BOUNDARIES = {
    "exp": [0.0, 89.0, -104.0, 88.72283935546875, -87.33654, -103.27893, -103.97208]
           + [k * math.log(2) / 2 * s for k in (1, 3, 5, 7, 51, 101) for s in (1, -1)],
    "sigmoid": [0.0, -87.33654, -103.27893, -103.97208, -104.0, 16.6, 17.4, -0.5],
    "tanh": [0.0, 0.17328679, 0.5199, 8.0, 9.011, 10.0, 1e-4, 0.0625],
    "erf": [0.0, 0.6, 3.92, 10.3, 1e-3, 0.9],
    "erfc": [0.0, 0.6, 1.0, 9.0, 10.05, 10.3, -0.6, -4.0],
    "gelu": [0.0, X0_GELU, -1.0, -5.0, -13.0, -14.33, -14.6, 14.6, 5.0],
    "gelu_grad": [0.0, X0_GELU, -1.0, -5.0, -13.0, -14.3, -14.6, 14.6, 5.5],
    "gelu_tanh": [0.0, -1.0, -5.0, -9.9, -10.3, -10.7, -11.0, 11.0, 5.0],
    "gelu_tanh_grad": [0.0, -0.7524614334106445, -0.6924614, -0.8124614, -1.0, -5.0,
                       -9.9, -10.3, -10.7, -11.0, 11.0],
}

SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0,
     np.finfo(F32).max, -np.finfo(F32).max, np.finfo(F32).tiny, -np.finfo(F32).tiny,
     2.0 ** -149, -2.0 ** -149, 2.0 ** -140, -2.0 ** -140, 1e-30, -1e-30, 1e30, -1e30],
    dtype=F32)
NANS = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FC12345, 0xFFFFFFFF, 0x7FBFFFFF],
                dtype=np.uint32).view(F32)


@functools.lru_cache(maxsize=None)
def inputs(name):
    rng = np.random.default_rng(1234 + FUNCS.index(name))
    parts = [SPECIALS]
    bits = rng.integers(0, 2 ** 32, size=60000, dtype=np.uint64).astype(np.uint32)
    r = bits.view(F32)
    parts.append(r[np.isfinite(r)])
    # every exponent, both signs
    e = np.repeat(np.arange(0, 255, dtype=np.uint32), 40)
    m = rng.integers(0, 2 ** 23, size=e.size, dtype=np.uint64).astype(np.uint32)
    s = rng.integers(0, 2, size=e.size, dtype=np.uint64).astype(np.uint32)
    parts.append(((s << 31) | (e << 23) | m).view(F32))
    # dense around 0 and over the interesting range
    parts.append(np.linspace(-16, 16, 40001).astype(F32))
    mags = np.logspace(-45, 2.1, 8000).astype(F32)
    parts += [mags, -mags]
    if name in ("exp",):
        parts.append(np.linspace(-105, 90, 40001).astype(F32))
    if name == "sigmoid":
        parts.append(np.linspace(-105, 20, 40001).astype(F32))
    for c in BOUNDARIES[name]:
        parts.append(ulp_sweep(c))
        parts.append(window(c, 1e-2))
        parts.append(window(c, 0.5))
    return np.concatenate(parts).astype(F32)


# ---------------------------------------------------------------------------
# error measurement
# ---------------------------------------------------------------------------
def errors(name, x, y):
    """(max relative error where the true result is normal, max abs error where
    it is subnormal or zero, list of mismatches of special classes)."""
    with np.errstate(all="ignore"):
        ref = REFS[name](x)
        ref32 = ref.astype(F32).astype(np.float64)
        y64 = y.astype(np.float64)
        bad = []
        nan_ref = np.isnan(ref)
        bad += list(x[nan_ref & ~np.isnan(y)][:5])
        bad += list(x[~nan_ref & np.isnan(y)][:5])
        inf_ref = np.isinf(ref32)
        bad += list(x[inf_ref & (y64 != ref32)][:5])
        bad += list(x[~inf_ref & ~nan_ref & np.isinf(y)][:5])
        ok = ~nan_ref & ~inf_ref & np.isfinite(y64)
        dead = FLUSHED.get(name)
        if dead is not None:
            # documented: a zero of the exact result's sign wherever that result is subnormal
            flushed = x < F32(dead)
            assert (np.abs(ref[flushed]) < TINY).all(), "threshold of " + name
            got, exact = y64[flushed], ref[flushed]     # (a 0 in double: either sign)
            wrong = (got != 0) | ((exact != 0) & (np.signbit(got) != np.signbit(exact)))
            bad += list(x[flushed][wrong][:5])
            ok &= ~flushed
        normal = ok & (np.abs(ref) >= TINY)
        sub = ok & (np.abs(ref) < TINY)
        rel = np.abs(y64[normal] - ref32[normal]) / np.abs(ref32[normal])
        ab = np.abs(y64[sub] - ref[sub])
        relmax = rel.max() if rel.size else 0.0
        absmax = ab.max() if ab.size else 0.0
        worst = x[normal][rel.argmax()] if rel.size else None
    return relmax, absmax, bad, worst


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", FUNCS)
def test_accuracy_w8(name):
    x = inputs(name)
    y = kernel(name, 8)(x)
    rel, ab, bad, worst = errors(name, x, y)
    assert not bad, "special-class mismatch for x=%r" % bad
    assert rel <= mathlib.PRIMS[name].bound <= REL_TOL, "max rel err %.3g at x=%r" % (rel, worst)
    assert ab <= SUB_TOL, "max abs err in subnormal range %.3g" % ab


@pytest.mark.parametrize("name", FUNCS)
def test_w3_w1_scalar_bitwise_equal_w8(name):
    x = inputs(name)[::3]
    y8 = kernel(name, 8)(x)
    for W in (3, 1, 0):
        y = kernel(name, W)(x)
        same = (y.view(np.uint32) == y8.view(np.uint32)) | (np.isnan(y) & np.isnan(y8))
        assert same.all(), (W, x[~same][:5])
    rel, ab, bad, worst = errors(name, x, kernel(name, 3)(x))
    assert not bad and rel <= REL_TOL and ab <= SUB_TOL


def _r(name, v):
    return float(kernel(name, 8)(np.array([v], F32))[0])


def _is_neg_zero(v):
    return v == 0 and math.copysign(1.0, v) < 0


def test_special_values():
    inf, nan = math.inf, math.nan
    assert _r("exp", inf) == inf and _r("exp", -inf) == 0.0 and math.isnan(_r("exp", nan))
    assert _r("exp", 88.72283172607422) < inf and _r("exp", 88.72284) == inf
    assert _r("exp", 0.0) == 1.0 and _r("exp", -0.0) == 1.0
    assert _r("exp", -103.0) > 0 and _r("exp", -104.0) == 0.0 and _r("exp", -1e30) == 0.0
    assert _r("tanh", inf) == 1.0 and _r("tanh", -inf) == -1.0
    assert _is_neg_zero(_r("tanh", -0.0)) and _r("tanh", 0.0) == 0.0
    assert _r("tanh", 20.0) == 1.0
    assert _r("sigmoid", inf) == 1.0 and _r("sigmoid", -inf) == 0.0
    assert _r("sigmoid", 0.0) == 0.5 and _r("sigmoid", -0.0) == 0.5
    assert _r("sigmoid", -100.0) == 0.0 and _r("sigmoid", -87.5) == 0.0  # would be subnormal
    assert _r("sigmoid", 100.0) == 1.0
    assert abs(_r("sigmoid", -80.0) / math.exp(-80.0) - 1) < 1e-6
    assert _is_neg_zero(_r("erf", -0.0)) and _r("erf", 0.0) == 0.0
    assert _r("erf", inf) == 1.0 and _r("erf", -inf) == -1.0
    assert _r("erfc", inf) == 0.0 and _r("erfc", -inf) == 2.0 and _r("erfc", 0.0) == 1.0
    assert _is_neg_zero(_r("gelu", -0.0)) and _r("gelu", 0.0) == 0.0
    assert _r("gelu", inf) == inf and _is_neg_zero(_r("gelu", -inf))
    assert _r("gelu_grad", inf) == 1.0 and _is_neg_zero(_r("gelu_grad", -inf))
    assert _r("gelu_grad", 0.0) == 0.5 and _r("gelu_grad", -0.0) == 0.5
    assert _r("gelu_tanh", inf) == inf and _is_neg_zero(_r("gelu_tanh", -inf))
    assert _is_neg_zero(_r("gelu_tanh", -0.0))
    assert _r("gelu_tanh_grad", inf) == 1.0 and _is_neg_zero(_r("gelu_tanh_grad", -inf))
    assert _r("gelu_tanh_grad", 0.0) == 0.5
    for name in FUNCS:
        y = kernel(name, 8)(NANS)
        assert np.isnan(y).all(), name
    # subnormal results near x ~ -13 for gelu and friends stay within tolerance
    x = np.linspace(-14.6, -12.5, 3001).astype(F32)
    for name in ("gelu", "gelu_grad", "gelu_tanh", "erfc"):
        xx = -x if name == "erfc" else x * (0.75 if name == "gelu_tanh" else 1)
        rel, ab, bad, _ = errors(name, xx, kernel(name, 8)(xx))
        assert not bad and rel <= REL_TOL and ab <= SUB_TOL, name


def test_gelu_subnormal_results_exhaustive():
    """Every float32 in [-14.7, -12] (where gelu and gelu' round into the subnormals): the
    absolute tolerance there is a relative 4.8e-7 at the top of the subnormal range."""
    lo, hi = np.array([12.0, 14.7], F32).view(np.uint32)
    x = -np.arange(lo, hi, dtype=np.uint32).view(F32)
    for name in ("gelu", "gelu_grad"):
        rel, ab, bad, worst = errors(name, x, kernel(name, 8)(x))
        assert not bad and rel <= REL_TOL and ab <= SUB_TOL, (name, rel, ab / 2.0 ** -149, worst)


def test_roots_of_gradients():
    """Relative accuracy next to the zeros of gelu' and gelu_tanh'."""
    for name, x0 in (("gelu_grad", X0_GELU), ("gelu_tanh_grad", -0.7524614220710163)):
        x = np.concatenate([ulp_sweep(x0, 20000), window(x0, 0.2, 20001)])
        rel, ab, bad, worst = errors(name, x, kernel(name, 8)(x))
        assert not bad and rel <= REL_TOL, (name, rel, worst)


def test_codegen_w8_is_ymm_fma_no_calls():
    for name in FUNCS:
        text = asm(name, 8)
        body = loop_body(text)
        joined = "\n".join(body)
        assert "call" not in text, name
        assert "ymm" in joined and re.search(r"vf(n?)m(add|sub)\d+ps", joined), name
        scalar = [ln for ln in body if re.match(
            r"v?(add|sub|mul|div|min|max|sqrt|fn?madd\d*|fn?msub\d*|cvt\w*|round)ss\b", ln)]
        assert not scalar, (name, scalar)
        assert "zmm" not in text


@pytest.mark.parametrize("name", FUNCS)
def test_w16_verifies_and_emits(name):
    # host target (two ymm halves) and an AVX-512 target (compiled, never run)
    for tm in (target_machine(), target_machine("skylake-avx512", "+avx512f,+avx512dq,+avx512vl")):
        text = asm(name, 16, tm)
        assert "call" not in text
    assert "zmm" in text


def test_coefficients_match_fit_script():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import fit_vecmath as fit
    assert (fit.P_ERFC, fit.ERF_THR, fit.TGRAD_DELTA) == (vm.ERFC_P, vm.ERF_THR, vm.TGRAD_DELTA)
    for name, vals in fit.fit_all(verbose=False):
        mine = getattr(vm, name)
        assert len(mine) == len(vals), name
        # identical up to a float32 ulp (the re-fits go through LAPACK)
        np.testing.assert_allclose(mine, vals, rtol=2.0 ** -22, atol=2.0 ** -40, err_msg=name)


try:
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=60, deadline=None)
    @given(name=st.sampled_from(FUNCS),
           xs=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True,
                                 allow_subnormal=True), min_size=1, max_size=40))
    def test_hypothesis(name, xs):
        x = np.array(xs, dtype=F32)
        y = kernel(name, 8)(x)
        rel, ab, bad, worst = errors(name, x, y)
        assert not bad and rel <= REL_TOL and ab <= SUB_TOL, (rel, ab, bad, worst)
except ImportError:  # pragma: no cover
    pass


if __name__ == "__main__":
    for name in FUNCS:
        x = inputs(name)
        rel, ab, bad, worst = errors(name, x, kernel(name, 8)(x))
        ops, moves, reloads = count_instructions(name)
        print("%-15s rel %.3e (x=%r)  sub-abs %.2f*2^-149  bad %s   %d ops + %d copies + %d reloads"
              % (name, rel, worst, ab / 2.0 ** -149, bad[:3], ops, moves, reloads))
