"""The tensor-core BRGEMM kernel (bf16 x bf16, f16 x f16): mma.sync m16n8k16 fed by a
cp.async pipeline and ldmatrix; the design is in tpp_cuda.brgemm's docstring."""
from __future__ import annotations

from dataclasses import dataclass

from .brgemm_parts import (MmaTile, Stored, stored_a, stored_b, _params, _batch_args, _finish_fn,
                           _common_constants, _cursor, _helpers, _namespace, _prologue, _c_bool,
                           _cdiv, _CTYPE)


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


def _mma_source(spec, name, t: MmaTile, form) -> str:
    """The tensor-core kernel (form KERNEL: one BM x BN tile of C per block) or its block form
    (the block loops over all tiles); `name` is the spec's kernel name."""
    a, b = stored_a(spec, t.bm, t.bk), stored_b(spec, t.bn, t.bk)
    constants = (_common_constants(spec, t) +
                 f"constexpr int BM = {t.bm}, BN = {t.bn}, BK = {t.bk}, STAGES = {t.stages};\n"
                 f"constexpr int THREADS = {t.threads}, WARPS_N = {t.warps_n};\n"
                 f"constexpr int WM = {t.bm // t.warps_m}, WN = {t.bn // t.warps_n}, "
                 f"MI = {t.mi}, NI = {t.ni};\n"
                 f"constexpr int KT = {_cdiv(spec.k, t.bk)};   // k tiles per batch block\n"
                 f"constexpr int A_BYTES = {2 * t.bm * t.bk}, STAGE_BYTES = {t.stage_bytes};\n"
                 f"constexpr int A_ROW_BYTES = {2 * a.tile_cols}, B_ROW_BYTES = {2 * b.tile_cols};\n"
                 f"constexpr bool VEC_LD_A = {_c_bool(spec.lda % 8 == 0)}, "
                 f"VEC_LD_B = {_c_bool(spec.ldb % 8 == 0)};   // rows 16-byte aligned\n")
    fname = form.name(name)
    helpers = _namespace(fname, constants, _cursor(spec), _mma_tile_offset(a), _mma_tile_offset(b),
                         _mma_copy_fn(spec, a, t), _mma_copy_fn(spec, b, t),
                         _mma_copy_next(spec, t), _mma_compute_fn(spec), _finish_fn(spec))
    _, names = _batch_args(spec)
    body = f"""{_prologue(form, t)}  using namespace {fname}_ns;
  extern __shared__ __align__(16) unsigned char tpp_smem[];
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const int wm0 = (warp / WARPS_N) * WM, wn0 = (warp % WARPS_N) * WN;
{_mma_lane_offsets(spec)}  /* block-uniform loops over the C tiles: all threads reach every barrier */
  for (int tm = (int)biy; tm < TILES_M; tm += (int)gdy)
  for (int tn = (int)bix; tn < TILES_N; tn += (int)gdx) {{
  const int m0 = tm * BM, n0 = tn * BN;
  float acc[MI][NI][4];
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
{_mma_epilogue(spec)}  __syncthreads();   // the next tile's copies rewrite the stages
  }}
"""
    bounds = f"__launch_bounds__({t.threads}, {2 if t.threads >= 256 else 4}) "
    return _helpers(form, fname, helpers) + form.function(name, _params(spec), body,
                                                          bounds=bounds)
