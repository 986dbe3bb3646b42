"""Every call path of a kernel checks what the first call checks: after a first call has set up
the fast path, an aliased output, an unknown keyword or a bad dump request is still refused with
a TPPError. Also: sparse tensors and outputs that require grad."""
import numpy as np
import pytest

import tpp
from tpp.errors import ArgumentError

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
