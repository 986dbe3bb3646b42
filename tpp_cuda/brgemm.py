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

Block form (`block_function(spec, threads)`, what a loop nest calls; tpp_cuda.cooperative): the
same kernel code with the block looping over all C tiles (a barrier between tiles), on the
tile of BLOCK_TILES that has exactly `threads` threads (64, 128 or 256; block_tile).
"""
from __future__ import annotations

import hashlib

from tpp.core.errors import UnsupportedError

from . import eltwise, ptx
from .brgemm_mma import _mma_source
from .brgemm_parts import MmaTile, SimtTile, _cdiv
from .brgemm_simt import _simt_source
from .cooperative import BLOCK_PREAMBLE, KERNEL, Block, Form
from .launch import MAX_GRID_X, MAX_GRID_YZ, Launch

__all__ = ["BLOCK_TILES", "MMA_TILES", "SIMT_TILES", "MmaTile", "SimtTile", "block_function",
           "block_tile", "kernel_name", "launch", "source", "supported", "tile",
           "uses_tensor_cores"]

# ---------------------------------------------------------------- tiles
MMA_TILES = {"large": MmaTile(128, 128, 32, 2, 4, 3), "medium": MmaTile(64, 64, 32, 2, 2, 3),
             "small": MmaTile(32, 32, 32, 1, 2, 2)}
SIMT_TILES = {"large": SimtTile(128, 128, 8, 16, 16), "medium": SimtTile(64, 64, 8, 16, 16),
              "small": SimtTile(32, 32, 8, 8, 8)}
# block forms (loop nests): threads per block -> (tensor-core tiles, smallest first; SIMT tile),
# every tile of exactly that many threads
BLOCK_TILES = {64: ((MMA_TILES["small"],), SIMT_TILES["small"]),
               128: ((MmaTile(32, 32, 32, 2, 2, 3), MMA_TILES["medium"]),
                     SimtTile(64, 32, 8, 8, 16)),
               256: ((MMA_TILES["large"],), SIMT_TILES["medium"])}


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
    return _source(spec, kernel_name(spec, tile_), tile_ or tile(spec), KERNEL)


def block_tile(spec, threads: int):
    """The tile of the spec's block form for a block of `threads` threads (BLOCK_TILES): the
    SIMT tile, or the first tensor-core tile whose edge covers min(m, n) (else the last)."""
    if threads not in BLOCK_TILES:
        raise UnsupportedError(f"a BRGEMM block function runs on {sorted(BLOCK_TILES)} "
                               f"threads, not {threads}")
    mma, simt = BLOCK_TILES[threads]
    if not uses_tensor_cores(spec):
        return simt
    return next((t for t in mma if min(spec.m, spec.n) <= min(t.bm, t.bn)), mma[-1])


def block_function(spec, threads: int) -> Block:
    """The spec's block form (tpp_cuda.cooperative): the kernel's code, the block looping over
    all C tiles of block_tile(spec, threads); the tensor-core form takes the tile's pipeline
    as dynamic shared memory (`tpp_smem`)."""
    _check(spec)
    t, form = block_tile(spec, threads), Form(threads)
    shared = t.shared_bytes if isinstance(t, MmaTile) else 0
    return Block(form.name(kernel_name(spec)), _source(spec, kernel_name(spec), t, form), shared)


def _source(spec, name, t, form) -> str:
    body = _mma_source(spec, name, t, form) if uses_tensor_cores(spec) else \
        _simt_source(spec, name, t, form)
    pre = "" if form.kernel else BLOCK_PREAMBLE
    return f"{eltwise._PREAMBLE}{ptx.PREAMBLE}{pre}\n/* {spec.key()} */\n{body}"
