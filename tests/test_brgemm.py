"""BRGEMM, C = act(beta*C + sum_i A_i @ B_i + bias), against tpp.core.reference.

The sweep is libxsmm's: m, n, k from 1..100 plus 1, 16, 17, 64, 65; ld exact and larger; beta 0
and 1; the three batch modes with counts 1..8 (and 0); transposed A and B, VNNI-packed B; every
dtype combination of A, B, C (f32, bf16, f16); every epilogue. Each call writes C into a buffer
of sentinel bytes (a row before, a row after, ld > n) and the bitmask between guard bytes, and
checks that nothing outside them changed; A and B are views whose margins hold NaN, so a read
outside a block that reaches the result shows. 16-bit inputs are drawn in f32 and rounded, so
the reference computes on the very values the kernel reads; products of bf16 or f16 values are
exact in f32, so every dtype combination gets the same f32 accumulation bound.

Tolerance (_assert_close). An element sums K = k*count products in f32; its partial sums grow
like sqrt(j)*sigma and each addition rounds with relative error <= u = 2^-24, so the summation
error is a random walk of size ~u*sqrt(K/2)*rms(x), x the pre-activation (a blocked order is
no worse). With acc = u*sqrt(K)*rms(x)*1.13 (1.13: the largest slope of the activations,
gelu's), each element must satisfy |got - ref| <= rtol*|ref| + 8*acc: rtol is 1 ulp of dtype_c
(2^-23, 2^-7, 2^-10: both sides round nearby f32 values, possibly across a rounding boundary)
plus the activation's own relative bound (support.TOLERANCE), and 8*acc (> 11 standard
deviations) is the absolute slack for elements near zero, where cancellation makes a relative
bound meaningless. The relative Frobenius error must also stay below rtol + 3*acc*sqrt(m*n)/||ref||
(for f32 and no activation: 2^-23 + 3.4*2^-24*sqrt(K), about 6e-6 at K = 800).
"""
import dataclasses
import itertools
import math
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tpp
from support import TOLERANCE

DT = ("f32", "bf16", "f16")
SPECIAL = (1, 16, 17, 64, 65)
EPILOGUES = [(None, None, False), ("row", None, False), (None, "relu", False),
             (None, "relu", True), ("row", "relu", True), (None, "gelu", False),
             ("row", "gelu", False), (None, "sigmoid", False), ("row", "tanh", False),
             ("col", None, False), ("col", "relu", True), ("col", "gelu", False)]
LAYOUTS = ("plain", "ta", "tb", "ta.tb", "vnni", "ta.vnni")
U = 2.0 ** -24
OUT_ULP = {"f32": 2.0 ** -23, "bf16": 2.0 ** -7, "f16": 2.0 ** -10}
SLOPE = 1.13          # max |act'(x)| over relu, gelu, sigmoid, tanh
SENTINEL = 0xA5       # byte pattern of every C buffer and mask guard


def _np(dtype):
    return tpp.core.dtypes.lookup(dtype).numpy


def _data(rng, shape, dtype, scale=1.0):
    """Normal values of the given scale, exactly representable in dtype."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(_np(dtype))


def _vnni(b, pad=0.0):
    """(..., k, n) -> (..., (k+1)//2, 2n): element (p, 2j+t) is b[2p+t, j]; an odd k's pad holds
    `pad`."""
    *lead, k, n = b.shape
    full = np.full((*lead, k + k % 2, n), pad, np.float32).astype(b.dtype)
    full[..., :k, :] = b
    half = (k + 1) // 2
    return full.reshape(*lead, half, 2, n).swapaxes(-1, -2).reshape(*lead, half, 2 * n)


@dataclasses.dataclass(frozen=True)
class Case:
    m: int
    n: int
    k: int
    batch: str = "stride"
    count: int = 1
    beta: int = 0
    layout: str = "plain"
    dtypes: tuple = ("f32", "f32", "f32")
    pad: int = 0                  # added to every ld (0: exact)
    epilogue: tuple = (None, None, False)
    spare: int = 0                # extra blocks beyond count (then passed as count=)

    def __post_init__(self):    # VNNI needs a 16-bit B: with f32 B, transpose B instead
        if "vnni" in self.layout and self.dtypes[1] == "f32":
            object.__setattr__(self, "layout", self.layout.replace("vnni", "tb"))

    def __str__(self):
        bias, act, bitmask = self.epilogue
        epi = "+".join([x for x in (bias and f"bias-{bias}", act) if x] + ["mask"] * bitmask) \
            or "none"
        return (f"{self.m}x{self.n}x{self.k}-{self.batch}{self.count}"
                f"{f'+{self.spare}' if self.spare else ''}-beta{self.beta}-{self.layout}-"
                f"{'.'.join(self.dtypes)}-ld{f'+{self.pad}' if self.pad else '='}-{epi}")

    def kernel(self):
        da, db, dc = self.dtypes
        bias, act, bitmask = self.epilogue
        ta, vnni = "ta" in self.layout, "vnni" in self.layout
        tb = "tb" in self.layout
        a_cols = self.m if ta else self.k
        b_cols = 2 * self.n if vnni else (self.k if tb else self.n)
        return tpp.brgemm(self.m, self.n, self.k, lda=a_cols + self.pad, ldb=b_cols + self.pad,
                          ldc=self.n + self.pad, dtype_a=da, dtype_b=db, dtype_c=dc,
                          beta=self.beta, trans_a=ta, trans_b=tb, vnni_b=vnni, batch=self.batch,
                          bias=bias, activation=act, bitmask=bitmask)


def _sweep(n_cases=135, seed=2024):
    """A seeded, balanced sample: every (batch, count), dtype triple, (beta, epilogue) and
    (layout, ld) combination appears about equally often, in random pairings."""
    rng = np.random.default_rng(seed)

    def balanced(values):
        reps = -(-n_cases // len(values))
        idx = np.concatenate([rng.permutation(len(values)) for _ in range(reps)])
        return [values[i] for i in idx[:n_cases]]

    def size():
        return int(rng.choice(SPECIAL)) if rng.random() < 0.4 else int(rng.integers(1, 101))

    cols = [balanced(list(itertools.product(("stride", "offset", "address"), range(1, 9)))),
            balanced(list(itertools.product(DT, DT, DT))),
            balanced(list(itertools.product((0, 1), EPILOGUES))),
            balanced(list(itertools.product(LAYOUTS, (0, 1))))]
    cases = []
    for (batch, count), dtypes, (beta, epi), (layout, larger) in zip(*cols):
        pad = int(rng.integers(1, 20)) if larger else 0
        cases.append(Case(size(), size(), size(), batch, count, beta, layout, dtypes, pad, epi,
                          int(rng.choice([0, 0, 0, 2]))))
    return cases


# ---------------------------------------------------------------- placing blocks in memory
def _place(rng, batch, blocks, ld, dtype):
    """Stored blocks (cnt, rows, cols) laid out for a batch mode, margins NaN (_data of scale
    NaN). Returns (the kernel's argument, the blocks the kernel will read, offsets or None)."""
    cnt, rows, cols = blocks.shape
    if batch == "stride":                     # a batch stride with spare rows between blocks
        buf = _data(rng, (cnt, rows + int(rng.integers(0, 3)), ld), dtype, np.nan)
        buf[:, :rows, :cols] = blocks
        return buf[:, :rows, :cols], buf[:, :rows, :cols], None
    if batch == "address":                    # separate allocations; one block used twice
        views = [_place(rng, "stride", blk[None], ld, dtype)[0][0] for blk in blocks]
        if cnt >= 3:
            views[2] = views[0]
        return views, views, None
    span = (rows - 1) * ld + cols             # offset: unordered, unaligned, may overlap
    flat = _data(rng, span + 2 * max(cnt, 1) * rows * ld, dtype, np.nan)
    offsets = rng.integers(0, flat.size - span + 1, cnt).astype(np.int64)
    isz = flat.itemsize
    views = [np.lib.stride_tricks.as_strided(flat[o:], (rows, cols), (ld * isz, isz))
             for o in offsets]
    for view, blk in zip(views, blocks):
        view[...] = blk
    return flat, views, offsets


def _guarded_c(rng, spec):
    """C as a view into a sentinel-byte buffer (one row before and after, ld = spec.ldc)."""
    m, n = spec.m, spec.n
    raw = np.full((m + 2) * spec.ldc * spec.dtype_c.itemsize, SENTINEL, np.uint8)
    big = raw.view(spec.dtype_c.numpy).reshape(m + 2, spec.ldc)
    c = big[1:m + 1, :n]
    if spec.beta:
        c[...] = _data(rng, (m, n), spec.dtype_c)
    return c, big


def _check_guards(big, m, n, mask_buf=None, mask_len=0):
    outside = np.ones(big.shape, bool)
    outside[1:m + 1, :n] = False
    bits = big.view(f"u{big.itemsize}")
    pattern = np.full(1, SENTINEL, np.uint8).repeat(big.itemsize).view(bits.dtype)[0]
    assert (bits[outside] == pattern).all(), \
        f"written outside C at {np.argwhere(outside & (bits != pattern))[:5].tolist()}"
    if mask_buf is not None:
        guard = np.r_[mask_buf[:8], mask_buf[8 + mask_len:]]
        assert (guard == SENTINEL).all(), "written outside the bitmask"


# ---------------------------------------------------------------- checking
def _assert_close(got, want, pre, spec, count, label):
    """See the module docstring: elementwise and relative-Frobenius bounds."""
    g, w = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    x = np.asarray(pre).astype(np.float64)
    acc = U * math.sqrt(max(spec.k * count, 1)) * math.sqrt(np.mean(x * x)) * SLOPE
    act = spec.activation
    rtol = OUT_ULP[spec.dtype_c.name] + (TOLERANCE[act][0] if act in TOLERANCE else 0.0)
    assert np.isfinite(g).all(), f"{label}: non-finite at {np.argwhere(~np.isfinite(g))[:5]}"
    err = np.abs(g - w)
    bound = rtol * np.abs(w) + 8 * acc + 1e-37
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (
        f"{label} [{spec.key()}]: {(err > bound).sum()} of {err.size} elements off; worst at "
        f"{worst}: got {g[worst]!r} want {w[worst]!r} (|err| {err[worst]:.3g} > "
        f"{bound[worst]:.3g}); max |err| {err.max():.3g}")
    norm = max(np.linalg.norm(w), 1e-30)
    frob = np.linalg.norm(g - w) / norm
    limit = rtol + 3 * acc * math.sqrt(w.size) / norm
    assert frob <= limit, f"{label} [{spec.key()}]: relative Frobenius error {frob:.3g} > " \
        f"{limit:.3g}"
    return acc


def _assert_mask(mask, want_mask, pre, n, slack, label):
    """The bitmask is relu's `x > 0` on the f32 pre-activation: it must match the reference
    wherever x is farther from 0 than the summation slack (closer, rounding may flip it), and
    the pad bits of the last byte are 0."""
    got_bits = np.unpackbits(np.asarray(mask), axis=1, bitorder="little")
    assert not got_bits[:, n:].any(), f"{label}: bitmask pad bits set"
    decisive = np.abs(np.asarray(pre, np.float64)) > slack
    diff = (got_bits[:, :n].astype(bool) != tpp.core.reference.unpack_mask(want_mask, n)) & decisive
    assert not diff.any(), f"{label}: bitmask differs at {np.argwhere(diff)[:5].tolist()}"


def _run_case(case):
    """Build the case's kernel and inputs, call it, check C, the bitmask and the guards."""
    kern = case.kernel()
    spec, label = kern.spec, str(case)
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    count, total = case.count, case.count + case.spare
    a = _data(rng, (total, spec.m, spec.k), spec.dtype_a, 1 / math.sqrt(max(spec.k * count, 1)))
    b = _data(rng, (total + (1 if case.spare else 0), spec.k, spec.n), spec.dtype_b)
    a_st = a.transpose(0, 2, 1) if spec.trans_a else a
    b_st = _vnni(b) if spec.vnni_b else (b.transpose(0, 2, 1) if spec.trans_b else b)
    a_arg, a_ref, off_a = _place(rng, spec.batch, a_st, spec.lda, spec.dtype_a)
    b_arg, b_ref, off_b = _place(rng, spec.batch, b_st, spec.ldb, spec.dtype_b)
    c, big = _guarded_c(rng, spec)
    extra = ([c.copy()] if spec.beta else [])
    kw = {"count": count} if case.spare else {}
    if spec.batch == "offset":
        kw.update(offsets_a=off_a, offsets_b=off_b)
    if spec.bias:
        kw["bias"] = _data(rng, spec.m if spec.bias == "col" else spec.n, spec.dtype_c, 0.5)
        extra.append(kw["bias"])
    if spec.bitmask:
        nb = (spec.n + 7) // 8
        mask_buf = np.full(spec.m * nb + 16, SENTINEL, np.uint8)
        kw["mask"] = mask_buf[8:8 + spec.m * nb].reshape(spec.m, nb)
    got = kern(a_arg, b_arg, c, **kw)
    want = tpp.core.reference.run(spec, a_ref[:count], b_ref[:count], *extra)
    pre = tpp.core.reference.run(spec.replace(activation=None, bitmask=False, dtype_c=tpp.F32),
                            a_ref[:count], b_ref[:count], *extra)
    if spec.bitmask:
        assert got[0] is c and got[1] is kw["mask"], "the given C and mask are returned"
        slack = _assert_close(got[0], want[0], pre, spec, count, label)
        _assert_mask(got[1], want[1], pre, spec.n, 8 * slack / SLOPE + 1e-37, label)
        _check_guards(big, spec.m, spec.n, mask_buf, spec.m * nb)
    else:
        assert got is c, "the given C is returned"
        _assert_close(got, want, pre, spec, count, label)
        _check_guards(big, spec.m, spec.n)


# ---------------------------------------------------------------- the sweep
@pytest.mark.parametrize("case", _sweep(), ids=str)
def test_sweep(case):
    """One seeded sample of the libxsmm sweep per case (see _sweep), checked as in _run_case."""
    _run_case(case)


_size_st = st.one_of(st.sampled_from(SPECIAL), st.integers(1, 100))


@settings(max_examples=25, deadline=None)
@given(m=_size_st, n=_size_st, k=_size_st, batch=st.sampled_from(["stride", "offset", "address"]),
       count=st.integers(0, 8), beta=st.sampled_from([0, 1]), layout=st.sampled_from(LAYOUTS),
       dtypes=st.tuples(*[st.sampled_from(DT)] * 3), pad=st.sampled_from([0, 1, 5, 16]),
       epilogue=st.sampled_from(EPILOGUES), spare=st.sampled_from([0, 1]))
def test_hypothesis(m, n, k, batch, count, beta, layout, dtypes, pad, epilogue, spare):
    """Any combination of the sweep's dimensions, counts 0..8 included."""
    _run_case(Case(m, n, k, batch, count, beta, layout, dtypes, pad, epilogue, spare))


@pytest.mark.parametrize("case", [
    Case(5, 20, 7, "stride", 0, 1, epilogue=("row", "gelu", False)),
    Case(9, 3, 4, "offset", 0, 0, "vnni", ("bf16", "bf16", "bf16"), 2, (None, "sigmoid", False)),
    Case(17, 17, 1, "address", 0, 1, "ta", ("f16", "f32", "f16"), 0, ("row", "relu", True)),
    Case(1, 65, 3, "stride", 0, 0, "tb", epilogue=("row", "tanh", False), spare=3),
], ids=str)
def test_count_zero(case):
    """count=0 sums nothing: C = act(beta*C + bias) (sigmoid of 0 is 0.5), from empty arrays or
    from count=0 with blocks present."""
    _run_case(case)


# ---------------------------------------------------------------- register blocking
def test_register_blocking_covers_c_and_caps_aliasing_rows():
    """Every plan tiles C exactly once within the register budget; an A row stride that is a
    multiple of 4 KiB (every row in one L1 set) caps the rows per tile at 6, 2 KiB at 12 (two
    sets), and a transposed A (None) or a stride that spreads the rows leaves the cap off."""
    from tpp_cpu.brgemm_blocking import plan

    def rows_of(p):
        return max(rg.rows for rg in p.row_groups)

    for m, n in itertools.product((1, 5, 16, 17, 64, 65, 100), (1, 16, 17, 64, 100)):
        for lanes, regs in ((16, 32), (8, 16)):
            for a_row_bytes in (None, 256, 2048, 4096, 8192, 4000):
                p = plan(m, n, lanes, regs, 1, a_row_bytes)
                assert sum(rg.rows * rg.count for rg in p.row_groups) == m
                covered = sum(cg.count * cg.vectors * lanes for cg in p.col_groups)
                assert covered - (lanes - p.col_groups[-1].tail) == n
                for rg, cg in p.tiles():
                    assert rg.rows * cg.vectors + cg.vectors + 2 <= regs   # one spare
    assert rows_of(plan(64, 64, 16, 32, 1, 4096)) == 6
    assert rows_of(plan(64, 64, 16, 32, 1, 8192)) == 6
    assert 6 < rows_of(plan(64, 16, 16, 32, 1, 2048)) <= 12      # 64 = 4 x 11 + 2 x 10
    assert rows_of(plan(64, 16, 16, 32, 1, None)) > 12
    assert rows_of(plan(64, 16, 16, 32, 1, 4000)) > 12      # not a multiple of a line
    assert rows_of(plan(16, 16, 16, 32, 1, 64)) == 16        # the 16^3 BRGEMM: one 16x1 tile


def test_register_blocking_reads_b_once_where_a_tie_allows():
    """Among the cheapest plans, one whose tiles cover all rows in one tile row (B read once
    per k step) wins over a wider tile that needs several rows of tiles, where its tiles are
    at least 2 vectors wide; otherwise the widest tile wins the tie."""
    from tpp_cpu.brgemm_blocking import plan

    def shape(p):
        return [(rg.rows, rg.count) for rg in p.row_groups], [cg.vectors for cg in p.col_groups]

    assert shape(plan(7, 64, 16, 32)) == ([(7, 1)], [2])          # not 4 + 3 rows x 4 vectors
    assert shape(plan(14, 768, 16, 32)) == ([(14, 1)], [2])
    assert shape(plan(7, 128, 16, 32)) == ([(7, 1)], [3, 2])
    assert shape(plan(6, 64, 16, 32)) == ([(6, 1)], [4])          # one row of 4-vector tiles
    assert shape(plan(64, 64, 16, 32)) == ([(6, 9), (5, 2)], [4])  # no one-pass plan: widest
    assert shape(plan(7, 64, 8, 16)) == ([(4, 1), (3, 1)], [2])   # AVX2: 7 x 1 is load-bound
    assert shape(plan(6, 48, 8, 16)) == ([(6, 1)], [2])


@pytest.mark.parametrize("case", [
    Case(7, 64, 64, "stride", 8, 1),
    Case(13, 100, 16, "offset", 3, 0, "vnni", ("bf16", "bf16", "f32"), epilogue=("row", "gelu",
                                                                              False)),
    Case(10, 768, 8, "address", 2, 1, pad=3, epilogue=("row", "relu", False)),
    Case(6, 48, 5, "stride", 2, 0),
], ids=str)
def test_one_pass_tiles(case):
    """The one-pass tilings (test_register_blocking_reads_b_once_where_a_tie_allows) compute
    what the reference does (AVX2 and AVX-512 tilings alike: the suite runs under both)."""
    _run_case(case)


@pytest.mark.parametrize("case", [
    # lda = 1024 f32 (4 KiB): 6-row tiles; n = 70: a 4-vector tile and a masked 1-vector tail
    Case(40, 70, 30, "stride", 2, 1, "plain", ("f32",) * 3, 994, ("row", "gelu", False)),
    # lda = 2048 bf16 (4 KiB), VNNI B, f32 C
    Case(13, 33, 8, "stride", 3, 0, "vnni", ("bf16", "bf16", "f32"), 2040),
    # a transposed A with a 4 KiB stride: no cap (a k step reads one row of A^T)
    Case(20, 17, 9, "stride", 2, 1, "ta", ("f32",) * 3, 1004),
], ids=str)
def test_aliasing_lda(case):
    """A row strides that alias in L1 take the capped tiles; results as in the sweep."""
    _run_case(case)


# ---------------------------------------------------------------- call forms
def test_raw_stride_path():
    """kern.raw(a, b, c, bias, mask, count, stride_a, stride_b) with plain addresses and element
    strides reads blocks spaced by the strides, and matches the checked call."""
    kern = tpp.brgemm(13, 22, 9, beta=1)
    rng = np.random.default_rng(5)
    a = _data(rng, (4, 15, 9), "f32")           # block stride 15*9: two spare rows per block
    b = _data(rng, (4, 9, 22), "f32")
    c0 = _data(rng, (13, 22), "f32")
    for count in (3, 4):
        c = c0.copy()
        kern.raw(a.ctypes.data, b.ctypes.data, c.ctypes.data, 0, 0, count, 15 * 9, 9 * 22)
        want = tpp.core.reference.run(kern.spec, a[:count, :13], b[:count], c0)
        _assert_close(c, want, want, kern.spec, count, f"raw count={count}")
        assert np.array_equal(kern(a[:, :13], b, c0.copy(), count=count), c)


def test_torch_tensors_in_and_out():
    """torch CPU tensors work zero copy in every role; C allocated by the kernel is a tensor of
    dtype_c; the result matches torch's own float64 matmul."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    kern = tpp.brgemm(12, 40, 24, beta=1, bias="row", activation="gelu")
    a, b = torch.randn(3, 12, 24, generator=g) / 8, torch.randn(3, 24, 40, generator=g)
    c, bias = torch.randn(12, 40, generator=g), torch.randn(40, generator=g)
    want = torch.nn.functional.gelu(c.double() + bias.double() +
                                    torch.einsum("bmk,bkn->mn", a.double(), b.double()))
    got = kern(a, b, c.clone(), bias=bias)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    bf = tpp.brgemm(7, 33, 16, dtype_a="bf16", dtype_c="bf16", batch="address")
    a16 = [torch.randn(7, 16, generator=g).bfloat16() for _ in range(2)]
    b16 = [torch.randn(16, 33, generator=g).bfloat16() for _ in range(2)]
    out = bf(a16, b16)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    want16 = sum(x.double() @ y.double() for x, y in zip(a16, b16)).float().bfloat16()
    torch.testing.assert_close(out.float(), want16.float(), rtol=2.0 ** -7, atol=1e-5)


@pytest.mark.parametrize("dtype,k", [("bf16", 1), ("bf16", 33), ("f16", 17)])
def test_vnni_odd_k_packed_by_the_unary(dtype, k):
    """B packed by tpp.unary('vnni2') feeds vnni_b; with an odd k the pad half of the last pair
    is never read as a value (NaN there must not reach C)."""
    m, n, count = 6, 35, 2
    rng = np.random.default_rng(k)
    a = _data(rng, (count, m, k), dtype, 0.2)
    b = _data(rng, (count, k, n), dtype)
    pack = tpp.unary("vnni2", k, n, dtype_in=dtype)
    packed = np.stack([pack(x) for x in b])
    assert np.array_equal(packed.view(np.uint16), _vnni(b).view(np.uint16))
    kern = tpp.brgemm(m, n, k, dtype_a=dtype, vnni_b=True)
    want = tpp.core.reference.run(kern.spec, a, packed)
    _assert_close(kern(a, packed), want, want, kern.spec, count, "vnni packed")
    poisoned = _vnni(b, pad=np.nan)
    _assert_close(kern(a, poisoned), want, want, kern.spec, count, "vnni NaN pad")


@pytest.mark.parametrize("batch", ["stride", "address"])
def test_lds_come_from_the_strides(batch):
    """A kernel built with exact lds called with wider views compiles the variant for the views'
    row strides: the result and C's margins are those of a kernel built with those lds."""
    kern = tpp.brgemm(10, 19, 21, beta=1, batch=batch, trans_a=True)
    rng = np.random.default_rng(3)
    a = _data(rng, (3, 21, 10), "f32", 0.2)
    b = _data(rng, (3, 21, 19), "f32")
    a_arg, a_ref, _ = _place(rng, batch, a, 13, "f32")
    b_arg, b_ref, _ = _place(rng, batch, b, 24, "f32")
    c, big = _guarded_c(rng, kern.spec.replace(ldc=23))
    want = tpp.core.reference.run(kern.spec, a_ref, b_ref, c.copy())
    _assert_close(kern(a_arg, b_arg, c), want, want, kern.spec, 3, "ld from strides")
    _check_guards(big, 10, 19)


def test_reference_against_einsum():
    """tpp.core.reference itself, on the stored layouts, against a plain numpy einsum on the logical
    blocks (transposes, odd-k VNNI, beta, bias, the activations, a bf16 C)."""
    rng = np.random.default_rng(11)
    erfc = np.vectorize(math.erfc)    # 1 + erf(x) cancels for x << 0
    acts = {None: lambda x: x, "relu": lambda x: np.maximum(x, 0), "tanh": np.tanh,
            "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
            "gelu": lambda x: 0.5 * x * erfc(-x / math.sqrt(2))}
    for ta, vnni, act, dc in [(False, False, None, "f32"), (True, False, "relu", "f32"),
                              (False, True, "gelu", "bf16"), (True, True, "tanh", "f32"),
                              (False, False, "sigmoid", "f16")]:
        m, n, k, count = 5, 6, 7, 3
        spec = tpp.make_brgemm(m, n, k, dtype_a="bf16", dtype_c=dc, beta=1, trans_a=ta,
                               trans_b=not vnni, vnni_b=vnni, bias="row", activation=act)
        a, b = _data(rng, (count, m, k), "bf16"), _data(rng, (count, k, n), "bf16")
        c, bias = _data(rng, (m, n), dc), _data(rng, n, dc)
        a_st = a.transpose(0, 2, 1) if ta else a
        b_st = _vnni(b) if vnni else b.transpose(0, 2, 1)
        got = tpp.core.reference.run(spec, a_st, b_st, c, bias)
        x = np.einsum("bmk,bkn->mn", a.astype(np.float64), b.astype(np.float64))
        x = (x + c.astype(np.float64) + bias.astype(np.float64)).astype(np.float32)
        want = acts[act](x.astype(np.float64)).astype(np.float32).astype(_np(dc))
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=OUT_ULP[dc] + 1e-7, atol=1e-30, err_msg=f"{spec.key()}")


# ---------------------------------------------------------------- bad input
SPEC_ERRORS = {
    "k=0": dict(k=0),
    "vnni_b with f32 B": dict(vnni_b=True),
    "vnni_b with trans_b": dict(dtype_a="bf16", vnni_b=True, trans_b=True),
    "bitmask without relu": dict(activation="gelu", bitmask=True),
    "bad batch mode": dict(batch="strided"),
    "bad activation": dict(activation="swish"),
    "beta=2": dict(beta=2),
    "lda < k": dict(lda=3),
    "ldb < 2n with vnni": dict(dtype_a="bf16", vnni_b=True, ldb=9),
    "bias='both'": dict(bias="both"),
    "dtype_comp bf16": dict(dtype_comp="bf16"),
}


@pytest.mark.parametrize("kwargs", SPEC_ERRORS.values(), ids=SPEC_ERRORS.keys())
def test_bad_spec_raises(kwargs):
    """Invalid tpp.brgemm arguments raise a TPPError (SpecError or UnsupportedError)."""
    args = {"m": 4, "n": 5, "k": 6, **kwargs}
    with pytest.raises(tpp.TPPError):
        tpp.brgemm(args.pop("m"), args.pop("n"), args.pop("k"), **args)


def _z(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


A1, B1, OFFS = _z(1, 4, 6), _z(1, 6, 5), np.array([0, 6], np.int64)
OFF, ADDR = {"batch": "offset"}, {"batch": "address"}
CALL_ERRORS = {   # name: (kernel kwargs, call args, call kwargs, message); m, n, k = 4, 5, 6
    "k mismatch": ({}, (_z(2, 4, 7), _z(2, 6, 5)), {}, "3-D array"),
    "stride a 2-D": ({}, (_z(4, 6), B1), {}, "3-D array"),
    "counts differ": ({}, (_z(3, 4, 6), _z(2, 6, 5)), {}, "pass count="),
    "count too large": ({}, (_z(3, 4, 6), _z(3, 6, 5)), {"count": 4}, "holds only"),
    "count negative": ({}, (A1, B1), {"count": -1}, "non-negative"),
    "a f64": ({}, (_z(1, 4, 6, dtype=np.float64), B1), {}, "expected dtype"),
    "offsets to stride": ({}, (A1, B1), {"offsets_a": OFFS}, "belong to batch='offset'"),
    "c wrong dtype": ({}, (A1, B1, _z(4, 5, dtype=np.float16)), {}, "expected dtype"),
    "c wrong shape": ({}, (A1, B1, _z(5, 4)), {}, "expected shape"),
    "beta=1 without c": ({"beta": 1}, (A1, B1), {}, "pass c="),
    "bias missing": ({"bias": "row"}, (A1, B1), {}, "pass bias="),
    "bias unexpected": ({}, (A1, B1), {"bias": _z(5)}, "no bias"),
    "bias wrong length": ({"bias": "row"}, (A1, B1), {"bias": _z(6)}, "expected 5 values"),
    "col bias missing": ({"bias": "col"}, (A1, B1), {}, "pass bias="),
    "col bias wrong length": ({"bias": "col"}, (A1, B1), {"bias": _z(5)}, "expected 4 values"),
    "mask unexpected": ({}, (A1, B1), {"mask": _z(4, 1, dtype=np.uint8)}, "no bitmask"),
    "offsets missing": (OFF, (_z(99), _z(99)), {"offsets_a": OFFS}, "needs offsets_a"),
    "offset out of range": (OFF, (_z(29), _z(99)), {"offsets_a": OFFS, "offsets_b": OFFS},
                            "must lie in"),
    "offset negative": (OFF, (_z(99), _z(99)), {"offsets_a": -OFFS[::-1], "offsets_b": OFFS},
                        "must lie in"),
    "offsets int32": (OFF, (_z(99), _z(99)), {"offsets_a": OFFS.astype(np.int32),
                                              "offsets_b": OFFS}, "int64"),
    "offsets lengths differ": (OFF, (_z(99), _z(99)), {"offsets_a": OFFS[:1], "offsets_b": OFFS},
                               "pass count="),
    "address not a list": (ADDR, (_z(2, 4, 6), [_z(6, 5)] * 2), {}, "list or tuple"),
    "address mixed ld": (ADDR, ([_z(4, 6), _z(4, 8)[:, :6]], [_z(6, 5)] * 2), {}, "same row"),
    "address lengths differ": (ADDR, ([_z(4, 6)] * 3, [_z(6, 5)] * 2), {}, "pass count="),
}


@pytest.mark.parametrize("case", CALL_ERRORS.values(), ids=CALL_ERRORS.keys())
def test_bad_call_raises(case):
    """Bad arrays are rejected with an ArgumentError, from the check named by the message,
    before any compiled code runs (offset out of range: a block at 6 spans 6 + 3*6 + 6 = 30 >
    29 elements)."""
    spec_kw, args, kwargs, message = case
    with pytest.raises(tpp.ArgumentError, match=message):
        tpp.brgemm(4, 5, 6, **spec_kw)(*args, **kwargs)


def test_col_bias_checked_after_a_good_call():
    """A "col" bias (m values) is checked on the cached path too: a good call, then a bias
    of n values on the same kernel raises."""
    kern = tpp.brgemm(4, 5, 6, bias="col")
    got = kern(np.ones((1, 4, 6), np.float32), np.ones((1, 6, 5), np.float32),
               bias=np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(got, 6.0 + np.arange(4, dtype=np.float32)[:, None]
                                  * np.ones((1, 5), np.float32))
    with pytest.raises(tpp.ArgumentError, match="expected 4 values"):
        kern(np.ones((1, 4, 6), np.float32), np.ones((1, 6, 5), np.float32), bias=_z(5))


def test_offsets_reaching_the_end_of_the_base_array():
    """The last valid offset (size - span) is accepted and read correctly: the range check is
    not off by one."""
    kern = tpp.brgemm(4, 5, 6, batch="offset")
    rng = np.random.default_rng(8)
    a, b = _data(rng, 29, "f32"), _data(rng, 35, "f32")
    oa, ob = np.array([5, 0], np.int64), np.array([5, 0], np.int64)
    want = tpp.core.reference.run(kern.spec, [a[o:o + 24].reshape(4, 6) for o in oa],
                             [b[o:o + 30].reshape(6, 5) for o in ob])
    got = kern(a, b, offsets_a=oa, offsets_b=ob)
    _assert_close(got, want, want, kern.spec, 2, "offsets at the end")


def test_overlapping_or_read_only_c_raises():
    """C may not alias an input (a C that is a view into A's buffer is refused) and must be
    writable."""
    a = _z(2, 4, 6)
    with pytest.raises(tpp.ArgumentError, match="overlap"):
        tpp.brgemm(4, 5, 6)(a, _z(2, 6, 5), a[1, :, :5])
    c = _z(4, 5)
    c.flags.writeable = False
    with pytest.raises(tpp.ArgumentError, match="read-only"):
        tpp.brgemm(4, 5, 6)(a, _z(2, 6, 5), c)


_NO_DOT_CASES = [
    Case(64, 64, 64, "stride", 4, 0, "vnni", ("bf16", "bf16", "f32")),
    Case(13, 33, 7, "stride", 3, 1, "vnni", ("bf16", "bf16", "bf16"), 2, ("row", "gelu", False)),
    Case(5, 20, 1, "offset", 2, 0, "vnni", ("bf16", "bf16", "f32")),
    Case(9, 17, 33, "address", 2, 1, "plain", ("bf16", "bf16", "f32"), 1, (None, "relu", True)),
    Case(6, 8, 16, "stride", 2, 0, "ta.vnni", ("bf16", "bf16", "f32")),
    # A widened per row tile: k = 1024 pads each widened row by a line (4 KiB apart
    # otherwise); 820 pairs of 5 x 1 rows overflow brgemm.WIDE_ELEMENTS, so A is read in place
    Case(6, 16, 1024, "stride", 1, 0, "vnni", ("bf16", "bf16", "f32")),
    Case(5, 8, 1, "stride", 820, 0, "vnni", ("bf16", "bf16", "f32")),
    Case(7, 19, 21, "offset", 3, 1, "plain", ("f16", "f16", "f32"), 1, ("row", None, False)),
    Case(13, 40, 33, "address", 3, 1, "ta.vnni", ("bf16", "bf16", "bf16"), 3),
    Case(64, 64, 64, "stride", 2, 0, "ta.vnni", ("bf16", "bf16", "f32")),
    Case(5, 8, 64, "stride", 65, 1, "ta.vnni", ("bf16", "bf16", "f32")),
]


def _no_dot_cases():
    from tpp_cpu import target
    assert not target.current().bf16_dot and target.current().lanes == 8
    for case in _NO_DOT_CASES:
        _run_case(case)
    print("ok", len(_NO_DOT_CASES))


def test_bf16_without_a_dot_instruction_in_a_subprocess(run_as_avx2):
    """bf16 A where there is no bf16 dot: widened once per row tile (brgemm.widen_rows) or,
    for batches too big for its buffer, pairs split on the vector (brgemm._opaque): the
    sweep's bf16 cases and a few more with AVX2 code (a fresh process), whatever this host
    runs by default."""
    out = run_as_avx2("test_brgemm", "_no_dot_cases()")
    assert out.returncode == 0, f"{[str(c) for c in _NO_DOT_CASES]}\n{out.stdout}\n{out.stderr}"
    assert out.stdout.strip() == f"ok {len(_NO_DOT_CASES)}"
