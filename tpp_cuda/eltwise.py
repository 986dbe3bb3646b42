"""CUDA C source for the element-wise TPPs: unary map / map_inv and binary map / compare.

One `extern "C" __global__` kernel per spec. Its arguments are one pointer per operand of
`spec.operands()`, in order, then `long long seed` when the definition draws random bits
(dropout): the CPU ABI's order. The sizes and leading dimensions are baked in as constants; a
2-D grid-stride loop runs over rows (y) and column chunks (x). `block_function(spec, threads)`
is the same code as a block-cooperative device function (tpp_cuda.cooperative). Inputs are
loaded and widened to float, the op's definition (`tpp.core.optable`) is computed in float,
rendered node by node by `tpp_cuda.expr_cuda` (so the results are the CPU backend's bits), and
the result is rounded to the output dtype with round-to-nearest-even. A bitmask input reads as
a bool. The definition's other leaves are C expressions: X.index("flat") is the element's flat
index (unsigned int)(i * n + j) (n the logical row length, not the leading dimension),
X.seed(0 / 1) the low / high word of the seed, so dropout draws the CPU kernel's stream
(`optable.dropout_draw`).

A spec writing a bitmask (relu with bitmask=True, dropout, the compare ops) gives each thread a
chunk jc of 8 columns, so one thread owns each mask byte: bit j%8 of byte j//8 of row i is element
(i, j), the byte rows are ceil(n/8) bytes apart, the unused high bits of a last partial byte are 0.
"""
from __future__ import annotations

import hashlib

from tpp.core import optable
from tpp.core.errors import UnsupportedError
from tpp.core.spec import mask_bytes

from . import expr_cuda
from .cooperative import BLOCK_PREAMBLE, KERNEL, Block, Form, pow2_at_least
from .launch import Launch, grid_stride_2d

# C element type, load (to float) and store (from float) per dtype
_CTYPE = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half", "u8": "unsigned char"}
_LOAD = {"f32": "{}", "bf16": "__bfloat162float({})", "f16": "__half2float({})"}
_STORE = {"f32": "{}", "bf16": "__float2bfloat16_rn({})", "f16": "__float2half_rn({})"}

_PREAMBLE = r"""#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef TPP_CUDA_ELTWISE_PREAMBLE
#define TPP_CUDA_ELTWISE_PREAMBLE
static __device__ __forceinline__ float tpp_max(float a, float b) {
  return (isnan(a) || isnan(b)) ? a + b : fmaxf(a, b);   /* nan propagates */
}
static __device__ __forceinline__ float tpp_min(float a, float b) {
  return (isnan(a) || isnan(b)) ? a + b : fminf(a, b);
}
#endif
""" + expr_cuda.PREAMBLE


def _check(spec):
    if spec.family not in ("unary", "binary"):
        raise UnsupportedError(f"{spec.family} specs are not yet in the CUDA backend")
    if spec.kind not in ("map", "map_inv", "compare"):
        raise UnsupportedError(f"{spec.family} op {spec.op!r} (kind {spec.kind}) is not yet "
                               f"in the CUDA backend")


def kernel_name(spec) -> str:
    """A C identifier unique to the spec and stable across processes (hash of spec.key())."""
    _check(spec)
    digest = hashlib.sha1(spec.key().encode()).hexdigest()[:16]
    return f"tpp_{spec.family}_{spec.op}_{digest}"


def offset_expr(operand) -> str:
    """The element offset of (i, j) in `operand`, an expression in i and j that is both C and
    Python (for a mask: the byte holding bit j % 8)."""
    layout = operand.layout
    if layout == "block":
        return f"i * {operand.ld} + j"
    if layout == "row":
        return "j"
    if layout == "col":
        return "i"
    if layout == "scalar":
        return "0"
    if layout == "mask":
        return f"i * {operand.cols} + (j >> 3)"
    raise UnsupportedError(f"operand layout {layout!r} is not yet in the CUDA backend")


def _variables(spec) -> dict:
    """operand name -> the C variable it is loaded into (float; bool for a mask bit)."""
    if spec.family == "binary":
        return {"in0": "a", "in1": "b", "out": "c"}
    if spec.kind == "map_inv":
        names = [o.name for o in spec.operands()]
        return {"grad": "g", names[1]: "s"}
    return {"in": "x"}


# the C expressions of the leaves other than the inputs: the flat element index (i, j and N
# are the kernel's locals), the low / high word of the `long long seed` argument
_LEAVES = {("index", "flat"): "(unsigned int)(i * N + j)",
           ("seed", 0): "(unsigned int)((unsigned long long)seed)",
           ("seed", 1): "(unsigned int)((unsigned long long)seed >> 32)"}


def body(definition, variables: dict, prefix: str = "e") -> tuple:
    """(lines, values): the C statements of an element-wise definition (`tpp.core.optable`) whose
    inputs are loaded into `variables` (operand name -> C variable), and the C expressions of
    its outputs. The flat index and the seed words (dropout) read the locals i, j, N and the
    argument seed of `source`'s kernel."""
    def leaf(nd):
        if nd.op in ("input", "maskbit"):
            return variables[nd.attr[0]]
        if (nd.op, nd.attr[0]) in _LEAVES:
            return _LEAVES[nd.op, nd.attr[0]]
        raise ValueError(f"an element-wise CUDA kernel has no value for {nd!r}")
    return expr_cuda.render(definition.outputs, leaf, prefix)


def source(spec) -> str:
    """The CUDA C source of one kernel for an element-wise spec."""
    _check(spec)
    return f"{_PREAMBLE}\n/* {spec.key()} */\n" + _function(spec, KERNEL)


def block_function(spec, threads: int) -> Block:
    """The spec's block form (tpp_cuda.cooperative): the kernel's parameters, the whole block
    striding over the rows (y) and column chunks (x): BX the power of two >= the chunks (at
    most the block), so short rows still keep every thread busy."""
    _check(spec)
    form = Form(threads)
    text = f"{_PREAMBLE}{BLOCK_PREAMBLE}\n/* {spec.key()} */\n" + _function(spec, form)
    return Block(form.name(kernel_name(spec)), text)


def _function(spec, form) -> str:
    """The spec's C function in `form`: a 2-D grid-stride loop over rows (y) and column
    chunks (x) around the element code."""
    ops = spec.operands()
    var = _variables(spec)
    mask_out = next((o for o in ops if o.layout == "mask" and o.role == "out"), None)
    width = _chunk_width(spec)
    chunks = (spec.n + width - 1) // width
    args, loads, stores = [], [], []
    definition = optable.definition(spec.info, spec.params)
    for o in ops:
        ctype = _CTYPE[o.dtype.name]
        const = "const " if o.role == "in" else ""
        args.append(f"{const}{ctype}* __restrict__ {o.name}")
        off = offset_expr(o)
        if o.role in ("in", "inout") and o.name in definition.reads:
            if o.layout == "mask":
                loads.append(f"const bool {var[o.name]} = "
                             f"(({o.name}[{off}] >> (j & 7)) & 1u) != 0u;")
            else:
                loads.append(f"const float {var[o.name]} = "
                             + _LOAD[o.dtype.name].format(f"{o.name}[{off}]") + ";")
    args += [f"long long {name}" for name in spec.scalars]       # dropout's seed
    lines, values = body(definition, var)
    outs = [o for o in ops if o.role in ("out", "inout")]
    for o, value in zip(outs, values):
        if o.layout == "block":
            stores.append(f"{o.name}[{offset_expr(o)}] = "
                          + _STORE[o.dtype.name].format(value) + ";")
        else:
            stores.append(f"bits |= ({value} ? 1u : 0u) << jj;")
    body_lines = [*loads, *lines, *stores]
    inner = "\n".join("        " + line for line in body_lines)
    head = "      unsigned int bits = 0u;\n" if mask_out is not None else ""
    tail = (f"      {mask_out.name}[i * {mask_bytes(spec.n)} + jc] = (unsigned char)bits;\n"
            if mask_out is not None else "")
    prologue = form.prologue() if form.kernel else \
        form.prologue(*form.split(pow2_at_least(chunks)))
    text = f"""{prologue}  const long long M = {spec.m}, CHUNKS = {chunks}, N = {spec.n};
  for (long long i = (long long)biy * bdy + tiy; i < M; i += (long long)gdy * bdy) {{
    for (long long jc = (long long)bix * bdx + tix; jc < CHUNKS; jc += (long long)gdx * bdx) {{
{head}      for (int jj = 0; jj < {width}; ++jj) {{
        const long long j = jc * {width} + jj;
        if (j >= N) break;
{inner}
      }}
{tail}    }}
  }}
"""
    return form.function(kernel_name(spec), args, text)


def launch(spec) -> Launch:
    """The grid-stride geometry of `source(spec)`: x over column chunks, y over rows."""
    _check(spec)
    width = _chunk_width(spec)
    return grid_stride_2d(spec.m, (spec.n + width - 1) // width)


def _chunk_width(spec) -> int:
    """Columns per thread: 8 (one mask byte) when the spec writes a bitmask (relu's, dropout's,
    a compare's), else 1."""
    return 8 if any(o.layout == "mask" and o.role == "out" for o in spec.operands()) else 1


def supported(spec) -> bool:
    """Whether `source(spec)` can build the spec."""
    try:
        _check(spec)
    except UnsupportedError:
        return False
    return True

