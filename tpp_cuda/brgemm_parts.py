"""The pieces both CUDA BRGEMM kernels share (see tpp_cuda.brgemm for the design): the
tile shapes, the stored operand tiles a thread block copies, the kernel parameters, the batch
cursor, and the epilogue of one C element."""
from __future__ import annotations

from dataclasses import dataclass

from tpp.core import optable
from tpp.core.spec import mask_bytes

from . import eltwise
from .cooperative import guarded

_CTYPE, _LOAD, _STORE = eltwise._CTYPE, eltwise._LOAD, eltwise._STORE

PARAM_NAMES = {"stride": ("stride_a", "stride_b"), "offset": ("offsets_a", "offsets_b"),
               "address": ("unused_a", "unused_b")}


# ---------------------------------------------------------------- tiles
@dataclass(frozen=True)
class MmaTile:
    """A tensor-core block tile: BM x BN of C, BK of k per pipeline stage, warps_m x warps_n
    warps each owning a (bm/warps_m) x (bn/warps_n) piece made of 16x8 mma tiles."""
    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int

    @property
    def threads(self):
        return 32 * self.warps_m * self.warps_n

    @property
    def mi(self):          # 16-row mma tiles per warp
        return self.bm // self.warps_m // 16

    @property
    def ni(self):          # 8-column mma tiles per warp
        return self.bn // self.warps_n // 8

    @property
    def stage_bytes(self):
        return 2 * (self.bm * self.bk + self.bk * self.bn)

    @property
    def shared_bytes(self):
        return self.stages * self.stage_bytes


@dataclass(frozen=True)
class SimtTile:
    """A SIMT block tile: BM x BN of C, BK of k per step, tx x ty threads each owning
    (4*split_m) x (4*split_n) of C as strips of 4 rows / 4 columns, bm/split_m apart."""
    bm: int
    bn: int
    bk: int
    tx: int
    ty: int

    @property
    def threads(self):
        return self.tx * self.ty

    @property
    def split_m(self):
        return self.bm // (4 * self.ty)

    @property
    def split_n(self):
        return self.bn // (4 * self.tx)


def _cdiv(a, b):
    return (a + b - 1) // b


def _c_bool(v) -> str:
    return "true" if v else "false"


# ---------------------------------------------------------------- stored operand tiles
@dataclass(frozen=True)
class Stored:
    """The tile of one stored input block a thread block copies at (m0, n0, k0)."""
    name: str        # "a" / "b"
    dtype: str
    rows: int        # stored rows / columns of the whole block (the bounds)
    cols: int
    row0: str        # C expressions of the tile's first stored row / column
    col0: str
    tile_rows: int
    tile_cols: int
    vnni: bool       # stored (p, c) is logical k = 2p + (c & 1), present only when < k
    to_kx: tuple     # C (k, x) of tile element (r, c) in a [k][m or n] tile (SIMT kernel)

    def valid(self, k: int, gr="gr", gc="gc") -> str:
        """C condition: stored element (gr, gc) lies inside the block."""
        cond = f"{gr} < {self.rows} && {gc} < {self.cols}"
        return cond + (f" && 2 * {gr} + ({gc} & 1) < {k}" if self.vnni else "")


def stored_a(spec, bm, bk) -> Stored:
    if spec.trans_a:
        return Stored("a", spec.dtype_a.name, spec.k, spec.m, "k0", "m0", bk, bm, False,
                      ("r", "c"))
    return Stored("a", spec.dtype_a.name, spec.m, spec.k, "m0", "k0", bm, bk, False, ("c", "r"))


def stored_b(spec, bn, bk) -> Stored:
    dt = spec.dtype_b.name
    if spec.vnni_b:
        return Stored("b", dt, (spec.k + 1) // 2, 2 * spec.n, "k0 / 2", "2 * n0", bk // 2,
                      2 * bn, True, ("2 * r + (c & 1)", "c >> 1"))
    if spec.trans_b:
        return Stored("b", dt, spec.n, spec.k, "n0", "k0", bn, bk, False, ("c", "r"))
    return Stored("b", dt, spec.k, spec.n, "k0", "n0", bk, bn, False, ("r", "c"))


# ---------------------------------------------------------------- shared C pieces
def _params(spec) -> list:
    """The kernel's eight parameters, as C declarations."""
    ta, tb, tc = (_CTYPE[d.name] for d in (spec.dtype_a, spec.dtype_b, spec.dtype_c))
    arg_a, arg_b = PARAM_NAMES[spec.batch]
    if spec.batch == "address":
        ptrs = [f"const {ta}* const* __restrict__ a", f"const {tb}* const* __restrict__ b"]
    else:
        ptrs = [f"const {ta}* __restrict__ a", f"const {tb}* __restrict__ b"]
    args = {"stride": "long long", "offset": "const long long* __restrict__",
            "address": "long long"}[spec.batch]
    return ptrs + [f"{tc}* __restrict__ c", f"const {tc}* __restrict__ bias",
                   "unsigned char* __restrict__ mask", "long long count",
                   f"{args} {arg_a}", f"{args} {arg_b}"]


def _batch_args(spec) -> tuple:
    """(declarations, names) of the parameters that locate the batch blocks."""
    decls = [p for p in _params(spec) if p.split()[-1] in
             ("a", "b", "count", *PARAM_NAMES[spec.batch])]
    return ", ".join(decls), ", ".join(d.split()[-1] for d in decls)


def _block_pointer(spec, name) -> str:
    """C expression of batch block `cur.i` of input `name`."""
    arg = dict(zip("ab", PARAM_NAMES[spec.batch]))[name]
    return {"stride": f"{name} + cur.i * {arg}", "offset": f"{name} + {arg}[cur.i]",
            "address": f"{name}[cur.i]"}[spec.batch]


def _finish_fn(spec) -> str:
    """The per-element epilogue: beta*C + bias, the activation (its `tpp.core.optable` definition,
    rendered like the element-wise kernels'), the rounded store; returns the relu mask bit
    (0 outside the block)."""
    tc, load, store = _CTYPE[spec.dtype_c.name], _LOAD[spec.dtype_c.name], _STORE[spec.dtype_c.name]
    lines = ["  if (row >= M || col >= N) return 0u;",
             "  const long long at = (long long)row * LDC + col;",
             "  float x = acc;"]
    if spec.beta:
        lines.append(f"  x += {load.format('c[at]')};")
    if spec.bias:
        lines.append(f"  x += {load.format('bias[row]' if spec.bias == 'col' else 'bias[col]')};")
    values = ["x"]
    if spec.activation:
        definition = optable.definition(*optable.epilogue(spec.activation, spec.bitmask))
        body, values = eltwise.body(definition, {"in": "x"})
        lines += ["  " + line for line in body]
    lines.append(f"  c[at] = {store.format(values[0])};")
    lines.append("  return " + (f"{values[1]} ? 1u : 0u;" if spec.bitmask else "0u;"))
    return (f"__device__ __forceinline__ unsigned finish({tc}* c, const {tc}* bias, int row, "
            f"int col, float acc) {{\n" + "\n".join(lines) + "\n}\n"
            "// one relu mask byte: columns col..col+7 of row (col a multiple of 8)\n"
            "__device__ __forceinline__ void put_mask(unsigned char* mask, int row, int col, "
            "unsigned bits) {\n"
            f"  if (row < M && col < N) mask[(long long)row * {mask_bytes(spec.n)} + (col >> 3)]"
            " = (unsigned char)bits;\n}\n")


def _common_constants(spec, t) -> str:
    return (f"constexpr int M = {spec.m}, N = {spec.n}, K = {spec.k};\n"
            f"constexpr long long LDA = {spec.lda}, LDB = {spec.ldb}, LDC = {spec.ldc};\n"
            f"constexpr int TILES_M = {_cdiv(spec.m, t.bm)}, TILES_N = {_cdiv(spec.n, t.bn)};"
            f"   // C tiles\n")


def _cursor(spec) -> str:
    """The (batch block, k tile) a copy reads next, and `seek`, which points it at block cur.i."""
    ta, tb = _CTYPE[spec.dtype_a.name], _CTYPE[spec.dtype_b.name]
    decls, _ = _batch_args(spec)
    return f"""struct Cursor {{
  long long i;   // batch block
  int kt;        // k tile
  const {ta}* a;
  const {tb}* b;
  bool vec_a, vec_b;   // 16-byte aligned: cp.async may copy the block
}};
__device__ __forceinline__ void seek(Cursor& cur, {decls}) {{
  if (cur.i >= count) return;
  cur.a = {_block_pointer(spec, 'a')};
  cur.b = {_block_pointer(spec, 'b')};
  cur.vec_a = VEC_LD_A && ((unsigned long long)cur.a & 15) == 0;
  cur.vec_b = VEC_LD_B && ((unsigned long long)cur.b & 15) == 0;
}}
"""


def _namespace(name, *pieces) -> str:
    return f"namespace {name}_ns {{\n" + "\n".join(pieces) + f"}}  // namespace {name}_ns\n"


def _helpers(form, fname: str, namespace: str) -> str:
    """The helper namespace of function `fname` as its form needs it: a block form's guarded
    (several nests calling the same function may share one translation unit)."""
    return namespace if form.kernel else guarded(f"{fname}_ns", namespace)


def _prologue(form, t) -> str:
    """The grid names (tpp_cuda.cooperative) of a kernel whose blocks are t.threads threads
    along x: the kernel's built-ins, or one block of exactly t.threads threads."""
    return form.prologue() if form.kernel else form.prologue(t.threads, 1)
