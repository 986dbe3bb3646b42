"""Bad input is a TPPError with a message that names the problem, never a crash."""
import numpy as np
import pytest

import tpp
from tpp import ArgumentError, SpecError, TPPError, UnsupportedError


@pytest.mark.parametrize("kwargs, words", [
    (dict(op="nope", m=4, n=4), "unknown unary op"),
    (dict(op="relu", m=-1, n=4), "m must be >= 1"),
    (dict(op="relu", m=4, n=0), "n must be >= 1"),
    (dict(op="relu", m=4.0, n=4), "m must be an int"),
    (dict(op="relu", m=4, n=8, ldi=7), "ldi=7 is smaller"),
    (dict(op="relu", m=4, n=8, ldo=3), "ldo=3 is smaller"),
    (dict(op="relu", m=4, n=8, dtype_in="f64"), "unknown dtype"),
    (dict(op="relu", m=4, n=8, dtype_in="i64"), "expected one of f32, bf16, f16"),
    (dict(op="relu", m=4, n=8, dtype_comp="bf16"), "dtype_comp must be f32"),
    (dict(op="relu", m=4, n=8, bcast="diag"), "bcast must be one of"),
    (dict(op="relu", m=4, n=8, alpha=1.0), "takes no parameter"),
    (dict(op="leaky_relu", m=4, n=8, alpha="x"), "must be a number"),
    (dict(op="gelu", m=4, n=8, approximate="fast"), "approximate must be"),
    (dict(op="dropout", m=4, n=8, p=1.0), "p must be in [0, 1)"),
    (dict(op="reduce_sum", m=4, n=8, axis=2), "axis must be 0 or 1"),
    (dict(op="vnni2", m=4, n=8), "16-bit"),
    (dict(op="transpose", m=4, n=8, dtype_out="bf16"), "without converting"),
    (dict(op="relu_inv", m=4, n=8, bcast="row"), "no broadcast"),
])
def test_bad_unary_specs(kwargs, words):
    with pytest.raises(TPPError, match=None) as info:
        tpp.unary(**kwargs)
    assert words in str(info.value)


def test_bad_binary_specs():
    with pytest.raises(SpecError, match="unknown binary op"):
        tpp.binary("pow", 2, 2)
    with pytest.raises(SpecError, match="ldi1=1 is smaller"):
        tpp.binary("add", 2, 2, ldi1=1)
    with pytest.raises(SpecError, match="bitmask"):
        tpp.binary("cmp_gt", 2, 2, dtype_out="f32")
    with pytest.raises(SpecError, match="op must be a string"):
        tpp.binary(3, 2, 2)


def test_errors_are_value_errors_too():
    with pytest.raises(ValueError):
        tpp.unary("relu", 0, 1)


RELU = tpp.unary("relu", 4, 8)
X = np.ones((4, 8), np.float32)


@pytest.mark.parametrize("make_args, words", [
    (lambda: (np.ones((4, 9), np.float32),), "expected shape (4, 8), got (4, 9)"),
    (lambda: (np.ones((8,), np.float32),), "expected shape (4, 8)"),
    (lambda: (np.ones((4, 8), np.float64),), "expected dtype f32, got float64"),
    (lambda: (np.ones((4, 8), np.int32),), "expected dtype f32, got int32"),
    (lambda: (np.ones((8, 4), np.float32).T,), "column stride"),
    (lambda: (np.ones((4, 16), np.float32)[:, ::2],), "column stride"),
    (lambda: (np.broadcast_to(np.ones(8, np.float32), (4, 8)),), "smaller than the row"),
    (lambda: (np.ones((4, 8), np.float32)[::-1],), "smaller than the row"),
    (lambda: ([[1.0] * 8] * 4,), "expected an array"),
    (lambda: ("abc",), "expected an array"),
    (lambda: (X, X), "takes 1 input array"),
    (lambda: (), "takes 1 input array"),
])
def test_bad_call_arguments(make_args, words):
    with pytest.raises(ArgumentError) as info:
        RELU(*make_args())
    assert words in str(info.value)


def test_bad_outputs():
    ro = np.ones((4, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ArgumentError, match="read-only"):
        RELU(X, out=ro)
    with pytest.raises(ArgumentError, match=r"expected shape \(4, 8\), got \(3, 8\)"):
        RELU(X, out=np.empty((3, 8), np.float32))
    with pytest.raises(ArgumentError, match="expected dtype f32"):
        RELU(X, out=np.empty((4, 8), np.float16))
    with pytest.raises(ArgumentError, match="no output named 'mask'"):
        RELU(X, mask=np.empty((4, 1), np.uint8))
    with pytest.raises(ArgumentError, match="bitmask"):
        tpp.unary("relu", 4, 8, bitmask=True)(X, mask=np.empty((4, 2), np.uint8))


def test_overlap_is_refused_except_identical_in_place():
    buf = np.zeros((5, 8), np.float32)
    with pytest.raises(ArgumentError, match="overlaps"):
        RELU(buf[:4], out=buf[1:])
    RELU(buf[:4], out=buf[:4])  # identical: in place is fine for elementwise ops
    t = tpp.unary("transpose", 8, 8)
    sq = np.zeros((8, 8), np.float32)
    with pytest.raises(ArgumentError, match="overlaps"):
        t(sq, out=sq)


def test_broadcast_operand_shapes():
    add = tpp.binary("add", 4, 8, bcast_in1="row")
    add(X, np.ones(8, np.float32))
    add(X, np.ones((1, 8), np.float32))
    with pytest.raises(ArgumentError, match="expected 8 values"):
        add(X, np.ones(4, np.float32))
    with pytest.raises(ArgumentError, match="contiguous"):
        add(X, np.ones(16, np.float32)[::2])
    col = tpp.binary("add", 4, 8, bcast_in1="col")
    col(X, np.ones((4, 1), np.float32))
    with pytest.raises(ArgumentError, match="expected 4 values"):
        col(X, np.ones(8, np.float32))
    shapes = [o.shape for o in col.spec.operands()] + [add.spec.operands()[1].shape]
    assert shapes == [(4, 8), (4,), (4, 8), (8,)]


def test_seed_rules():
    drop = tpp.unary("dropout", 4, 8)
    with pytest.raises(ArgumentError, match="integer seed"):
        drop(X)
    with pytest.raises(ArgumentError, match="integer seed"):
        drop(X, seed=1.5)
    with pytest.raises(ArgumentError, match="takes no seed"):
        RELU(X, seed=3)


def test_gather_scatter_index_bounds():
    src = np.ones((10, 8), np.float32)
    g = tpp.unary("gather_rows", 3, 8)
    with pytest.raises(ArgumentError, match=r"must lie in \[0, 10\)"):
        g(src, np.array([0, 10, 1]))
    with pytest.raises(ArgumentError, match=r"must lie in \[0, 10\)"):
        g(src, np.array([0, -1, 1]))
    with pytest.raises(ArgumentError, match="expected dtype i64"):
        g(src, np.array([0, 1, 2], np.int32))
    s = tpp.unary("scatter_rows", 3, 8)
    with pytest.raises(ArgumentError, match="pass it as out"):
        s(np.ones((3, 8), np.float32), np.array([0, 1, 2]))
    with pytest.raises(ArgumentError, match=r"must lie in \[0, 4\)"):
        s(np.ones((3, 8), np.float32), np.array([0, 1, 4]), out=np.zeros((4, 8), np.float32))


def test_muladd_needs_out():
    with pytest.raises(ArgumentError, match="pass it as out"):
        tpp.binary("muladd", 4, 8)(X, X)


def test_cuda_like_objects_are_refused():
    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4, 8), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
    with pytest.raises(UnsupportedError, match="CUDA"):
        RELU(FakeCuda())


def test_avx512_code_on_a_host_without_it_is_refused_not_run(monkeypatch):
    from tpp_cpu import target
    if target.host_isa() == "avx512":
        pytest.skip("this host runs AVX-512")
    monkeypatch.setenv("TPP_CPU_ISA", "avx512")
    with pytest.raises(UnsupportedError, match="cannot run avx512"):
        tpp.unary("negate", 3, 5)(np.ones((3, 5), np.float32))


def test_numpy_scalars_as_parameters_and_what_is_not_a_number():
    """Kernel parameters take numpy numbers as the operators do; eps and scale refuse bools
    (numpy's too) and strings instead of reading them as numbers."""
    import ops
    leaky = tpp.unary("leaky_relu", 4, 16, alpha=np.float32(0.25))
    assert leaky.spec == tpp.unary("leaky_relu", 4, 16, alpha=0.25).spec
    assert dict(tpp.unary("dropout", 4, 16, p=np.int64(0)).spec.params)["p"] == 0.0
    with pytest.raises(SpecError, match="must be a number"):
        tpp.unary("leaky_relu", 4, 16, alpha=np.True_)
    x = np.ones((4, 16), np.float32)
    for bad in (True, np.True_, "1e-5"):
        with pytest.raises(ArgumentError, match="eps must be a number"):
            ops.layer_norm(x, eps=bad)
    with pytest.raises(ArgumentError, match="scale must be a number"):
        ops.softmax(x, scale="0.5")


def test_parameters_beyond_the_f32_range_are_refused_not_made_infinite():
    """A finite parameter the f32 kernel would hold as an infinity is refused; inf and nan
    themselves are values f32 holds and are taken as given (IEEE propagation)."""
    with pytest.raises(SpecError, match="beyond the f32 range"):
        tpp.unary("leaky_relu", 2, 16, alpha=-1e40)
    assert dict(tpp.unary("leaky_relu", 2, 16, alpha=3.4e38).spec.params)["alpha"] == 3.4e38
    eq = tpp.equation(2, 16)
    k = eq.compile(eq.input("x") * eq.param("p"))
    x = np.ones((2, 16), np.float32)
    for _ in range(2):                              # the first call and the cached one
        with pytest.raises(ArgumentError, match="beyond the f32 range"):
            k(x=x, p=1e40)
    assert np.isinf(k(x=x, p=float("inf"))).all() and np.isnan(k(x=x, p=float("nan"))).all()
    np.testing.assert_array_equal(k(x=x, p=3.0e38), np.full((2, 16), np.float32(3.0e38)))


def test_nest_refuses_an_output_requiring_grad_while_autograd_records():
    torch = pytest.importorskip("torch")
    nest = tpp.LoopNest("A", a=1)
    a, = nest.vars
    x, y = nest.tensor("x", (4, 16)), nest.tensor("y", (4, 16))
    nest.call(tpp.unary("exp", 4, 16), x[a * 4], y[a * 4])
    f = nest.compile()
    src = torch.zeros(4, 16)
    out = torch.zeros(4, 16, requires_grad=True)
    for _ in range(2):                                  # the checked path, then the fast one
        with pytest.raises(ArgumentError, match="requires grad"):
            f(src, out)
        with torch.no_grad():
            f(src, out)
        assert bool((out == 1).all())
