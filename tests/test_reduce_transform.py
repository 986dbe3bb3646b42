"""Reductions (reduce_*) and data movement (transpose, vnni2, vnni2_inv, gather_rows,
scatter_rows) against tpp.core.reference: values for reductions, bits for the movers, and nothing
written outside the output block."""
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tpp   # tests/conftest.py has set TPP_CACHE_DIR already

RNG = np.random.default_rng(20240607)

SHAPES = [(1, 1), (1, 17), (16, 16), (17, 17), (100, 100), (5, 100), (100, 3), (7, 300)] + \
    [tuple(int(v) for v in RNG.integers(1, 101, 2)) for _ in range(3)]
DTYPES = ["f32", "bf16", "f16"]
REDUCE_OPS = ["reduce_sum", "reduce_sumsq", "reduce_max", "reduce_min", "reduce_absmax"]
EXACT_REDUCE = ("reduce_max", "reduce_min", "reduce_absmax")
MOVERS = ["transpose", "vnni2", "vnni2_inv", "gather_rows", "scatter_rows"]
_UINT = {2: np.uint16, 4: np.uint32}
_OUT_ROUNDING = {"f32": 0.0, "bf16": 2.0 ** -7, "f16": 2.0 ** -10}
_OUT_TINY = {"f32": 0.0, "bf16": 0.0, "f16": 2.0 ** -24}   # f16 subnormal spacing


def _np(dtype):
    return tpp.core.dtypes.lookup(dtype).numpy


def _shape_id(s):
    return f"{s[0]}x{s[1]}"


def _padded(arr, pad):
    """arr as a view into a wider buffer (ld = cols + pad); the margins hold garbage bits."""
    if not pad:
        return arr
    rows, cols = arr.shape
    big = np.empty((rows, cols + pad), arr.dtype)
    big.view(_UINT[arr.itemsize])[...] = RNG.integers(0, 2 ** (8 * arr.itemsize), big.shape,
                                                      dtype=np.uint64)
    big[:, :cols] = arr
    return big[:, :cols]


# ---------------------------------------------------------------- reductions
def _reduce_values(shape, dtype):
    return (RNG.standard_normal(shape) * 3.0).astype(np.float32).astype(_np(dtype))


def _check_reduce(spec, x, got, want):
    dt = spec.dtype_out.name
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert g.shape == w.shape
    if spec.op in EXACT_REDUCE:
        np.testing.assert_array_equal(g, w, err_msg=f"{spec.op} axis={spec.param('axis')}")
        return
    xs = np.abs(x.astype(np.float64))
    if spec.op == "reduce_sumsq":
        xs = xs * xs
    scale = xs.sum(axis=spec.param("axis"))      # f32 accumulation error is relative to this
    nan = np.isnan(w)
    assert (np.isnan(g) == nan).all(), f"{spec.op}: nan mismatch"
    with np.errstate(invalid="ignore"):
        bound = 1e-5 * scale + _OUT_ROUNDING[dt] * np.abs(w) + _OUT_TINY[dt]
        err = np.abs(g - w)
    bad = ~nan & (g != w) & ~(err <= bound)     # g != w: equal infinities are fine
    assert not bad.any(), (f"{spec.op} axis={spec.param('axis')}: {bad.sum()} of {w.size} off; "
                           f"got {g[bad][:3]} want {w[bad][:3]} bound {bound[bad][:3]}")


def _run_reduce(op, m, n, axis, dtype_in, dtype_out=None, pad=0, x=None):
    k = tpp.unary(op, m, n, dtype_in=dtype_in, dtype_out=dtype_out, axis=axis)
    spec = k.spec
    if x is None:
        x = _reduce_values((m, n), dtype_in)
    xv = _padded(x, pad)
    length = n if axis == 0 else m
    sentinel = np.array(7.0, np.float32).astype(spec.dtype_out.numpy)
    buf = np.full(length + 2, sentinel)
    out = buf[1:length + 1]
    got = k(xv, out=out)
    assert got is out or np.shares_memory(got, out)
    assert buf[0] == sentinel and buf[-1] == sentinel, "wrote outside the output vector"
    with np.errstate(invalid="ignore", over="ignore"):   # inf - inf in the reference's sums
        want = tpp.core.reference.run(spec, x)
    _check_reduce(spec, x, out, want)
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_shapes_and_lds(op, dtype, axis, shape):
    m, n = shape
    _run_reduce(op, m, n, axis, dtype)
    _run_reduce(op, m, n, axis, dtype, pad=3 + n % 5)


@pytest.mark.parametrize("dtype_out", DTYPES)
@pytest.mark.parametrize("dtype_in", DTYPES)
@pytest.mark.parametrize("op", ["reduce_sum", "reduce_sumsq", "reduce_max"])
def test_reduce_dtype_pairs(op, dtype_in, dtype_out):
    for axis in (0, 1):
        _run_reduce(op, 13, 45, axis, dtype_in, dtype_out)


def test_reduce_default_axis_is_1_and_allocates_output():
    x = _reduce_values((6, 21), "f32")
    got = tpp.unary("reduce_sum", 6, 21)(x)
    assert got.shape == (6,)
    np.testing.assert_allclose(got, x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_nan_and_inf(op, dtype, axis):
    """A NaN anywhere in a row (axis=1) or column (axis=0) makes that result NaN, wherever it
    sits: first element, inside the vector loop, in the masked tail; infinities win max/min."""
    m, n = 11, 45      # 45 = 5 full vectors + a tail of 5 (AVX2) / 2 full + 13 (AVX-512)
    x = _reduce_values((m, n), "f32")
    spots = [(0, 0), (2, 7), (3, 44), (5, 20), (7, 40), (10, 33)]
    for i, j in spots:
        x[i, j] = np.nan
    x[1, 3] = np.inf
    x[4, 9] = -np.inf
    x[6, 0] = np.inf
    x[6, 44] = -np.inf
    x[8, :] = -np.inf      # a row of -inf: max is -inf (the identity must not leak)
    x[9, :] = np.inf
    x = x.astype(_np(dtype))
    got = _run_reduce(op, m, n, axis, dtype, pad=2, x=x).astype(np.float64)
    nan_lines = {i for i, _ in spots} if axis == 1 else {j for _, j in spots}
    assert all(np.isnan(got[k]) for k in nan_lines)
    if axis == 1 and op == "reduce_max":
        assert got[8] == -np.inf and got[9] == np.inf and got[1] == np.inf
    if axis == 1 and op == "reduce_min":
        assert got[8] == -np.inf and got[9] == np.inf and got[4] == -np.inf


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("op", EXACT_REDUCE)
def test_reduce_identity_does_not_leak_into_tails(op, axis):
    """All-negative (max) / all-positive (min) blocks whose tails are partial vectors."""
    for m, n in [(3, 5), (9, 13), (4, 29)]:
        x = -np.abs(_reduce_values((m, n), "f32")) - 1.0
        if op == "reduce_min":
            x = -x
        _run_reduce(op, m, n, axis, "f32", x=x)


# ---------------------------------------------------------------- data movement
def _random_bits(shape, dtype):
    """Arbitrary bit patterns (NaN payloads, signalling NaNs, subnormals, -0) of a dtype."""
    size = np.dtype(_np(dtype)).itemsize
    bits = RNG.integers(0, 2 ** (8 * size), shape, dtype=np.uint64).astype(_UINT[size])
    return bits.view(_np(dtype))


def _bits(a):
    return np.asarray(a).view(_UINT[np.asarray(a).itemsize])


def _sentinel_block(rows, cols, pad, dtype):
    """An output view (ld = cols + pad) of a buffer with a sentinel row above and below."""
    size = np.dtype(_np(dtype)).itemsize
    big = np.full((rows + 2, cols + pad), 0x7E57 if size == 2 else 0x7E577E57, _UINT[size])
    return big[1:rows + 1, :cols].view(_np(dtype)), big


def _check_block_margins(big, rows, cols, before):
    mask = np.ones(big.shape, bool)
    mask[1:rows + 1, :cols] = False
    assert np.array_equal(big[mask], before[mask]), "the kernel wrote outside the output block"


def _run_mover(op, m, n, dtype, pad_in=0, pad_out=0, dup=True):
    k = tpp.unary(op, m, n, dtype_in=dtype)
    spec = k.spec
    ops = spec.operands()
    src_rows = ops[0].rows if ops[0].rows > 0 else m + 4
    x = _random_bits((src_rows, ops[0].cols), dtype)
    inputs = [_padded(x, pad_in)]
    ref_inputs = [x]
    if op in ("gather_rows", "scatter_rows"):
        out_rows = m if op == "gather_rows" else m + 4
        if op == "gather_rows" or dup:
            idx = RNG.integers(0, src_rows if op == "gather_rows" else out_rows, m)
        else:
            idx = RNG.permutation(out_rows)[:m]
        idx = idx.astype(np.int64)
        inputs.append(idx)
        ref_inputs.append(idx)
    else:
        out_rows = ops[-1].rows
    out_cols = ops[-1].cols
    out, big = _sentinel_block(out_rows, out_cols, pad_out, dtype)
    if op == "scatter_rows":
        out[...] = _random_bits(out.shape, dtype)
        ref_inputs.append(out.copy())
    before = big.copy()
    got = k(*inputs, out=out)
    assert np.shares_memory(got, out)
    want = tpp.core.reference.run(spec, *ref_inputs)
    assert want.shape == out.shape
    if not np.array_equal(_bits(out), _bits(want)):
        bad = np.argwhere(_bits(out) != _bits(want))
        raise AssertionError(f"{op} {dtype} {m}x{n}: {len(bad)} elements differ, first at "
                             f"{bad[:4].tolist()}")
    _check_block_margins(big, out_rows, out_cols, before)
    return out


def _mover_cases():
    for op in MOVERS:
        for dtype in DTYPES:
            if op.startswith("vnni2") and dtype == "f32":
                continue
            yield op, dtype


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("case", list(_mover_cases()), ids=lambda c: f"{c[0]}-{c[1]}")
def test_movers_bit_exact(case, shape):
    op, dtype = case
    m, n = shape
    _run_mover(op, m, n, dtype)
    _run_mover(op, m, n, dtype, pad_in=3 + n % 4, pad_out=1 + m % 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_edge_tiles(dtype):
    """Every combination of full and partial tiles in both directions, for 8- and 16-wide
    tiles (and 32 for 16-bit data on AVX-512)."""
    for m, n in [(8, 24), (24, 8), (9, 31), (31, 9), (15, 16), (33, 47), (40, 40), (64, 3)]:
        _run_mover("transpose", m, n, dtype, pad_in=1, pad_out=2)


def _run_strided(op, m, n, dtype, ldi, ldo, shift=0):
    """Run a mover on views with the given row pitches, the output starting `shift` elements
    into its rows (another phase against cache lines and 16-byte boundaries); check the bits
    against the reference and that nothing outside the output was written."""
    k = tpp.unary(op, m, n, dtype_in=dtype)
    ops = k.spec.operands()
    (in_rows, in_cols), (out_rows, out_cols) = [(o.rows, o.cols) for o in (ops[0], ops[-1])]
    assert ldi >= in_cols and ldo >= out_cols + shift
    x = _random_bits((in_rows, in_cols), dtype)
    xv = _padded(x, ldi - in_cols)
    size = np.dtype(_np(dtype)).itemsize
    big = np.full((out_rows + 2, ldo), 0x7E57 if size == 2 else 0x7E577E57, _UINT[size])
    out = big[1:out_rows + 1, shift:shift + out_cols].view(_np(dtype))
    before = big.copy()
    k(xv, out=out)
    want = tpp.core.reference.run(k.spec, x)
    if not np.array_equal(_bits(out), _bits(want)):
        bad = np.argwhere(_bits(out) != _bits(want))
        raise AssertionError(f"{op} {dtype} {m}x{n}: {len(bad)} elements differ, first at "
                             f"{bad[:4].tolist()}")
    mask = np.ones(big.shape, bool)
    mask[1:out_rows + 1, shift:shift + out_cols] = False
    assert np.array_equal(big[mask], before[mask]), "the kernel wrote outside the output block"


# Cache-blocked transposes: blocks of 64 input columns by 256 bytes of output row (64 f32 /
# 128 16-bit elements) go through stack buffers; whole tiles outside the blocks, and the
# partial edge tiles, are done directly. Blocks are used for footprints above 256 KiB when a
# row pitch is a multiple of 512 bytes, above 32 MiB always, and for outputs of 16 MiB or more
# (then with non-temporal stores when the output rows are 16-byte aligned, as whole vectors
# when ldo is a multiple of a cache line). No shape below is a multiple of the block or tile
# sizes.
BLOCKED = [   # (dtype, m, n, ldi, ldo)
    ("f32", 517, 701, 768, 522),       # input pitch 3 KiB
    ("bf16", 1000, 555, 560, 1024),    # output pitch 2 KiB
    ("f16", 300, 1100, 1280, 306),
    ("f32", 1500, 150, 151, 1536),     # two block columns and a partial one
]


@pytest.mark.parametrize("case", BLOCKED, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
def test_transpose_cache_blocked(case):
    dtype, m, n, ldi, ldo = case
    _run_strided("transpose", m, n, dtype, ldi, ldo)
    _run_strided("transpose", m, n, dtype, ldi, ldo, shift=5)


# outputs of 16 MiB and more: (dtype, m, n, ldo); the output shifted by 0 or 1 element
STREAMED = [
    ("f32", 2053, 2051, 2064),    # ldo a multiple of a line: whole-vector streaming stores
    ("bf16", 2900, 2901, 2904),   # ldo a multiple of 16 bytes only: 16-byte pieces
]


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("case", STREAMED, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
def test_transpose_streaming(case, shift):
    """With shift=1 the bf16 output is not 16-byte aligned, so the kernel takes its
    ordinary-store copy; the f32 one streams with the blocks moved to the new phase."""
    dtype, m, n, ldo = case
    _run_strided("transpose", m, n, dtype, n + 3, ldo, shift)


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("op", ["vnni2", "vnni2_inv"])
def test_vnni2_streaming(op, shift):
    """Outputs of 16 MiB and more with 16-byte aligned rows are written non-temporally (an odd
    m, column tails); shifted by one element they are not aligned and take ordinary stores."""
    m, n = 4099, 2051
    if op == "vnni2":
        _run_strided(op, m, n, "bf16", n + 1, 2 * n + 2, shift)
    else:
        _run_strided(op, m, n, "bf16", 2 * n + 1, n + 5, shift)


def test_transpose_blocked_with_sixteen_lanes(monkeypatch):
    """The cache-blocked and streaming code of the AVX-512 variant (16 f32 / 32 16-bit lanes),
    compiled for this host when it has no AVX-512 (LLVM splits the vectors)."""
    from tpp_cpu import backend, target
    host = target.make_target(target.host_isa())
    if host.lanes == 16:
        pytest.skip("this host runs the 16-lane code natively")
    wide = target.Target("w16-on-" + host.isa, 16, True, host.host)
    monkeypatch.setattr(backend, "current", lambda: wide)
    _run_strided("transpose", 517, 701, "f32", 768, 520, shift=3)
    _run_strided("transpose", 700, 555, "bf16", 560, 1024)
    _run_strided("transpose", 2053, 2051, "f32", 2051, 2064, shift=1)


def test_transpose_round_trip_and_public_allocation():
    x = _random_bits((37, 53), "bf16")
    t = tpp.unary("transpose", 37, 53, dtype_in="bf16")(x)
    assert t.shape == (53, 37)
    back = tpp.unary("transpose", 53, 37, dtype_in="bf16")(t)
    assert np.array_equal(_bits(back), _bits(x))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_vnni2_layout_and_inverse(dtype):
    m, n = 7, 5
    x = np.arange(m * n, dtype=np.float32).reshape(m, n).astype(_np(dtype))
    packed = tpp.unary("vnni2", m, n, dtype_in=dtype)(x)
    assert packed.shape == (4, 10)
    for r in range(4):
        for j in range(n):
            assert packed[r, 2 * j] == x[2 * r, j]
            assert packed[r, 2 * j + 1] == (x[2 * r + 1, j] if 2 * r + 1 < m else 0)
    back = tpp.unary("vnni2_inv", m, n, dtype_in=dtype)(packed)
    assert np.array_equal(_bits(back), _bits(x))


def test_scatter_repeated_index_keeps_last_row():
    k = tpp.unary("scatter_rows", 3, 20)
    src = np.arange(60, dtype=np.float32).reshape(3, 20)
    dst = np.zeros((5, 20), np.float32)
    k(src, np.array([4, 1, 4], np.int64), out=dst)
    assert (dst[4] == src[2]).all() and (dst[1] == src[1]).all()
    assert (dst[[0, 2, 3]] == 0).all()


def test_scatter_permutation_without_repeats():
    for dtype in DTYPES:
        _run_mover("scatter_rows", 23, 41, dtype, pad_in=2, pad_out=3, dup=False)


def test_gather_rows_from_a_taller_source():
    k = tpp.unary("gather_rows", 4, 9, dtype_in="f16")
    src = _random_bits((50, 9), "f16")
    idx = np.array([49, 0, 17, 17], np.int64)
    assert np.array_equal(_bits(k(src, idx)), _bits(src[idx]))


# ---------------------------------------------------------------- property tests
@settings(max_examples=25, deadline=None)
@given(op=st.sampled_from(REDUCE_OPS), m=st.integers(1, 70), n=st.integers(1, 70),
       axis=st.sampled_from([0, 1]), dtype=st.sampled_from(DTYPES), pad=st.integers(0, 9))
def test_reduce_hypothesis(op, m, n, axis, dtype, pad):
    _run_reduce(op, m, n, axis, dtype, pad=pad)


@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from(list(_mover_cases())), m=st.integers(1, 70), n=st.integers(1, 70),
       pad_in=st.integers(0, 9), pad_out=st.integers(0, 9))
def test_movers_hypothesis(case, m, n, pad_in, pad_out):
    op, dtype = case
    _run_mover(op, m, n, dtype, pad_in=pad_in, pad_out=pad_out)


# ---------------------------------------------------------------- generated code
def test_transpose_is_a_register_tile_shuffle_network():
    asm = tpp.unary("transpose", 64, 64).dump("asm", isa="avx2")
    # LLVM picks the float or the integer domain of the same shuffles by CPU model
    for insn in (r"v(unpcklps|punpckldq)", r"v(unpckhpd|punpckhqdq)", r"vperm2[fi]128"):
        assert re.search(insn, asm), insn
    assert "zmm" not in asm
    assert "vmovss" not in asm and "vextractps" not in asm     # no element-by-element moves
    asm16 = tpp.unary("transpose", 64, 64, dtype_in="bf16").dump("asm", isa="avx2")
    assert "vpunpcklwd" in asm16 and "pextrw" not in asm16 and "pinsrw" not in asm16


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_large_transpose_streams_and_prefetches(isa):
    """A 4096 x 4096 transpose: cache blocks that prefetch the next block's input, and
    non-temporal stores fenced at the end."""
    for dtype in ("f32", "bf16"):
        asm = tpp.unary("transpose", 4096, 4096, dtype_in=dtype).dump("asm", isa=isa)
        assert re.search(r"vmovnt(ps|dq)\s+%[yz]mm", asm), "no whole-vector streaming store"
        assert "sfence" in asm and "prefetcht0" in asm
        assert ("zmm" in asm) == (isa == "avx512")


def test_reductions_are_vectorised():
    rows = tpp.unary("reduce_sum", 64, 100, axis=1).dump("asm", isa="avx2")
    cols = tpp.unary("reduce_sum", 64, 100, axis=0).dump("asm", isa="avx2")
    for asm in (rows, cols):
        assert "vaddps" in asm and "ymm" in asm and "vmaskmovps" in asm


@pytest.mark.parametrize("op", ["transpose", "vnni2", "gather_rows", "reduce_max"])
def test_avx512_variants_generate(op):
    """The AVX-512 code (16 f32 / 32 16-bit lanes) compiles: its transpose network is checked
    for correctness symbolically while it is generated."""
    for dtype in ("f32", "bf16"):
        if op == "vnni2" and dtype == "f32":
            continue
        params = {"axis": 0} if op.startswith("reduce") else {}
        asm = tpp.unary(op, 37, 45, dtype_in=dtype, **params).dump("asm", isa="avx512")
        assert "zmm" in asm
