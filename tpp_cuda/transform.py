"""CUDA C source for the unary TPPs that are not element-wise maps: reductions and data movement
(transpose, vnni2, vnni2_inv, gather_rows, scatter_rows). Dropout / dropout_inv are element-wise
maps: `tpp_cuda.eltwise` renders their op-table definitions (the RNG included).

The contract is eltwise's: one `extern "C" __global__` kernel per spec, one pointer argument per
operand of `spec.operands()` in order (eltwise's C element types; an index operand is
`const long long*`). Sizes and leading dimensions are baked in as constants. `launch(spec)` gives
the geometry; every kernel loops over whatever its grid does not cover, so it is correct for any
grid, but kernels that use shared memory or warp shuffles fix their block shape: the source names
it as the constants BX, BY, the launch uses exactly that block, and the kernel asserts
`blockDim == (BX, BY, 1)`. `block_function(spec, threads)` is the same code as a
block-cooperative device function (tpp_cuda.cooperative; its block is the whole grid).

reduce_*     Values are widened to f32 and accumulated in f32 in a fixed order (no atomics, so
             the result is deterministic and independent of the grid). max / min / absmax
             propagate nan like numpy (tpp_max / tpp_min of eltwise's preamble); sums start from
             -0.0, so a row of -0.0 sums to -0.0 as in numpy; sumsq accumulates with fmaf.
             axis 1 (m results): a group of L lanes of one warp reduces one row, L = 32 or, for
             rows shorter than 32, the next power of two >= n, so a warp reduces 32/L rows at
             once; the lanes stride the row (coalesced), then a __shfl_xor_sync tree combines
             them. axis 0 (n results): BX consecutive columns per block (coalesced loads), each
             column split over BY threads that stride the rows; their partial results are
             combined in shared memory in the order y = 0, 1, ..., BY-1.
transpose    32 x 32 tiles staged in shared memory, so both the loads (along input rows) and the
             stores (along output rows) coalesce; the tile's row is padded to an odd number of
             32-bit words, so reading a tile column is free of bank conflicts. Bits are moved as
             unsigned integers of the element's width (bit-exact, nan payloads included).
vnni2(_inv)  One thread per output pair: vnni2 reads in[2r][j] and in[2r+1][j] (0 past an odd
             last row) and writes out[r][2j], out[r][2j+1]; vnni2_inv is the inverse.
gather_rows  out[i] = in[idx[i]]; scatter_rows: out[idx[i]] = in[i]. BY rows per block, the BX
             threads of a block row stride the columns. A repeated index keeps the last row (as
             numpy's fancy assignment and the CPU backend do): before copying row i, scatter
             checks cooperatively whether a later entry holds the same index (O(m) index reads
             per row, no atomics, deterministic). Indices are not bounds-checked here (the
             caller validates them, as for the CPU backend).
"""
from __future__ import annotations

import hashlib

from tpp.core.errors import UnsupportedError

from .cooperative import KERNEL, Block, Form, pow2_at_least
from .eltwise import _CTYPE, _LOAD, _PREAMBLE, _STORE
from .launch import Launch, grid_stride_2d

_MOVE_KINDS = ("transpose", "vnni2", "vnni2_inv", "gather", "scatter")
_MAX_BLOCKS = 4096          # the kernels loop over whatever a grid this size does not cover
_TILE = 32                  # transpose tile edge
_TILE_ROWS = 8              # transpose: threadIdx.y rows per step (block 32 x 8)

_CTYPES = {**_CTYPE, "i64": "long long"}
_BITS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int"}   # movers copy bits

# reduce op -> (identity, how `acc` absorbs the widened input x, how two partials a, b combine)
_REDUCE = {
    "reduce_sum": ("-0.0f", "acc + x", "a + b"),
    "reduce_sumsq": ("-0.0f", "fmaf(x, x, acc)", "a + b"),
    "reduce_max": ("-INFINITY", "tpp_max(acc, x)", "tpp_max(a, b)"),
    "reduce_min": ("INFINITY", "tpp_min(acc, x)", "tpp_min(a, b)"),
    "reduce_absmax": ("0.0f", "tpp_max(acc, fabsf(x))", "tpp_max(a, b)"),
}

_TRANSFORM_PREAMBLE = "#include <assert.h>\n"


# ---------------------------------------------------------------- the contract
def _check(spec):
    if spec.family != "unary":
        raise UnsupportedError(f"{spec.family} specs are not a transform (tpp_cuda.transform "
                               f"builds reductions and data movement)")
    if spec.kind not in ("reduce", *_MOVE_KINDS):
        raise UnsupportedError(f"unary op {spec.op!r} (kind {spec.kind}) is not a transform; "
                               f"tpp_cuda.transform builds reduce_*, transpose, vnni2, vnni2_inv, "
                               f"gather_rows and scatter_rows")


def supported(spec) -> bool:
    """Whether `source(spec)` can build the spec."""
    try:
        _check(spec)
    except UnsupportedError:
        return False
    return True


def kernel_name(spec) -> str:
    """A C identifier unique to the spec and stable across processes (hash of spec.key())."""
    _check(spec)
    digest = hashlib.sha1(spec.key().encode()).hexdigest()[:16]
    return f"tpp_{spec.family}_{spec.op}_{digest}"


def source(spec) -> str:
    """The CUDA C source of one kernel for the spec."""
    _check(spec)
    return _source(spec, KERNEL)


def block_function(spec, threads: int) -> Block:
    """The spec's block form (tpp_cuda.cooperative): the kernel's code with the whole block as
    its grid, the fixed block shapes (BX, BY) refitted to `threads` threads."""
    _check(spec)
    form = Form(threads)
    return Block(form.name(kernel_name(spec)), _source(spec, form))


def _source(spec, form) -> str:
    body = _generator(spec)[0](spec, form)
    return (f"{_PREAMBLE}{_TRANSFORM_PREAMBLE}\n/* {spec.key()} */\n"
            + form.function(kernel_name(spec), _parameters(spec), body))


def launch(spec) -> Launch:
    """The geometry `source(spec)` is written for (see the module docstring)."""
    _check(spec)
    return _generator(spec)[1](spec)


def _generator(spec):
    """(body generator, launch generator) of the spec's kind."""
    return {"reduce": (_reduce_body, _reduce_launch),
            "transpose": (_transpose_body, _transpose_launch),
            "vnni2": (_vnni_body, _vnni_launch),
            "vnni2_inv": (_vnni_body, _vnni_launch),
            "gather": (_by_index_body, _by_index_launch),
            "scatter": (_by_index_body, _by_index_launch)}[spec.kind]


def _parameters(spec) -> str:
    args = []
    for o in spec.operands():
        const = "const " if o.role == "in" else ""
        args.append(f"{const}{_CTYPES[o.dtype.name]}* __restrict__ {o.name}")
    return args


def _fixed_block(form, bx: int, by: int) -> str:
    """Prologue of a body written for a (bx, by) block: the kernel's blockDim, or a block
    form's `threads` split as (bx, threads / bx)."""
    return form.prologue(bx, by) if form.kernel else form.prologue(*form.split(bx))


def _grid(items_x: int, items_y: int = 1) -> tuple:
    """A grid of at most _MAX_BLOCKS blocks over items_x x items_y block-sized work items."""
    gx = max(1, min(items_x, _MAX_BLOCKS))
    gy = max(1, min(items_y, 65535, _MAX_BLOCKS // gx))
    return (gx, gy, 1)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _bits_view(spec, pointers=("in", "out")) -> str:
    """Declarations re-typing the data pointers as unsigned integers of the element's width."""
    bits = _BITS[spec.dtype_in.itemsize]
    lines = []
    for o in spec.operands():
        if o.name in pointers:
            const = "const " if o.role == "in" else ""
            lines.append(f"  {const}{bits}* __restrict__ {o.name}_bits = "
                         f"({const}{bits}*){o.name};\n")
    return "".join(lines)


# ---------------------------------------------------------------- reductions
def _lanes_per_row(n: int) -> int:
    """axis 1: lanes that reduce one row (a power of two <= 32)."""
    return pow2_at_least(min(n, 32))


def _axis0_block(spec, form=KERNEL) -> tuple:
    """axis 0: (BX columns, BY row strides) per block, 256 threads at most (a block form:
    all its threads)."""
    by = min(8, pow2_at_least(spec.m))
    if not form.kernel:
        return form.threads // by, by
    bx = min(256 // by, 32 * _cdiv(spec.n, 32))
    return bx, by


def _reduce_body(spec, form) -> str:
    identity, absorb, combine = _REDUCE[spec.op]
    load = _LOAD[spec.dtype_in.name].format("in[i * LDI + j]")
    store = _STORE[spec.dtype_out.name].format("acc")
    head = f"  const long long M = {spec.m}, N = {spec.n}, LDI = {spec.ldi};\n"
    if spec.param("axis") == 1:
        lanes = _lanes_per_row(spec.n)
        return head + _fixed_block(form, 32, 8) + f"""\
  constexpr int L = {lanes}, RPW = 32 / L;   /* lanes per row, rows per warp */
  const int sub = tix / L, lane = tix % L;
  /* the loop condition is warp-uniform: all 32 lanes reach every shuffle */
  for (long long i0 = ((long long)bix * BY + tiy) * RPW; i0 < M;
       i0 += (long long)gdx * BY * RPW) {{
    const long long i = i0 + sub;
    float acc = {identity};
    if (i < M) {{
      for (long long j = lane; j < N; j += L) {{
        const float x = {load};
        acc = {absorb};
      }}
    }}
    for (int o = L / 2; o > 0; o /= 2) {{
      const float a = acc, b = __shfl_xor_sync(0xffffffffu, acc, o);
      acc = {combine};
    }}
    if (lane == 0 && i < M) out[i] = {store};
  }}
"""
    bx, by = _axis0_block(spec, form)
    combine_partials = "" if by == 1 else f"""\
    part[tiy][tix] = acc;
    __syncthreads();
    if (tiy == 0) {{
      for (int y = 1; y < BY; ++y) {{
        const float a = acc, b = part[y][tix];
        acc = {combine};
      }}
    }}
    __syncthreads();                 /* part is rewritten by the next column group */
"""
    return head + _fixed_block(form, bx, by) + ("" if by == 1 else
                                                "  __shared__ float part[BY][BX];\n") + f"""\
  /* the loop condition is block-uniform: every thread reaches every barrier */
  for (long long j0 = (long long)bix * BX; j0 < N; j0 += (long long)gdx * BX) {{
    const long long j = j0 + tix;
    float acc = {identity};
    if (j < N) {{
      for (long long i = tiy; i < M; i += BY) {{
        const float x = {load};
        acc = {absorb};
      }}
    }}
{combine_partials}    if (tiy == 0 && j < N) out[j] = {store};
  }}
"""


def _reduce_launch(spec) -> Launch:
    if spec.param("axis") == 1:
        rows_per_block = 8 * (32 // _lanes_per_row(spec.n))
        return Launch(_grid(_cdiv(spec.m, rows_per_block)), (32, 8, 1))
    bx, by = _axis0_block(spec)
    return Launch(_grid(_cdiv(spec.n, bx)), (bx, by, 1))


# ---------------------------------------------------------------- transpose
def _tile_pitch(itemsize: int) -> int:
    """Elements per shared tile row: an odd number of 32-bit words, >= _TILE elements."""
    per_word = 4 // itemsize
    words = _cdiv(_TILE, per_word)
    return per_word * (words + 1 - words % 2)


def _transpose_body(spec, form) -> str:
    bits = _BITS[spec.dtype_in.itemsize]
    return _fixed_block(form, _TILE, _TILE_ROWS) + _bits_view(spec) + f"""\
  constexpr int T = {_TILE};
  const long long M = {spec.m}, N = {spec.n}, LDI = {spec.ldi}, LDO = {spec.ldo};
  const long long TILES_M = {_cdiv(spec.m, _TILE)}, TILES_N = {_cdiv(spec.n, _TILE)};
  __shared__ {bits} tile[T][{_tile_pitch(spec.dtype_in.itemsize)}];
  /* block-uniform loops over tiles: every thread reaches every barrier */
  for (long long tm = biy; tm < TILES_M; tm += gdy) {{
    for (long long tn = bix; tn < TILES_N; tn += gdx) {{
      for (int y = tiy; y < T; y += BY) {{      /* load along input rows */
        const long long i = tm * T + y, j = tn * T + tix;
        if (i < M && j < N) tile[y][tix] = in_bits[i * LDI + j];
      }}
      __syncthreads();
      for (int y = tiy; y < T; y += BY) {{      /* store along output rows */
        const long long i = tn * T + y, j = tm * T + tix;   /* out (i, j) = in (j, i) */
        if (i < N && j < M) out_bits[i * LDO + j] = tile[tix][y];
      }}
      __syncthreads();
    }}
  }}
"""


def _transpose_launch(spec) -> Launch:
    return Launch(_grid(_cdiv(spec.n, _TILE), _cdiv(spec.m, _TILE)), (_TILE, _TILE_ROWS, 1))


# ---------------------------------------------------------------- vnni2 / vnni2_inv
def _vnni_body(spec, form) -> str:
    if spec.kind == "vnni2":       # in (m, n) -> out (ceil(m/2), 2n)
        pair = """\
        const long long lo = 2 * r * LDI + j;
        out_bits[r * LDO + 2 * j] = in_bits[lo];
        out_bits[r * LDO + 2 * j + 1] = 2 * r + 1 < M ? in_bits[lo + LDI] : 0;   /* pad 0 */
"""
    else:                          # in (ceil(m/2), 2n) -> out (m, n)
        pair = """\
        out_bits[2 * r * LDO + j] = in_bits[r * LDI + 2 * j];
        if (2 * r + 1 < M) out_bits[(2 * r + 1) * LDO + j] = in_bits[r * LDI + 2 * j + 1];
"""
    prologue = form.prologue() if form.kernel else \
        form.prologue(*form.split(pow2_at_least(spec.n)))
    return prologue + _bits_view(spec) + f"""\
  const long long M = {spec.m}, PAIRS = {_cdiv(spec.m, 2)}, N = {spec.n};
  const long long LDI = {spec.ldi}, LDO = {spec.ldo};
  for (long long r = (long long)biy * bdy + tiy; r < PAIRS; r += (long long)gdy * bdy) {{
    for (long long j = (long long)bix * bdx + tix; j < N; j += (long long)gdx * bdx) {{
{pair}    }}
  }}
"""


def _vnni_launch(spec) -> Launch:
    return grid_stride_2d(_cdiv(spec.m, 2), spec.n)


# ---------------------------------------------------------------- gather_rows / scatter_rows
def _by_index_block(spec, form=KERNEL) -> tuple:
    """(BX threads along a row, BY rows) per block, 256 threads (a block form: its threads,
    BX a power of two)."""
    if not form.kernel:
        return form.split(max(32, pow2_at_least(spec.n)))
    bx = min(256, 32 * _cdiv(spec.n, 32))
    return bx, 256 // bx


def _by_index_body(spec, form) -> str:
    bx, by = _by_index_block(spec, form)
    if spec.kind == "gather":
        src_row, dst_row, select = "r", "i", "    const bool copy = i < M;\n"
    else:
        src_row, dst_row = "i", "r"
        select = """\
    /* a repeated index keeps its last row: skip row i if a later entry repeats idx[i] */
    if (tix == 0) later[tiy] = 0;
    __syncthreads();
    if (i < M) {
      for (long long k = i + 1 + tix; k < M; k += BX) {
        if (idx[k] == r) { later[tiy] = 1; break; }
      }
    }
    __syncthreads();
    const bool copy = i < M && !later[tiy];
    __syncthreads();                 /* later is reset by the next row group */
"""
    shared = "  __shared__ int later[BY];\n" if spec.kind == "scatter" else ""
    return _fixed_block(form, bx, by) + shared + _bits_view(spec) + f"""\
  const long long M = {spec.m}, N = {spec.n}, LDI = {spec.ldi}, LDO = {spec.ldo};
  /* block-uniform loop over groups of BY index entries: every thread reaches every barrier */
  for (long long i0 = (long long)bix * BY; i0 < M; i0 += (long long)gdx * BY) {{
    const long long i = i0 + tiy;
    const long long r = i < M ? idx[i] : 0;
{select}    if (copy) {{
      for (long long j = tix; j < N; j += BX)
        out_bits[{dst_row} * LDO + j] = in_bits[{src_row} * LDI + j];
    }}
  }}
"""


def _by_index_launch(spec) -> Launch:
    bx, by = _by_index_block(spec)
    return Launch(_grid(_cdiv(spec.m, by)), (bx, by, 1))
