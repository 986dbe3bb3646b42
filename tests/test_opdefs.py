"""Every element-wise op's single definition (tpp.core.optable), as the CPU backend and the CUDA
backend (run on the emulator, tests/cuda_emulator.py) render it, against INDEPENDENT formulas
written here (float64 torch, numpy and math; not tpp.core.reference), on the op table's test inputs
(its `domain` and `specials`) within its tolerance `tol`.

Also: every op of the table has a rendering on every backend and a formula here (completeness);
the transcendental expansions stay within their stated `tpp.core.mathlib` bounds; they compute the
bits the hand-written LLVM vector math computed before they became IR (pinned CRCs); dropout's
draws are murmur3's, computed here in plain Python.
"""
import math
import os
import sys
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpp
from tpp.core import mathlib, optable
from tpp.core.spec import make_binary, make_unary
from tpp_cuda import generators

import cuda_emulator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import measure_transcendentals as measure  # noqa: E402

ELEMENTWISE = [info for info in list(tpp.UNARY_OPS.values()) + list(tpp.BINARY_OPS.values())
               if info.expr is not None]
# parameter variants tested besides the defaults
VARIANTS = {"relu": [{"bitmask": True}], "relu_inv": [{"bitmask": True}],
            "gelu": [{"approximate": "tanh"}], "gelu_inv": [{"approximate": "tanh"}],
            "leaky_relu": [{"alpha": 0.2}], "leaky_relu_inv": [{"alpha": 3.0}],
            "elu": [{"alpha": 0.5}], "elu_inv": [{"alpha": 0.5}]}
M, N = 3, 700


def _a32(v):
    """A parameter as the f32 the kernels use."""
    return float(np.float32(v))


def _t(x):
    return torch.from_numpy(np.asarray(x, np.float64))


def _grad_of(fn):
    """g * f'(x) by torch autograd in float64; f'(+-inf) = 1 / 0 (the limits of the
    activations here, where autograd's formulas give inf * 0)."""
    def inv(g, x, p):
        t = _t(x).requires_grad_(True)
        fn(t, p).backward(_t(g))
        return np.where(np.isinf(x), g * (x > 0), t.grad.numpy())
    return inv


def _neg_inf_limit(fn, limit):
    """fn, with its mathematical limit at x = -inf (torch's formula gives inf * 0 there)."""
    return lambda x, p: np.where(np.isneginf(x), limit, fn(x, p))


_erfc = np.frompyfunc(math.erfc, 1, 1)
_C = math.sqrt(2.0 / math.pi)


def _sig(v):
    return torch.sigmoid(_t(v)).numpy()


def _gelu(x, p):
    """x Phi(x) (torch's own float64 formulas cancel for x < -8: not used)."""
    if p["approximate"] == "tanh":
        return x * _sig(2.0 * _C * (x + 0.044715 * x ** 3))
    return x * 0.5 * _erfc(-x / math.sqrt(2.0)).astype(np.float64)


def _gelu_inv(g, x, p):
    if p["approximate"] == "tanh":
        u2 = 2.0 * _C * (x + 0.044715 * x ** 3)
        du2 = 2.0 * _C * (1.0 + 3 * 0.044715 * x * x)
        d = _sig(u2) + x * du2 * _sig(u2) * _sig(-u2)
    else:
        d = 0.5 * _erfc(-x / math.sqrt(2.0)).astype(np.float64) + \
            x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return np.where(np.isinf(x), g * (x > 0), g * d)


# The independent formulas: unary map f(x, p); map_inv f(g, s, p) (s: the second operand, a
# bool array for a bitmask); binary f(a, b, p) (+ c for muladd). float64 in, float64 out.
INDEPENDENT = {
    "identity": lambda x, p: x,
    "zero": lambda x, p: np.zeros_like(x),
    "square": lambda x, p: x * x,
    "sqrt": lambda x, p: np.sqrt(x),
    "rsqrt": lambda x, p: 1.0 / np.sqrt(x),
    "reciprocal": lambda x, p: 1.0 / x,
    "exp": lambda x, p: np.exp(x),
    "log": lambda x, p: np.log(x),
    "negate": lambda x, p: -x,
    "abs": lambda x, p: np.abs(x),
    "increment": lambda x, p: x + 1.0,
    "replicate_col": lambda x, p: x,
    "relu": lambda x, p: torch.relu(_t(x)).numpy(),
    "relu_inv": lambda g, s, p: np.where(s if s.dtype == bool else s > 0, g, 0.0),
    "leaky_relu": lambda x, p: F.leaky_relu(_t(x), _a32(p["alpha"])).numpy(),
    "leaky_relu_inv": lambda g, x, p: np.where(x > 0, g, g * _a32(p["alpha"])),
    "elu": lambda x, p: F.elu(_t(x), _a32(p["alpha"])).numpy(),
    "elu_inv": lambda g, y, p: np.where(y > 0, g, g * (y + _a32(p["alpha"]))),
    "gelu": _neg_inf_limit(_gelu, -0.0),
    "gelu_inv": _gelu_inv,
    "tanh": lambda x, p: np.tanh(x),
    "tanh_inv": lambda g, y, p: g * (1.0 - y * y),
    "sigmoid": lambda x, p: torch.sigmoid(_t(x)).numpy(),
    "sigmoid_inv": lambda g, y, p: g * y * (1.0 - y),
    "silu": _neg_inf_limit(lambda x, p: F.silu(_t(x)).numpy(), -0.0),
    "silu_inv": _grad_of(lambda t, p: F.silu(t)),
    "softplus": lambda x, p: np.logaddexp(0.0, x),
    "softplus_inv": lambda g, x, p: g / (1.0 + np.exp(-x)),
    "dropout_inv": lambda g, keep, p: np.where(keep, g * float(np.float32(1 / (1 - p["p"]))),
                                               0.0),
    "add": lambda a, b, p: a + b,
    "sub": lambda a, b, p: a - b,
    "mul": lambda a, b, p: a * b,
    "div": lambda a, b, p: a / b,
    "max": lambda a, b, p: np.maximum(a, b),
    "min": lambda a, b, p: np.minimum(a, b),
    "muladd": lambda a, b, p, c: c + a * b,
    **{f"cmp_{c}": (lambda fn: lambda a, b, p: fn(a, b))(fn) for c, fn in (
        ("gt", np.greater), ("ge", np.greater_equal), ("lt", np.less),
        ("le", np.less_equal), ("eq", np.equal), ("ne", np.not_equal))},
}
# dropout's draws are checked against murmur3 below (test_dropout_draws_are_murmur3)
RANDOM = {"dropout"}


def _specs():
    specs = []
    for info in ELEMENTWISE:
        if info.name in RANDOM:
            continue
        for params in [{}] + VARIANTS.get(info.name, []):
            if info.family == "binary":
                specs.append(make_binary(info.name, M, N))
            elif info.bcast == "col":
                specs.append(make_unary(info.name, N, 1))
            else:
                specs.append(make_unary(info.name, M, N, **params))
    return specs


SPECS = _specs()


def _id(spec):
    return spec.op + "".join(f"-{k}={v}" for k, v in spec.params if spec.info.params[k] != v)


def _inputs(spec):
    """The spec's inputs: the op's domain, its specials (in every input of a binary op) and,
    for map_inv, a normal gradient; masks are random bytes."""
    rng = np.random.default_rng(zlib.crc32(spec.key().encode()))
    info, out = spec.info, []
    for o in spec.operands():
        if o.role == "out":
            continue
        if o.layout == "mask":
            out.append(rng.integers(0, 256, (o.rows, o.cols), dtype=np.uint8))
            continue
        size = o.rows * o.cols
        if o.name == "grad":
            x = rng.standard_normal(size) * 3.0
        else:
            x = rng.uniform(*info.domain, size)
            x[size // 2:] = rng.standard_normal(size - size // 2) * max(map(abs, info.domain))
            specials = np.array(info.specials, np.float64)
            x[:specials.size] = specials if o.name != "in1" else specials[::-1]
        out.append(x.astype(np.float32).reshape(o.rows, o.cols))
    return out


def _expected(spec, inputs):
    """The independent formula on the inputs (float64), each output as an (m, n) array."""
    info, p = spec.info, dict(spec.params)
    x = [np.asarray(a, np.float64) if a.dtype != np.uint8 else
         tpp.core.reference.unpack_mask(a, spec.n) for a in inputs]
    with np.errstate(all="ignore"):
        fn = INDEPENDENT[spec.op]
        if info.family == "binary":
            got = fn(x[0], x[1], p, *x[2:])
        elif info.kind == "map_inv":
            got = fn(x[0], x[1], p)
        else:
            got = fn(x[0] if x else np.zeros((spec.m, spec.n)), p)
    got = np.broadcast_to(np.asarray(got), (spec.m, spec.n))
    if info.kind == "compare":
        return [got]
    if spec.op == "relu" and p["bitmask"]:
        return [got, np.asarray(x[0]) > 0]
    return [got]


def _check(spec, got, want):
    info = spec.info
    if want.dtype == bool:
        np.testing.assert_array_equal(tpp.core.reference.unpack_mask(got, spec.n), want,
                                      err_msg=f"{spec.op}: bitmask")
        return
    rtol, atol = info.tol
    g = np.asarray(got, np.float64)
    assert (np.isnan(g) == np.isnan(want)).all(), \
        f"{spec.op}: nan at {np.argwhere(np.isnan(g) != np.isnan(want))[:3].tolist()}"
    inf = np.isinf(want) | (np.abs(want) > 3.4028234663852886e38)
    with np.errstate(over="ignore"):                 # finite beyond the f32 range: inf
        np.testing.assert_array_equal(g[inf], np.float32(want[inf]), err_msg=f"{spec.op}: inf")
    fin = ~np.isnan(want) & ~inf
    # the exact value rounded to f32 is within half an ulp: tol bounds the rest
    err = np.abs(g[fin] - want[fin])
    half_ulp = np.spacing(np.abs(want[fin]).astype(np.float32)).astype(np.float64) / 2
    limit = rtol * np.abs(want[fin]) + atol + half_ulp
    worst = int(np.argmax(err - limit)) if err.size else 0
    assert (err <= limit).all(), (f"{spec.op}: |error| {err[worst]:.3g} > {limit[worst]:.3g} at "
                                  f"{want[fin][worst]!r} (rtol {rtol}, atol {atol})")


# ---------------------------------------------------------------- CPU
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_cpu_matches_independent_formula(spec):
    inputs = _inputs(spec)
    kernel = _kernel(spec)
    if spec.info.reads_out or not inputs:
        out = inputs[-1].copy() if inputs else np.zeros((spec.m, spec.n), np.float32)
        got = (kernel(*inputs[:-1], out=out),)
    else:
        got = kernel(*inputs)
        got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, _expected(spec, inputs)):
        _check(spec, g, w)


def _kernel(spec):
    if spec.family == "binary":
        return tpp.binary(spec.op, spec.m, spec.n)
    bcast = {"bcast": spec.bcast} if spec.bcast else {}
    return tpp.unary(spec.op, spec.m, spec.n, dtype_in=spec.dtype_in, dtype_out=spec.dtype_out,
                     **bcast, **dict(spec.params))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("op", ["silu", "silu_inv", "log", "softplus", "softplus_inv"])
def test_new_ops_in_16_bit_dtypes(op, dtype):
    spec = make_unary(op, 4, 37, dtype_in=dtype, dtype_out=dtype)
    with np.errstate(all="ignore"):                  # 3e38 overflows f16
        inputs = [a.astype(spec.dtype_in.numpy) for a in _inputs(spec)]
        got = _kernel(spec)(*inputs)
        want = _expected(spec, [a.astype(np.float32) for a in inputs])[0]
        w = want.astype(np.float32).astype(spec.dtype_out.numpy).astype(np.float64)
        g = np.asarray(got, np.float64)
        ulp = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}[dtype]
        ok = (np.isnan(g) & np.isnan(w)) | (g == w) | (np.abs(g - w) <= 2 * ulp * np.abs(w) + 1e-7)
    assert ok.all(), (op, g[~ok][:4], w[~ok][:4])


# ---------------------------------------------------------------- CUDA (emulated)
needs_emulator = pytest.mark.skipif(not cuda_emulator.available(),
                                    reason="g++ or the CUDA headers are missing")


@pytest.fixture(scope="module")
def cuda_module():
    return cuda_emulator.EmulatedModule({generators.kernel_name(s): generators.source(s)
                                         for s in SPECS})


@needs_emulator
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_cuda_matches_independent_formula(cuda_module, spec):
    inputs = _inputs(spec)
    args, outs, it = [], [], iter(inputs)
    for o in spec.operands():
        if o.role == "out":
            buf = np.zeros((o.rows, o.cols), o.dtype.numpy)
            outs.append(buf)
            args.append(buf)
        else:
            a = next(it).copy()
            args.append(a)
            if o.role == "inout":
                outs.append(a)
    cuda_module.launch(generators.kernel_name(spec), generators.launch(spec), args)
    for g, w in zip(outs, _expected(spec, inputs)):
        _check(spec, g, w)


# ---------------------------------------------------------------- completeness
@pytest.mark.parametrize("info", ELEMENTWISE, ids=lambda i: i.name)
def test_every_op_has_a_formula_and_a_rendering_on_every_backend(info):
    assert info.name in INDEPENDENT or info.name in RANDOM, f"{info.name}: no formula here"
    spec = make_binary(info.name, 2, 9) if info.family == "binary" else \
        make_unary(info.name, 2, 9, **({"bcast": info.bcast} if info.bcast else {}))
    kernel = _kernel(spec)                      # compiles: the CPU renders the definition
    assert kernel.spec == spec
    assert generators.supported(spec), f"{info.name}: no CUDA rendering"
    assert generators.source(spec)


def test_every_op_of_the_table_is_tested_here():
    tested = {s.op for s in SPECS} | RANDOM
    assert tested == {info.name for info in ELEMENTWISE}


# ---------------------------------------------------------------- transcendentals
@pytest.mark.parametrize("name", list(mathlib.PRIMS))
def test_transcendental_within_its_bound(name):
    x = measure.inputs(200_000, seed=5)
    rel, at, sub, bad = measure.errors(name, x, measure.kernel(name)(x))
    assert bad == 0
    assert rel <= mathlib.PRIMS[name].bound, (name, rel, at)
    assert sub <= 4.0, (name, sub)


def test_log_specials_and_subnormals():
    f = measure.kernel("log")
    x = np.array([0.0, -0.0, -1.0, -np.inf, np.inf, np.nan, 1.0, 1e-45, 2.0 ** -126,
                  3.4028235e38, 0.99999994, 1.0000001], np.float32)
    y = f(x)
    assert y[0] == -np.inf and y[1] == -np.inf and y[4] == np.inf and y[6] == 0.0
    assert np.isnan(y[2]) and np.isnan(y[3]) and np.isnan(y[5])
    np.testing.assert_allclose(y[7:], np.log(x[7:].astype(np.float64)), rtol=1e-6)
    sub = np.arange(1, 1 << 23, 997, dtype=np.uint32).view(np.float32)    # subnormals
    rel, _, _, bad = measure.errors("log", sub, f(sub))
    assert bad == 0 and rel <= mathlib.PRIMS["log"].bound


# CRCs of the outputs (NaNs made canonical) of the LLVM vector math as it was hand-written
# before the expansions became IR, on _golden_inputs(): the IR renders the very same bits.
# sigmoid, the gelus and their gradients since their subnormal results became zeros
# (flush_below): only those lanes changed (sigmoid 27, gelu 2492, gelu_grad 2470, gelu_tanh
# 1379, gelu_tanh_grad 1359 of them, each formerly of magnitude below 2^-126).
GOLDEN = {
    "exp": 0xa83522bc, "sigmoid": 0x5f8d9399, "tanh": 0xd2b780eb, "erf": 0xd3a655f5,
    "erfc": 0x17bd7fa2, "gelu": 0x6524fc9d, "gelu_grad": 0x682b30ad,
    "gelu_tanh": 0x6ed573ad, "gelu_tanh_grad": 0xb4498bcb, "expm1": 0x4722ee35,
}


def _golden_inputs():
    rng = np.random.default_rng(20240611)
    pattern = rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(
        np.float32)
    return np.concatenate([pattern, np.linspace(-16.0, 16.0, 1 << 16, dtype=np.float32)])


@pytest.mark.parametrize("name", list(GOLDEN))
def test_expansions_compute_the_former_bits(name):
    y = measure.kernel(name)(_golden_inputs())
    y = np.where(np.isnan(y), np.float32(np.nan), y).astype(np.float32)
    assert zlib.crc32(y.tobytes()) == GOLDEN[name]


# ---------------------------------------------------------------- dropout
def _murmur3_draw(seed, k):
    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return fmix(fmix(((k * 0x9E3779B9) & 0xFFFFFFFF) ^ lo) ^ hi)


def test_dropout_draws_are_murmur3():
    seed, m, n, p = 0x1234_5678_9ABC_DEF0, 5, 23, 0.3
    draws = np.array([[_murmur3_draw(seed, i * n + j) for j in range(n)] for i in range(m)],
                     np.uint32)
    np.testing.assert_array_equal(tpp.core.reference.dropout_bits(seed, m, n), draws)
    x = np.random.default_rng(1).standard_normal((m, n)).astype(np.float32)
    y, mask = tpp.unary("dropout", m, n, p=p)(x, seed=seed)
    keep = draws >= min(round(p * 2 ** 32), 2 ** 32 - 1)
    np.testing.assert_array_equal(tpp.core.reference.unpack_mask(mask, n), keep)
    np.testing.assert_array_equal(y, np.where(keep, x * np.float32(1 / (1 - p)), 0.0))
    assert math.isclose(keep.mean(), 1 - p, abs_tol=0.15)
