"""tpp.equation: graphs of element-wise nodes and reductions compiled into one kernel, checked
against independent numpy formulas and against the exact reference (tpp.core.reference.run)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tpp
from tpp import BF16
from tpp.core.errors import ArgumentError, SpecError

RNG = np.random.default_rng(7)


def _rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def _layer_norm_eq(m, n, dtype="f32"):
    eq = tpp.equation(m, n)
    x = eq.input("x", dtype=dtype)
    g, b = eq.input("g", bcast="row"), eq.input("b", bcast="row")
    eps = eq.param("eps")
    mu = eq.mean(x, axis=1)
    xc = x - mu
    rstd = eq.rsqrt(eq.mean(xc * xc, axis=1) + eps)
    return eq.compile(xc * rstd * g + b, mu=mu, rstd=rstd)


@pytest.mark.parametrize("m,n", [(1, 1), (1, 7), (3, 16), (5, 37), (8, 64), (2, 100), (4, 1024)])
def test_layer_norm_against_numpy(m, n):
    ln = _layer_norm_eq(m, n)
    x, g, b = _rand(m, n), _rand(n), _rand(n)
    res = ln(x=x, g=g, b=b, eps=1e-5)
    x64 = x.astype(np.float64)
    mu = x64.mean(1, keepdims=True)
    rstd = 1 / np.sqrt(((x64 - mu) ** 2).mean(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(res.out, (x64 - mu) * rstd * g + b, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(res.mu, mu[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.rstd, rstd[:, 0], rtol=2e-5)
    assert res.out.shape == (m, n) and res.mu.shape == (m,) and res.out.dtype == np.float32


def test_softmax_rows_and_reference():
    m, n = 6, 45
    eq = tpp.equation(m, n)
    x = eq.input("x")
    e = eq.exp(x - eq.max(x, axis=1))
    k = eq.compile(e / eq.sum(e, axis=1))
    xa = _rand(m, n) * 4
    y = k(x=xa)
    z = np.exp(xa - xa.max(1, keepdims=True))
    np.testing.assert_allclose(y, z / z.sum(1, keepdims=True), rtol=3e-6, atol=1e-7)
    np.testing.assert_allclose(y, tpp.core.reference.run(k.spec, xa), rtol=3e-6, atol=1e-7)


@pytest.mark.parametrize("m,n", [(1, 1), (7, 3), (5, 37), (17, 64), (3, 130)])
def test_reductions_both_axes_and_mixed_shapes(m, n):
    """Axis-0 and axis-1 reductions, a reduction of a reduction, row/col/scalar outputs."""
    eq = tpp.equation(m, n)
    x = eq.input("x")
    c = eq.input("c", bcast="col")
    s = eq.input("s", bcast="scalar")
    col_sum = eq.sum(x, axis=0)                  # n values
    row_max = eq.max(x * c, axis=1)              # m values
    y = x * col_sum - row_max + s
    k = eq.compile(y, col_sum=col_sum, row_max=row_max, total=eq.sum(col_sum, axis=1),
                   low=eq.min(row_max, axis=0))
    xa, ca, sa = _rand(m, n), _rand(m), _rand(1)
    res = k(x=xa, c=ca, s=sa)
    cs = xa.astype(np.float64).sum(0)
    rm = (xa * ca[:, None]).max(1)
    np.testing.assert_allclose(res.col_sum, cs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.row_max, rm, rtol=1e-6)
    np.testing.assert_allclose(res.out, xa * cs - rm[:, None] + sa, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(res.total, [cs.sum()], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(res.low, [rm.min()], rtol=1e-6)
    for got, want in zip(res, tpp.core.reference.run(k.spec, xa, ca, sa)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_bf16_inputs_and_outputs_f32_statistics():
    m, n = 4, 33
    ln = _layer_norm_eq(m, n, dtype="bf16")
    x = _rand(m, n).astype(BF16.numpy)
    g, b = _rand(n), _rand(n)
    res = ln(x=x, g=g, b=b, eps=1e-5)
    assert res.out.dtype == BF16.numpy and res.mu.dtype == np.float32
    ref = tpp.core.reference.run(ln.spec, x, g, b, np.float32(1e-5))
    np.testing.assert_allclose(res.out.astype(np.float32), ref[0].astype(np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(res.mu, ref[1], rtol=1e-5, atol=1e-6)


def test_output_dtypes_and_predicate_outputs():
    m, n = 3, 20
    eq = tpp.equation(m, n)
    x = eq.input("x")
    k = eq.compile(x * 2.0, positive=x > 0.0, dtypes={"out": "f16"})
    xa = _rand(m, n)
    res = k(x=xa)
    assert res.out.dtype == np.float16
    np.testing.assert_array_equal(res.out, (xa * 2).astype(np.float16))
    bits = np.unpackbits(res.positive, axis=1, count=n, bitorder="little").astype(bool)
    np.testing.assert_array_equal(bits, xa > 0)
    mask_eq = tpp.equation(m, n)
    g, keep = mask_eq.input("g"), mask_eq.mask("keep")
    masked = mask_eq.compile(mask_eq.where(keep, g, 0.0))
    np.testing.assert_array_equal(masked(g=xa, keep=res.positive), np.where(xa > 0, xa, 0))


def test_strided_inputs_outputs_in_place_and_positional_call():
    m, n = 5, 12
    eq = tpp.equation(m, n)
    x, y = eq.input("x"), eq.input("y")
    k = eq.compile(x * y + 1.0)
    big = _rand(m, 20)
    xa, ya = big[:, :n], _rand(m, n)
    out = np.zeros((m, 30), np.float32)
    k(xa, ya, out=out[:, 3:3 + n])
    np.testing.assert_allclose(out[:, 3:3 + n], xa * ya + 1, rtol=1e-6)
    assert not out[:, :3].any() and not out[:, 3 + n:].any()
    yy = ya.copy()
    k(x=xa, y=yy, out=yy)        # element-wise: in place onto the identical array
    np.testing.assert_allclose(yy, xa * ya + 1, rtol=1e-6)


def test_in_place_only_block_output_onto_block_input():
    """A broadcast input under a reduction output, or two outputs on one array, were taken
    as "in place" and came back wrong (the broadcast row is read by every row after the
    reduction has overwritten it; one of two outputs is lost): an ArgumentError now."""
    m, n = 8, 32
    x, r, c = _rand(m, n), _rand(1, n)[0], _rand(1, m)[0]
    eq = tpp.equation(m, n)
    xi, ri = eq.input("x"), eq.input("r", bcast="row")
    k = eq.compile(xi * ri, s=eq.sum(xi, axis=0) + ri)
    with pytest.raises(ArgumentError, match="overlaps"):
        k(x, r, s=r)
    eq = tpp.equation(m, n)
    xi, ci = eq.input("x"), eq.input("c", bcast="col")
    k = eq.compile(eq.max(xi + ci, axis=1), o2=xi - ci)
    with pytest.raises(ArgumentError, match="overlaps"):
        k(x, c, out=c)
    eq = tpp.equation(m, n)
    xi = eq.input("x")
    k = eq.compile(xi * 2.0, xi + 1.0)
    o = np.zeros((m, n), np.float32)
    with pytest.raises(ArgumentError, match="overlaps"):
        k(x, out=o, out1=o)
    eq = tpp.equation(m, n)                # one output, one broadcast input: the fast path
    xi, ri = eq.input("x"), eq.input("r", bcast="row")
    k = eq.compile(eq.sum(xi * ri, axis=0))
    with pytest.raises(ArgumentError, match="overlaps"):
        k(x, r, out=r)
    xx = x.copy()
    eq = tpp.equation(m, n)
    xi, ri = eq.input("x"), eq.input("r", bcast="row")
    k = eq.compile(xi * ri, s=eq.sum(xi, axis=0))
    out, s = k(xx, r, out=xx)              # a block output onto the block input: fine
    np.testing.assert_allclose(out, x * r, rtol=1e-6)
    np.testing.assert_allclose(s, x.sum(0), rtol=1e-5, atol=1e-5)


def test_runtime_param_is_not_compiled_in():
    eq = tpp.equation(2, 8)
    x, a = eq.input("x"), eq.param("a")
    k = eq.compile(x * a)
    xa = _rand(2, 8)
    k(x=xa, a=1.0)
    before = tpp.cache_info()["compiled"]
    for a in (2.0, -3.5, 0.25):
        np.testing.assert_allclose(k(x=xa, a=a), xa * np.float32(a), rtol=1e-6)
    assert tpp.cache_info()["compiled"] == before


def test_same_graph_is_one_kernel_and_text_is_stable():
    a, b = _layer_norm_eq(3, 9), _layer_norm_eq(3, 9)
    assert a is b
    assert a.spec.key() == b.spec.key()
    assert "rsum" in a.spec.key()


def test_equation_inside_a_loop_nest_with_runtime_rows():
    n, bm = 24, 4
    eq = tpp.equation(bm, n)
    x = eq.input("x")
    e = eq.exp(x - eq.max(x, axis=1))
    block = eq.compile(e / eq.sum(e, axis=1))
    M = tpp.size("M")
    nest = tpp.LoopNest("A", a=M // bm)
    X, Y = nest.tensor("x", (M, n)), nest.tensor("y", (M, n))
    (i,) = nest.vars
    nest.call(block, X[i * bm], Y[i * bm])
    run = nest.compile()
    for rows in (4, 12, 40):
        xa = _rand(rows, n)
        ya = np.zeros_like(xa)
        run(xa, ya)
        z = np.exp(xa - xa.max(1, keepdims=True))
        np.testing.assert_allclose(ya, z / z.sum(1, keepdims=True), rtol=3e-6, atol=1e-7)


def test_dump_shows_one_function():
    k = _layer_norm_eq(4, 64)
    asm = k.dump("asm")
    assert "vsqrtps" in asm or "vsqrtss" in asm
    assert "call" not in asm          # one straight function: no calls out of it
    assert k.dump("ir").count("define") == 1


def test_bad_builds_are_spec_errors():
    eq = tpp.equation(3, 4)
    x = eq.input("x")
    with pytest.raises(SpecError, match="already a name"):
        eq.input("x")
    with pytest.raises(SpecError, match="bcast"):
        eq.input("y", bcast="diag")
    with pytest.raises(SpecError, match="axis"):
        eq.sum(x, axis=2)
    with pytest.raises(SpecError, match="at least one output"):
        eq.compile()
    other = tpp.equation(3, 4).input("z")
    with pytest.raises(SpecError, match="not inputs of this equation"):
        eq.compile(x + other)
    with pytest.raises(SpecError, match="already an input"):
        eq.compile(x, x=x)
    with pytest.raises(SpecError, match="names no output"):
        eq.compile(x, dtypes={"nope": "f32"})
    with pytest.raises(SpecError):
        tpp.equation(0, 4)
    with pytest.raises(SpecError):
        eq.compile(x + "a")
    with pytest.raises(SpecError, match="already constant"):
        eq.sum(eq.sum(x, axis=1), axis=1)


def test_bad_calls_are_argument_errors():
    eq = tpp.equation(3, 4)
    x, a = eq.input("x"), eq.param("a")
    k = eq.compile(x * a)
    xa = _rand(3, 4)
    with pytest.raises(ArgumentError, match="missing input"):
        k(x=xa)
    with pytest.raises(ArgumentError, match="no input or output named"):
        k(x=xa, a=1.0, b=2)
    with pytest.raises(ArgumentError, match="shape"):
        k(x=_rand(4, 3), a=1.0)
    with pytest.raises(ArgumentError, match="dtype"):
        k(x=xa.astype(np.float64), a=1.0)
    with pytest.raises(ArgumentError, match="number"):
        k(x=xa, a=True)
    with pytest.raises(ArgumentError, match="given twice"):
        k(xa, x=xa, a=1.0)
    with pytest.raises(ArgumentError, match="overlaps"):
        big = _rand(3, 8)
        k(x=big[:, :4], a=1.0, out=big[:, 2:6])


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 70), axis=st.sampled_from([0, 1]),
       red=st.sampled_from(["sum", "max", "min"]))
def test_hypothesis_reduce_then_broadcast(m, n, axis, red):
    eq = tpp.equation(m, n)
    x = eq.input("x")
    r = getattr(eq, red)(x, axis=axis)
    k = eq.compile(x - r, r=r)
    xa = _rand(m, n)
    res = k(x=xa)
    fn = {"sum": np.sum, "max": np.max, "min": np.min}[red]
    want = fn(xa.astype(np.float64), axis=axis, keepdims=True)
    np.testing.assert_allclose(res.r, want.reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.out, xa - want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n", [(1, 5), (9, 33), (64, 64)])
def test_softmax_down_the_columns_keeps_exp_and_matches_numpy(m, n):
    """The general schedule (axis-0 reductions) keeps exp(x - max) in a block buffer between
    its passes; the result must not change."""
    eq = tpp.equation(m, n)
    x = eq.input("x")
    e = eq.exp(x - eq.max(x, axis=0))
    k = eq.compile(e / eq.sum(e, axis=0), colsum=eq.sum(e, axis=0))
    xa = _rand(m, n) * 3
    res = k(x=xa)
    z = np.exp(xa - xa.max(0, keepdims=True))
    np.testing.assert_allclose(res.out, z / z.sum(0, keepdims=True), rtol=3e-6, atol=1e-7)
    np.testing.assert_allclose(res.colsum, z.sum(0), rtol=3e-6)
    import re
    import tpp_cpu.equation as gen
    fmas = lambda: len(re.findall(r"\bvf(n?)m(add|sub)", k.dump("asm")))   # noqa: E731
    kept = fmas()
    saved, gen.KEPT_ELEMENTS = gen.KEPT_ELEMENTS, 0
    try:
        recomputed = fmas()             # the same kernel without the buffer: exp twice
    finally:
        gen.KEPT_ELEMENTS = saved
    assert kept < recomputed


def _schedule(k, **target):
    """The generator of k's spec after generating it (its schedule flags), for the current
    target with the given fields replaced."""
    import dataclasses

    import tpp_cpu.equation as gen
    from tpp_cpu.target import current
    g = gen._Gen(k.spec, dataclasses.replace(current(), **target), "probe")
    g.generate()
    return g


@pytest.mark.parametrize("m,n", [(1, 1), (1, 100), (5, 37), (7, 16), (3, 80), (32, 1024)])
@pytest.mark.parametrize("with_dx", [True, False])
def test_rowwise_folds_sums_down_the_columns(m, n, with_dx):
    """Sums (max, min) down the columns that are outputs only join the rowwise schedule (stack
    rows filled in the output pass, beside a per-row reduction and a block output or alone);
    a column sum that another node uses keeps the general one. numpy's values."""
    eq = tpp.equation(m, n)
    x, dy, c = eq.input("x"), eq.input("dy"), eq.input("c", bcast="col")
    g = dy * (x * c - c)
    outs = dict(dw=eq.sum(g, axis=0), db=eq.sum(dy, axis=0), hi=eq.max(x, axis=0),
                lo=eq.min(x * dy, axis=0))
    if with_dx:
        outs["dx"] = g - eq.sum(g * x, axis=1) * x
    k = eq.compile(**outs)
    assert _schedule(k).rowwise and len(_schedule(k).down) == 4
    xa, dya, ca = _rand(m, n), _rand(m, n), _rand(m)
    got = k(x=xa, dy=dya, c=ca)
    x64, c64 = xa.astype(np.float64), ca[:, None].astype(np.float64)
    g64 = dya * (x64 * c64 - c64)
    np.testing.assert_allclose(got.dw, g64.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.db, dya.sum(0, dtype=np.float64), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.hi, xa.max(0))
    np.testing.assert_array_equal(got.lo, (xa * dya).min(0))
    if with_dx:
        np.testing.assert_allclose(got.dx, g64 - (g64 * x64).sum(1, keepdims=True) * x64,
                                   rtol=1e-4, atol=1e-4)
    eq2 = tpp.equation(m, n)
    x2 = eq2.input("x")
    s = eq2.sum(x2, axis=0)
    used = eq2.compile(x2 * s, s=s)
    assert not _schedule(used).rowwise
    np.testing.assert_allclose(used(x=xa).out, xa * x64.sum(0), rtol=1e-5, atol=1e-4)


_PRIMS = {"exp": np.exp, "tanh": np.tanh, "sigmoid": lambda v: 1 / (1 + np.exp(-v))}


@pytest.mark.parametrize("m,n", [(1, 1), (4, 16), (5, 37), (9, 300)])
@pytest.mark.parametrize("prim", sorted(_PRIMS))
def test_folded_column_sum_of_a_transcendental_beside_a_row_reduction(m, n, prim):
    """A transcendental that is a block output and the argument of a sum down the columns,
    beside a reduction along the rows: the output pass computes it for both (the sum is
    folded there, not in the row reduction's pass, so nothing may be kept from that pass).
    It once read a stack buffer that no pass wrote: garbage in both outputs."""
    eq = tpp.equation(m, n)
    x = eq.input("x")
    e = getattr(eq, prim)(x)
    k = eq.compile(e, colsum=eq.sum(e, axis=0), colmax=eq.max(e * x, axis=0),
                   rowsum=eq.sum(x, axis=1), scaled=e * eq.mean(x, axis=1))
    assert _schedule(k).rowwise and len(_schedule(k).down) == 2
    xa = _rand(m, n)
    got = k(x=xa)
    x64 = xa.astype(np.float64)
    e64 = _PRIMS[prim](x64)
    np.testing.assert_allclose(got.out, e64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.colsum, e64.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.colmax, (e64 * x64).max(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.rowsum, x64.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.scaled, e64 * x64.mean(1, keepdims=True), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("m,n", [(1, 16), (3, 37), (9, 1024)])
def test_rowwise_second_pass_prefetches_the_next_row(m, n):
    """A rowwise kernel whose second pass does PREFETCH_OPS or more block operations per vector
    prefetches the next row's inputs there (past the last row too: a prefetch never faults);
    a cheap second pass does not, except on eager_prefetch targets. Results as numpy's."""
    eq = tpp.equation(m, n)
    x, dy, w = eq.input("x"), eq.input("dy"), eq.input("w", bcast="row")
    g = dy * w
    s = eq.sum(g * x, axis=1)
    heavy = eq.compile((g - s * x) * x + g * 0.5)
    eq2 = tpp.equation(m, n)
    x2 = eq2.input("x")
    cheap = eq2.compile(x2 - eq2.sum(x2, axis=1))
    assert _schedule(heavy).prefetching and "prefetcht0" in heavy.dump("asm")
    plan = _schedule(cheap, eager_prefetch=False)
    assert not plan.prefetching
    assert _schedule(cheap, eager_prefetch=True).prefetching == (not plan.pipelining)
    assert _schedule(heavy, eager_prefetch=True).prefetching
    eager = _schedule(cheap).eager_prefetch
    if not plan.pipelining:      # (a pipelined one-input kernel prefetches rows ahead instead)
        assert ("prefetch" in cheap.dump("asm")) == eager
    xa, dya, wa = _rand(m, n), _rand(m, n), _rand(n)
    ga = dya * wa
    sa = (ga.astype(np.float64) * xa).sum(1, keepdims=True)
    np.testing.assert_allclose(heavy(x=xa, dy=dya, w=wa), (ga - sa * xa) * xa + ga * 0.5,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cheap(x=xa), xa - xa.astype(np.float64).sum(1, keepdims=True),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n", [(1, 16), (3, 37), (9, 1024), (40, 128)])
@pytest.mark.parametrize("eager", [True, False])
def test_heavy_map_prefetches_rows_ahead_on_eager_targets(m, n, eager):
    """A kernel without reductions whose pass does MAP_PREFETCH_OPS operations per vector or
    more (bias + gelu) prefetches its block inputs MAP_AHEAD_BYTES ahead on eager_prefetch
    targets (past the last row too: a prefetch never faults); a light one (an add) never
    does. Results as numpy's, the broadcast row input not prefetched."""
    import math
    eq = tpp.equation(m, n)
    x, bias = eq.input("x"), eq.input("b", bcast="row")
    heavy = eq.compile(eq.gelu(x + bias))
    eq2 = tpp.equation(m, n)
    light = eq2.compile(eq2.input("x") + eq2.input("b", bcast="row"))
    assert _schedule(heavy, eager_prefetch=eager).prefetching == eager
    assert not _schedule(light, eager_prefetch=eager).prefetching
    if _schedule(heavy).eager_prefetch:
        assert "prefetch" in heavy.dump("asm") and "prefetch" not in light.dump("asm")
    xa, ba = _rand(m, n), _rand(n)
    v = xa.astype(np.float64) + ba
    exact = 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))
    np.testing.assert_allclose(heavy(x=xa, b=ba), exact, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(light(x=xa, b=ba), v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m,n", [(3, 1024), (4, 1000), (5, 300), (9, 1024), (33, 517)])
def test_pipelined_rows_match_the_plain_schedule(m, n, monkeypatch):
    """Rows of a one-at-a-time rowwise kernel with a heavy pass (PIPE_OPS operations or more:
    a transcendental) run pipelined (pass 1 of row t beside pass 2 of row t - 1 and the
    outputs of row t - depth, rows more than depth + 1): bit for bit the results of the plain
    schedule, for one and two reduction levels, a kept exp, a row with a NaN, per-row outputs
    and a sum down the columns. A light kernel keeps the plain schedule."""
    import tpp_cpu.equation as gen
    from tpp.runtime import cache
    from tpp_cpu import backend
    # no disk cache: its keys do not know PIPELINE
    monkeypatch.setattr(backend, "_disk", lambda: cache.DiskCache(None))
    rng = np.random.default_rng(m * n)
    xa = rng.standard_normal((m, n)).astype(np.float32)
    wa = rng.standard_normal(n).astype(np.float32)
    xa[m // 2, n // 3] = np.nan

    def build():
        eq = tpp.equation(m, n)
        x = eq.input("x")
        e = eq.exp(x - eq.max(x, axis=1))
        sm = eq.compile(e / eq.sum(e, axis=1))
        mu = eq.mean(x, 1)
        xc = x - mu
        r = 1.0 / eq.sqrt(eq.mean(xc * xc, 1) + 1e-5)
        ln = eq.compile(eq.tanh(xc * r), rstd=r)
        light = eq.compile(xc * r)
        eq2 = tpp.equation(m, n)
        x2, w2 = eq2.input("x"), eq2.input("w", bcast="row")
        g = eq2.sum(x2 * x2, axis=1)
        one = eq2.compile(eq2.exp(-eq2.abs(x2 * w2 - g * x2)), dw=eq2.sum(x2 * w2, axis=0))
        return sm, ln, one, light

    def run(kernels):
        sm, ln, one, light = kernels
        out = ln(x=xa)
        return [sm(x=xa), out.out, out.rstd, *one(x=xa, w=wa), light(x=xa)]

    monkeypatch.setattr(gen, "PIPELINE", True)
    monkeypatch.setattr(gen, "PIPE_UNROLL", gen.UNROLL)     # the same sums, in the same order
    tpp.clear_caches()
    piped = build()
    long_rows = -(-n // 16) > 16        # (short rows go in groups instead)
    assert [_schedule(k).pipelining for k in piped] == [m >= 4 and long_rows] * 2 + [
        long_rows, False]
    got = run(piped)
    monkeypatch.setattr(gen, "PIPELINE", False)
    tpp.clear_caches()
    plain = build()
    assert not any(_schedule(k).pipelining for k in plain)
    want = run(plain)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    monkeypatch.setattr(gen, "PIPELINE", True)
    monkeypatch.setattr(gen, "PIPE_UNROLL", 1)      # the default: one accumulator per sum
    tpp.clear_caches()
    for a, b in zip(run(build()), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-6)
    tpp.clear_caches()


@pytest.mark.parametrize("m,n", [(2, 16), (5, 37), (9, 128), (64, 256)])
def test_short_rows_run_in_groups(m, n):
    """Short rows of a one-input rowwise kernel go ROW_GROUP at a time (each with its own
    accumulators; an odd last row alone); two-input kernels one at a time, and so do heavy
    ones (softmax's exp pass: pipelined instead, from 4 rows, its exp kept). Softmax and
    LayerNorm as numpy's."""
    import tpp_cpu.equation as gen
    eq = tpp.equation(m, n)
    x = eq.input("x")
    e = eq.exp(x - eq.max(x, axis=1))
    sm = eq.compile(e / eq.sum(e, axis=1), s=eq.sum(e, axis=1))
    ln = _layer_norm_eq(m, n)
    plan = _schedule(sm)
    assert plan.group == 1 and plan.kept and plan.pipelining == (m >= 4)
    from tpp_cpu.target import current
    short = -(-n // current().lanes) <= gen.GROUP_VECTORS     # 256 f32: 16 zmm, 32 ymm
    # one block input (g and b are rows): short rows go in groups
    assert _schedule(ln).group == (gen.ROW_GROUP if short else 1) and gen.ROW_GROUP == 2
    xa = _rand(m, n) * 3
    g, b = _rand(n), _rand(n)
    x64 = xa.astype(np.float64)
    mu = x64.mean(1, keepdims=True)
    rstd = 1 / np.sqrt(((x64 - mu) ** 2).mean(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ln(x=xa, g=g, b=b, eps=1e-5).out, (x64 - mu) * rstd * g + b,
                               rtol=2e-5, atol=2e-5)
    res = sm(x=xa)
    z = np.exp(xa.astype(np.float64) - xa.max(1, keepdims=True))
    np.testing.assert_allclose(res.out, z / z.sum(1, keepdims=True), rtol=3e-6, atol=1e-7)
    np.testing.assert_allclose(res.s, z.sum(1), rtol=3e-6)
    eq2 = tpp.equation(m, n)
    a, b = eq2.input("a"), eq2.input("b")
    two = eq2.compile(a * b - eq2.sum(a * b, axis=1))
    assert _schedule(two).group == 1


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_streaming_whole_vectors_or_pieces(dtype):
    """A streaming kernel stores whole vectors non-temporally where every block output is
    64-byte aligned, in 16-byte pieces where it is only 16-byte aligned: the same values."""
    m, n = 6, 64
    eq = tpp.equation(m, n)
    x = eq.input("x")
    k = eq.compile(x * 2.0 - eq.max(x, axis=1), dtypes={"out": dtype}, stream=True)
    if dtype == "f32":      # whatever this host runs, the AVX-512 code and the AVX2 code
        assert "vmovntps\t%zmm" in k.dump("asm", isa="avx512")
        assert "vmovntps\t%ymm" in k.dump("asm", isa="avx2")
    xa = _rand(m, n)
    want = xa * 2 - xa.max(1, keepdims=True)
    np_dt = np.float32 if dtype == "f32" else BF16.numpy
    for offset in (0, 16):
        buf = np.zeros(m * n * np.dtype(np_dt).itemsize + 128, np.uint8)
        start = -buf.ctypes.data % 64 + offset
        out = buf[start:start + m * n * np.dtype(np_dt).itemsize].view(np_dt).reshape(m, n)
        k(x=xa, out=out)
        np.testing.assert_allclose(out.astype(np.float32), want,
                                   rtol=1e-6 if dtype == "f32" else 1e-2, atol=1e-2)


def test_norm_outputs_are_64_byte_aligned():
    """ops.norms allocates large numpy outputs at 64-byte boundaries (whole-vector streaming)."""
    import ops.norms as N
    x = _rand(512, 1024)
    y = N.layer_norm(x)
    assert y.ctypes.data % 64 == 0 and y.shape == x.shape and y.flags.c_contiguous
    small = N.layer_norm(_rand(4, 16))
    assert small.shape == (4, 16)
