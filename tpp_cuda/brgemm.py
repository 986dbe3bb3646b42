"""CUDA C source for the batch-reduce GEMM: C = act(beta*C + sum_i A_i @ B_i + bias).

One `extern "C" __global__` kernel per spec. Sizes, leading dimensions, layouts, dtypes and the
epilogue are compile-time; the batch (count, strides / offsets / addresses) is run-time. The
parameters are eight 64-bit values in the CPU ABI's order `f(a, b, c, bias, mask, count, arg_a,
arg_b)`:
  stride   (const TA* a, const TB* b, TC* c, const TC* bias, unsigned char* mask,
            long long count, long long stride_a, long long stride_b)   element strides
  offset   (..., long long count, const long long* offsets_a, const long long* offsets_b)
  address  (const TA* const* a, const TB* const* b, ..., long long count, long long, long long)
bias / mask may be null when the spec has none; count may be 0 (then C = act(beta*C + bias)).
The grid covers C in BM x BN block tiles (x over n, y over m); each thread block loops over the
batch and, inside each batch block, over k in BK steps, as one flat sequence of (block, k-tile)
steps, so the copy pipeline runs on across batch boundaries.

Two kernels, chosen from the dtypes:

Tensor cores (dtype_a == dtype_b, both bf16 or both f16): `mma.sync m16n8k16` with f32
accumulators (tpp_cuda.ptx wrappers). Tiles (picked from m, n): 128x128 (8 warps, 2 x 4, each
owning 64x32 of C: 4 x 4 mma tiles), 64x64 (4 warps of 32x32) or 32x32 (2 warps of 32x16); BK=32.
Operands are copied global -> shared memory with 16-byte cp.async, in a 3-stage pipeline (2 for
the 32x32 tile) in dynamic shared memory (48 KiB for 128x128: no opt-in above the default limit
needed). Each tile keeps the *stored* orientation of its block (no transposition on the way) and
ldmatrix reads the mma fragments out of it:
  A (m, k)        ldmatrix.x4         A trans (k, m)   ldmatrix.x4.trans
  B (k, n)        ldmatrix.x4.trans   B trans (n, k)   ldmatrix.x4 (the natural "col" operand)
  B vnni          plain 32-bit shared loads: a VNNI pair (B[2p, j], B[2p+1, j]) is exactly the
                  32-bit (k, k+1) register an mma B fragment holds, so a thread reads word
                  (p = k/2 + tig, j = n + g) of the tile - no shuffling at all.
Shared rows are XOR-swizzled in 16-byte chunks (chunk ^ f(row)), so the 8 rows an ldmatrix
phase reads (and the 4 x 8 words of the vnni loads) hit distinct banks without padding.
Edges: cp.async copies only the bytes inside the block (`src_bytes`, the rest zero-filled), so
m, n, k need not be multiples of anything. cp.async needs 16-byte aligned sources: when ld is not
a multiple of 8 elements (compile-time) or a batch block's address is not 16-byte aligned (a
block-uniform run-time test per batch block) the tile is filled element by element with plain
loads instead (correct, slower). An odd k with vnni B uses the element path for the last k tile,
which zeroes the unused half of the last pair (it may hold anything, even nan).

SIMT f32 FFMA (every other dtype combination: f32, and mixed bf16/f16 inputs - these are widened
exactly to f32 on the way into shared memory, so no precision is lost to a common 16-bit type).
No TF32: the reference is the exactly rounded f32 result, TF32's 10-bit mantissa is far from it.
Tiles 128x128 (256 threads, 8x8 accumulators each, as two 4-row by two 4-column strips 64 apart
so the shared loads are float4 and conflict-free), 64x64 (256 threads, 4x4) or 32x32 (64
threads, 4x4); BK=8; shared memory double-buffered [k][m] / [k][n] f32 tiles (rows padded by 4
floats), next tile prefetched into registers during the FFMAs. Element-wise predicated global
loads, so any layout (trans_a, trans_b, vnni_b), alignment and size works.

Epilogue (both kernels, on the f32 accumulators): + C (beta=1, read in dtype_c) + bias, then the
activation with the element-wise kernels' device functions (tpp_cuda.eltwise), rounded to dtype_c
to nearest even, stores predicated at the edges. The relu bitmask: the mma accumulator layout
gives 4 lanes 2 columns each of one byte, the SIMT layout 2 lanes 4 columns each; the lanes OR
their bits together with __shfl_xor_sync and one lane writes the byte, so each byte is written
exactly once (bits past n stay 0).

Fast: bf16/f16 tensor-core GEMMs with lds multiple of 8 and 16-byte aligned blocks. Slow-ish:
unaligned blocks or lds (element-wise copies), mixed 16-bit inputs (SIMT), small m/n (few blocks:
no split-k). Not done: wgmma/TMA (Hopper), split-k, block rasterization for L2 reuse.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tpp.errors import UnsupportedError
from tpp.spec import mask_bytes

from . import eltwise, ptx
from .launch import MAX_GRID_X, MAX_GRID_YZ, Launch

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


MMA_TILES = {"large": MmaTile(128, 128, 32, 2, 4, 3), "medium": MmaTile(64, 64, 32, 2, 2, 3),
             "small": MmaTile(32, 32, 32, 1, 2, 2)}
SIMT_TILES = {"large": SimtTile(128, 128, 8, 16, 16), "medium": SimtTile(64, 64, 8, 16, 16),
              "small": SimtTile(32, 32, 8, 8, 8)}


def _size_class(spec) -> str:
    """32x32 tiles when m or n is that small, 128x128 when that still gives >= 64 blocks (about
    half the SMs of an H100 busy before counting the second block per SM), else 64x64."""
    if min(spec.m, spec.n) <= 32:
        return "small"
    if _cdiv(spec.m, 128) * _cdiv(spec.n, 128) >= 64:
        return "large"
    return "medium"


def uses_tensor_cores(spec) -> bool:
    """bf16 x bf16 and f16 x f16 run on tensor cores; everything else on the SIMT f32 kernel."""
    return spec.dtype_a is spec.dtype_b and spec.dtype_a.name in ("bf16", "f16")


def tile(spec):
    """The block tile of the spec's kernel (an MmaTile or a SimtTile)."""
    table = MMA_TILES if uses_tensor_cores(spec) else SIMT_TILES
    return table[_size_class(spec)]


def _cdiv(a, b):
    return (a + b - 1) // b


# ---------------------------------------------------------------- the interface
def _check(spec, tile_=None):
    if getattr(spec, "family", None) != "brgemm":
        raise UnsupportedError(f"tpp_cuda.brgemm builds BRGEMM specs, got a "
                               f"{getattr(spec, 'family', type(spec).__name__)} spec "
                               f"(not yet in the CUDA backend)")
    t = tile(spec)
    if tile_ is not None:
        table = MMA_TILES if uses_tensor_cores(spec) else SIMT_TILES
        if tile_ not in table.values():
            raise UnsupportedError(f"tile {tile_!r} is not one of this spec's tiles "
                                   f"{list(table.values())}")
        t = tile_
    if _cdiv(spec.m, t.bm) > MAX_GRID_YZ or _cdiv(spec.n, t.bn) > MAX_GRID_X:
        raise UnsupportedError(f"brgemm m={spec.m}, n={spec.n} needs more than CUDA's grid "
                               f"limit of {t.bm}x{t.bn} block tiles")
    if max(spec.m, 2 * spec.n, spec.k, spec.lda, spec.ldb, spec.ldc) >= 2**31 - 256:
        raise UnsupportedError("brgemm sizes and lds must be below 2**31 (the kernels index "
                               "rows and columns with int)")


def supported(spec) -> bool:
    """Whether `source(spec)` can build the spec."""
    try:
        _check(spec)
    except UnsupportedError:
        return False
    return True


def kernel_name(spec, tile_=None) -> str:
    """A C identifier unique to the spec and stable across processes (hash of spec.key(), and
    of a tile that is not the spec's own)."""
    _check(spec, tile_)
    key = spec.key() if tile_ in (None, tile(spec)) else f"{spec.key()}/{tile_!r}"
    return f"tpp_brgemm_{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def launch(spec, tile_=None) -> Launch:
    """x over BN-column tiles of C, y over BM-row tiles; dynamic shared memory for the
    tensor-core pipeline (the SIMT kernel's is static)."""
    _check(spec, tile_)
    t = tile_ or tile(spec)
    shared = t.shared_bytes if isinstance(t, MmaTile) else 0
    return Launch((_cdiv(spec.n, t.bn), _cdiv(spec.m, t.bm), 1), (t.threads, 1, 1), shared)


def source(spec, tile_=None) -> str:
    """The CUDA C source of the spec's kernel (preambles included). `tile_` (tests, tuning)
    overrides the tile chosen from the spec: one of MMA_TILES / SIMT_TILES' values, of the
    spec's kind."""
    _check(spec, tile_)
    name, t = kernel_name(spec, tile_), tile_ or tile(spec)
    body = _mma_source(spec, name, t) if uses_tensor_cores(spec) else _simt_source(spec, name, t)
    return f"{eltwise._PREAMBLE}{ptx.PREAMBLE}\n/* {spec.key()} */\n{body}"


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
    """The per-element epilogue: beta*C + bias, the activation, the rounded store; returns the
    relu mask bit (0 outside the block)."""
    tc, load, store = _CTYPE[spec.dtype_c.name], _LOAD[spec.dtype_c.name], _STORE[spec.dtype_c.name]
    lines = ["  if (row >= M || col >= N) return 0u;",
             "  const long long at = (long long)row * LDC + col;",
             "  float x = acc;"]
    if spec.beta:
        lines.append(f"  x += {load.format('c[at]')};")
    if spec.bias:
        lines.append(f"  x += {load.format('bias[col]')};")
    y = eltwise.FORMULAS[spec.activation].format(approximate="none") if spec.activation else "x"
    lines.append(f"  c[at] = {store.format(y)};")
    lines.append("  return " + (f"({eltwise.FORMULAS['relu.mask']}) ? 1u : 0u;"
                                if spec.bitmask else "0u;"))
    return (f"__device__ __forceinline__ unsigned finish({tc}* c, const {tc}* bias, int row, "
            f"int col, float acc) {{\n" + "\n".join(lines) + "\n}\n"
            "// one relu mask byte: columns col..col+7 of row (col a multiple of 8)\n"
            "__device__ __forceinline__ void put_mask(unsigned char* mask, int row, int col, "
            "unsigned bits) {\n"
            f"  if (row < M && col < N) mask[(long long)row * {mask_bytes(spec.n)} + (col >> 3)]"
            " = (unsigned char)bits;\n}\n")


def _common_constants(spec) -> str:
    return (f"constexpr int M = {spec.m}, N = {spec.n}, K = {spec.k};\n"
            f"constexpr long long LDA = {spec.lda}, LDB = {spec.ldb}, LDC = {spec.ldc};\n")


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


# ---------------------------------------------------------------- tensor-core kernel
def _swizzle(chunks: int, vnni: bool) -> str:
    """C expression (in r) XORed into the 16-byte chunk index of tile row r. ldmatrix reads
    8 consecutive rows at one logical chunk: f spreads them over the 8 chunk slots of 128 bytes.
    The vnni loads read 4 consecutive rows of 8 words (2 chunks): f moves them 2 chunks apart."""
    if vnni:
        return "((r & 3) << 1)"
    if chunks >= 8:
        return "(r & 7)"
    per = 8 // chunks                   # rows per 128 bytes
    return f"((r >> {per.bit_length() - 1}) & {chunks - 1})"


def _mma_tile_offset(op: Stored) -> str:
    chunks = op.tile_cols // 8
    return (f"// byte offset of 16-byte chunk ch of row r in the {op.name.upper()} tile "
            f"({op.tile_rows} x {op.tile_cols}, swizzled)\n"
            f"__device__ __forceinline__ int {op.name}_off(int r, int ch) {{\n"
            f"  return r * {op.name.upper()}_ROW_BYTES + ((ch ^ {_swizzle(chunks, op.vnni)}) << 4);\n}}\n")


def _mma_copy_fn(spec, op: Stored, t: MmaTile) -> str:
    """copy_X: one stored tile into shared memory in 16-byte chunks, each thread the same chunk
    column of rows PASS apart (PASS a multiple of the swizzle period: one swizzle per thread).
    Three ways, block-uniform: a tile wholly inside the block with cp.async (no bounds
    arithmetic), an edge tile with cp.async zero-filling past the block's edge, and an
    unaligned block element by element."""
    ctype, chunks = _CTYPE[op.dtype], op.tile_cols // 8
    if t.threads % chunks or (t.threads // chunks) % 8 or op.tile_rows % (t.threads // chunks):
        raise AssertionError(f"tile {t} does not split the {op.name} tile evenly")
    passes, pass_rows = op.tile_rows // (t.threads // chunks), t.threads // chunks
    ld, row_bytes = f"LD{op.name.upper()}", f"{op.name.upper()}_ROW_BYTES"
    inside = (f"{op.row0} + {op.tile_rows} <= {op.rows} && "
              f"{op.col0} + {op.tile_cols} <= {op.cols}")
    return f"""__device__ __forceinline__ void copy_{op.name}(unsigned char* st, const {ctype}* blk, int m0, int n0, int k0, bool vec) {{
  const int r0 = (int)threadIdx.x / {chunks}, ch = (int)threadIdx.x % {chunks};
  unsigned char* dst = st + {op.name}_off(r0, ch);
  const int gr = {op.row0} + r0, gc = {op.col0} + ch * 8;   // stored row / column of pass 0
  if (vec && {inside}) {{
    const {ctype}* src = blk + gr * {ld} + gc;
#pragma unroll
    for (int i = 0; i < {passes}; ++i)
      tpp_cp_async_16(dst + i * {pass_rows} * {row_bytes}, src + i * {pass_rows} * {ld}, 16);
  }} else if (vec) {{
    const int left = {op.cols} - gc;
    const int n = left <= 0 ? 0 : (left < 8 ? left : 8);
#pragma unroll
    for (int i = 0; i < {passes}; ++i) {{
      const int r = gr + i * {pass_rows}, bytes = r < {op.rows} ? 2 * n : 0;
      tpp_cp_async_16(dst + i * {pass_rows} * {row_bytes},
                      bytes ? (const void*)(blk + r * {ld} + gc) : (const void*)blk, bytes);
    }}
  }} else {{
    const unsigned short* src = (const unsigned short*)blk;
#pragma unroll
    for (int i = 0; i < {passes}; ++i) {{
      const int r = gr + i * {pass_rows};
#pragma unroll
      for (int e = 0; e < 8; e += 2) {{
        unsigned w = 0u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {{
          const int c = gc + e + h;
          if ({op.valid(spec.k, "r", "c")}) w |= (unsigned)src[r * {ld} + c] << (16 * h);
        }}
        ((unsigned*)(dst + i * {pass_rows} * {row_bytes}))[e / 2] = w;
      }}
    }}
  }}
}}
"""


def _mma_copy_next(spec, t: MmaTile) -> str:
    """copy_next: issue the copies of the cursor's step into stage `st`, advance the cursor;
    always commits a (possibly empty) group so wait_group counts stages."""
    decls, names = _batch_args(spec)
    vec_b = "cur.vec_b"
    if spec.vnni_b and spec.k % 2:
        vec_b += " && k0 + BK < K"     # the last pair's unused half must read as 0
    return f"""__device__ __forceinline__ void copy_next(unsigned char* st, Cursor& cur, int m0, int n0, {decls}) {{
  if (cur.i < count) {{
    const int k0 = cur.kt * BK;
    copy_a(st, cur.a, m0, n0, k0, cur.vec_a);
    copy_b(st + A_BYTES, cur.b, m0, n0, k0, {vec_b});
    if (++cur.kt == KT) {{
      cur.kt = 0;
      ++cur.i;
      seek(cur, {names});
    }}
  }}
  tpp_cp_async_commit();
}}
"""


@dataclass(frozen=True)
class Fragment:
    """Where a lane's ldmatrix (or 32-bit) fragment load reads a tile: row = lane_row + row and
    chunk = lane_chunk + chunk, the lane parts run-time (lane, warp), the others compile-time in
    the unrolled loops (mi, ni, kk). The constant rows are multiples of the swizzle's period and
    the constant chunks share no bit with the lane chunks, so the byte offset is
    (lane_off ^ (chunk << 4)) + row * row_bytes, lane_off computed once per thread."""
    lane_row: str
    lane_chunk: str
    row: str
    chunk: str
    lane_byte: str = "0"     # byte within the chunk (32-bit vnni loads)

    def lane_offset(self, tile: str) -> str:
        return f"{tile}_off({self.lane_row}, {self.lane_chunk}) + {self.lane_byte}"

    def address(self, base: str, tile: str, lane_off: str) -> str:
        return (f"{base} + (({lane_off} ^ (({self.chunk}) << 4)) + ({self.row}) * "
                f"{tile.upper()}_ROW_BYTES)")


def a_fragment(spec) -> tuple:
    """(ldmatrix, Fragment) of A fragment (mi, kk): lane l addresses row l%8 of 8x8 matrix
    q = l/8, matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
    k 8-15)."""
    if spec.trans_a:   # stored rows are k, chunks are 8 m
        return "tpp_ldmatrix_x4_trans", Fragment("(q >> 1) * 8 + lr", "wm0 / 8 + (q & 1)",
                                                 "kk * 16", "mi * 2")
    return "tpp_ldmatrix_x4", Fragment("wm0 + (q & 1) * 8 + lr", "q >> 1", "mi * 16", "kk * 2")


def b_fragment(spec) -> tuple:
    """(ldmatrix or None, Fragment) of B fragment (ni, kk); an x4 ldmatrix fills bf[ni] and
    bf[ni + 1]: matrices (ni, k 0-7), (ni, k 8-15), (ni+1, k 0-7), (ni+1, k 8-15)."""
    if spec.vnni_b:    # word (p, j) of the tile is the (k = 2p, 2p + 1) pair of column j
        return None, Fragment("tig", "wn0 / 4 + (g >> 2)", "kk * 8", "ni * 2", "((g & 3) << 2)")
    if spec.trans_b:   # stored rows are n, chunks are 8 k: the natural "col" operand
        return "tpp_ldmatrix_x4", Fragment("wn0 + (q >> 1) * 8 + lr", "q & 1", "ni * 8",
                                           "kk * 2")
    return "tpp_ldmatrix_x4_trans", Fragment("(q & 1) * 8 + lr", "wn0 / 8 + (q >> 1)",
                                             "kk * 16", "ni")


def _b_load(spec) -> tuple:
    """(step over ni, C statement) filling bf[ni] (and bf[ni + 1] for an x4 ldmatrix)."""
    fn, frag = b_fragment(spec)
    if fn is None:     # rows p = k/2 + tig and k/2 + 4 + tig: (k, k+1) pairs 0-7 and 8-15
        lo = frag.address("sb", "b", "b_lane")
        hi = Fragment(frag.lane_row, frag.lane_chunk, frag.row + " + 4", frag.chunk)
        return 1, (f"bf[ni][0] = *(const unsigned*)({lo});\n"
                   f"      bf[ni][1] = *(const unsigned*)({hi.address('sb', 'b', 'b_lane')});")
    return 2, f"{fn}(&bf[ni][0], {frag.address('sb', 'b', 'b_lane')});"


def _mma_lane_offsets(spec) -> str:
    """The per-thread parts of the fragment offsets (see Fragment), computed once."""
    a, b = a_fragment(spec)[1], b_fragment(spec)[1]
    return f"""  const int q = lane >> 3, lr = lane & 7;   // ldmatrix: matrix and row this lane addresses
  const int g = lane >> 2, tig = lane & 3;  // mma: fragment row / column pair of this lane
  (void)q; (void)lr; (void)g; (void)tig;
  const int a_lane = {a.lane_offset("a")};
  const int b_lane = {b.lane_offset("b")};
"""


def _mma_compute_fn(spec) -> str:
    """compute: the BK/16 k16 steps of one stage: fragments by ldmatrix, MI x NI mma."""
    step, b_load = _b_load(spec)
    a_fn, a_frag = a_fragment(spec)
    mma = f"tpp_mma_{spec.dtype_a.name}_16816"
    return f"""__device__ __forceinline__ void compute(const unsigned char* st, float (&acc)[MI][NI][4], int a_lane, int b_lane) {{
  const unsigned char* sa = st;
  const unsigned char* sb = st + A_BYTES;
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {{
    unsigned af[MI][4], bf[NI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {a_fn}(af[mi], {a_frag.address("sa", "a", "a_lane")});
#pragma unroll
    for (int ni = 0; ni < NI; ni += {step}) {{
      {b_load}
    }}
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {mma}(acc[mi][ni], af[mi], bf[ni]);
  }}
}}
"""


def _mma_epilogue(spec) -> str:
    """Accumulator (mi, ni) holds rows g and g+8, columns 2*tig and 2*tig+1 of its 16x8 tile:
    the 4 lanes of a row hold the 8 columns of one mask byte."""
    mask = ""
    if spec.bitmask:
        mask = """
        bits <<= 2 * tig;
        bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
        bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
        if (tig == 0) put_mask(mask, row, col, bits);"""
    return f"""#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {{
        const int row = m0 + wm0 + mi * 16 + h * 8 + g, col = n0 + wn0 + ni * 8 + 2 * tig;
        unsigned bits = finish(c, bias, row, col, acc[mi][ni][2 * h]);
        bits |= finish(c, bias, row, col + 1, acc[mi][ni][2 * h + 1]) << 1;{mask or " (void)bits;"}
      }}
"""


def _mma_source(spec, name, t: MmaTile) -> str:
    a, b = stored_a(spec, t.bm, t.bk), stored_b(spec, t.bn, t.bk)
    constants = (_common_constants(spec) +
                 f"constexpr int BM = {t.bm}, BN = {t.bn}, BK = {t.bk}, STAGES = {t.stages};\n"
                 f"constexpr int THREADS = {t.threads}, WARPS_N = {t.warps_n};\n"
                 f"constexpr int WM = {t.bm // t.warps_m}, WN = {t.bn // t.warps_n}, "
                 f"MI = {t.mi}, NI = {t.ni};\n"
                 f"constexpr int KT = {_cdiv(spec.k, t.bk)};   // k tiles per batch block\n"
                 f"constexpr int A_BYTES = {2 * t.bm * t.bk}, STAGE_BYTES = {t.stage_bytes};\n"
                 f"constexpr int A_ROW_BYTES = {2 * a.tile_cols}, B_ROW_BYTES = {2 * b.tile_cols};\n"
                 f"constexpr bool VEC_LD_A = {_c_bool(spec.lda % 8 == 0)}, "
                 f"VEC_LD_B = {_c_bool(spec.ldb % 8 == 0)};   // rows 16-byte aligned\n")
    helpers = _namespace(name, constants, _cursor(spec), _mma_tile_offset(a), _mma_tile_offset(b),
                         _mma_copy_fn(spec, a, t), _mma_copy_fn(spec, b, t),
                         _mma_copy_next(spec, t), _mma_compute_fn(spec), _finish_fn(spec))
    _, names = _batch_args(spec)
    kernel = f"""extern "C" __global__ void __launch_bounds__({t.threads}, {2 if t.threads >= 256 else 4}) {name}({", ".join(_params(spec))}) {{
  using namespace {name}_ns;
  extern __shared__ __align__(16) unsigned char tpp_smem[];
  const int m0 = (int)blockIdx.y * BM, n0 = (int)blockIdx.x * BN;
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const int wm0 = (warp / WARPS_N) * WM, wn0 = (warp % WARPS_N) * WN;
{_mma_lane_offsets(spec)}  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
  Cursor cur = {{0, 0, nullptr, nullptr, false, false}};
  seek(cur, {names});
  // pipeline: stage s % STAGES holds step s; STAGES - 1 steps in flight
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) copy_next(tpp_smem + s * STAGE_BYTES, cur, m0, n0, {names});
  const long long steps = count > 0 ? count * KT : 0;
  int rd = 0, wr = STAGES - 1;
  for (long long s = 0; s < steps; ++s) {{
    tpp_cp_async_wait<STAGES - 2>();
    __syncthreads();   // step s landed; every warp is done with step s - 1's stage (wr)
    copy_next(tpp_smem + wr * STAGE_BYTES, cur, m0, n0, {names});
    compute(tpp_smem + rd * STAGE_BYTES, acc, a_lane, b_lane);
    rd = rd + 1 == STAGES ? 0 : rd + 1;
    wr = wr + 1 == STAGES ? 0 : wr + 1;
  }}
  tpp_cp_async_wait<0>();
{_mma_epilogue(spec)}}}
"""
    return helpers + kernel


def _c_bool(v) -> str:
    return "true" if v else "false"


# ---------------------------------------------------------------- SIMT f32 kernel
def _simt_fetch_fn(spec, op: Stored, t: SimtTile) -> str:
    """fetch_X: this thread's elements of the stored tile (one column, rows PASS apart),
    widened to f32, 0 outside the block; consecutive threads take consecutive stored columns,
    so loads coalesce. stash_X: them into the [k][x] shared tile."""
    if t.threads % op.tile_cols or op.tile_rows % (t.threads // op.tile_cols):
        raise AssertionError(f"tile {t} does not split the {op.name} tile evenly")
    per, pass_rows = op.tile_rows * op.tile_cols // t.threads, t.threads // op.tile_cols
    ld, big = f"LD{op.name.upper()}", op.name.upper()
    inside = (f"{op.row0} + {op.tile_rows} <= {op.rows} && "
              f"{op.col0} + {op.tile_cols} <= {op.cols}")
    width = t.bm if op.name == "a" else t.bn
    return f"""constexpr int {big}_PER = {per};
__device__ __forceinline__ void fetch_{op.name}(float (&v)[{big}_PER], const {_CTYPE[op.dtype]}* blk, int m0, int n0, int k0) {{
  const int gr = {op.row0} + (int)threadIdx.x / {op.tile_cols}, gc = {op.col0} + (int)threadIdx.x % {op.tile_cols};
  if ({inside}) {{
    const {_CTYPE[op.dtype]}* src = blk + gr * {ld} + gc;
#pragma unroll
    for (int i = 0; i < {big}_PER; ++i) v[i] = {_LOAD[op.dtype].format(f"src[i * {pass_rows} * {ld}]")};
  }} else {{
#pragma unroll
    for (int i = 0; i < {big}_PER; ++i) {{
      const int r = gr + i * {pass_rows};
      v[i] = ({op.valid(spec.k, "r", "gc")}) ? {_LOAD[op.dtype].format(f"blk[r * {ld} + gc]")} : 0.0f;
    }}
  }}
}}
__device__ __forceinline__ void stash_{op.name}(float (*s)[{width} + 4], const float (&v)[{big}_PER]) {{
  const int c = (int)threadIdx.x % {op.tile_cols};
#pragma unroll
  for (int i = 0; i < {big}_PER; ++i) {{
    const int r = (int)threadIdx.x / {op.tile_cols} + i * {pass_rows};
    s[{op.to_kx[0]}][{op.to_kx[1]}] = v[i];
  }}
}}
"""


def _simt_fetch_next(spec) -> str:
    """fetch_next: registers <- the cursor's step, then advance the cursor."""
    decls, names = _batch_args(spec)
    return f"""__device__ __forceinline__ void fetch_next(float (&va)[A_PER], float (&vb)[B_PER], Cursor& cur, int m0, int n0, {decls}) {{
  fetch_a(va, cur.a, m0, n0, cur.kt * BK);
  fetch_b(vb, cur.b, m0, n0, cur.kt * BK);
  if (++cur.kt == KT) {{
    cur.kt = 0;
    ++cur.i;
    seek(cur, {names});
  }}
}}
"""


def _simt_compute_fn() -> str:
    """compute: BK rank-1 updates of this thread's RM x RN accumulators from float4 strips."""
    return """__device__ __forceinline__ void compute(const float (*as)[BM + 4], const float (*bs)[BN + 4], float (&acc)[RM][RN], int tx, int ty) {
#pragma unroll
  for (int kk = 0; kk < BK; ++kk) {
    float av[RM], bv[RN];
#pragma unroll
    for (int s = 0; s < SPLIT_M; ++s)
      *(float4*)&av[4 * s] = *(const float4*)&as[kk][s * (BM / SPLIT_M) + ty * 4];
#pragma unroll
    for (int s = 0; s < SPLIT_N; ++s)
      *(float4*)&bv[4 * s] = *(const float4*)&bs[kk][s * (BN / SPLIT_N) + tx * 4];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}
"""


def _simt_epilogue(spec) -> str:
    """Thread (tx, ty) holds 4 consecutive columns per strip: lanes tx and tx^1 share a byte."""
    mask = ""
    if spec.bitmask:
        mask = """
        bits <<= (tx & 1) * 4;
        bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
        if ((tx & 1) == 0) put_mask(mask, row, col, bits);"""
    return f"""#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int sn = 0; sn < SPLIT_N; ++sn) {{
        const int row = m0 + (i / 4) * (BM / SPLIT_M) + ty * 4 + i % 4;
        const int col = n0 + sn * (BN / SPLIT_N) + tx * 4;
        unsigned bits = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) bits |= finish(c, bias, row, col + j, acc[i][sn * 4 + j]) << j;{mask or " (void)bits;"}
    }}
"""


def _simt_source(spec, name, t: SimtTile) -> str:
    a, b = stored_a(spec, t.bm, t.bk), stored_b(spec, t.bn, t.bk)
    constants = (_common_constants(spec) +
                 f"constexpr int BM = {t.bm}, BN = {t.bn}, BK = {t.bk}, TX = {t.tx}, "
                 f"THREADS = {t.threads};\n"
                 f"constexpr int SPLIT_M = {t.split_m}, SPLIT_N = {t.split_n}, "
                 f"RM = {4 * t.split_m}, RN = {4 * t.split_n};\n"
                 f"constexpr int KT = {_cdiv(spec.k, t.bk)};   // k tiles per batch block\n"
                 "constexpr bool VEC_LD_A = false, VEC_LD_B = false;   // element loads only\n")
    helpers = _namespace(name, constants, _cursor(spec), _simt_fetch_fn(spec, a, t),
                         _simt_fetch_fn(spec, b, t), _simt_fetch_next(spec), _simt_compute_fn(),
                         _finish_fn(spec))
    _, names = _batch_args(spec)
    kernel = f"""extern "C" __global__ void __launch_bounds__({t.threads}, 2) {name}({", ".join(_params(spec))}) {{
  using namespace {name}_ns;
  __shared__ __align__(16) float as[2][BK][BM + 4];
  __shared__ __align__(16) float bs[2][BK][BN + 4];
  const int m0 = (int)blockIdx.y * BM, n0 = (int)blockIdx.x * BN;
  const int tx = (int)threadIdx.x % TX, ty = (int)threadIdx.x / TX;
  float acc[RM][RN];
#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int j = 0; j < RN; ++j) acc[i][j] = 0.0f;
  float va[A_PER], vb[B_PER];
  Cursor cur = {{0, 0, nullptr, nullptr, false, false}};
  seek(cur, {names});
  const long long steps = count > 0 ? count * KT : 0;
  if (steps > 0) {{
    fetch_next(va, vb, cur, m0, n0, {names});
    stash_a(as[0], va);
    stash_b(bs[0], vb);
  }}
  __syncthreads();
  int buf = 0;
  for (long long s = 0; s < steps; ++s) {{
    const bool more = s + 1 < steps;
    if (more) fetch_next(va, vb, cur, m0, n0, {names});   // in flight during the FFMAs
    compute(as[buf], bs[buf], acc, tx, ty);
    if (more) {{
      stash_a(as[buf ^ 1], va);
      stash_b(bs[buf ^ 1], vb);
    }}
    __syncthreads();
    buf ^= 1;
  }}
{_simt_epilogue(spec)}}}
"""
    return helpers + kernel
