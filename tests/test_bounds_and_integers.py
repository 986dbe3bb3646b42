"""Issue 12: exact bounds arithmetic, integral sizes, bounded thread counts, // and & in loop
nests, unknown keywords.

Cases that would crash the process if a check regressed (a kernel reading before its array, a
nest asking libgomp for 2**31 threads) never reach compiled code: the kernel's or nest's entry
is replaced by one that fails the test, so a regression is a test failure, not a segfault.
"""
import numpy as np
import pytest

import ops
import tpp
from tpp import ArgumentError, Loop, SpecError
from tpp.core.brgemm_spec import make_brgemm
from tpp.core.checks import ADDRESS_LIMIT, MAX_THREADS
from tpp.runtime.loops import CompiledNest
from tpp.core.spec import make_binary

INC = tpp.unary("increment", 1, 1)


@pytest.fixture
def no_kernel_runs(monkeypatch):
    """Compiled BRGEMM variants and nests fail the test instead of running."""
    def ran(*args, **kwargs):
        raise AssertionError("compiled code ran: the bad input was not rejected")
    monkeypatch.setattr(tpp.BrgemmKernel, "_variant", lambda self, lds: ran)
    monkeypatch.setattr(CompiledNest, "run", ran)


def _needs_runtime():
    from tpp_cpu import threads
    if threads.runtime() is None:
        pytest.skip("libgomp is not available: nests run on one thread")


# ---------------------------------------------------------------- 1. BRGEMM offsets
@pytest.mark.parametrize("lda, offset", [
    (2 ** 40, 2 ** 63 - 2 ** 40),     # used to wrap to a small sum: segfault
    (None, 2 ** 63 - 16),             # used to wrap to 48: read the 64 bytes before A
    (None, 2 ** 63 - 1),
    (None, 57),                       # a plain one past the end
])
def test_offset_bounds_are_checked_in_exact_ints(no_kernel_runs, lda, offset):
    mm = tpp.brgemm(8, 8, 8, batch="offset", lda=lda)
    with pytest.raises(ArgumentError, match="a: "):
        mm(np.zeros(64, np.float32), np.zeros((8, 8), np.float32),
           offsets_a=np.array([0, offset]), offsets_b=np.array([0, 0]))


def test_offset_past_a_base_too_small_for_one_block(no_kernel_runs):
    mm = tpp.brgemm(2, 2, 2, batch="offset", lda=100)
    with pytest.raises(ArgumentError, match="does not fit in the base array of 64 elements"):
        mm(np.zeros(64, np.float32), np.zeros(4, np.float32), offsets_a=np.array([0]),
           offsets_b=np.array([0]))


def test_offsets_and_counts_that_fit_still_run():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(40).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    mm = tpp.brgemm(2, 2, 2, batch="offset")
    got = mm(a, b, offsets_a=np.array([36, 0]), offsets_b=np.array([4, 0]),
             count=np.int64(1))                               # the last block of a
    np.testing.assert_allclose(got, a[36:].reshape(2, 2) @ b[4:].reshape(2, 2), rtol=1e-6)


@pytest.mark.parametrize("count, words", [(-1, "non-negative"), (True, "non-negative"),
                                          (1.0, "non-negative"), (2 ** 64, "holds only 2")])
def test_bad_brgemm_counts(no_kernel_runs, count, words):
    mm = tpp.brgemm(2, 2, 2)
    with pytest.raises(ArgumentError, match=words):
        mm(np.zeros((2, 2, 2), np.float32), np.zeros((2, 2, 2), np.float32), count=count)


# ---------------------------------------------------------------- 2. addressable sizes
@pytest.mark.parametrize("build", [
    lambda: tpp.unary("relu", 4, 4, ldi=2 ** 50),
    lambda: tpp.unary("relu", 4, 4, ldo=2 ** 46),             # 3 * 2**46 * 4 bytes
    lambda: tpp.unary("relu", 2 ** 40, 2 ** 40),
    lambda: tpp.unary("transpose", 2, 2 ** 50),
    lambda: tpp.unary("reduce_sum", 1, 2 ** 46, axis=0),
    lambda: tpp.binary("add", 4, 4, ldi1=2 ** 62),
    lambda: tpp.binary("cmp_gt", 2 ** 24, 2 ** 24),            # inputs too, then the mask
    lambda: tpp.brgemm(8, 8, 8, lda=2 ** 50),
    lambda: tpp.brgemm(8, 8, 8, ldb=2 ** 63),
    lambda: tpp.brgemm(8, 8, 8, ldc=2 ** 64 + 3),
    lambda: tpp.brgemm(2 ** 30, 2 ** 30, 8),
], ids=["ldi", "ldo", "m*n", "transpose", "vector", "ldi1", "mask", "lda", "ldb", "ldc", "m*n"])
def test_blocks_beyond_the_address_space_are_spec_errors(build):
    with pytest.raises(SpecError, match="bytes a process can address"):
        build()


def test_blocks_up_to_the_address_space_are_accepted():
    """Specs only (nothing this large is allocated): 2**47 bytes exactly is the limit."""
    assert tpp.unary("relu", 1, ADDRESS_LIMIT // 4).spec.n == 2 ** 45
    assert tpp.unary("relu", 2, 4, ldi=(ADDRESS_LIMIT // 4 - 4)).spec.ldi == 2 ** 45 - 4
    with pytest.raises(SpecError):
        tpp.unary("relu", 2, 4, ldi=(ADDRESS_LIMIT // 4 - 3))
    assert tpp.brgemm(8, 8, 8, lda=2 ** 40, batch="offset").spec.lda == 2 ** 40


def test_nest_tensors_and_loops_beyond_the_address_space():
    nest = tpp.LoopNest("a", a=4)
    with pytest.raises(SpecError, match="bytes a process can address"):
        nest.tensor("X", (2 ** 32, 2 ** 32))
    with pytest.raises(SpecError, match="bytes a process can address"):
        nest.tensor("X", (2 ** 20, 2 ** 20, 2 ** 6))             # 2**48 bytes of f32
    nest.tensor("X", (2 ** 20, 2 ** 20, 2 ** 5))                 # 2**47 bytes: accepted
    for loop in [(0, 2 ** 47 + 1), (-2 ** 47 - 1, 0), (0, 8, 2 ** 48), (0, 8, 1, (2 ** 48,))]:
        with pytest.raises(SpecError, match="must lie within"):
            Loop.of(loop)
    Loop(-2 ** 47, 2 ** 47)


def _nest_over(loops, order, shape=(4,)):
    nest = tpp.LoopNest(order, **loops)
    return nest, nest.vars, nest.tensor("X", shape)


def test_guard_that_wraps_in_int64_is_rejected(no_kernel_runs):
    """a + (2**63 - 10) < 0 never holds in exact arithmetic (so the bounds check skipped the
    call), but wraps around for a >= 10 in the generated int64 compare: X[a] out of bounds."""
    nest, (a,), X = _nest_over(dict(a=20), "a", (5,))
    nest.call(INC, X[a], X[a], when=(a + (2 ** 63 - 10) < 0))
    with pytest.raises(SpecError, match="int64"):
        nest.spec()


@pytest.mark.parametrize("build, words", [
    (lambda n, a, X: n.call(INC, X.at(0), X.at(0), when=(a * 2 ** 62 > 0)), "int64"),
    (lambda n, a, X: n.call(INC, X.at((a * 2 ** 62) // 3), X.at(0)), "int64"),
    (lambda n, a, X: n.call(INC, X.at(a * 2 ** 64), X.at(0), when=(a > 9)), "int64"),
    (lambda n, a, X: n.call(INC, X.at(0), X.at(0), when=(a > 9) & (a == 2 ** 64)), "int64"),
    (lambda n, a, X: n.call(tpp.brgemm(1, 1, 1), X.at(0), X.at(0), X.at(0), stride_a=2 ** 64),
     "stride_a must be an int in"),
])
def test_expressions_the_generated_code_cannot_compute_are_rejected(no_kernel_runs, build, words):
    nest, (a,), X = _nest_over(dict(a=4), "a")
    with pytest.raises(SpecError, match=words):
        build(nest, a, X)
        nest.spec()


def test_parallel_band_too_large_to_split_is_rejected():
    nest, (a, b), X = _nest_over(dict(a=2 ** 40, b=2 ** 40), "AB")
    nest.call(INC, X.at(0), X.at(0))
    with pytest.raises(SpecError, match="parallel band"):
        nest.spec()


# ---------------------------------------------------------------- 3. numpy integers
def test_numpy_integer_sizes_make_the_same_specs():
    i64, i32, u8 = np.int64, np.int32, np.uint8
    relu = tpp.unary("relu", i64(4), i32(4), ldi=u8(8))
    assert relu.spec == tpp.unary("relu", 4, 4, ldi=8).spec
    assert all(type(getattr(relu.spec, f)) is int for f in ("m", "n", "ldi", "ldo"))
    x = np.arange(-16, 16, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(relu(x[:, :4]), np.maximum(x[:, :4], 0))
    assert tpp.binary("add", i64(3), np.intp(5), ldo=i64(7)).spec == \
        tpp.binary("add", 3, 5, ldo=7).spec
    mm = tpp.brgemm(i64(2), i32(3), np.int16(4), lda=i64(4), beta=i64(1))
    assert mm.spec == tpp.brgemm(2, 3, 4, beta=1).spec and type(mm.spec.k) is int
    a, b = np.ones((2, 2, 4), np.float32), np.ones((2, 4, 3), np.float32)
    np.testing.assert_array_equal(mm(a, b, np.zeros((2, 3), np.float32), count=np.int64(1)),
                                  np.full((2, 3), 4, np.float32))


@pytest.mark.parametrize("build", [
    lambda: tpp.unary("relu", True, 4), lambda: tpp.unary("relu", np.True_, 4),
    lambda: tpp.binary("add", 4, 4, ldi0=True), lambda: tpp.brgemm(4, 4, np.True_),
    lambda: tpp.unary("relu", np.float64(4), 4), lambda: Loop(0, True),
    lambda: Loop(0, 4, 1, (np.True_,)), lambda: tpp.LoopNest("a", a=4).tensor("X", (True,)),
    lambda: Loop.of((0, 8, 1, 4)), lambda: tpp.LoopNest("a", a=4).tensor("X", 4),
])
def test_non_integral_sizes_are_spec_errors(build):
    """bool is not a size (nor np.bool_), floats are not, and an int is not a tuple of them."""
    with pytest.raises(SpecError):
        build()


def _blocked_gemm(n):
    """A 2x2-block GEMM nest whose every number is given as n(value)."""
    nest = tpp.LoopNest("aBb", a=(n(0), n(2), n(2)), b=Loop(n(0), n(2), n(1), [n(2)]))
    a, b = nest.vars
    A = nest.tensor("A", (n(2), n(2), n(4), n(4)))
    B = nest.tensor("B", [n(2), n(4), n(4)])
    C = nest.tensor("C", (n(2), n(4), n(4)))
    nest.call(tpp.brgemm(n(4), n(4), n(4)), A[b, a], B[a], C[b], count=n(2),
              stride_a=n(16), stride_b=n(16))
    return nest


def test_numpy_integers_in_loop_nests():
    nest = _blocked_gemm(np.int64)
    spec = nest.spec()
    assert spec == _blocked_gemm(int).spec()
    assert all(type(v) is int for lp in spec.loops for v in (lp.start, lp.stop, *lp.blocks))
    assert all(type(d) is int for t in spec.tensors for d in t.shape)
    rng = np.random.default_rng(1)
    A = rng.standard_normal((2, 2, 4, 4)).astype(np.float32)
    B = rng.standard_normal((2, 4, 4)).astype(np.float32)
    C = np.zeros((2, 4, 4), np.float32)
    nest.compile()(A, B, C, threads=np.int64(2))
    np.testing.assert_allclose(C, np.einsum("bkij,kjl->bil", A, B), rtol=1e-5, atol=1e-5)


def test_numpy_integer_panel_width():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    packed = ops.pack_kn(w, bn=np.int64(2))
    assert packed.bn == 2 and type(packed.bn) is int
    with pytest.raises(ArgumentError, match="bn must be a positive int"):
        ops.pack_kn(w, bn=np.True_)


# ---------------------------------------------------------------- 4. thread counts
@pytest.mark.parametrize("n", [2 ** 31, 2 ** 64, MAX_THREADS + 1, np.int64(2 ** 31),
                               np.uint64(2 ** 64 - 1)])
def test_set_num_threads_is_bounded(n):
    with pytest.raises(ArgumentError, match=f"at most {MAX_THREADS}"):
        tpp.set_num_threads(n)


def test_set_num_threads_takes_numpy_ints():
    _needs_runtime()
    tpp.set_num_threads(np.int64(2))
    assert tpp.get_num_threads() == 2 and type(tpp.get_num_threads()) is int
    tpp.set_num_threads(MAX_THREADS)
    assert tpp.get_num_threads() == MAX_THREADS


@pytest.mark.parametrize("name, value", [("TPP_NUM_THREADS", "2147483648"),
                                         ("OMP_NUM_THREADS", str(MAX_THREADS + 1))])
def test_thread_environment_is_bounded(monkeypatch, name, value):
    _needs_runtime()
    monkeypatch.delenv("TPP_NUM_THREADS", raising=False)
    monkeypatch.setenv(name, value)
    tpp.set_num_threads(None)
    with pytest.raises(ArgumentError, match=name):
        tpp.get_num_threads()


def _copy_nest():
    nest, (a,), X = _nest_over(dict(a=4), "A")
    nest.call(tpp.unary("identity", 1, 1), X[a], nest.tensor("Y", (4,))[a])
    return nest.compile()


@pytest.mark.parametrize("threads", [2 ** 31, 2 ** 64, MAX_THREADS + 1, 0, np.int64(2 ** 31),
                                     np.uint64(2 ** 64 - 1), True, 2.0])
def test_nest_threads_argument_is_bounded(no_kernel_runs, threads):
    nest = _copy_nest()
    x, y = np.zeros(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ArgumentError, match="threads must be a positive int"):
        nest(x, y, threads=threads)                   # the fast path
    with pytest.raises(ArgumentError, match="threads must be a positive int"):
        nest(X=x, Y=y, threads=threads)               # named
    with pytest.raises(ArgumentError, match="threads must be a positive int"):
        nest.bind(x, y, threads=threads)


def test_nest_threads_with_torch_tensors_are_bounded(no_kernel_runs):
    torch = pytest.importorskip("torch")
    nest = _copy_nest()
    for threads in (2 ** 64, 2 ** 31):
        with pytest.raises(ArgumentError, match="threads must be a positive int"):
            nest(torch.zeros(4), torch.zeros(4), threads=threads)


def test_nest_threads_takes_numpy_ints_and_max_threads():
    _needs_runtime()
    nest = _copy_nest()
    x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    nest(x, y, threads=np.int32(2))
    np.testing.assert_array_equal(x, y)
    assert nest.bind(x, y, threads=MAX_THREADS)[0] == MAX_THREADS


# ---------------------------------------------------------------- 5. // and &
def _visits(order, loops, index, size, when=(), threads=(1, 2)):
    """counts[index(a, b)] += 1 per iteration where `when` holds, run by a nest on `size`
    counts (one result per thread count). Each iteration increments a cell of its own in a
    (size, cells) grid, summed afterwards: iterations of a parallel order that share an
    index would otherwise race on one counter (a lost update, not a wrong index)."""
    start = [lp.start for lp in map(Loop.of, loops.values())]
    span = [lp.stop - lp.start for lp in map(Loop.of, loops.values())]
    cells = span[0] * span[1]
    nest = tpp.LoopNest(order, **loops)
    a, b = nest.vars
    n = nest.tensor("n", (size * cells,))
    addr = n.at(index(a, b) * cells + (a - start[0]) * span[1] + (b - start[1]))
    nest.call(INC, addr, addr, when=when(a, b) if callable(when) else when)
    compiled = nest.compile()
    results = []
    for t in threads:
        tpp.set_num_threads(t)
        out = np.zeros(size * cells, np.float32)
        compiled(n=out)
        results.append(out.reshape(size, cells).sum(axis=1))
    return results


def _model(loops, index, size, when=lambda *v: True):
    """The counts _visits computes, from Python ints (Python's // and `and`)."""
    ranges = [range(lp.start, lp.stop, lp.step) for lp in map(Loop.of, loops.values())]
    want = np.zeros(size, np.float32)
    for a in ranges[0]:
        for b in ranges[1]:
            if when(a, b):
                want[index(a, b)] += 1
    return want


FLOORS = {  # name: (loops, index, size): index(a, b) floor-divides values of both signs
    "a//4, negative a": (dict(a=(-9, 10), b=3), lambda a, b: (a // 4 + 3) * 3 + b, 18),
    "(a+b)//3": (dict(a=(-4, 5), b=(-3, 2)), lambda a, b: (a + b) // 3 + 3, 5),
    "(3a-1)//2 - b": (dict(a=(-2, 6, 2), b=4), lambda a, b: (3 * a - 1) // 2 - b + 7, 13),
    "nested": (dict(a=(-20, 20), b=2), lambda a, b: (a // 3 - 1) // 2 * 2 + b + 8, 14),
    "exact": (dict(a=(0, 12, 3), b=2), lambda a, b: (6 * a + 3) // 3 + b - 1, 20),
}


@pytest.mark.parametrize("order", ["ab", "Ab", "AB"])
@pytest.mark.parametrize("case", FLOORS.values(), ids=FLOORS.keys())
def test_floor_division_matches_python(case, order):
    loops, index, size = case
    want = _model(loops, index, size)
    assert want[0] and want[-1]           # the extent is reached at both ends
    for got in _visits(order, loops, index, size):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", FLOORS.values(), ids=FLOORS.keys())
def test_floor_division_bounds_check_is_exact(case):
    """The extent is exact for these indices: one element less is rejected."""
    loops, index, size = case
    nest = tpp.LoopNest("ab", **loops)
    n = nest.tensor("n", (size - 1,))
    nest.call(INC, n.at(index(*nest.vars)), n.at(0))
    with pytest.raises(SpecError, match="may touch elements"):
        nest.spec()


def test_floor_division_below_zero_is_rejected():
    nest = tpp.LoopNest("a", a=(-1, 4))
    n = nest.tensor("n", (4,))
    nest.call(INC, n.at(nest.vars[0] // 2), n.at(0))     # -1 // 2 == -1: before n
    with pytest.raises(SpecError, match=r"\[-1, "):
        nest.spec()


CONJUNCTIONS = {  # name: (when= of the nest, the same on Python ints)
    "(a==0)&(b==0)": (lambda a, b: (a == 0) & (b == 0), lambda a, b: a == 0 and b == 0),
    "three": (lambda a, b: (a >= 1) & (b < 3) & (a != b),
              lambda a, b: a >= 1 and b < 3 and a != b),
    "& with //": (lambda a, b: (a // 2 == b) & (b > 0), lambda a, b: a // 2 == b and b > 0),
    "tuple of &": (lambda a, b: ((a > 1) & (b > 1), a - b < 2),
                   lambda a, b: a > 1 and b > 1 and a - b < 2),
}


@pytest.mark.parametrize("order", ["ab", "AB"])
@pytest.mark.parametrize("case", CONJUNCTIONS.values(), ids=CONJUNCTIONS.keys())
def test_conditions_joined_with_and(case, order):
    when, py_when = case
    loops, index = dict(a=6, b=5), (lambda a, b: a * 5 + b)
    want = _model(loops, index, 30, py_when)
    assert want.any() and not want.all()
    for got in _visits(order, loops, index, 30, when):
        np.testing.assert_array_equal(got, want)


def test_conjunction_is_the_same_spec_as_a_tuple_and_narrows_bounds():
    def build(when):
        nest = tpp.LoopNest("ab", a=6, b=5)
        a, b = nest.vars
        n = nest.tensor("n", (3,))
        nest.call(INC, n[a], n[a], when=when(a, b))      # fits only under a < 3
        return nest.spec()
    assert build(lambda a, b: (a < 3) & (b == 0)) == build(lambda a, b: (a < 3, b == 0))
    with pytest.raises(SpecError, match="may touch elements"):
        build(lambda a, b: (a < 4) & (b == 0))


@pytest.mark.parametrize("build, words", [
    (lambda a, b: a // b, "only by a positive int"),
    (lambda a, b: a // 0, "only by a positive int"),
    (lambda a, b: a // -2, "only by a positive int"),
    (lambda a, b: a // 2.0, "only by a positive int"),
    (lambda a, b: 6 // a, "// by a loop expression is not supported"),
    (lambda a, b: a / 2, "use // for floor division"),
    (lambda a, b: a % 2, "% is not supported"),
    (lambda a, b: (a == 0) | (b == 0), r"join only with &"),
    (lambda a, b: ~(a == 0), "opposite comparison"),
    (lambda a, b: (a == 0) & 1, "& joins loop conditions"),
    (lambda a, b: (a == 0) and (b == 0), "join conditions with &"),
])
def test_unsupported_expression_operators_say_what_is_supported(build, words):
    a, b = tpp.LoopNest("ab", a=2, b=2).vars
    with pytest.raises(SpecError, match=words):
        build(a, b)


# ---------------------------------------------------------------- 6. unknown keywords
@pytest.mark.parametrize("build, where", [
    (lambda: tpp.binary("add", 4, 4, alpha=2.0), "tpp.binary"),
    (lambda: make_binary("add", 4, 4, beta=1), "tpp.binary"),
    (lambda: tpp.brgemm(4, 4, 4, alpha=2.0), "tpp.brgemm"),
    (lambda: make_brgemm(4, 4, 4, transa=True), "tpp.brgemm"),
    (lambda: tpp.LoopNest("a", a=4, threads=2), "tpp.LoopNest"),
    (lambda: tpp.LoopNest("a", a=4).tensor("X", (4,), dtpye="bf16"), "LoopNest.tensor"),
    (lambda: tpp.LoopNest("a", a=4).call(INC, when=(), cond=()), "LoopNest.call"),
])
def test_unknown_keywords_are_spec_errors(build, where):
    with pytest.raises(SpecError, match=f"{where}: unknown keyword argument") as info:
        build()
    assert "accepted:" in str(info.value)
