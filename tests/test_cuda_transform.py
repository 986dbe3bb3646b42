"""The CUDA backend's transform generator (reductions, transpose, vnni2, gather/scatter) and the
generator dispatcher: every generated kernel compiles with nvcc (sm_80 and sm_90, one translation
unit per arch), the launch geometry matches the block shape a kernel is written for, and
unsupported specs (element-wise maps, dropout included: tpp_cuda.eltwise builds those) are
rejected."""
import re
import zlib

import numpy as np
import pytest

import tpp
from tpp.core import reference
from tpp.core.errors import UnsupportedError
from tpp.core.spec import make_binary, make_unary
from tpp_cuda import eltwise, generators, nvcc, transform
from tpp_cuda.launch import Launch

needs_nvcc = pytest.mark.skipif(not nvcc.available(), reason="nvcc is not on PATH")

REDUCE_OPS = ["reduce_sum", "reduce_sumsq", "reduce_max", "reduce_min", "reduce_absmax"]
DTYPE_PAIRS = [("f32", "f32"), ("bf16", "bf16"), ("f16", "f32"), ("bf16", "f32"), ("f32", "bf16")]
SHAPES = [(1, 1), (1, 45), (45, 1), (7, 45), (33, 31), (100, 3), (3, 300)]


def _specs():
    specs = []
    for op in REDUCE_OPS:
        for axis in (0, 1):
            for din, dout in DTYPE_PAIRS:
                specs.append(make_unary(op, 7, 45, axis=axis, dtype_in=din, dtype_out=dout))
            for m, n in SHAPES:
                specs.append(make_unary(op, m, n, axis=axis, ldi=n + 3))
    for dt in ("f32", "bf16", "f16"):
        for m, n in SHAPES:
            specs.append(make_unary("transpose", m, n, dtype_in=dt))
        specs.append(make_unary("transpose", 7, 45, ldi=50, ldo=9, dtype_in=dt))
        specs += [make_unary("gather_rows", 5, 45, ldi=47, ldo=46, dtype_in=dt),
                  make_unary("scatter_rows", 5, 45, ldi=47, ldo=46, dtype_in=dt),
                  make_unary("gather_rows", 1, 1, dtype_in=dt),
                  make_unary("scatter_rows", 300, 2, dtype_in=dt)]
    for dt in ("bf16", "f16"):
        for op in ("vnni2", "vnni2_inv"):
            specs += [make_unary(op, 7, 5, dtype_in=dt), make_unary(op, 1, 1, dtype_in=dt),
                      make_unary(op, 8, 33, dtype_in=dt),
                      make_unary(op, 9, 5, ldi=70, ldo=71, dtype_in=dt)]
    return specs


SPECS = _specs()


@pytest.fixture(scope="module")
def sources():
    return {transform.kernel_name(s): transform.source(s) for s in SPECS}


# ---------------------------------------------------------------- compiling
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_all_sources_compile(sources, arch):
    nvcc.compile_check(sources, arch)


@needs_nvcc
def test_transform_and_eltwise_sources_share_a_translation_unit():
    specs = [make_unary("relu", 4, 9, bitmask=True), make_unary("dropout", 4, 9),
             make_unary("reduce_max", 4, 9), make_binary("max", 4, 9)]
    nvcc.compile_check({generators.kernel_name(s): generators.source(s) for s in specs}, "sm_80")


def test_every_transform_op_is_covered():
    ops = {s.op for s in SPECS}
    for name, info in tpp.UNARY_OPS.items():
        if info.kind not in ("map", "map_inv"):
            assert name in ops


def test_kernel_names_unique_stable_and_in_the_signature(sources):
    assert len(sources) == len(SPECS)
    spec = make_unary("transpose", 7, 45, ldi=50)
    assert transform.kernel_name(spec) == transform.kernel_name(make_unary("transpose", 7, 45,
                                                                          ldi=50))
    assert transform.kernel_name(spec) != transform.kernel_name(spec.replace(ldi=51))
    for spec in SPECS:
        src = sources[transform.kernel_name(spec)]
        sig = re.search(r'extern "C" __global__ void (\w+)\(([^)]*)\)', src)
        assert sig.group(1) == transform.kernel_name(spec)
        params = [a.split()[-1] for a in sig.group(2).split(",")]
        assert params == [o.name for o in spec.operands()] + list(spec.scalars)
        if spec.kind in ("gather", "scatter"):
            assert "const long long* __restrict__ idx" in sig.group(2)
        assert not spec.scalars


# ---------------------------------------------------------------- geometry
def test_fixed_block_kernels_get_their_block():
    """A kernel that names its block shape (BX, BY) is launched with exactly that block."""
    for spec in SPECS:
        src, geo = transform.source(spec), transform.launch(spec)
        fixed = re.search(r"constexpr int BX = (\d+), BY = (\d+);", src)
        if fixed:
            assert geo.block == (int(fixed.group(1)), int(fixed.group(2)), 1), spec.key()
            assert "assert(blockDim.x == BX && blockDim.y == BY" in src
        assert geo.block[0] % 32 == 0 and geo.threads_per_block <= 256, spec.key()


def test_launch_covers_large_shapes_with_a_bounded_grid():
    for spec in (make_unary("reduce_sum", 10**6, 3), make_unary("reduce_sum", 3, 10**6, axis=0),
                 make_unary("transpose", 10**5, 10**5), make_unary("gather_rows", 10**6, 64)):
        geo = transform.launch(spec)
        assert geo.grid[0] * geo.grid[1] * geo.grid[2] <= 4096 * 8


def test_reduce_lanes_match_short_rows():
    """axis 1 with n < 32: L lanes per row, 32 / L rows per warp."""
    for n, lanes in ((1, 1), (3, 4), (16, 16), (17, 32), (1000, 32)):
        src = transform.source(make_unary("reduce_sum", 50, n))
        assert f"constexpr int L = {lanes}, RPW = 32 / L;" in src


def test_transpose_tile_pitch_is_an_odd_number_of_words():
    for dtype, pitch in (("f32", 33), ("bf16", 34), ("f16", 34)):
        assert f"tile[T][{pitch}]" in transform.source(make_unary("transpose", 5, 5,
                                                                   dtype_in=dtype))


# ---------------------------------------------------------------- rejection and dispatch
@pytest.mark.parametrize("spec", [make_unary("relu", 4, 4), make_unary("relu_inv", 4, 4),
                                  make_unary("identity", 4, 4), make_unary("dropout", 4, 4),
                                  make_unary("dropout_inv", 4, 4), make_binary("add", 4, 4),
                                  make_binary("cmp_lt", 4, 4)], ids=lambda s: s.op)
def test_non_transforms_are_unsupported(spec):
    for fn in (transform.source, transform.kernel_name, transform.launch):
        with pytest.raises(UnsupportedError, match="not a transform"):
            fn(spec)
    assert not transform.supported(spec)


def test_brgemm_is_not_a_transform():
    spec = tpp.make_brgemm(4, 4, 4)
    with pytest.raises(UnsupportedError):
        transform.source(spec)
    assert not transform.supported(spec)


def test_dispatcher_picks_the_generator():
    cases = [(make_unary("relu", 4, 4), eltwise), (make_binary("mul", 4, 4), eltwise),
             (make_unary("reduce_sum", 4, 4), transform), (make_unary("dropout", 4, 4), eltwise),
             (make_unary("dropout_inv", 4, 4), eltwise),
             (make_unary("vnni2", 4, 4, dtype_in="bf16"), transform)]
    for spec, module in cases:
        assert generators.module_for(spec) is module
        assert generators.source(spec) == module.source(spec)
        assert generators.kernel_name(spec) == module.kernel_name(spec)
        assert generators.launch(spec) == module.launch(spec)
        assert generators.supported(spec)


def test_dispatcher_brgemm():
    spec = tpp.make_brgemm(4, 4, 4)
    try:
        from tpp_cuda import brgemm
    except ImportError:
        with pytest.raises(UnsupportedError, match="brgemm"):
            generators.module_for(spec)
        assert not generators.supported(spec)
    else:
        assert generators.module_for(spec) is brgemm


# ---------------------------------------------------------------- running on the CPU emulator
# The kernels run on tests/cuda_emulator.py (all in one emulated module) against
# tpp.core.reference: bits for the movers, values for the max-like
# reductions, an f32-accumulation bound for the sums. Inputs live in buffers with ld > the row
# (random bits in the padding), outputs in sentinel-filled buffers one row taller whose margins
# must survive. A few kernels also run with a one-block grid (the grid-stride loops must cover
# the problem).
try:
    import cuda_emulator
except ImportError:                     # the emulator is test support that may be absent
    cuda_emulator = None

needs_emulator = pytest.mark.skipif(cuda_emulator is None or not cuda_emulator.available(),
                                    reason="the CUDA emulator (g++ and CUDA headers) is missing")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SENTINEL = 0xA5                        # every byte of an output buffer before the launch
_EMU_SHAPES = [(1, 1), (1, 45), (45, 1), (7, 45), (33, 31), (3, 70)]
_SRC_ROWS = 11                          # rows of gather's source / scatter's destination


def _emulated_specs():
    specs = []
    for op in REDUCE_OPS:
        for axis in (0, 1):
            specs += [make_unary(op, m, n, axis=axis, ldi=n + 3) for m, n in _EMU_SHAPES]
            specs += [make_unary(op, 9, 37, axis=axis, dtype_in=din, dtype_out=dout)
                      for din, dout in (("bf16", "f32"), ("f16", "bf16"), ("f32", "f16"))]
    for dt in ("f32", "bf16", "f16"):
        specs += [make_unary("transpose", m, n, dtype_in=dt, ldi=n + 2, ldo=m + 5)
                  for m, n in _EMU_SHAPES + [(40, 70)]]
        specs += [make_unary(op, m, n, dtype_in=dt, ldi=n + 2, ldo=n + 1)
                  for op in ("gather_rows", "scatter_rows") for m, n in ((1, 1), (5, 45), (20, 3))]
    for dt in ("bf16", "f16"):
        for m, n in ((1, 1), (7, 5), (8, 33), (9, 5)):
            specs += [make_unary("vnni2", m, n, dtype_in=dt, ldi=n + 1, ldo=2 * n + 3),
                      make_unary("vnni2_inv", m, n, dtype_in=dt, ldi=2 * n + 1, ldo=n + 3)]
    return specs + _ONE_BLOCK


_ONE_BLOCK = [make_unary("transpose", 70, 40, dtype_in="bf16", ldi=41, ldo=75),
              make_unary("reduce_max", 100, 5, axis=1, ldi=7),
              make_unary("reduce_sum", 100, 40, axis=1),
              make_unary("reduce_min", 20, 300, axis=0, ldi=301),
              make_unary("reduce_sumsq", 3, 300, axis=0),
              make_unary("scatter_rows", 20, 3), make_unary("gather_rows", 20, 3),
              make_unary("vnni2", 9, 300, dtype_in="f16")]
EMULATED = _emulated_specs()


@pytest.fixture(scope="module")
def emulated():
    return cuda_emulator.EmulatedModule({transform.kernel_name(s): transform.source(s)
                                         for s in EMULATED})


def _random_bits(shape, dtype, rng):
    out = np.empty(shape, dtype)
    out.view(_UINT[out.itemsize])[...] = rng.integers(0, 2 ** (8 * out.itemsize), shape,
                                                      dtype=np.uint64)
    return out


def _values(shape, dtype, rng, specials=False):
    """Normal values (x3); with specials, a nan, an inf and (in another row) a -inf."""
    x = (rng.standard_normal(shape) * 3.0).astype(np.float32).astype(dtype)
    if specials:
        x[0, 0], x[-1, -1], x[-1, 0] = np.nan, np.inf, -np.inf
    return x


def _input(spec, operand, rng, specials):
    """(buffer passed to the kernel, logical view given to the reference) of an input."""
    if operand.layout == "index":
        idx = rng.integers(0, _SRC_ROWS, operand.cols).astype(np.int64)
        return idx, idx
    if operand.layout == "mask":
        mask = rng.integers(0, 256, operand.shape).astype(np.uint8)
        return mask, mask
    rows = _SRC_ROWS if operand.rows == -1 else operand.rows
    buf = _random_bits((rows, operand.ld), operand.dtype.numpy, rng)   # padding: random bits
    view = buf[:, :operand.cols]
    if spec.kind == "reduce":                                         # values, not bits
        view[...] = _values(view.shape, operand.dtype.numpy, rng, specials)
    return buf, view


def _output(operand, inout):
    """(buffer, logical view) of an output: one row taller than needed, sentinel bytes."""
    rows = _SRC_ROWS if operand.rows == -1 else operand.rows
    shape = (rows + 1, operand.ld) if operand.layout == "block" else (operand.cols + 1,)
    if operand.layout == "mask":
        shape = (rows + 1, operand.cols)
    nbytes = int(np.prod(shape)) * operand.dtype.itemsize
    buf = np.full(nbytes, _SENTINEL, np.uint8).view(operand.dtype.numpy).reshape(shape)
    if inout is not None:
        buf[:rows, :operand.cols] = inout
    view = buf[:rows, :operand.cols] if len(shape) == 2 else buf[:operand.cols]
    return buf, view


def _check_reduce(spec, x, got, want):
    g, w = got.astype(np.float64), want.astype(np.float64)
    if spec.op in ("reduce_max", "reduce_min", "reduce_absmax"):
        np.testing.assert_array_equal(g, w, err_msg=spec.key())      # nan == nan here
        return
    xs = np.abs(x.astype(np.float64))
    scale = (xs * xs if spec.op == "reduce_sumsq" else xs).sum(axis=spec.param("axis"))
    out_ulp = {"f32": 0.0, "bf16": 2.0 ** -7, "f16": 2.0 ** -10}[spec.dtype_out.name]
    with np.errstate(invalid="ignore"):
        ok = (np.isnan(g) & np.isnan(w)) | (g == w) | \
            (np.abs(g - w) <= 1e-5 * scale + out_ulp * np.abs(w) + 2.0 ** -24)
    assert ok.all(), f"{spec.key()}: got {g[~ok][:3]}, want {w[~ok][:3]}"


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(_UINT[a.itemsize])


def _run_emulated(module, spec, *, specials=False, one_block=False):
    rng = np.random.default_rng(zlib.crc32(spec.key().encode()))
    args, inputs, outputs = [], [], []
    for operand in spec.operands():
        if operand.role == "in":
            buf, view = _input(spec, operand, rng, specials)
            inputs.append(view)
        else:
            prior = None
            if operand.role == "inout":            # scatter's destination: random rows
                prior = _random_bits((_SRC_ROWS, operand.cols), operand.dtype.numpy, rng)
                inputs.append(prior)
            buf, view = _output(operand, prior)
            outputs.append((buf, view, buf.copy()))
        args.append(buf)
    geo = transform.launch(spec)
    if one_block:
        geo = Launch((1, 1, 1), geo.block)
    module.launch(transform.kernel_name(spec), geo, args)
    with np.errstate(all="ignore"):
        want = reference.run(spec, *inputs)
    want = want if isinstance(want, tuple) else (want,)
    for (buf, view, before), w in zip(outputs, want):
        if spec.kind == "reduce":
            _check_reduce(spec, inputs[0], view, w)
        else:
            np.testing.assert_array_equal(_bits(view), _bits(w), err_msg=spec.key())
        margin = np.ones(buf.shape, bool)
        margin[tuple(slice(0, s) for s in view.shape)] = False
        assert (_bits(buf)[margin] == _bits(before)[margin]).all(), f"{spec.key()}: margin"


def _ids(spec):
    return f"{spec.op}-{spec.m}x{spec.n}-{spec.dtype_in}-{spec.dtype_out}-" + \
        "-".join(f"{k}{v}" for k, v in spec.params)


@needs_emulator
@pytest.mark.parametrize("spec", [s for s in EMULATED if s.kind == "reduce"], ids=_ids)
def test_emulated_reduce(emulated, spec):
    _run_emulated(emulated, spec)
    _run_emulated(emulated, spec, specials=spec.m > 1 or spec.n > 1)


@needs_emulator
@pytest.mark.parametrize("spec", [s for s in EMULATED if s.kind in
                                  ("transpose", "vnni2", "vnni2_inv", "gather", "scatter")],
                         ids=_ids)
def test_emulated_data_movement_is_bit_exact(emulated, spec):
    _run_emulated(emulated, spec)


@needs_emulator
@pytest.mark.parametrize("spec", _ONE_BLOCK, ids=_ids)
def test_emulated_one_block_grid_covers_the_problem(emulated, spec):
    _run_emulated(emulated, spec, specials=spec.kind == "reduce", one_block=True)
