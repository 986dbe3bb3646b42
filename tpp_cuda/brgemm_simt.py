"""The SIMT f32 FFMA BRGEMM kernel (f32 and mixed 16-bit inputs; no TF32); the design is in
tpp_cuda.brgemm's docstring."""
from __future__ import annotations

from .brgemm_parts import (SimtTile, Stored, stored_a, stored_b, _params, _batch_args, _finish_fn,
                           _common_constants, _cursor, _helpers, _namespace, _prologue, _cdiv,
                           _CTYPE, _LOAD)


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


def _simt_source(spec, name, t: SimtTile, form) -> str:
    """The SIMT kernel (form KERNEL: one BM x BN tile of C per block) or its block form (the
    block loops over all tiles); `name` is the spec's kernel name."""
    a, b = stored_a(spec, t.bm, t.bk), stored_b(spec, t.bn, t.bk)
    constants = (_common_constants(spec, t) +
                 f"constexpr int BM = {t.bm}, BN = {t.bn}, BK = {t.bk}, TX = {t.tx}, "
                 f"THREADS = {t.threads};\n"
                 f"constexpr int SPLIT_M = {t.split_m}, SPLIT_N = {t.split_n}, "
                 f"RM = {4 * t.split_m}, RN = {4 * t.split_n};\n"
                 f"constexpr int KT = {_cdiv(spec.k, t.bk)};   // k tiles per batch block\n"
                 "constexpr bool VEC_LD_A = false, VEC_LD_B = false;   // element loads only\n")
    fname = form.name(name)
    helpers = _namespace(fname, constants, _cursor(spec), _simt_fetch_fn(spec, a, t),
                         _simt_fetch_fn(spec, b, t), _simt_fetch_next(spec), _simt_compute_fn(),
                         _finish_fn(spec))
    _, names = _batch_args(spec)
    body = f"""{_prologue(form, t)}  using namespace {fname}_ns;
  __shared__ __align__(16) float as[2][BK][BM + 4];
  __shared__ __align__(16) float bs[2][BK][BN + 4];
  const int tx = (int)threadIdx.x % TX, ty = (int)threadIdx.x / TX;
  /* block-uniform loops over the C tiles: every thread reaches every barrier */
  for (int tm = (int)biy; tm < TILES_M; tm += (int)gdy)
  for (int tn = (int)bix; tn < TILES_N; tn += (int)gdx) {{
  const int m0 = tm * BM, n0 = tn * BN;
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
{_simt_epilogue(spec)}  __syncthreads();   // the next tile rewrites the shared tiles
  }}
"""
    return _helpers(form, fname, helpers) + form.function(
        name, _params(spec), body, bounds=f"__launch_bounds__({t.threads}, 2) ")
