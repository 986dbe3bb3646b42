"""Loop nests (tpp.LoopNest): iteration semantics, guards, bounds checks, threads, bad input.

Which iterations run is observed through the nest itself: a body calling the `increment`
unary in place on counts[values] leaves at each index the number of visits. `_walk` is an
independent model of the order string (tpp.core.loop_spec semantics), against which the counts,
and for sequential nests the visiting order, are compared. Parallel nests run on 1, 2 and 3
threads (more threads than cores; counts that do not divide the work); every test restores
the environment's thread count.
"""
import os

import numpy as np
import pytest

import tpp
from tpp import Loop
from tpp.runtime.loops import compiled

INC = tpp.unary("increment", 1, 1)
COPY = tpp.unary("identity", 1, 1)
THREADS = (1, 2, 3)


def _walk(order, loops, k=0, vals=None):
    """The loop values the body sees, in sequential execution order (a model of the spec)."""
    vals = {} if vals is None else vals
    if k == len(order):
        yield vals
        return
    letter = order[k].lower()
    lp = Loop.of(loops[letter])
    level = order[:k].lower().count(letter)
    sizes = tuple(lp.blocks) + (lp.step,)
    lo = lp.start if level == 0 else vals[letter]
    hi = lp.stop if level == 0 else min(lo + sizes[level - 1], lp.stop)
    for v in range(lo, hi, sizes[level]):
        yield from _walk(order, loops, k + 1, {**vals, letter: v})


def _shape(loops):
    return tuple(Loop.of(v).stop for v in loops.values())


def _expected_counts(order, loops, keep=lambda v: True):
    want = np.zeros(_shape(loops), np.float32)
    for vals in _walk(order, loops):
        if keep(vals):
            want[tuple(vals[ch] for ch in sorted(vals))] += 1
    return want


def _counts(order, loops, threads=1):
    """Run a nest incrementing counts[values] per iteration; return the counts."""
    nest = tpp.LoopNest(order, **loops)
    n = nest.tensor("n", _shape(loops))
    nest.call(INC, n[nest.vars], n[nest.vars])
    tpp.set_num_threads(threads)
    out = np.zeros(_shape(loops), np.float32)
    nest.compile()(n=out)
    return out


# ---------------------------------------------------------------- blocked GEMM
def _gemm_nest(order, step, count=None, Mb=3, Nb=2, Kb=4, bm=8, bn=8, bk=8):
    nest = tpp.LoopNest(order, a=(0, Kb, step), b=Mb, c=Nb)
    a, b, c = nest.vars
    A = nest.tensor("A", (Mb, Kb, bm, bk))
    B = nest.tensor("B", (Nb, Kb, bk, bn))
    C = nest.tensor("C", (Nb, Mb, bm, bn))
    nest.call(tpp.unary("zero", bm, bn), C[c, b], when=(a == 0))
    nest.call(tpp.brgemm(bm, bn, bk, beta=1), A[b, a], B[c, a], C[c, b], count=count or step,
              stride_a=bm * bk, stride_b=bk * bn)
    return nest


def _gemm_data(rng, Mb=3, Nb=2, Kb=4, bm=8, bn=8, bk=8):
    A = rng.standard_normal((Mb, Kb, bm, bk)).astype(np.float32)
    B = rng.standard_normal((Nb, Kb, bk, bn)).astype(np.float32)
    return A, B, np.einsum("mkij,nkjl->nmil", A.astype(np.float64), B.astype(np.float64))


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("order", ["aBC", "aCB", "BCa", "bCa", "abc"])
def test_blocked_gemm(order, step):
    """C (zeroed at a == 0, NaN before) = sum over k blocks of A @ B, for the reduction loop
    outermost (threads meet at a barrier per k step), innermost, and a band in the middle;
    with a step of 2 (BRGEMM count=2) the zero guard still fires at a == 0."""
    gemm = _gemm_nest(order, step).compile()
    A, B, want = _gemm_data(np.random.default_rng(len(order) * 10 + step))
    A.flags.writeable = False               # read-only inputs are fine
    for threads in THREADS:
        tpp.set_num_threads(threads)
        C = np.full(want.shape, np.nan, np.float32)
        gemm(A=A, B=B, C=C)
        np.testing.assert_allclose(C, want, rtol=1e-5, atol=1e-5, err_msg=f"{threads} threads")
        C2 = np.full(want.shape, np.nan, np.float32)
        gemm(A, B, C=C2)                    # positions (declaration order) and names: bind()
        np.testing.assert_array_equal(C2, C)


def test_brgemm_bias_epilogue_in_a_band():
    """A BRGEMM with bias and relu called once per (b, c) over all k blocks (count = Kb)."""
    Mb, Nb, Kb, bm, bn, bk = 2, 3, 3, 4, 8, 8
    nest = tpp.LoopNest("AB", a=Mb, b=Nb)
    b, c = nest.vars
    A, B, C, bias = (nest.tensor(*t) for t in [("A", (Mb, Kb, bm, bk)), ("B", (Nb, Kb, bk, bn)),
                                               ("C", (Nb, Mb, bm, bn)), ("bias", (Nb, bn))])
    nest.call(tpp.brgemm(bm, bn, bk, bias="row", activation="relu"), A[b, 0], B[c, 0], C[c, b],
              bias=bias[c], count=Kb, stride_a=bm * bk, stride_b=bk * bn)
    rng = np.random.default_rng(7)
    a_v, b_v, prod = _gemm_data(rng, Mb, Nb, Kb, bm, bn, bk)
    bias_v = rng.standard_normal((Nb, bn)).astype(np.float32)
    want = np.maximum(prod + bias_v[:, None, None, :], 0)
    for threads in THREADS:
        tpp.set_num_threads(threads)
        out = np.full(want.shape, np.nan, np.float32)
        nest.compile()(a_v, b_v, out, bias_v)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- which iterations run
L4, L62 = Loop(0, 10, 1, (4,)), Loop(1, 12, 1, (6, 2))   # ragged: 10 % 4, 11 % 6 != 0
BLOCKED = [
    ("aa", dict(a=L4)), ("AA", dict(a=L4)),      # a band of two levels of one loop
    ("aA", dict(a=L4)),                          # band inside its own outer level
    ("aaa", dict(a=L62)), ("AAa", dict(a=L62)), ("aAA", dict(a=L62)),   # three levels
    ("bBa", dict(a=5, b=L4)),
    ("ABA", dict(a=L4, b=3)), ("aBa", dict(a=L4, b=3)),   # another loop between two levels
    ("aBAb", dict(a=Loop(2, 13, 1, (4,)), b=Loop(1, 9, 2, (4,)))),
    ("abAB", dict(a=Loop(2, 13, 1, (4,)), b=Loop(1, 9, 2, (4,)))),
    ("aAa", dict(a=Loop(0, 23, 2, (12, 4)))),
    ("aBC", dict(a=2, b=3, c=(1, 5))), ("abC", dict(a=2, b=3, c=2)),
]


@pytest.mark.parametrize("order,loops", BLOCKED, ids=[o for o, _ in BLOCKED])
def test_every_iteration_runs_once(order, loops):
    """Every point of the iteration space is visited exactly once, nothing else is touched,
    sequential or parallel (bands of one or more levels, at or below the outermost level)."""
    want = _expected_counts(order, loops)
    assert want.max() == 1 and want.sum() == np.prod(
        [len(range(lp.start, lp.stop, lp.step)) for lp in map(Loop.of, loops.values())])
    for threads in THREADS:
        got = _counts(order, loops, threads)
        assert np.array_equal(got, want), f"{threads} threads: visited {np.argwhere(got != want)}"


@pytest.mark.parametrize("order,loops", [
    ("aa", dict(a=L4)), ("bab", dict(a=3, b=L4)), ("aba", dict(a=Loop(1, 12, 1, (6,)), b=(2, 4))),
    ("aaba", dict(a=L62, b=2))])
def test_sequential_visiting_order(order, loops):
    """Without a parallel band the body runs in the order string's order: a clock tensor is
    incremented per iteration and copied to rec[values], giving each index its visit number."""
    nest = tpp.LoopNest(order, **loops)
    clock = nest.tensor("clock", (1,))
    rec = nest.tensor("rec", _shape(loops))
    nest.call(INC, clock[0], clock[0])
    nest.call(COPY, clock[0], rec[nest.vars])
    out = np.zeros(_shape(loops), np.float32)
    t = np.zeros(1, np.float32)
    nest.compile()(clock=t, rec=out)
    want = np.zeros_like(out)
    for i, vals in enumerate(_walk(order, loops)):
        want[tuple(vals[ch] for ch in sorted(vals))] = i + 1
    assert t[0] == i + 1
    np.testing.assert_array_equal(out, want)


def test_threads_meet_after_each_pass_over_the_band():
    """With a sequential loop outside the band, pass a + 1 reads what other threads wrote in
    pass a (X[a+1, j] = X[a, j-1] + X[a, j+1], both neighbours): the result matches the
    sequential one only if threads wait for each other (without the barrier this fails
    on 2 and 3 threads)."""
    K, N = 64, 12
    nest = tpp.LoopNest("aB", a=K, b=N)
    a, b = nest.vars
    X = nest.tensor("X", (K + 1, N + 2))
    nest.call(tpp.binary("add", 1, 1), X[a, b], X[a, b + 2], X[a + 1, b + 1])
    x0 = np.zeros((K + 1, N + 2), np.float32)
    x0[0] = np.arange(1, N + 3)
    want = x0.copy()
    for k in range(K):
        want[k + 1, 1:N + 1] = want[k, :N] + want[k, 2:]
    for threads in THREADS:
        tpp.set_num_threads(threads)
        for _ in range(3):
            x = x0.copy()
            nest.compile()(X=x)
            np.testing.assert_array_equal(x, want, err_msg=f"{threads} threads")


@pytest.mark.parametrize("order,loop", [
    ("a", Loop(2, 11, 3)), ("A", Loop(2, 11, 3)), ("a", (2, 11, 3)), ("a", 7), ("A", (3, 8)),
    ("aa", Loop(2, 11, 3, (6,))), ("AA", (2, 20, 3, (9,))), ("aA", Loop(2, 20, 3, (9,))),
])
def test_start_and_step(order, loop):
    """The body sees exactly range(start, stop, step), whatever the blocking and threads."""
    lp = Loop.of(loop)
    want = np.zeros(lp.stop, np.float32)
    want[list(range(lp.start, lp.stop, lp.step))] = 1
    for threads in THREADS:
        np.testing.assert_array_equal(_counts(order, {"a": loop}, threads), want)


# ---------------------------------------------------------------- guards
GUARDS = {  # name: conditions of a, b; the same lambda on ints says where they hold
    "a==3": lambda a, b: a == 3, "a!=3": lambda a, b: a != 3, "a<3": lambda a, b: a < 3,
    "a<=3": lambda a, b: a <= 3, "a>3": lambda a, b: a > 3, "a>=3": lambda a, b: a >= 3,
    "2<b (reflected)": lambda a, b: 2 < b, "tuple": lambda a, b: (a >= 1, a < 4, b != 2),
    "list": lambda a, b: [a > 0, b < 3], "a-b==0": lambda a, b: a - b == 0,
    "a+b<=4": lambda a, b: a + b <= 4, "2a-b>1": lambda a, b: 2 * a - b > 1,
    "5-a>b, b!=0": lambda a, b: (5 - a > b, b != 0), "never": lambda a, b: a > 9,
}


def _holds(result):
    return all(result) if isinstance(result, (tuple, list)) else result


@pytest.mark.parametrize("order", ["ab", "AB", "bA"])
def test_guards(order):
    """Each call runs exactly where all of its conditions hold: one nest whose body has one
    guarded call per case, each incrementing its own counts plane."""
    loops = dict(a=6, b=5)
    nest = tpp.LoopNest(order, **loops)
    a, b = nest.vars
    n = nest.tensor("n", (len(GUARDS), 6, 5))
    for k, cond in enumerate(GUARDS.values()):
        nest.call(INC, n[k, a, b], n[k, a, b], when=cond(a, b))
    for threads in THREADS:
        tpp.set_num_threads(threads)
        out = np.zeros((len(GUARDS), 6, 5), np.float32)
        nest.compile()(n=out)
        for k, (name, cond) in enumerate(GUARDS.items()):
            want = _expected_counts(order, loops, lambda v: _holds(cond(v["a"], v["b"])))
            assert want.any() or name == "never"
            np.testing.assert_array_equal(out[k], want, err_msg=f"{name}, {threads} threads")


# ---------------------------------------------------------------- bounds
def _one_call(shape, address, loops=None, when=(), kernel=INC):
    loops = loops or dict(a=6)
    nest = tpp.LoopNest("".join(loops), **loops)
    X = nest.tensor("X", shape)
    addr = address(X, *nest.vars)
    nest.call(kernel, *([addr] * len(kernel.spec.operands())),
              when=when(*nest.vars) if callable(when) else when)
    return nest


BOUNDS = {  # name: (shape, address, loops (default a=6), when, accepted)
    "last element": ((6,), lambda X, a: X[a], None, (), True),
    "one past the end": ((5,), lambda X, a: X[a], None, (), False),
    "step: last value 8": ((9,), lambda X, a: X[a], dict(a=(2, 11, 3)), (), True),
    "step: past the end": ((8,), lambda X, a: X[a], dict(a=(2, 11, 3)), (), False),
    "before the start": ((6,), lambda X, a: X.at(a - 1), None, (), False),
    "a>=1 guard": ((6,), lambda X, a: X.at(a - 1), None, lambda a: a >= 1, True),
    "0<a guard": ((6,), lambda X, a: X.at(a - 1), None, lambda a: 0 < a, True),
    "a<4 guard": ((4,), lambda X, a: X[a], None, lambda a: a < 4, True),
    "a<=4 guard": ((4,), lambda X, a: X[a], None, lambda a: a <= 4, False),
    "two guards": ((4,), lambda X, a: X[a], None, lambda a: (a >= 1, a - 3 <= 0), True),
    "5-a>2 (a<3)": ((3,), lambda X, a: X[a], None, lambda a: 5 - a > 2, True),
    "5-a<2 (a>3)": ((3,), lambda X, a: X[a], None, lambda a: 5 - a < 2, False),
    "-a==-2": ((3,), lambda X, a: X[a], None, lambda a: -a == -2, True),
    "never runs": ((3,), lambda X, a: X[a], None, lambda a: a > 9, True),
    "!= narrows nothing": ((3,), lambda X, a: X[a], None, lambda a: a != 5, False),
    "2-D fits": ((3, 5), lambda X, a, b: X[a, b], dict(a=3, b=5), (), True),
    "2-D b+1": ((3, 5), lambda X, a, b: X[a, b + 1], dict(a=3, b=5), (), False),
    "2-D swapped": ((3, 5), lambda X, a, b: X[b, a], dict(a=3, b=5), (), False),
}


@pytest.mark.parametrize("shape,address,loops,when,ok", BOUNDS.values(), ids=BOUNDS.keys())
def test_bounds_checked_at_build_time(shape, address, loops, when, ok):
    """spec() and compile() reject a call that may touch an element outside its tensor; a
    guard narrowing one variable's range (coefficient +-1) lets a call that fits through."""
    nest = _one_call(shape, address, loops, when)
    if ok:
        nest.compile()(X=np.zeros(shape, np.float32))
    else:
        with pytest.raises(tpp.SpecError, match="may touch elements"):
            nest.spec()
        with pytest.raises(tpp.SpecError, match="may touch elements"):
            nest.compile()


def test_block_operand_and_brgemm_batch_extents():
    """A (2, 3) block with ld 5 spans 8 elements; a BRGEMM reads count blocks at its stride."""
    blk = tpp.unary("identity", 2, 3, ldi=5, ldo=5)
    _one_call((4, 5), lambda X, a, b: X[a, b], dict(a=3, b=3), kernel=blk).compile()
    with pytest.raises(tpp.SpecError, match=r"\[0, 21\)"):
        _one_call((4, 5), lambda X, a, b: X[a, b], dict(a=3, b=4), kernel=blk).spec()
    _gemm_nest("aBC", 2).spec()                         # a in (0, 2), count 2: fits
    with pytest.raises(tpp.SpecError, match="argument 0: tensor 'A'"):
        _gemm_nest("aBC", 1, count=2).compile()         # a = 3 with count 2: past the end


# ---------------------------------------------------------------- bad input
def _bad(build):
    """A callable building a one-loop nest over X (4,) with `build`, then its spec."""
    def run():
        nest = tpp.LoopNest("a", a=4)
        build(nest, nest.vars[0], nest.tensor("X", (4,)))
        nest.spec()
    return run


S, BLK4, BRG = tpp.SpecError, Loop(0, 8, 1, (4,)), dict(count=1, stride_a=0, stride_b=0)
BUILD_ERRORS = {  # name: (callable, error, message)
    "unknown letter": (lambda: tpp.LoopNest("abd", a=2, b=2), S, "names no loop"),
    "empty order": (lambda: tpp.LoopNest("", a=2), S, "non-empty"),
    "blocked once": (lambda: tpp.LoopNest("ab", a=BLK4, b=2), S, "must appear 2 times, got 1"),
    "blocked thrice": (lambda: tpp.LoopNest("aaa", a=BLK4), S, "must appear 2 times, got 3"),
    "unblocked twice": (lambda: tpp.LoopNest("aab", a=2, b=2), S, "must appear 1 times, got 2"),
    "loop missing": (lambda: tpp.LoopNest("a", a=2, b=2), S, "got 0"),
    "parallel apart": (lambda: tpp.LoopNest("AbC", a=2, b=2, c=2), S, "adjacent"),
    "parallel apart, one loop": (lambda: tpp.LoopNest("AbA", a=BLK4, b=2), S, "adjacent"),
    "empty range": (lambda: Loop(3, 3), S, "empty"),
    "reversed range": (lambda: tpp.LoopNest("a", a=(5, 2)), S, "empty"),
    "zero trips": (lambda: tpp.LoopNest("a", a=0), S, "empty"),
    "step 0": (lambda: Loop(0, 4, 0), S, "step must be >= 1"),
    "step -1": (lambda: tpp.LoopNest("a", a=(4, 0, -1)), S, "step must be >= 1"),
    "block % step": (lambda: Loop(0, 10, 2, (5,)), S, "not a multiple"),
    "blocks grow": (lambda: Loop(0, 10, 1, (4, 8)), S, "not a multiple"),
    "block 0": (lambda: Loop(0, 10, 1, (0,)), S, "positive ints"),
    "float stop": (lambda: Loop(0, 4.0), S, "must be an int"),
    "bad loop value": (lambda: tpp.LoopNest("a", a="4"), S, "a loop is"),
    "keyword skipped": (lambda: tpp.LoopNest("ab", a=2, c=2), S, "keywords a, b"),
    "keywords reordered": (lambda: tpp.LoopNest("ab", b=2, a=2), S, "keywords"),
    "condition as bool": (_bad(lambda n, a, X: 1 if a == 0 else 0), S, "no truth value"),
    "var * var": (_bad(lambda n, a, X: X.at(a * a)), S, "affine"),
    "var * float": (_bad(lambda n, a, X: X.at(a * 1.5)), S, "affine"),
    "too many indices": (_bad(lambda n, a, X: X[a, 0]), S, "1 dimensions"),
    "operand count": (_bad(lambda n, a, X: n.call(INC, X[a])), S, "takes 2 operands"),
    "not an address": (_bad(lambda n, a, X: n.call(INC, X[a], 3)), S, "tensor addresses"),
    "not a primitive": (_bad(lambda n, a, X: n.call(np.add, X[a], X[a])), S, "tpp primitives"),
    "when=True": (_bad(lambda n, a, X: n.call(INC, X[a], X[a], when=True)), S, "when= takes"),
    "dtype mismatch": (_bad(lambda n, a, X: n.call(INC, n.tensor("Y", (4,), "bf16")[a], X[a])),
                       S, "operand 0 is f32, tensor 'Y' is bf16"),
    "seed missing": (_bad(lambda n, a, X: n.call(tpp.unary("dropout", 1, 1), X[a], X[a], X[a])),
                     S, "needs seed="),
    "brgemm offset batch": (_bad(lambda n, a, X: n.call(tpp.brgemm(1, 1, 1, batch="offset"),
                                                        X[a], X[a], X[a])),
                            tpp.UnsupportedError, "stride batch"),
    "brgemm bias missing": (_bad(lambda n, a, X: n.call(tpp.brgemm(1, 1, 1, bias="row"),
                                                        X[a], X[a], X[a], **BRG)), S, "pass bias="),
    "brgemm bias unexpected": (_bad(lambda n, a, X: n.call(tpp.brgemm(1, 1, 1), X[a], X[a], X[a],
                                                           bias=X[a], **BRG)), S, "pass bias="),
    "brgemm two operands": (_bad(lambda n, a, X: n.call(tpp.brgemm(1, 1, 1), X[a], X[a])), S,
                            "a, b, c"),
    "brgemm count < 0": (_bad(lambda n, a, X: n.call(tpp.brgemm(1, 1, 1), X[a], X[a], X[a],
                                                     count=-1)), S, "count must be"),
    "empty body": (_bad(lambda n, a, X: None), S, "calls nothing"),
    "tensor twice": (_bad(lambda n, a, X: n.tensor("X", (2,))), S, "declared twice"),
    "tensor bad shape": (_bad(lambda n, a, X: n.tensor("Z", (2, 0))), S, "positive ints"),
}


@pytest.mark.parametrize("case", BUILD_ERRORS.values(), ids=BUILD_ERRORS.keys())
def test_bad_nest_raises(case):
    build, error, message = case
    with pytest.raises(error, match=message):
        build()


def _counts_nest():
    nest = tpp.LoopNest("aB", a=2, b=3)
    a, b = nest.vars
    src, dst = nest.tensor("src", (2, 3)), nest.tensor("dst", (2, 3))
    nest.call(INC, src[a, b], dst[a, b])
    return nest.compile()


def _ro(arr):
    arr.flags.writeable = False
    return arr


Z = np.zeros((2, 3), np.float32)
CALL_ERRORS = {  # name: (args, kwargs, message)
    "missing tensor": ((Z,), {}, "missing array for tensor 'dst'"),
    "unknown tensor": ((Z, Z.copy()), {"out": Z}, "no tensor 'out'"),
    "given twice": ((Z, Z.copy()), {"src": Z}, "given twice"),
    "too many positional": ((Z, Z.copy(), Z), {}, "takes 2 arrays"),
    "wrong shape": ((Z, np.zeros((3, 2), np.float32)), {}, r"expected shape \(2, 3\)"),
    "flat": ((Z.ravel(), Z.copy()), {}, "expected shape"),
    "wrong dtype": ((Z, np.zeros((2, 3))), {}, "dst: expected f32"),
    "non-contiguous": ((np.zeros((2, 6), np.float32)[:, ::2], Z.copy()), {}, "C-contiguous"),
    "Fortran order": ((np.asfortranarray(Z), Z.copy()), {}, "C-contiguous"),
    "read-only output": ((Z, _ro(Z.copy())), {}, "read-only"),
    "not an array": ((Z, "dst"), {}, "expected an array"),
    "threads=0": ((Z, Z.copy()), {"threads": 0}, "threads must be"),
}


@pytest.mark.parametrize("case", CALL_ERRORS.values(), ids=CALL_ERRORS.keys())
def test_bad_call_raises(case):
    args, kwargs, message = case
    with pytest.raises(tpp.ArgumentError, match=message):
        _counts_nest()(*args, **kwargs)


def test_read_only_input_bind_and_run():
    """A read-only array for a tensor only read is fine; bind() validates once, run() reuses
    the table, and the table's thread slot follows set_num_threads."""
    nest = _counts_nest()
    src, dst = _ro(np.arange(6, dtype=np.float32).reshape(2, 3)), np.zeros((2, 3), np.float32)
    tpp.set_num_threads(3)
    table = nest.bind(src, dst=dst)
    nest.run(table)
    np.testing.assert_array_equal(dst, src + 1)
    assert table[0] == 3 and nest.bind(src, dst, threads=2)[0] == 2
    tpp.set_num_threads(1)
    assert nest.bind(src, dst)[0] == 1
    assert "aB" in repr(nest) and "src" in repr(nest)


def test_torch_tensors():
    """torch CPU tensors work as arguments (written in place); wrong dtype/layout rejected."""
    torch = pytest.importorskip("torch")
    gemm = _gemm_nest("aBC", 2).compile()
    A, B, want = _gemm_data(np.random.default_rng(3))
    C = torch.full(want.shape, float("nan"))
    tpp.set_num_threads(2)
    gemm(A=torch.from_numpy(A), B=torch.from_numpy(B), C=C)
    np.testing.assert_allclose(C.numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(tpp.ArgumentError, match="expected f32"):
        gemm(A=torch.from_numpy(A).bfloat16(), B=torch.from_numpy(B), C=C)
    with pytest.raises(tpp.ArgumentError, match="C-contiguous"):
        gemm(A=torch.from_numpy(A), B=torch.from_numpy(B).transpose(2, 3), C=C)


def test_compiled_cache_and_dump():
    """The same spec built twice gives the same CompiledNest; another spec another one; the
    generated IR and assembly call the primitives."""
    first, second = _gemm_nest("BCa", 2), _gemm_nest("BCa", 2)
    assert first.spec() == second.spec() and hash(first.spec()) == hash(second.spec())
    nest = first.compile()
    assert second.compile() is nest and compiled(second.spec()) is nest
    assert _gemm_nest("BCa", 1).compile() is not nest
    assert _gemm_nest("bCa", 2).compile() is not nest
    ir = nest.dump("ir")
    assert "call void" in ir and "icmp" in ir
    assert "call" in nest.dump("asm")


# ---------------------------------------------------------------- thread count
@pytest.fixture
def clean_env(monkeypatch):
    from tpp_cpu import threads
    if threads.runtime() is None:
        pytest.skip("libgomp is not available: nests run on one thread")
    monkeypatch.delenv("TPP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return monkeypatch


@pytest.mark.parametrize("env,want", [
    ({"TPP_NUM_THREADS": "3"}, 3), ({"OMP_NUM_THREADS": "2"}, 2),
    ({"OMP_NUM_THREADS": "5,2"}, 5),                     # nested list: the outer level
    ({"TPP_NUM_THREADS": " 4 ", "OMP_NUM_THREADS": "2"}, 4),
    ({"TPP_NUM_THREADS": "", "OMP_NUM_THREADS": "6"}, 6), ({}, None)])
def test_threads_from_environment(clean_env, env, want):
    for name, value in env.items():
        clean_env.setenv(name, value)
    tpp.set_num_threads(None)
    expected = len(os.sched_getaffinity(0)) if want is None else want
    assert tpp.get_num_threads() == expected
    tpp.set_num_threads(7)                 # an explicit count overrides the environment
    assert tpp.get_num_threads() == 7
    tpp.set_num_threads(None)
    assert tpp.get_num_threads() == expected


@pytest.mark.parametrize("name,value", [("TPP_NUM_THREADS", "two"), ("TPP_NUM_THREADS", "0"),
                                        ("OMP_NUM_THREADS", "-1"), ("OMP_NUM_THREADS", "1.5")])
def test_bad_thread_environment(clean_env, name, value):
    clean_env.setenv(name, value)
    tpp.set_num_threads(None)
    with pytest.raises(tpp.ArgumentError, match=name):
        tpp.get_num_threads()


@pytest.mark.parametrize("n", [0, -2, True, 2.0, "2"])
def test_bad_set_num_threads(n):
    with pytest.raises(tpp.ArgumentError, match="positive int"):
        tpp.set_num_threads(n)


def test_readme_blocked_gemm_runs():
    """The README's twenty-line blocked GEMM runs as printed and computes A @ B."""
    import pathlib
    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    snippet = text.split("A blocked GEMM in twenty lines:")[1].split("```python")[1].split("```")[0]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    Mb, Nb, Kb, bm, bn, bk = (scope[k] for k in ("Mb", "Nb", "Kb", "bm", "bn", "bk"))
    a = scope["A_"].transpose(0, 2, 1, 3).reshape(Mb * bm, Kb * bk).astype(np.float64)
    b = scope["B_"].transpose(1, 2, 0, 3).reshape(Kb * bk, Nb * bn).astype(np.float64)
    got = scope["C_"].transpose(1, 2, 0, 3).reshape(Mb * bm, Nb * bn)
    np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-3)
