"""Every call path of a kernel checks what the first call checks: after a first call has set up
the fast path, an aliased output, an unknown keyword or a bad dump request is still refused with
a TPPError. Also: sparse tensors and outputs that require grad."""
import numpy as np
import pytest

import tpp
from tpp.core.errors import ArgumentError

rng = np.random.default_rng(12)


def _f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# (kernel, inputs) for every op kind that has a fast path; none of them may write onto an input
NOT_IN_PLACE = [
    ("transpose", lambda: (tpp.unary("transpose", 16, 16), (_f32(16, 16),))),
    ("transpose_bf16", lambda: (tpp.unary("transpose", 8, 8, dtype_in="bf16"),
                                (_f32(8, 8).astype(tpp.BF16.numpy),))),
    ("vnni2", lambda: (tpp.unary("vnni2", 4, 8, dtype_in="bf16"),
                       (_f32(4, 8).astype(tpp.BF16.numpy),))),
    ("reduce_rows", lambda: (tpp.unary("reduce_sum", 8, 8, axis=0), (_f32(8, 8),))),
    ("reduce_cols", lambda: (tpp.unary("reduce_max", 8, 8, axis=1), (_f32(8, 8),))),
]


def _alias_for(kern, x):
    """An output array of the kernel's output shape that shares memory with x."""
    op = kern.spec.operands()[-1]
    shape = (op.rows, op.cols) if op.layout == "block" else \
        ((op.rows,) if op.layout == "col" else (op.cols,))
    size = int(np.prod(shape))
    assert size <= x.size
    return x.reshape(-1)[:size].reshape(shape)


@pytest.mark.parametrize("case", NOT_IN_PLACE, ids=[c[0] for c in NOT_IN_PLACE])
def test_no_aliased_output_on_the_fast_path(case):
    kern, (x,) = case[1]()
    kern(x.copy())                        # the first call sets up the fast path
    kern(x.copy())                        # and the second one takes it
    before = x.copy()
    if kern.spec.kind == "transpose":
        with pytest.raises(ArgumentError, match="overlaps"):
            kern(x, out=x)                # the identical array: no longer let through
    with pytest.raises(ArgumentError, match="overlaps"):
        kern(x, out=_alias_for(kern, x))  # a view of the same memory
    assert np.array_equal(x.view(np.uint8), before.view(np.uint8)), "x was written"


def test_in_place_elementwise_still_allowed_on_the_fast_path():
    relu = tpp.unary("relu", 8, 8)
    add = tpp.binary("add", 8, 8)
    x, y = _f32(8, 8), _f32(8, 8)
    relu(x.copy()), add(x.copy(), y)
    want = np.maximum(x, 0)
    assert relu(x, out=x) is x and np.array_equal(x, want)
    want = x + y
    assert add(x, y, out=x) is x and np.array_equal(x, want)
    with pytest.raises(ArgumentError, match="overlaps"):
        buf = np.zeros(65, np.float32)        # x's memory and one element past it
        buf[:64] = x.reshape(-1)
        relu(buf[:64].reshape(8, 8), out=buf[1:].reshape(8, 8))  # shifted overlap: refused


def test_unknown_keywords_are_argument_errors_on_every_path():
    relu = tpp.unary("relu", 4, 4)
    x = _f32(4, 4)
    for _ in range(2):                    # the first call and the cached fast path
        with pytest.raises(ArgumentError, match="'outt'"):
            relu(x, outt=np.empty_like(x))
    mm = tpp.brgemm(4, 4, 4)
    with pytest.raises(ArgumentError, match="'alpha'"):
        mm(_f32(1, 4, 4), _f32(1, 4, 4), alpha=2.0)


def test_dump_rejects_unknown_formats_and_isas():
    k = tpp.unary("relu", 4, 4)
    with pytest.raises(ArgumentError, match="'elf'"):
        k.dump("elf")
    with pytest.raises(ArgumentError, match="'neon'") as info:
        k.dump(isa="neon")
    assert "TPP_CPU_ISA" not in str(info.value)
    assert "ymm" in k.dump("asm", isa="avx2")


def test_sparse_tensors_are_refused_clearly():
    torch = pytest.importorskip("torch")
    relu = tpp.unary("relu", 4, 4)
    for sparse in (torch.eye(4).to_sparse(),):
        with pytest.raises(ArgumentError, match="sparse"):
            relu(sparse)


def test_output_tensor_that_requires_grad_is_refused():
    torch = pytest.importorskip("torch")
    relu = tpp.unary("relu", 4, 4)
    x = torch.randn(4, 4)
    out = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ArgumentError, match="requires grad"):
        relu(x, out=out)
    assert not out.detach().any()
    with torch.no_grad():                 # as torch allows in-place writes there
        relu(x, out=out)
    torch.testing.assert_close(out.detach(), torch.relu(x))
    mm = tpp.brgemm(4, 4, 4, beta=1)
    with pytest.raises(ArgumentError, match="requires grad"):
        mm(torch.randn(1, 4, 4), torch.randn(1, 4, 4), torch.zeros(4, 4, requires_grad=True))


# ---------------------------------------------------------------- ops with no input arrays
@pytest.mark.parametrize("dtype_out", ["f32", "bf16"])
def test_zero_without_arrays_allocates_a_host_output(dtype_out):
    """An op that reads no array (zero) called with nothing: a numpy output, on every path."""
    k = tpp.unary("zero", 5, 7, dtype_out=dtype_out)
    for _ in range(3):                       # the first call plans, the later ones reuse it
        y = k()
        assert isinstance(y, np.ndarray) and y.shape == (5, 7)
        assert y.dtype == tpp.core.dtypes.lookup(dtype_out).numpy
        assert not y.astype(np.float32).any() and not np.signbit(y.astype(np.float32)).any()
    assert k() is not y                      # a fresh array per call


def test_zero_writes_a_given_output():
    k = tpp.unary("zero", 4, 6, ldo=9)
    big = np.full((5, 9), 7.0, np.float32)
    assert k(out=big[:4, :6]) is not None
    assert not big[:4, :6].any() and (big[4:] == 7).all() and (big[:4, 6:] == 7).all()
    y = k()                                  # then without arrays: still a host array
    assert isinstance(y, np.ndarray) and not y.any()


def test_zero_writes_a_torch_output():
    torch = pytest.importorskip("torch")
    k = tpp.unary("zero", 4, 6)
    for _ in range(2):
        out = torch.full((4, 6), 3.0)
        assert k(out=out) is out
        assert not out.any()
    assert isinstance(k(), np.ndarray)        # no torch input: the allocated output is numpy
    wide = torch.full((4, 10), 3.0)
    assert tpp.unary("zero", 4, 6, ldo=10)(out=wide[:, :6]) is not None
    assert not wide[:, :6].any() and (wide[:, 6:] == 3.0).all()


def test_zero_with_unknown_output_or_arrays_is_refused():
    k = tpp.unary("zero", 2, 3)
    with pytest.raises(ArgumentError, match="input array"):
        k(np.zeros((2, 3), np.float32))
    with pytest.raises(ArgumentError, match="no output named"):
        k(mask=np.zeros((2, 1), np.uint8))


# ---------------------------------------------------------------- loop nests
def _gemm_nest():
    nest = tpp.LoopNest("a", a=2)
    a, = nest.vars
    A = nest.tensor("A", (2, 8, 8))
    B = nest.tensor("B", (2, 8, 8))
    C = nest.tensor("C", (8, 8))
    nest.call(tpp.unary("zero", 8, 8), C[0], when=(a == 0))
    nest.call(tpp.brgemm(8, 8, 8, beta=1), A[a], B[a], C[0], count=1)
    return nest.compile()


def test_nest_refuses_an_output_overlapping_an_input_on_every_path():
    gemm = _gemm_nest()
    A, B = _f32(2, 8, 8), _f32(2, 8, 8)
    gemm(A, B, np.empty((8, 8), np.float32))           # the fast path is warm
    for call in (lambda: gemm(A, B, A[0]),             # positional, fast path
                 lambda: gemm(A=A, B=B, C=A[1]),       # named
                 lambda: gemm(A, B, A[0], threads=1)):
        before = A.copy()
        with pytest.raises(ArgumentError, match="C overlaps A"):
            call()
        assert np.array_equal(A, before)
    torch = pytest.importorskip("torch")
    At = torch.from_numpy(A)
    with pytest.raises(ArgumentError, match="C overlaps A"):   # the checked (bind) path
        gemm(At, torch.from_numpy(B), At[0])


def _map_nest(op):
    nest = tpp.LoopNest("A", a=4)
    a, = nest.vars
    x = nest.tensor("x", (16, 8))
    y = nest.tensor("y", (16, 8))
    nest.call(tpp.unary(op, 4, 8), x[a * 4], y[a * 4])
    return nest.compile()


def test_nest_allows_the_identical_array_for_element_wise_calls_only():
    relu = _map_nest("relu")
    x = _f32(16, 8)
    want = np.maximum(x, 0)
    relu(x, x)
    assert np.array_equal(x, want)
    with pytest.raises(ArgumentError, match="y overlaps x"):
        buf = np.zeros(16 * 8 + 8, np.float32)
        relu(buf[:128].reshape(16, 8), buf[8:].reshape(16, 8))   # shifted by a row
    nest = tpp.LoopNest("A", a=2)                       # a transpose may not write in place
    a, = nest.vars
    s = nest.tensor("s", (2, 8, 8))
    t = nest.tensor("t", (2, 8, 8))
    nest.call(tpp.unary("transpose", 8, 8), s[a], t[a])
    transpose = nest.compile()
    z = _f32(2, 8, 8)
    with pytest.raises(ArgumentError, match="t overlaps s"):
        transpose(z, z)


def test_nest_refuses_the_identical_array_where_a_later_read_sees_a_write():
    """Each call in place on its own, yet wrong together: a second call reading x after the
    first wrote y (y = relu(x); y = y + x gave 2 relu(x)), or a loop revisiting a block (the
    second visit reads what the first wrote)."""
    nest = tpp.LoopNest("A", a=4)
    a, = nest.vars
    x, y = nest.tensor("x", (16, 8)), nest.tensor("y", (16, 8))
    nest.call(tpp.unary("relu", 4, 8), x[a * 4], y[a * 4])
    nest.call(tpp.binary("add", 4, 8), y[a * 4], x[a * 4], y[a * 4])
    two_calls = nest.compile()
    z = _f32(16, 8)
    want = np.maximum(z, 0) + z
    out = np.empty_like(z)
    two_calls(z, out)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    with pytest.raises(ArgumentError, match="y overlaps x"):
        two_calls(z, z)
    nest = tpp.LoopNest("AB", a=4, b=2)                  # block a, visited for each b
    a, b = nest.vars
    x, y = nest.tensor("x", (16, 8)), nest.tensor("y", (16, 8))
    nest.call(tpp.unary("exp", 4, 8), x[a * 4], y[a * 4])
    revisits = nest.compile()
    with pytest.raises(ArgumentError, match="y overlaps x"):
        revisits(z, z)


def test_overlap_sweep_agrees_with_the_pairwise_verdict():
    """_check_overlap's sweep in address order raises exactly where the pairwise judgement
    does (random placements of the gemm nest's three tensors, sizes 0 included)."""
    gemm = _gemm_nest()
    rng = np.random.default_rng(0)
    for _ in range(2000):
        addresses = [int(a) for a in rng.integers(0, 64, 3)]
        nbytes = [int(n) for n in rng.integers(0, 24, 3)]
        verdicts = []
        for check in (gemm._check_overlap, gemm._judge_overlaps):
            try:
                check(addresses, nbytes)
                verdicts.append(None)
            except ArgumentError as exc:
                verdicts.append(str(exc))
        assert verdicts[0] == verdicts[1], (addresses, nbytes)
