"""Frozen, hashable descriptions of primitives: the cache key and all a backend ever sees.

A spec fixes the op, the block shape (m rows, n columns, row-major), the leading dimension of
every block operand (elements between rows, >= the row length), the dtypes, broadcast flags and
op parameters. `operands()` lists the arrays a kernel for the spec reads and writes, in the order
of the kernel's arguments; dispatch and code generators both work from that list.

Layouts of operands:
  block   (rows, cols) with leading dimension ld
  row     one row of `cols` contiguous values, broadcast down the rows
  col     one column of `rows` contiguous values, broadcast across the columns
  scalar  one value broadcast everywhere
  vector  `cols` contiguous values (a reduction's result)
  mask    a bitmask of a (rows, n) block: rows x ceil(n/8) contiguous bytes, bit j%8 of byte j//8
          of row i is element (i, j) (numpy.packbits(..., axis=1, bitorder="little"))
  index   `cols` contiguous int64 row indices
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import checks
from . import dtypes as _dt
from . import optable
from .errors import SpecError, UnsupportedError

BCASTS = (None, "row", "col", "scalar")


@dataclass(frozen=True)
class Operand:
    name: str
    role: str      # "in", "out" or "inout"
    layout: str    # block, row, col, scalar, vector, mask, index
    dtype: _dt.DType
    rows: int      # -1: any number of rows (gather's source, scatter's destination)
    cols: int
    ld: int = 0    # elements between rows for blocks; 0 for contiguous layouts
    ld_param: str | None = None   # the spec field that holds ld (blocks only)

    @property
    def shape(self) -> tuple:
        if self.layout in ("block", "mask"):
            return (self.rows, self.cols)
        if self.layout == "scalar":
            return ()
        if self.layout == "col":
            return (self.rows,)
        return (self.cols,)

    @property
    def extent(self) -> int:
        """Elements the operand spans from its first element (one row when rows is -1)."""
        if self.layout == "block":
            return (max(self.rows, 1) - 1) * self.ld + self.cols
        if self.layout == "mask":
            return self.rows * self.cols
        if self.layout == "col":
            return self.rows
        if self.layout == "scalar":
            return 1
        return self.cols

    def check_addressable(self):
        """SpecError unless the bytes the operand spans fit in the address space (so the
        kernel's int64 offsets never wrap around)."""
        what = f"operand {self.name!r} ({self.layout} of shape {self.shape}"
        what += f", {self.ld_param}={self.ld})" if self.ld_param else ")"
        checks.addressable(self.extent * self.dtype.itemsize, what)


def mask_bytes(n: int) -> int:
    """Bytes per row of the bitmask of an n-column block."""
    return (n + 7) // 8


def _size(value, what: str) -> int:
    """A size or ld: any integral value >= 1, as a Python int."""
    return checks.integer(value, what, minimum=1)


def _ld(value, default: int, row_len: int, what: str) -> int:
    if value is None:
        return default
    value = _size(value, what)
    if value < row_len:
        raise SpecError(f"{what}={value} is smaller than the row it holds ({row_len} elements)")
    return value


def _bcast(value, what: str):
    if value not in BCASTS:
        raise SpecError(f"{what} must be one of None, 'row', 'col', 'scalar', got {value!r}")
    return value


def _comp(value) -> _dt.DType:
    dt = _dt.float_dtype(value, "dtype_comp")
    if dt is not _dt.F32:
        raise UnsupportedError(f"dtype_comp must be f32 (computation is in f32), got {value!r}")
    return dt


def _input_operand(name, bcast, dtype, m, n, ld, ld_param) -> Operand:
    if bcast is None:
        return Operand(name, "in", "block", dtype, m, n, ld, ld_param)
    if bcast == "row":
        return Operand(name, "in", "row", dtype, 1, n)
    if bcast == "col":
        return Operand(name, "in", "col", dtype, m, 1)
    return Operand(name, "in", "scalar", dtype, 1, 1)


class _SpecBase:
    def param(self, key):
        return dict(self.params)[key]

    @property
    def info(self) -> optable.OpInfo:
        return optable.lookup(self.family, self.op)

    @property
    def kind(self) -> str:
        """The op's kind (map, reduce, transpose, ...): which generator builds it."""
        return self.info.kind

    def key(self) -> str:
        """A canonical text form of the spec, stable across processes (the cache key)."""
        parts = []
        for f in dataclasses.fields(self):
            parts.append(f"{f.name}={getattr(self, f.name)!r}")
        return f"{self.family}(" + ",".join(parts) + ")"

    @property
    def scalars(self) -> tuple:
        """Names of the run-time scalar arguments a kernel takes after its operand pointers
        (each an int64): ("seed",) for an op whose definition draws random numbers (dropout),
        else none."""
        if self.info.expr is None:
            return ()
        return ("seed",) if optable.definition(self.info, self.params).seeded else ()

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def __post_init__(self):
        for op in self.operands():   # validates operand geometry once
            op.check_addressable()


@dataclass(frozen=True)
class UnarySpec(_SpecBase):
    op: str
    m: int
    n: int
    ldi: int
    ldo: int
    dtype_in: _dt.DType
    dtype_out: _dt.DType
    dtype_comp: _dt.DType
    bcast: str | None
    params: tuple
    family = "unary"

    def operands(self) -> tuple:
        info, m, n = self.info, self.m, self.n
        din, dout = self.dtype_in, self.dtype_out
        if info.kind == "map":
            definition = optable.definition(info, self.params)
            ops = []
            if "in" in definition.reads:
                ops.append(_input_operand("in", self.bcast, din, m, n, self.ldi, "ldi"))
            ops.append(Operand("out", "out", "block", dout, m, n, self.ldo, "ldo"))
            if definition.mask:
                ops.append(Operand("mask", "out", "mask", _dt.U8, m, mask_bytes(n)))
            return tuple(ops)
        if info.kind == "map_inv":
            second = info.second_operand(dict(self.params))
            if second == "mask":
                extra = Operand("mask", "in", "mask", _dt.U8, m, mask_bytes(n))
            else:
                extra = Operand(second, "in", "block", din, m, n, self.ldi, "ldi")
            return (Operand("grad", "in", "block", din, m, n, self.ldi, "ldi"), extra,
                    Operand("out", "out", "block", dout, m, n, self.ldo, "ldo"))
        if info.kind == "reduce":
            length = n if self.param("axis") == 0 else m
            return (Operand("in", "in", "block", din, m, n, self.ldi, "ldi"),
                    Operand("out", "out", "vector", dout, 1, length))
        if info.kind == "transpose":
            return (Operand("in", "in", "block", din, m, n, self.ldi, "ldi"),
                    Operand("out", "out", "block", dout, n, m, self.ldo, "ldo"))
        if info.kind == "vnni2":
            return (Operand("in", "in", "block", din, m, n, self.ldi, "ldi"),
                    Operand("out", "out", "block", dout, (m + 1) // 2, 2 * n, self.ldo, "ldo"))
        if info.kind == "vnni2_inv":
            return (Operand("in", "in", "block", din, (m + 1) // 2, 2 * n, self.ldi, "ldi"),
                    Operand("out", "out", "block", dout, m, n, self.ldo, "ldo"))
        if info.kind == "gather":
            return (Operand("in", "in", "block", din, -1, n, self.ldi, "ldi"),
                    Operand("idx", "in", "index", _dt.I64, 1, m),
                    Operand("out", "out", "block", dout, m, n, self.ldo, "ldo"))
        if info.kind == "scatter":
            return (Operand("in", "in", "block", din, m, n, self.ldi, "ldi"),
                    Operand("idx", "in", "index", _dt.I64, 1, m),
                    Operand("out", "inout", "block", dout, -1, n, self.ldo, "ldo"))
        raise AssertionError(info.kind)


@dataclass(frozen=True)
class BinarySpec(_SpecBase):
    op: str
    m: int
    n: int
    ldi0: int
    ldi1: int
    ldo: int
    dtype_in0: _dt.DType
    dtype_in1: _dt.DType
    dtype_out: _dt.DType
    dtype_comp: _dt.DType
    bcast_in0: str | None
    bcast_in1: str | None
    params: tuple = ()
    family = "binary"

    def operands(self) -> tuple:
        m, n = self.m, self.n
        ins = (_input_operand("in0", self.bcast_in0, self.dtype_in0, m, n, self.ldi0, "ldi0"),
               _input_operand("in1", self.bcast_in1, self.dtype_in1, m, n, self.ldi1, "ldi1"))
        if self.info.kind == "compare":
            return ins + (Operand("mask", "out", "mask", _dt.U8, m, mask_bytes(n)),)
        role = "inout" if self.info.reads_out else "out"
        return ins + (Operand("out", role, "block", self.dtype_out, m, n, self.ldo, "ldo"),)


def _row_lengths(info, m, n):
    """(input row length, output row length, default ldi, default ldo) of a unary op."""
    if info.kind == "transpose":
        return n, m, n, m
    if info.kind == "vnni2":
        return n, 2 * n, n, 2 * n
    if info.kind == "vnni2_inv":
        return 2 * n, n, 2 * n, n
    return n, n, n, n


def make_unary(op, m, n, *, ldi=None, ldo=None, dtype_in="f32", dtype_out=None,
               dtype_comp="f32", bcast=None, **params) -> UnarySpec:
    """Validate the arguments of `tpp.unary` and build its spec."""
    if not isinstance(op, str):
        raise SpecError(f"op must be a string, got {op!r}")
    info = optable.lookup("unary", op)
    m, n = _size(m, "m"), _size(n, "n")
    din = _dt.float_dtype(dtype_in, "dtype_in")
    dout = din if dtype_out is None else _dt.float_dtype(dtype_out, "dtype_out")
    comp = _comp(dtype_comp)
    bcast = _bcast(bcast, "bcast")
    if info.bcast is not None:
        if bcast not in (None, info.bcast):
            raise SpecError(f"{op} reads a {info.bcast}; bcast must be {info.bcast!r} or None, "
                            f"got {bcast!r}")
        bcast = info.bcast
    if bcast is not None and info.kind != "map":
        raise SpecError(f"op {op!r} takes no broadcast input (bcast={bcast!r})")
    if info.kind in ("transpose", "vnni2", "vnni2_inv", "gather", "scatter") and din is not dout:
        raise SpecError(f"{op} moves data without converting it: dtype_out must equal "
                        f"dtype_in ({din}), got {dout}")
    if info.kind in ("vnni2", "vnni2_inv") and din.itemsize != 2:
        raise SpecError(f"{op} packs 16-bit data (bf16, f16), got {din}")
    checked = optable.check_params(info, params)
    in_len, out_len, dldi, dldo = _row_lengths(info, m, n)
    ldi = _ld(ldi, dldi, in_len, "ldi")
    ldo = _ld(ldo, dldo, out_len, "ldo")
    return UnarySpec(op, m, n, ldi, ldo, din, dout, comp, bcast, checked)


def make_binary(op, m, n, *, ldi0=None, ldi1=None, ldo=None, dtype_in0="f32", dtype_in1=None,
                dtype_out=None, dtype_comp="f32", bcast_in0=None, bcast_in1=None,
                **unknown) -> BinarySpec:
    """Validate the arguments of `tpp.binary` and build its spec (binary ops take no
    parameters: an unknown keyword is a SpecError)."""
    checks.reject_unknown("tpp.binary", unknown, checks.keywords_of(make_binary))
    if not isinstance(op, str):
        raise SpecError(f"op must be a string, got {op!r}")
    info = optable.lookup("binary", op)
    m, n = _size(m, "m"), _size(n, "n")
    d0 = _dt.float_dtype(dtype_in0, "dtype_in0")
    d1 = d0 if dtype_in1 is None else _dt.float_dtype(dtype_in1, "dtype_in1")
    if info.kind == "compare":
        if dtype_out not in (None, "u8", _dt.U8):
            raise SpecError(f"{op} writes a bitmask; dtype_out must be None, got {dtype_out!r}")
        dout = _dt.U8
    else:
        dout = d0 if dtype_out is None else _dt.float_dtype(dtype_out, "dtype_out")
    comp = _comp(dtype_comp)
    b0, b1 = _bcast(bcast_in0, "bcast_in0"), _bcast(bcast_in1, "bcast_in1")
    ldi0 = _ld(ldi0, n, n, "ldi0")
    ldi1 = _ld(ldi1, n, n, "ldi1")
    ldo = _ld(ldo, n, n, "ldo")
    return BinarySpec(op, m, n, ldi0, ldi1, ldo, d0, d1, dout, comp, b0, b1)
