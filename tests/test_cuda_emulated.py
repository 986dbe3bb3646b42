"""The element-wise CUDA kernels of `tpp_cuda.eltwise`, run on the CPU emulator
(tests/cuda_emulator.py), agree with `tpp.core.reference`, and compute the CPU backend's bits.

Every supported unary and binary op runs in f32, bf16 and f16 (mixed input / output dtypes),
with row / col / scalar broadcasts, leading dimensions larger than n, bitmask outputs (relu's
bitmask, the compare ops), m or n = 1, n not a multiple of 8 or 32, muladd in place; a few ops
also see inf, nan, -0, huge and subnormal inputs. Outputs live in buffers wider and one row
taller than the block, filled with a sentinel that must survive; padding inside input buffers
is NaN, so reading it shows. Ops whose formula is correctly rounded compare bit-exactly, the
others within the op table's tolerance (plus one ulp of a 16-bit output dtype). Every
element-wise map / map_inv op also runs on f32 data with special values through both the
emulated CUDA kernel and the CPU kernel: the results must be the same bits (NaN payloads aside;
dropout: the same output and mask for the same seed). Dropout draws from the seed of each call
(the reference's stream for several seeds, high words included). A few kernels also run
with a grid smaller than the problem (the grid-stride loops must cover it), a bigger block,
and in the emulator's threaded mode. All kernels build as one emulated module.
"""
import zlib

import numpy as np
import pytest

import tpp
from tpp.core import reference
from tpp.core.spec import make_binary, make_unary
from tpp_cuda import eltwise
from tpp_cuda.launch import Launch

import cuda_emulator

pytestmark = pytest.mark.skipif(not cuda_emulator.available(),
                                reason="g++ or the CUDA headers are missing")

UNARY = [op for op, info in tpp.UNARY_OPS.items() if info.kind in ("map", "map_inv")]
BINARY = list(tpp.BINARY_OPS)
MIXED = [("bf16", "bf16"), ("f16", "f16"), ("bf16", "f32"), ("f32", "f16"), ("f16", "bf16")]


def _info(op):
    return tpp.UNARY_OPS.get(op) or tpp.BINARY_OPS[op]


# correctly rounded definitions (the table's tolerance is 0): bit-exact against the reference
EXACT = {op for op in UNARY + BINARY if _info(op).tol == (0.0, 0.0)}
_OUT_ULP = {"f32": (0.0, 0.0), "bf16": (2.0 ** -7, 2.0 ** -133), "f16": (2.0 ** -10, 2.0 ** -24)}
SPECIALS = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e30, -1e30, 1e-40, -3e-39, 88.5, -104.0])
SENTINEL = 7.0
MASK_SENTINEL = 0xA5


def _unary_specs():
    specs = []
    for op in UNARY:
        specs.append(make_unary(op, 9, 37, ldi=40, ldo=45))
        specs += [make_unary(op, 5, 13, dtype_in=i, dtype_out=o) for i, o in MIXED]
        if tpp.UNARY_OPS[op].kind == "map" and op not in ("zero", "replicate_col"):
            specs += [make_unary(op, 6, 11, bcast=b, ldo=12) for b in ("row", "col", "scalar")]
    specs += [make_unary("relu", m, n, ldi=n + 2, bitmask=True, dtype_in=d)
              for m, n, d in ((4, 13, "f32"), (3, 8, "bf16"), (1, 70, "f16"), (5, 1, "f32"))]
    specs += [make_unary("relu_inv", 4, 19, ldo=21, bitmask=True),
              make_unary("relu_inv", 3, 9, dtype_in="f16", dtype_out="bf16", bitmask=True),
              make_unary("gelu", 6, 33, approximate="tanh"),
              make_unary("gelu", 4, 9, dtype_in="bf16", approximate="tanh"),
              make_unary("gelu_inv", 6, 33, approximate="tanh"),
              make_unary("leaky_relu", 1, 40, alpha=0.2),
              make_unary("leaky_relu_inv", 7, 1, alpha=3.0),
              make_unary("leaky_relu_inv", 3, 5, alpha=float("inf")),
              make_unary("elu", 3, 17, alpha=0.5), make_unary("elu_inv", 3, 17, alpha=1e-5),
              make_unary("exp", 1, 1), make_unary("tanh", 1, 64, dtype_out="bf16"),
              make_unary("dropout", 7, 45, p=0.9, ldi=47, ldo=46),
              make_unary("dropout", 1, 1, p=0.0, dtype_in="bf16", dtype_out="f16"),
              make_unary("dropout_inv", 2, 17, p=0.3, ldi=20, ldo=19)]
    return specs


def _binary_specs():
    specs = []
    for op in BINARY:
        compare = tpp.BINARY_OPS[op].kind == "compare"
        specs.append(make_binary(op, 9, 37, ldi0=40, ldi1=41, ldo=None if compare else 45))
        specs.append(make_binary(op, 5, 13, dtype_in0="bf16", dtype_in1="f16"))
        if not compare:
            specs += [make_binary(op, 5, 13, dtype_in0="f16", dtype_out="bf16"),
                      make_binary(op, 4, 10, dtype_in0="bf16", dtype_in1="f32", dtype_out="f32")]
        for b in ("row", "col", "scalar"):
            specs.append(make_binary(op, 6, 11, bcast_in1=b, ldi0=14))
            specs.append(make_binary(op, 6, 11, bcast_in0=b, dtype_in1="bf16"))
    specs += [make_binary("mul", 5, 7, bcast_in0="row", bcast_in1="col"),
              make_binary("cmp_gt", 1, 1), make_binary("cmp_le", 7, 1, bcast_in0="col"),
              make_binary("add", 1, 33, dtype_out="f16"),
              make_binary("muladd", 1, 9, dtype_in0="f16")]
    return specs


SPECS = _unary_specs() + _binary_specs()
# specs whose inputs also hold inf, nan, -0, huge and subnormal values
SPECIAL_SPECS = [make_unary(op, 4, 23, **p) for op, p in (
    ("relu", {"bitmask": True}), ("abs", {}), ("exp", {}), ("tanh", {}), ("sigmoid", {}),
    ("log", {}), ("silu", {}), ("softplus", {}),
    ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("gelu_inv", {}),
    ("gelu_inv", {"approximate": "tanh"}), ("elu", {}), ("sqrt", {}), ("rsqrt", {}),
    ("reciprocal", {}), ("identity", {"dtype_out": "bf16"}), ("identity", {"dtype_out": "f16"}))]
SPECIAL_SPECS += [make_binary(op, 4, 23) for op in ("max", "min", "add", "div", "muladd",
                                                    "cmp_eq", "cmp_ne", "cmp_lt", "cmp_ge")]
# every element-wise op with each of its parameter variants, f32, for the CPU-vs-CUDA bits
VARIANTS = {"relu": [{"bitmask": True}], "relu_inv": [{"bitmask": True}],
            "gelu": [{"approximate": "tanh"}], "gelu_inv": [{"approximate": "tanh"}],
            "leaky_relu": [{"alpha": 0.2}], "elu": [{"alpha": 0.5}],
            "dropout": [{"p": 0.0}, {"p": 0.1}, {"p": 0.9999}], "dropout_inv": [{"p": 0.25}]}
SAME_BITS = [make_unary(op, 7, 300, **p) for op in UNARY for p in [{}] + VARIANTS.get(op, [])]
SAME_BITS += [make_binary(op, 7, 300) for op in BINARY]
BIG = make_binary("add", 70, 300, ldi0=301, ldo=303)
BIG_MASK = make_unary("relu", 33, 150, bitmask=True)
BIG_DROPOUT = make_unary("dropout", 20, 300, p=0.3)
SEEDS = (0, 12345, 2 ** 63 + 5, 2 ** 64 - 3)       # unsigned 64-bit values, high words too


@pytest.fixture(scope="module")
def module():
    every = SPECS + SPECIAL_SPECS + SAME_BITS + [BIG, BIG_MASK, BIG_DROPOUT]
    return cuda_emulator.EmulatedModule({eltwise.kernel_name(s): eltwise.source(s) for s in every})


# ---------------------------------------------------------------- buffers
def _numpy(dtype) -> np.dtype:
    return tpp.core.dtypes.lookup(dtype).numpy


def _values(rng, shape, dtype, specials: bool) -> np.ndarray:
    """Normal * 3 with some exact zeros (and the SPECIALS first, when asked), in dtype."""
    data = np.asarray(rng.standard_normal(shape) * 3.0)
    data[rng.random(shape) < 0.1] = 0.0
    if specials:
        flat = data.reshape(-1)
        k = min(flat.size, SPECIALS.size)
        flat[:k] = SPECIALS[:k]
    return np.asarray(data, np.float32).astype(_numpy(dtype))


def _operand_buffer(operand, rng, specials):
    """(buffer passed to the kernel, the view of the operand in it, its logical shape)."""
    shape = {"row": (operand.cols,), "col": (operand.rows,), "scalar": ()}.get(
        operand.layout, (operand.rows, operand.cols))
    if operand.layout == "mask":
        if operand.role == "in":
            buf = rng.integers(0, 256, shape, dtype=np.uint8)
            return buf, buf
        buf = np.full((shape[0] + 1, shape[1]), MASK_SENTINEL, np.uint8)
        return buf, buf[:-1]
    if operand.layout != "block":
        buf = _values(rng, shape, operand.dtype.name, specials)
        return buf, buf
    rows, cols = shape
    if operand.role == "in":
        buf = np.full((rows, operand.ld), np.nan, np.float32).astype(operand.dtype.numpy)
        buf[:, :cols] = _values(rng, shape, operand.dtype.name, specials)
        return buf, buf[:, :cols]
    buf = np.full((rows + 1, operand.ld), SENTINEL, np.float32).astype(operand.dtype.numpy)
    if operand.role == "inout":
        buf[:rows, :cols] = _values(rng, shape, operand.dtype.name, specials)
    return buf, buf[:rows, :cols]


def _assert_untouched(buf, view):
    """Everything of buf outside view still holds the sentinel."""
    outside = np.ones(buf.shape, bool)
    outside[:view.shape[0], :view.shape[1]] = False
    sentinel = MASK_SENTINEL if buf.dtype == np.uint8 else np.float32(SENTINEL).astype(buf.dtype)
    assert (buf[outside] == sentinel).all(), "the kernel wrote outside its output block"


# ---------------------------------------------------------------- comparisons
def _assert_exact(got, want, what):
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(g, w, err_msg=what)
    zeros = (w == 0) & (g == 0)
    if not what.startswith(("max", "min")):          # IEEE leaves max(-0, +0)'s sign open
        assert (np.signbit(g[zeros]) == np.signbit(w[zeros])).all(), f"{what}: sign of zero"


def _assert_close(got, want, op, dtype_out, what):
    rtol, atol = _info(op).tol
    out_rtol, out_atol = _OUT_ULP[dtype_out]
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert (np.isnan(g) == np.isnan(w)).all(), f"{what}: nan positions differ"
    inf = np.isinf(w)
    assert (g[inf] == w[inf]).all(), f"{what}: infinities differ"
    finite = ~np.isnan(w) & ~inf
    np.testing.assert_allclose(g[finite], w[finite], rtol=rtol + out_rtol,
                               atol=atol + out_atol, err_msg=what)


def _check(spec, operand, got, want):
    what = f"{spec.op} {operand.name} ({spec.key()})"
    if operand.layout == "mask":
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: bitmask")
    elif spec.op in EXACT:
        _assert_exact(got, want, what)
    else:
        _assert_close(got, want, spec.op, operand.dtype.name, what)


# ---------------------------------------------------------------- running
def run_case(module, spec, *, launch=None, specials=False, threaded=None, seed=7):
    """Run the spec's kernel on fresh inputs (dropout: with `seed`); check the outputs and the
    untouched margins."""
    rng = np.random.default_rng(zlib.crc32(f"{spec.key()}{specials}".encode()))
    operands = spec.operands()
    buffers = [_operand_buffer(o, rng, specials) for o in operands]
    inputs = [view.copy() for o, (_, view) in zip(operands, buffers) if o.role != "out"]
    seed = seed if spec.scalars else None
    module.launch(eltwise.kernel_name(spec), launch or eltwise.launch(spec),
                  [buf for buf, _ in buffers] + ([seed] if spec.scalars else []),
                  threaded=threaded)
    with np.errstate(all="ignore"):                  # inf * 0 in the reference's gelu'
        want = reference.run(spec, *inputs, seed=seed)
    want = want if isinstance(want, tuple) else (want,)
    outputs = [(o, b) for o, b in zip(operands, buffers) if o.role != "in"]
    assert len(outputs) == len(want)
    for (operand, (buf, view)), w in zip(outputs, want):
        _check(spec, operand, view, w)
        _assert_untouched(buf, view)


def _id(spec):
    dtypes = "-".join(o.dtype.name for o in spec.operands())
    bcast = [o.layout for o in spec.operands() if o.layout in ("row", "col", "scalar")]
    return f"{spec.op}-{spec.m}x{spec.n}-{dtypes}" + "".join(f"-{b}" for b in bcast)


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_matches_reference(module, spec):
    run_case(module, spec)


@pytest.mark.parametrize("spec", SPECIAL_SPECS, ids=_id)
def test_special_values(module, spec):
    run_case(module, spec, specials=True)


@pytest.mark.parametrize("geometry", [
    Launch((1, 1, 1), (32, 1, 1)), Launch((2, 3, 1), (32, 2, 1)), Launch((3, 1, 1), (64, 4, 1)),
    Launch((1, 1, 1), (1024, 1, 1)), Launch((1, 2, 1), (8, 128, 1))], ids=str)
@pytest.mark.parametrize("spec", [BIG, BIG_MASK, BIG_DROPOUT], ids=_id)
def test_any_grid_covers_the_problem(module, spec, geometry):
    run_case(module, spec, launch=geometry)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("spec", [s for s in SPECS if s.op == "dropout"] + [BIG_DROPOUT], ids=_id)
def test_dropout_draws_the_reference_stream(module, spec, seed):
    run_case(module, spec, seed=seed)


def test_threaded_mode_agrees(module):
    run_case(module, BIG_MASK, launch=Launch((2, 2, 1), (32, 4, 1)), threaded=True)


def _bit_inputs(spec):
    """Every input of the spec: wide-range f32 values with all the special values, the
    exponents of the op table's domain and random bit patterns (masks: random bytes)."""
    rng = np.random.default_rng(zlib.crc32(spec.key().encode()))
    out = []
    for o in spec.operands():
        if o.role == "out":
            continue
        if o.layout == "mask":
            out.append(rng.integers(0, 256, (o.rows, o.cols), dtype=np.uint8))
            continue
        lo, hi = _info(spec.op).domain
        flat = rng.uniform(lo, hi, o.rows * o.cols)
        k = min(flat.size, SPECIALS.size)
        flat[:k] = SPECIALS[:k]
        flat[k:200] = rng.standard_normal(flat[k:200].size) * 30
        flat = flat.astype(np.float32)
        flat[200:400] = rng.integers(0, 2 ** 32, flat[200:400].size, dtype=np.uint64).astype(
            np.uint32).view(np.float32)
        out.append(flat.reshape(o.rows, o.cols))
    return out


@pytest.mark.parametrize("spec", SAME_BITS, ids=lambda s: s.key().split("params=")[-1]
                         .join([s.op + "-", ""]))
def test_cuda_computes_the_cpu_bits(module, spec):
    inputs = _bit_inputs(spec)
    buffers = [x.copy() for x in inputs]
    outs = [np.zeros((o.rows, o.cols), o.dtype.numpy) for o in spec.operands() if o.role == "out"]
    args, k_in, k_out = [], iter(buffers), iter(outs)
    for o in spec.operands():
        args.append(next(k_out) if o.role == "out" else next(k_in))
    seed = {"seed": 0xFEDCBA9876543210} if spec.scalars else {}    # dropout: both take it
    module.launch(eltwise.kernel_name(spec), eltwise.launch(spec), args + list(seed.values()))
    kernel = tpp.unary(spec.op, spec.m, spec.n, **dict(spec.params)) \
        if spec.family == "unary" else tpp.binary(spec.op, spec.m, spec.n)
    cpu_in = [x.copy() for x in inputs]
    if _info(spec.op).reads_out:
        out = cpu_in.pop()
        cpu = (kernel(*cpu_in, out=out),)
    else:
        cpu = kernel(*cpu_in, **seed)
        cpu = cpu if isinstance(cpu, tuple) else (cpu,)
    cuda = [a for o, a in zip(spec.operands(), args) if o.role != "in"]
    assert len(cpu) == len(cuda)
    for c, g in zip(cpu, cuda):
        c, g = np.asarray(c), np.asarray(g)
        if c.dtype == np.uint8:
            np.testing.assert_array_equal(g, c, err_msg=f"{spec.op}: bitmask")
            continue
        same = (c.view(np.uint32) == g.view(np.uint32)) | (np.isnan(c) & np.isnan(g))
        bad = np.argwhere(~same)
        assert same.all(), (f"{spec.op}: {len(bad)} results differ from the CPU's, e.g. at "
                            f"{tuple(bad[0])}: cpu {c[tuple(bad[0])]!r} cuda {g[tuple(bad[0])]!r}")


def test_every_op_is_covered():
    assert {s.op for s in SPECS} == set(UNARY) | set(BINARY)
    assert all(eltwise.supported(s) for s in SPECS + SPECIAL_SPECS)
