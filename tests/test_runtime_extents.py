"""Runtime extents: loop nests whose row count (or any size) is given at call time.

One compiled nest serves every M (checked by counting compilations through
tpp.cache_info()["compiled"]); remainders, M smaller than a block and M = 0 run inside it; the
bounds check runs per call for the sizes given (complete, O(calls)), and bad sizes are
ArgumentErrors. The operators (matmul, linear, MLP forward/backward, blocked helpers) compile
per weight shape, never per M.
"""
import numpy as np
import pytest
import torch

import ops
import tpp
from ops import blocked
from tpp.core.errors import ArgumentError, SpecError

MS = (1, 7, 63, 64, 65, 1000)


def _compiled():
    return tpp.cache_info()["compiled"]


def _relu_rows_nest(n=24):
    """y = relu(x) for x (M, n), with full blocks of 64 rows and the rest in 8- and 1-row
    pieces (ops.blocked.row_blocks), M a size."""
    m = tpp.size("M")
    loop, levels, cases = blocked.row_blocks(m, 64)
    nest = tpp.LoopNest("A" + "a" * (levels - 1), a=loop)
    r, = nest.vars
    x = nest.tensor("x", (m, n))
    y = nest.tensor("y", (m, n))
    for rows, guard in cases:
        nest.call(tpp.unary("relu", rows, n), x[r], y[r], when=guard(r))
    return nest.compile()


def test_one_nest_every_m_against_numpy():
    nest = _relu_rows_nest()
    before = _compiled()
    rng = np.random.default_rng(0)
    for m in MS + (0, 2, 130):
        x = rng.standard_normal((m, 24)).astype(np.float32)
        y = np.full_like(x, np.nan)
        nest(x, y)
        np.testing.assert_array_equal(y, np.maximum(x, 0))
        nest(x, y, threads=2)                       # the parallel split at run time
        np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert _compiled() == before


def test_m_zero_runs_nothing_and_small_m():
    nest = _relu_rows_nest()
    x = np.zeros((0, 24), np.float32)
    nest(x, np.zeros((0, 24), np.float32))
    x = np.arange(3 * 24, dtype=np.float32).reshape(3, 24) - 30
    y = np.full((5, 24), 7.0, np.float32)
    nest(x, y[:3])                                   # a view of the first rows: rows 3, 4 kept
    np.testing.assert_array_equal(y[:3], np.maximum(x, 0))
    assert (y[3:] == 7).all()


def test_explicit_size_and_brgemm_count():
    """A size no dimension gives is a keyword; a BRGEMM count may be a size expression."""
    n_size = tpp.size("N")
    nest = tpp.LoopNest("a", a=1)
    a_t = nest.tensor("A", (64, 16))                 # up to 64 pairs of (1 x 1) @ (1 x 16)
    ones = nest.tensor("ones", (64,))
    out = nest.tensor("out", (16,))
    mm = tpp.make_brgemm(1, 16, 1, lda=1, ldb=16, ldc=16)
    nest.call(mm, ones[0], a_t[0, 0], out[0], count=n_size, stride_a=1, stride_b=16)
    f = nest.compile()
    a = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    o = np.empty(16, np.float32)
    for n in (0, 1, 5, 64):
        f(a, np.ones(64, np.float32), o, N=n)
        np.testing.assert_allclose(o, a[:n].sum(axis=0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ArgumentError, match="size N is not given"):
        f(a, np.ones(64, np.float32), o)
    with pytest.raises(ArgumentError, match=r"with N=65: call brgemm argument 0: tensor 'ones'"):
        f(a, np.ones(64, np.float32), o, N=65)      # 65 pairs read past both tensors
    with pytest.raises(ArgumentError, match="size N must be >= 0"):
        f(a, np.ones(64, np.float32), o, N=-1)
    with pytest.raises(ArgumentError, match="size N must be <= "):
        f(a, np.ones(64, np.float32), o, N=2 ** 64)


def test_bad_runtime_extents():
    m = tpp.size("M")
    nest = tpp.LoopNest("A", a=m + 1)                # one iteration too many for x and y
    a, = nest.vars
    x = nest.tensor("x", (m, 8))
    y = nest.tensor("y", (m, 8))
    nest.call(tpp.unary("relu", 1, 8), x[a], y[a])
    f = nest.compile()                               # nothing to check until M is known
    with pytest.raises(ArgumentError, match=r"with M=3: call relu argument 0: tensor 'x' "
                                            r"\(3, 8\) holds 24 elements.*\[0, 32\)"):
        f(np.zeros((3, 8), np.float32), np.zeros((3, 8), np.float32))
    with pytest.raises(ArgumentError, match="conflicting sizes"):
        f(np.zeros((3, 8), np.float32), np.zeros((4, 8), np.float32))
    with pytest.raises(ArgumentError, match="conflicting sizes"):
        f(np.zeros((3, 8), np.float32), np.zeros((3, 8), np.float32), M=4)
    with pytest.raises(ArgumentError, match=r"x: expected shape \(3, 8\), got \(3, 9\)"):
        f(np.zeros((3, 9), np.float32), np.zeros((3, 8), np.float32))
    with pytest.raises(ArgumentError, match=r"expected shape \(M, 8\)"):
        f(np.zeros(24, np.float32), np.zeros((3, 8), np.float32))
    # a dimension that a size expression makes negative; int64 overflow of an expression
    nest = tpp.LoopNest("a", a=1)
    x = nest.tensor("x", (m - 4, 8))
    nest.call(tpp.unary("relu", 1, 8), x[0], x[0])
    with pytest.raises(ArgumentError, match="negative"):
        nest.compile()(np.zeros((0, 8), np.float32), M=3)
    nest = tpp.LoopNest("a", a=1)
    x = nest.tensor("x", (1, 8))
    nest.call(tpp.unary("relu", 1, 8), x[0], x[0], when=(m * 2 ** 20 > 0))
    f = nest.compile()
    f(np.zeros((1, 8), np.float32), M=5)
    with pytest.raises(ArgumentError, match="int64"):
        f(np.zeros((1, 8), np.float32), M=2 ** 46)
    with pytest.raises(ArgumentError, match="loop a stops at"):
        g = tpp.LoopNest("a", a=m * 2 ** 10)
        g.call(tpp.unary("relu", 1, 8), g.tensor("z", (1, 8))[0], g.tensor("w", (1, 8))[0])
        g.compile()(np.zeros((1, 8), np.float32), np.zeros((1, 8), np.float32), M=2 ** 40)


def test_size_spec_errors():
    m = tpp.size("M")
    with pytest.raises(SpecError, match="identifier"):
        tpp.size("threads")
    with pytest.raises(SpecError, match="not of loop variables"):
        tpp.Loop(0, tpp.LoopNest("a", a=4).vars[0])
    nest = tpp.LoopNest("A", a=m)
    a, = nest.vars
    with pytest.raises(SpecError, match="affine"):
        nest.tensor("x", (m, 8))[a * m]
    x = nest.tensor("M", (m, 8))
    nest.call(tpp.unary("relu", 1, 8), x[a, 0], x[a, 0])
    with pytest.raises(SpecError, match="names both a size and a tensor"):
        nest.compile()


def test_a_second_m_compiles_nothing_and_cache_keeps_nests(tmp_path):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((70, 50)).astype(np.float32)
    b = rng.standard_normal(70).astype(np.float32)
    pw = ops.pack_nk(w)
    ops.linear(rng.standard_normal((3, 50)).astype(np.float32), pw, b, "relu")
    before = _compiled()
    for m in MS + (0,):
        x = rng.standard_normal((m, 50)).astype(np.float32)
        y = ops.linear(x, pw, b, "relu")
        assert y.shape == (m, 70)
        np.testing.assert_allclose(y, np.maximum(x @ w.T + b, 0), rtol=1e-4, atol=1e-4)
    assert _compiled() == before
    assert tpp.cache_info()["matmul_plans"] >= 1


def test_linear_3d_batch_and_sequence_reuse_one_nest():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 30)).astype(np.float32)
    pw = ops.pack_nk(w)
    ops.linear(np.zeros((1, 30), np.float32), pw)
    before = _compiled()
    for lead in ((2, 5), (3, 17), (1, 1), (4, 0), (2, 3, 11)):
        x = rng.standard_normal(lead + (30,)).astype(np.float32)
        y = ops.linear(x, pw)
        assert y.shape == lead + (40,)
        np.testing.assert_allclose(y, x @ w.T, rtol=1e-4, atol=1e-4)
    xt = torch.randn(3, 9, 30)
    np.testing.assert_allclose(ops.linear(xt, pw).numpy(), (xt.numpy() @ w.T),
                               rtol=1e-4, atol=1e-4)
    assert _compiled() == before


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_matmul_several_m_one_compile(dtype):
    rng = np.random.default_rng(4)
    npdt = tpp.core.dtypes.lookup(dtype).numpy
    b = rng.standard_normal((45, 33)).astype(np.float32).astype(npdt)
    pb = ops.pack_kn(b)
    ops.matmul(np.zeros((2, 45), npdt), pb)
    before = _compiled()
    for m in (1, 9, 64, 77):
        a = rng.standard_normal((m, 45)).astype(np.float32).astype(npdt)
        y = ops.matmul(a, pb)
        want = a.astype(np.float64) @ b.astype(np.float64)
        tol = 1e-4 if dtype == "f32" else 3e-2
        np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol * 10)
    assert _compiled() == before


def test_mlp_forward_backward_several_m_one_compile():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((36, 20)).astype(np.float32)
    b = rng.standard_normal(36).astype(np.float32)
    for m in (1, 65):   # dw has two nests: under 64 rows rank-1 steps, else a packed GEMM
        y, saved = ops.mlp_forward(np.zeros((m, 20), np.float32), w, b, "gelu")
        ops.mlp_backward(np.zeros_like(y), saved)
    before = _compiled()
    for m in (0, 1, 7, 65, 130, 200):
        x = rng.standard_normal((m, 20)).astype(np.float32)
        y, saved = ops.mlp_forward(x, w, b, "gelu")
        dy = rng.standard_normal(y.shape).astype(np.float32)
        dx, dw, db = ops.mlp_backward(dy, saved)
        xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
        bt = torch.tensor(b, dtype=torch.float64, requires_grad=True)
        yt = torch.nn.functional.gelu(torch.nn.functional.linear(xt, wt, bt))
        yt.backward(torch.tensor(dy, dtype=torch.float64))
        np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dw, wt.grad.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(db, bt.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert _compiled() == before


def test_blocked_helpers_several_m_one_compile():
    rng = np.random.default_rng(6)
    for m in (3, 70):          # the first M compiles, the second reuses
        z = rng.standard_normal((m, 40)).astype(np.float32)
        blocked.map_rows("relu", [z], np.empty_like(z))
        blocked.column_sums(z, np.empty(40, np.float32))
        if m == 3:
            before = _compiled()
    assert _compiled() == before
    z = rng.standard_normal((129, 40)).astype(np.float32)
    out = blocked.map_rows("gelu", [z], np.empty_like(z))
    np.testing.assert_allclose(out, torch.nn.functional.gelu(torch.from_numpy(z)).numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(blocked.column_sums(z, np.empty(40, np.float32)),
                               z.sum(axis=0), rtol=1e-5, atol=1e-5)
    assert blocked.column_sums(z[:0], np.full(40, 9.0, np.float32)).tolist() == [0.0] * 40


def test_generated_nest_keeps_compile_time_kernels():
    """The kernels a nest with sizes calls are the fixed-shape ones (their asm does not depend
    on the sizes); the nest IR reads the sizes from its table."""
    nest = _relu_rows_nest()
    kernels = nest.spec.kernel_specs()
    assert sorted(k.m for k in kernels) == [1, 8, 64]
    assert "call void" in nest.dump("ir")
    mm = tpp.make_brgemm(64, 64, 64, lda=64, ldb=64, ldc=64)
    assert "vfmadd" in tpp.kernel(mm).dump("asm")


def _dropout_nest():
    """x (M, 16) -> y and its keep mask (M, 2) u8 by a dropout TPP per row, seeded with the
    size S + row (a size only seeds use)."""
    M, S = tpp.size("M"), tpp.size("S")
    nest = tpp.LoopNest("a", a=M)
    x, y = nest.tensor("x", (M, 16)), nest.tensor("y", (M, 16))
    mask = nest.tensor("mask", (M, 2), "u8")
    a, = nest.vars
    nest.call(tpp.unary("dropout", 1, 16, p=0.5), x[a], y[a], mask[a], seed=S + a)
    return nest.compile()


def test_a_size_only_seeds_use_does_not_redo_the_bounds_check(monkeypatch):
    """A per-call seed passed as a size moves no address: a new seed value needs no new
    bounds check; a size that also moves an address still does."""
    import tpp.runtime.loops as loops
    M, S = tpp.size("M"), tpp.size("S")
    run = _dropout_nest()
    assert run._seed_only == {"S"}
    calls = []
    real = loops.loop_bounds.check
    monkeypatch.setattr(loops.loop_bounds, "check",
                        lambda *args: (calls.append(args), real(*args))[1])
    xa = np.ones((3, 16), np.float32)
    outs = []
    for seed in (1, 2, 3):
        ya, m = np.zeros_like(xa), np.zeros((3, 2), np.uint8)
        run(xa, ya, m, S=seed)
        outs.append(m.copy())
    assert len(calls) == 1
    assert not all(np.array_equal(outs[0], o) for o in outs[1:])   # the seed still arrives
    run(np.ones((4, 16), np.float32), np.zeros((4, 16), np.float32),
        np.zeros((4, 2), np.uint8), S=1)
    assert len(calls) == 2                                          # a new M is checked
    both = tpp.LoopNest("a", a=M)
    xs, ys = both.tensor("x", (M, 16)), both.tensor("y", (M, 16))
    ms = both.tensor("mask", (M, 2), "u8")
    b, = both.vars
    both.call(tpp.unary("dropout", 1, 16, p=0.5), xs[b], ys[b], ms[b], seed=S + b,
              when=(b < S))
    assert both.compile()._seed_only == frozenset()


def test_seed_sizes_ride_the_fast_path(monkeypatch):
    """A nest whose only keyword sizes are seeds (SEEDLO-style: no tensor gives them, only
    seeds use them) takes the fast path once a checked call has seen its shapes: each call's
    seed arrives (equal seeds, equal masks; another seed, another mask, as the checked path
    gives them), and a call without its seed, with an extra keyword or a seed that is not a
    plain int in range still goes the checked way and fails or runs as before."""
    import tpp.runtime.loops as loops
    run = _dropout_nest()
    checked = []
    real = loops.CompiledNest._checked_call
    monkeypatch.setattr(loops.CompiledNest, "_checked_call",
                        lambda self, *args: (checked.append(args), real(self, *args))[1])
    xa = np.ones((5, 16), np.float32)

    def masks(seed, **extra):
        ya, m = np.zeros_like(xa), np.zeros((5, 2), np.uint8)
        run(xa, ya, m, S=seed, **extra)
        return m

    first = masks(7)                                   # checked: remembers the shapes
    assert len(checked) == 1
    got = {seed: masks(seed) for seed in (7, 8, 7 + 2 ** 40)}
    assert len(checked) == 1                           # all three on the fast path
    np.testing.assert_array_equal(got[7], first)
    assert not np.array_equal(got[7], got[8]) and not np.array_equal(got[8], got[7 + 2 ** 40])
    for seed, m in got.items():                        # the masks the checked path makes
        ya, ref = np.zeros_like(xa), np.zeros((5, 2), np.uint8)
        real(run, (xa, ya, ref), None, {"S": seed})
        np.testing.assert_array_equal(m, ref)
    with pytest.raises(ArgumentError, match="size S"):
        run(xa, np.zeros_like(xa), np.zeros((5, 2), np.uint8))
    with pytest.raises(ArgumentError):
        masks(-1)
    with pytest.raises(ArgumentError):
        masks(7, T=1)
    np.testing.assert_array_equal(masks(np.int64(8)), got[8])     # checked, same answer
    assert len(checked) == 5
