"""The CPU emulator of CUDA kernels (tests/cuda_emulator.py + .h), checked on its own.

Independent of the TPP generators: small CUDA kernels written here exercise the emulated
mma.m16n8k16 (bf16, f16) with fragments loaded per the PTX ISA's documented layout by plain
loads, and again through ldmatrix (x1, x2, x4, .trans) from shared memory filled by cp.async;
numpy computes the expected products. Also: warp shuffles and votes, __syncthreads with static
and dynamic shared memory, partial warps and early-exiting threads, cp.async's zero fill, the
poisoning of dynamic shared memory, argument passing (ints of every width, negative values,
pointer tables, raw addresses) and the errors of the Python API.
"""
import ml_dtypes
import numpy as np
import pytest

from tpp.core.errors import CompileError
from tpp_cuda.launch import Launch

import cuda_emulator
from cuda_emulator import EmulatedModule

pytestmark = pytest.mark.skipif(not cuda_emulator.available(),
                                reason="g++ or the CUDA headers are missing")

MMA = r"""
#ifndef TEST_MMA_PREAMBLE
#define TEST_MMA_PREAMBLE
template <bool BF16>
__device__ void mma(float d[4], const unsigned a[4], const unsigned b[2]) {
  if (BF16) tpp_mma_bf16_16816(d, a, b); else tpp_mma_f16_16816(d, a, b);
}
__device__ unsigned pack2(const unsigned short* p, int lo, int hi) {
  return p[lo] | ((unsigned)p[hi] << 16);
}
/* C/D fragment (PTX ISA, m16n8k16 .f32): d[i] is (row g + 8*(i>>1), col 2t + (i&1)) */
__device__ int cd_index(int lane, int i) {
  return ((lane >> 2) + 8 * (i >> 1)) * 8 + 2 * (lane & 3) + (i & 1);
}
#endif
"""

MMA_PLAIN = MMA + r"""
/* One problem per warp: A 16x16 and B 16x8 ([k][n]) row-major 16-bit, C, D 16x8 f32. Fragments
   per the PTX ISA (g = lane >> 2, t = lane % 4): a[r] holds A[g + 8*(r&1)][2t + 8*(r>>1) + {0,1}],
   b[r] holds B[2t + 8r + {0,1}][g]. */
template <bool BF16>
__device__ void mma_plain(const unsigned short* A, const unsigned short* B, const float* C,
                          float* D) {
  const int problem = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  A += problem * 256; B += problem * 128; C += problem * 128; D += problem * 128;
  unsigned a[4], b[2];
  float d[4];
  for (int r = 0; r < 4; ++r) {
    const int at = (g + 8 * (r & 1)) * 16 + 2 * t + 8 * (r >> 1);
    a[r] = pack2(A, at, at + 1);
  }
  for (int r = 0; r < 2; ++r) b[r] = pack2(B, (2 * t + 8 * r) * 8 + g, (2 * t + 8 * r + 1) * 8 + g);
  for (int i = 0; i < 4; ++i) d[i] = C[cd_index(lane, i)];
  mma<BF16>(d, a, b);
  for (int i = 0; i < 4; ++i) D[cd_index(lane, i)] = d[i];
}
extern "C" __global__ void mma_plain_bf16(const unsigned short* A, const unsigned short* B,
                                          const float* C, float* D) { mma_plain<true>(A, B, C, D); }
extern "C" __global__ void mma_plain_f16(const unsigned short* A, const unsigned short* B,
                                         const float* C, float* D) { mma_plain<false>(A, B, C, D); }
"""

MMA_LDMATRIX = MMA + r"""
/* The same product with fragments from shared memory through ldmatrix. tiles holds per problem
   A [16][16], At = A^T [16][16], B [16][8], Bt = B^T [8][16] (768 16-bit values), copied into
   the warp's part of dynamic shared memory by cp.async. Lane 8j + r gives the address of row r
   of matrix j. mode 0: A by x4, B by x2.trans; mode 1: A from At by x4.trans, B from Bt by x2;
   mode 2: A by x4, B from Bt by two x1. */
template <bool BF16>
__device__ void mma_ldmatrix(const unsigned short* tiles, const float* C, float* D, int mode) {
  extern __shared__ __align__(16) unsigned char tpp_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int problem = blockIdx.x * (blockDim.x / 32) + warp;
  unsigned short* s = reinterpret_cast<unsigned short*>(tpp_smem) + warp * 768;
  for (int c = lane; c < 96; c += 32) tpp_cp_async_16(s + 8 * c, tiles + problem * 768 + 8 * c, 16);
  tpp_cp_async_commit();
  tpp_cp_async_wait<0>();
  __syncthreads();
  const unsigned short *sA = s, *sAt = s + 256, *sB = s + 512, *sBt = s + 640;
  const int j = lane / 8, r = lane % 8;
  unsigned a[4], b[2];
  if (mode == 1)   /* a[j] = (At[8*(j>>1) .. +8][8*(j&1) .. +8])^T */
    tpp_ldmatrix_x4_trans(a, sAt + (r + 8 * (j >> 1)) * 16 + 8 * (j & 1));
  else             /* a[j] = A[8*(j&1) .. +8][8*(j>>1) .. +8] */
    tpp_ldmatrix_x4(a, sA + (r + 8 * (j & 1)) * 16 + 8 * (j >> 1));
  if (mode == 0) {          /* b[j] = (B[8j .. +8][0 .. 8])^T; lanes 16-31 repeat valid rows */
    tpp_ldmatrix_x2_trans(b, sB + (lane % 16) * 8);
  } else if (mode == 1) {   /* b[j] = Bt[0 .. 8][8j .. +8] */
    tpp_ldmatrix_x2(b, sBt + r * 16 + 8 * (j & 1));
  } else {
    tpp_ldmatrix_x1(&b[0], sBt + r * 16);
    tpp_ldmatrix_x1(&b[1], sBt + r * 16 + 8);
  }
  float d[4];
  for (int i = 0; i < 4; ++i) d[i] = C[problem * 128 + cd_index(lane, i)];
  mma<BF16>(d, a, b);
  for (int i = 0; i < 4; ++i) D[problem * 128 + cd_index(lane, i)] = d[i];
}
extern "C" __global__ void mma_ldmatrix_bf16(const unsigned short* tiles, const float* C, float* D,
                                             int mode) { mma_ldmatrix<true>(tiles, C, D, mode); }
extern "C" __global__ void mma_ldmatrix_f16(const unsigned short* tiles, const float* C, float* D,
                                            int mode) { mma_ldmatrix<false>(tiles, C, D, mode); }
"""

WARP_OPS = r"""
/* block (16, 4): linear id x + 16*y, two full warps; 8 results per thread, one sum per block */
extern "C" __global__ void warp_ops(const int* in, int* out, int* sums) {
  __shared__ int partial[64];
  const int tid = threadIdx.x + threadIdx.y * blockDim.x, gid = blockIdx.x * 64 + tid;
  const int v = in[gid];
  int* o = out + gid * 8;
  o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
  o[1] = __shfl_down_sync(0xffffffffu, v, 3);
  o[2] = __shfl_up_sync(0xffffffffu, v, 2, 16);
  o[3] = __shfl_sync(0xffffffffu, v, 6, 8);
  o[4] = (int)__ballot_sync(0xffffffffu, v > 0);
  o[5] = __any_sync(0xffffffffu, v > 90) + 2 * __all_sync(0xffffffffu, v > -1000);
  o[6] = (int)__shfl_down_sync(0xffffffffu, (float)v, 16);
  o[7] = (int)(__shfl_xor_sync(0xffffffffu, (long long)v << 33, 1) >> 33);
  __syncwarp();
  partial[tid] = v;
  __syncthreads();
  for (int stride = 32; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    __syncthreads();
  }
  if (tid == 0) sums[blockIdx.x] = partial[0];
}
"""

PARTIAL = r"""
/* 48 threads: warp 1 has 16 lanes; threads >= live leave before the block barriers */
extern "C" __global__ void partial_warp(const int* in, int* out, int live) {
  __shared__ int s[64];
  const int t = threadIdx.x;
  out[t] = (int)__ballot_sync(0xffffffffu, in[t] > 0);
  if (t >= live) return;
  s[t] = in[t];
  __syncthreads();
  int sum = 0;
  for (int i = 0; i < live; ++i) sum += s[i];
  __syncthreads();
  out[48 + t] = sum;
}
"""

SMEM = r"""
/* what each block finds in dynamic shared memory, then scribbles over it */
extern "C" __global__ void read_smem(unsigned* out) {
  extern __shared__ __align__(16) unsigned char tpp_smem[];
  unsigned* s = reinterpret_cast<unsigned*>(tpp_smem);
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
  __syncthreads();
  s[threadIdx.x] = 12345u;
}
/* lane l copies l of its 16 bytes (l <= 16); cp.async zero-fills the rest */
extern "C" __global__ void cp_async_fill(const unsigned char* src, unsigned char* dst) {
  extern __shared__ __align__(16) unsigned char tpp_smem[];
  const int l = threadIdx.x;
  tpp_cp_async_16(tpp_smem + 16 * l, src + 16 * l, l);
  tpp_cp_async_commit();
  tpp_cp_async_wait<0>();
  __syncthreads();
  for (int i = 0; i < 16; ++i) dst[16 * l + i] = tpp_smem[16 * l + i];
}
"""

ARGS = r"""
#include <cstdint>
extern "C" __global__ void __launch_bounds__(64) take_args(
    float* __restrict__ out, const float* const* rows, const long long n, int scale,
    unsigned char small, unsigned long long raw, int64_t shift, unsigned short u16) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = rows[i % 2][i] * scale + small + reinterpret_cast<const float*>(raw)[i] + shift + u16;
}
"""

SOURCES = {"mma_plain_bf16": MMA_PLAIN, "mma_ldmatrix_bf16": MMA_LDMATRIX, "warp_ops": WARP_OPS,
           "partial_warp": PARTIAL, "read_smem": SMEM, "take_args": ARGS}
DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}


@pytest.fixture(scope="module")
def module():
    return EmulatedModule(SOURCES)


def test_kernels_found_and_modes_chosen(module):
    assert set(module.kernels) == {"mma_plain_bf16", "mma_plain_f16", "mma_ldmatrix_bf16",
                                   "mma_ldmatrix_f16", "warp_ops", "partial_warp", "read_smem",
                                   "cp_async_fill", "take_args"}
    assert module.threaded("mma_plain_f16") and module.threaded("read_smem")
    assert not module.threaded("take_args")


# ---------------------------------------------------------------- mma and ldmatrix
def _problems(rng, dtype, values, count):
    """count (A 16x16, B 16x8, C 16x8) problems; "integers" makes every sum exact."""
    if values == "integers":
        a, b = rng.integers(-4, 5, (count, 16, 16)), rng.integers(-4, 5, (count, 16, 8))
        c = rng.integers(-50, 51, (count, 16, 8))
    else:
        a, b, c = (rng.standard_normal((count, 16, k)) for k in (16, 8, 8))
    return (a.astype(np.float32).astype(DTYPES[dtype]), b.astype(np.float32).astype(DTYPES[dtype]),
            c.astype(np.float32))


def _check_products(d, a, b, c, values):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = a64 @ b64 + c
    if values == "integers":
        np.testing.assert_array_equal(d, want)
    else:   # 16 f32 additions in k order: within 16 ulps of the sum of magnitudes
        bound = 16 * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64) + np.abs(c))
        assert (np.abs(d - want) <= bound).all()


@pytest.mark.parametrize("values", ["integers", "normal"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_mma_with_documented_fragments(module, dtype, values):
    a, b, c = _problems(np.random.default_rng(1), dtype, values, 4)
    d = np.full_like(c, np.nan)
    module.launch(f"mma_plain_{dtype}", Launch((2, 1, 1), (64, 1, 1)),
                  [a.view(np.uint16), b.view(np.uint16), c, d])
    _check_products(d, a, b, c, values)


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["x4+x2trans", "x4trans+x2", "x4+x1"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_mma_with_ldmatrix_fragments(module, dtype, mode):
    a, b, c = _problems(np.random.default_rng(2), dtype, "normal", 6)
    tiles = np.concatenate([t.reshape(6, -1) for t in (a, a.transpose(0, 2, 1), b,
                                                       b.transpose(0, 2, 1))], axis=1)
    d = np.full_like(c, np.nan)
    module.launch(f"mma_ldmatrix_{dtype}", Launch((3, 1, 1), (64, 1, 1), 2 * 1536),
                  [np.ascontiguousarray(tiles).view(np.uint16), c, d, mode])
    _check_products(d, a, b, c, "normal")


# ---------------------------------------------------------------- warps and blocks
def _shfl(values, mode, b, width=32):
    """The PTX shfl.sync result of every lane of one full warp."""
    out = []
    for lane in range(32):
        start = lane & ~(width - 1)
        j = {"idx": start + (b & (width - 1)), "up": lane - b, "down": lane + b,
             "bfly": lane ^ b}[mode]
        inside = j >= start if mode == "up" else j <= start + width - 1
        out.append(values[j if inside else lane])
    return np.array(out)


def test_warp_shuffles_votes_and_block_reduction(module):
    rng = np.random.default_rng(3)
    v = rng.integers(-100, 100, 3 * 64).astype(np.int32)
    out = np.zeros((3 * 64, 8), np.int32)
    sums = np.zeros(3, np.int32)
    module.launch("warp_ops", Launch((3, 1, 1), (16, 4, 1)), [v, out, sums])
    for w, vals in enumerate(v.reshape(-1, 32)):
        o = out[32 * w:32 * w + 32]
        np.testing.assert_array_equal(o[:, 0], _shfl(vals, "bfly", 5))
        np.testing.assert_array_equal(o[:, 1], _shfl(vals, "down", 3))
        np.testing.assert_array_equal(o[:, 2], _shfl(vals, "up", 2, 16))
        np.testing.assert_array_equal(o[:, 3], _shfl(vals, "idx", 6, 8))
        ballot = np.packbits(vals > 0, bitorder="little").view(np.uint32).view(np.int32)[0]
        assert (o[:, 4] == ballot).all()
        assert (o[:, 5] == int((vals > 90).any()) + 2).all()
        np.testing.assert_array_equal(o[:, 6], _shfl(vals, "down", 16))
        np.testing.assert_array_equal(o[:, 7], _shfl(vals, "bfly", 1))
    np.testing.assert_array_equal(sums, v.reshape(3, 64).sum(axis=1))


@pytest.mark.parametrize("live", [48, 40, 7])
def test_partial_warp_and_early_exit(module, live):
    v = np.random.default_rng(4).integers(-9, 9, 48).astype(np.int32)
    out = np.full(96, -1, np.int32)
    module.launch("partial_warp", Launch((2, 1, 1), (48, 1, 1)), [v, out, live])
    bits = np.packbits(v > 0, bitorder="little")
    words = [int.from_bytes(bits[:4].tobytes(), "little"), int(bits[4]) | int(bits[5]) << 8]
    np.testing.assert_array_equal(out[:48].view(np.uint32), np.repeat(words, [32, 16]))
    np.testing.assert_array_equal(out[48:48 + live], v[:live].sum())
    assert (out[48 + live:] == -1).all()


@pytest.mark.parametrize("poison", [True, False])
def test_dynamic_smem_is_refilled_for_each_block(module, poison):
    out = np.zeros(3 * 32, np.uint32)
    module.launch("read_smem", Launch((3, 1, 1), (32, 1, 1), 128), [out], poison_smem=poison)
    assert (out == (0xFFFFFFFF if poison else 0)).all()


def test_cp_async_zero_fills(module):
    src = np.arange(17 * 16, dtype=np.uint8)
    dst = np.full(17 * 16, 0xEE, np.uint8)
    module.launch("cp_async_fill", Launch((1, 1, 1), (17, 1, 1), 17 * 16), [src, dst])
    want = src.reshape(17, 16).copy()
    want[np.arange(16) >= np.arange(17)[:, None]] = 0
    np.testing.assert_array_equal(dst.reshape(17, 16), want)


# ---------------------------------------------------------------- arguments and errors
@pytest.mark.parametrize("threaded", [None, True])
def test_argument_words(module, threaded):
    n = 100
    rows = np.arange(2 * n, dtype=np.float32).reshape(2, n)
    table = np.array([rows[0].ctypes.data, rows[1].ctypes.data], np.uint64)
    extra = np.full(n, 0.5, np.float32)
    out = np.zeros(n + 1, np.float32)
    module.launch("take_args", Launch((2, 1, 1), (64, 1, 1)),
                  [out, table, n, -3, 255, extra.ctypes.data, -(2 ** 40), 65535],
                  threaded=threaded)
    i = np.arange(n)
    want = rows[i % 2, i] * -3 + 255 + 0.5 + np.float32(-(2 ** 40)) + 65535
    np.testing.assert_array_equal(out[:n], want.astype(np.float32))
    assert out[n] == 0


def test_call_errors(module):
    geometry = Launch((1, 1, 1), (32, 1, 1))
    with pytest.raises(TypeError, match="takes 8 arguments, got 1"):
        module.launch("take_args", geometry, [np.zeros(1)])
    with pytest.raises(TypeError, match="numpy arrays and ints"):
        module.launch("read_smem", geometry, [1.5])
    with pytest.raises(KeyError, match="no kernel"):
        module.launch("missing", geometry, [])
    with pytest.raises(ValueError, match="dynamic shared memory"):
        module.launch("read_smem", Launch((1, 1, 1), (32, 1, 1), 300 * 1024), [np.zeros(32)])


def test_build_errors():
    with pytest.raises(ValueError, match="no __global__ function named 'k'"):
        EmulatedModule({"k": 'extern "C" __global__ void other(int* p) {}'})
    with pytest.raises(CompileError, match="undeclared_thing"):
        EmulatedModule({"bad": 'extern "C" __global__ void bad(int* p) { undeclared_thing; }'})
