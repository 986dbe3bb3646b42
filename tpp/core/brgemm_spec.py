"""The batch-reduce GEMM primitive's spec: C = act(beta*C + sum_i A_i @ B_i + bias).

Blocks are row-major, as everywhere in the library. The logical shapes are A_i (m, k), B_i (k, n)
and C (m, n); the *stored* shape of each block depends on the flags:

  A   (m, k), or (k, m) with trans_a (A_i is the transpose of the stored block)
  B   (k, n), or (n, k) with trans_b, or ((k+1)//2, 2n) with vnni_b: VNNI-2 pairs, element
      (p, 2j+t) holds B[2p+t, j] (the `vnni2` unary packs it; an odd k pads the last pair's
      second half, which is never read as a value)
  C   (m, n), written in place (beta=1 reads it first)

lda, ldb and ldc are the row strides of the stored blocks, in elements (>= the stored row).
bias "row" is one row of n values (dtype_c) added to every row, bias "col" one column of m
values added to every column (one value per row of C: per output channel where C's rows are
channels, as in a 1x1 convolution on NCHW data); activation is applied last, on the
f32 tile, then the tile is rounded (to nearest even) to dtype_c. bitmask=True also writes the
activation's bitmask (relu's `x > 0`; MASKED_ACTIVATIONS: the epilogues whose table definition
writes one), an (m, ceil(n/8)) uint8 block in the unary bitmask layout.

Batch modes (the count is a run-time argument, never part of the spec):
  stride   A_i = A + i*stride_a, B_i = B + i*stride_b (element strides, given at call time)
  offset   A_i = A + offsets_a[i], B_i = B + offsets_b[i] (int64 element offsets)
  address  A_i = a_ptrs[i], B_i = b_ptrs[i] (arrays of addresses)

The compiled function has one fixed signature, all arguments 64-bit integers:
    f(a, b, c, bias, mask, count, arg_a, arg_b)
bias/mask are 0 when the spec has none; arg_a/arg_b are the element strides (stride), the
addresses of the int64 offset arrays (offset), or unused (address, where a and b are the
addresses of the pointer arrays).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import checks, optable
from . import dtypes as _dt
from .errors import SpecError, UnsupportedError
from .spec import Operand, _size, _SpecBase, mask_bytes

BATCH_MODES = ("stride", "offset", "address")
ACTIVATIONS = (None, *optable.EPILOGUES)   # the ops the table marks as epilogues
# the epilogues that can record a bitmask: their mask_param makes the definition write one
MASKED_ACTIVATIONS = tuple(name for name in optable.EPILOGUES
                           if optable.lookup("unary", name).mask_param is not None)


@dataclass(frozen=True)
class BrgemmSpec(_SpecBase):
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    dtype_a: _dt.DType
    dtype_b: _dt.DType
    dtype_c: _dt.DType
    dtype_comp: _dt.DType
    beta: int
    trans_a: bool
    trans_b: bool
    vnni_b: bool
    batch: str
    bias: str | None
    activation: str | None
    bitmask: bool
    family = "brgemm"
    op = "brgemm"
    kind = "brgemm"
    scalars = ("count", "arg_a", "arg_b")

    @property
    def a_shape(self) -> tuple:
        """The stored shape of one A block."""
        return (self.k, self.m) if self.trans_a else (self.m, self.k)

    @property
    def b_shape(self) -> tuple:
        """The stored shape of one B block."""
        if self.vnni_b:
            return ((self.k + 1) // 2, 2 * self.n)
        return (self.n, self.k) if self.trans_b else (self.k, self.n)

    def operands(self) -> tuple:
        """The arrays a call binds: one A and one B block (each of the batch), C, and the
        optional bias row and relu bitmask."""
        ops = [Operand("a", "in", "block", self.dtype_a, *self.a_shape, self.lda, "lda"),
               Operand("b", "in", "block", self.dtype_b, *self.b_shape, self.ldb, "ldb"),
               Operand("c", "inout" if self.beta else "out", "block", self.dtype_c,
                       self.m, self.n, self.ldc, "ldc")]
        if self.bias == "col":
            ops.append(Operand("bias", "in", "col", self.dtype_c, self.m, 1))
        elif self.bias:
            ops.append(Operand("bias", "in", "row", self.dtype_c, 1, self.n))
        if self.bitmask:
            ops.append(Operand("mask", "out", "mask", _dt.U8, self.m, mask_bytes(self.n)))
        return tuple(ops)


def _flag(value, what):
    if not isinstance(value, bool):
        raise SpecError(f"{what} must be True or False, got {value!r}")
    return value


def make_brgemm(m, n, k, *, lda=None, ldb=None, ldc=None, dtype_a="f32", dtype_b=None,
                dtype_c=None, dtype_comp="f32", beta=0, trans_a=False, trans_b=False,
                vnni_b=False, batch="stride", bias=None, activation=None,
                bitmask=False, **unknown) -> BrgemmSpec:
    """Validate the arguments of `tpp.brgemm` and build its spec. dtype_b defaults to dtype_a,
    dtype_c to f32 (the accumulation dtype). Sizes and lds are any integral values (Python ints
    in the spec); every block must fit in the address space; an unknown keyword is a
    SpecError."""
    checks.reject_unknown("tpp.brgemm", unknown, checks.keywords_of(make_brgemm))
    m, n, k = _size(m, "m"), _size(n, "n"), _size(k, "k")
    da = _dt.float_dtype(dtype_a, "dtype_a")
    db = da if dtype_b is None else _dt.float_dtype(dtype_b, "dtype_b")
    dc = _dt.F32 if dtype_c is None else _dt.float_dtype(dtype_c, "dtype_c")
    comp = _dt.float_dtype(dtype_comp, "dtype_comp")
    if comp is not _dt.F32:
        raise UnsupportedError(f"dtype_comp must be f32 (BRGEMM accumulates in f32), got "
                               f"{dtype_comp!r}")
    if isinstance(beta, bool) or beta not in (0, 1):
        raise SpecError(f"beta must be 0 or 1, got {beta!r}")
    trans_a, trans_b = _flag(trans_a, "trans_a"), _flag(trans_b, "trans_b")
    vnni_b, bitmask = _flag(vnni_b, "vnni_b"), _flag(bitmask, "bitmask")
    if vnni_b and db.itemsize != 2:
        raise SpecError(f"vnni_b packs 16-bit B (bf16, f16), got dtype_b={db}")
    if vnni_b and trans_b:
        raise SpecError("vnni_b and trans_b exclude each other: a VNNI-packed B is (k/2, 2n)")
    if batch not in BATCH_MODES:
        raise SpecError(f"batch must be one of {BATCH_MODES}, got {batch!r}")
    if bias is True:
        bias = "row"
    if bias not in (None, False, "row", "col"):
        raise SpecError(f"bias must be None, 'row' (one row of n values) or 'col' (one column "
                        f"of m values), got {bias!r}")
    bias = bias or None
    if activation not in ACTIVATIONS:
        raise SpecError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if bitmask and activation not in MASKED_ACTIVATIONS:
        raise SpecError(f"bitmask=True records the activation's mask, which only "
                        f"{', '.join(MASKED_ACTIVATIONS)} writes; activation is {activation!r}")
    a_cols = m if trans_a else k
    b_cols = 2 * n if vnni_b else (k if trans_b else n)
    lda = _ld(lda, a_cols, "lda", "A")
    ldb = _ld(ldb, b_cols, "ldb", "B")
    ldc = _ld(ldc, n, "ldc", "C")
    return BrgemmSpec(m, n, k, lda, ldb, ldc, da, db, dc, comp, int(beta), trans_a, trans_b,
                      vnni_b, batch, bias, activation, bitmask)


def _ld(value, row, what, block):
    if value is None:
        return row
    value = _size(value, what)
    if value < row:
        raise SpecError(f"{what}={value} is smaller than a stored row of {block} ({row} elements)")
    return value
