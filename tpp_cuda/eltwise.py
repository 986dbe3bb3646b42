"""CUDA C source for the element-wise TPPs: unary map / map_inv and binary map / compare.

One `extern "C" __global__` kernel per spec. Its arguments are one pointer per operand of
`spec.operands()`, in order (the CPU ABI's order). The sizes and leading dimensions are baked in
as constants; a 2-D grid-stride loop runs over rows (y) and column chunks (x). Inputs are loaded
and widened to float, the op is computed in float (the formulas of `tpp.reference`), the result
is rounded to the output dtype with round-to-nearest-even.

A spec writing a bitmask (relu with bitmask=True, the compare ops) gives each thread a chunk jc of
8 columns, so one thread owns each mask byte: bit j%8 of byte j//8 of row i is element (i, j), the
byte rows are ceil(n/8) bytes apart, the unused high bits of a last partial byte are 0.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from tpp.errors import UnsupportedError
from tpp.spec import mask_bytes

from .launch import Launch, grid_stride_2d

# C element type, load (to float) and store (from float) per dtype
_CTYPE = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half", "u8": "unsigned char"}
_LOAD = {"f32": "{}", "bf16": "__bfloat162float({})", "f16": "__half2float({})"}
_STORE = {"f32": "{}", "bf16": "__float2bfloat16_rn({})", "f16": "__float2half_rn({})"}

# The per-op formulas (float C expressions). Variables: x (unary input), g and s (map_inv's
# gradient and second operand; a bitmask second operand reads as 1.0f / 0.0f), a, b (binary
# inputs), c (muladd's output, read). {alpha} / {approximate} come from spec.params.
FORMULAS = {
    # unary map
    "identity": "x",
    "replicate_col": "x",
    "zero": "0.0f",
    "square": "x * x",
    "sqrt": "sqrtf(x)",
    "rsqrt": "1.0f / sqrtf(x)",          # correctly rounded like the reference, not rsqrtf
    "reciprocal": "1.0f / x",
    "exp": "expf(x)",
    "negate": "-x",
    "abs": "fabsf(x)",
    "increment": "x + 1.0f",
    "relu": "(x <= 0.0f ? 0.0f : x)",     # nan propagates
    "leaky_relu": "(x > 0.0f ? x : {alpha} * x)",
    "elu": "(x > 0.0f ? x : {alpha} * expm1f(x))",
    "gelu": "tpp_gelu_{approximate}(x)",
    "tanh": "tanhf(x)",
    "sigmoid": "tpp_sigmoid(x)",
    # unary map_inv
    "relu_inv": "(s > 0.0f ? g : 0.0f)",
    "leaky_relu_inv": "(s > 0.0f ? g : {alpha} * g)",
    "elu_inv": "(s > 0.0f ? g : g * (s + {alpha}))",
    "gelu_inv": "g * tpp_gelu_grad_{approximate}(s)",
    "tanh_inv": "g * (1.0f - s * s)",
    "sigmoid_inv": "g * s * (1.0f - s)",
    # binary map
    "add": "a + b",
    "sub": "a - b",
    "mul": "a * b",
    "div": "a / b",
    "max": "tpp_max(a, b)",
    "min": "tpp_min(a, b)",
    "muladd": "fmaf(a, b, c)",            # c + a*b rounded once, as the reference
    # bitmask bits (compare ops; relu's bitmask)
    "cmp_gt": "a > b", "cmp_ge": "a >= b", "cmp_lt": "a < b",
    "cmp_le": "a <= b", "cmp_eq": "a == b", "cmp_ne": "a != b",
    "relu.mask": "x > 0.0f",
}

_PREAMBLE = r"""#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef TPP_CUDA_ELTWISE_PREAMBLE
#define TPP_CUDA_ELTWISE_PREAMBLE
static __device__ __forceinline__ float tpp_sigmoid(float x) {
  const float e = expf(-fabsf(x));                /* no overflow, no cancellation */
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}
static __device__ __forceinline__ float tpp_gelu_none(float x) {
  if (x == -INFINITY) return -0.0f;
  return x * (0.5f * erfcf(-x * 0.70710678118654752f));
}
static __device__ __forceinline__ float tpp_gelu_tanh(float x) {
  if (x == -INFINITY) return -0.0f;
  const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  return x * tpp_sigmoid(2.0f * u);               /* 0.5*x*(1 + tanh(u)) */
}
static __device__ __forceinline__ float tpp_gelu_grad_none(float x) {
  const float cdf = 0.5f * erfcf(-x * 0.70710678118654752f);
  if (isinf(x)) return cdf;
  return cdf + x * (expf(-0.5f * x * x) * 0.39894228040143268f);
}
static __device__ __forceinline__ float tpp_gelu_grad_tanh(float x) {
  const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  const float du = 0.79788456080286536f * (1.0f + 3.0f * 0.044715f * x * x);
  const float e = expf(-2.0f * fabsf(u));
  const float ds = e / ((1.0f + e) * (1.0f + e)); /* s*(1-s) without cancellation */
  const float s = tpp_sigmoid(2.0f * u);
  return ds == 0.0f ? s : s + 2.0f * x * ds * du; /* ds == 0: |x| huge or inf */
}
static __device__ __forceinline__ float tpp_max(float a, float b) {
  return (isnan(a) || isnan(b)) ? a + b : fmaxf(a, b);   /* nan propagates */
}
static __device__ __forceinline__ float tpp_min(float a, float b) {
  return (isnan(a) || isnan(b)) ? a + b : fminf(a, b);
}
#endif
"""


def _check(spec):
    if spec.family not in ("unary", "binary"):
        raise UnsupportedError(f"{spec.family} specs are not yet in the CUDA backend")
    if spec.kind not in ("map", "map_inv", "compare") or spec.op not in FORMULAS:
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


def _float_literal(value) -> str:
    """A C float literal of a parameter (exact bits for ones repr cannot spell as float)."""
    v = float(value)
    if math.isfinite(v) and abs(v) < 3.0e38:
        return f"{v!r}f"
    return f"__int_as_float(0x{int(np.float32(v).view(np.uint32)):08x})"


def _formula(spec) -> str:
    params = {k: (_float_literal(v) if k == "alpha" else v) for k, v in spec.params}
    return FORMULAS[spec.op].format(**params)


def _variables(spec) -> dict:
    """operand name -> the float variable it is loaded into."""
    if spec.family == "binary":
        return {"in0": "a", "in1": "b", "out": "c"}
    if spec.kind == "map_inv":
        names = [o.name for o in spec.operands()]
        return {"grad": "g", names[1]: "s"}
    return {"in": "x"}


def source(spec) -> str:
    """The CUDA C source of one kernel for an element-wise spec."""
    _check(spec)
    ops = spec.operands()
    name = kernel_name(spec)
    var = _variables(spec)
    mask_out = next((o for o in ops if o.layout == "mask" and o.role == "out"), None)
    width = _chunk_width(spec)
    chunks = (spec.n + width - 1) // width
    args, loads, stores = [], [], []
    for o in ops:
        ctype = _CTYPE[o.dtype.name]
        const = "const " if o.role == "in" else ""
        args.append(f"{const}{ctype}* __restrict__ {o.name}")
        off = offset_expr(o)
        if o.role in ("in", "inout") and o.layout == "mask":
            loads.append(f"const float {var[o.name]} = "
                         f"(({o.name}[{off}] >> (j & 7)) & 1u) ? 1.0f : 0.0f;")
        elif o.role == "in" or (o.role == "inout" and spec.op == "muladd"):
            loads.append(f"const float {var[o.name]} = "
                         + _LOAD[o.dtype.name].format(f"{o.name}[{off}]") + ";")
        if o.role in ("out", "inout") and o.layout == "block":
            stores.append(f"{o.name}[{off}] = " + _STORE[o.dtype.name].format("r") + ";")
    body = [*loads]
    if spec.kind != "compare":
        body.append(f"const float r = {_formula(spec)};")
    body += stores
    if mask_out is not None:
        bit = FORMULAS[spec.op if spec.kind == "compare" else spec.op + ".mask"]
        body.append(f"bits |= ({bit} ? 1u : 0u) << jj;")
    inner = "\n".join("        " + line for line in body)
    head = "      unsigned int bits = 0u;\n" if mask_out is not None else ""
    tail = (f"      {mask_out.name}[i * {mask_bytes(spec.n)} + jc] = (unsigned char)bits;\n"
            if mask_out is not None else "")
    return f"""{_PREAMBLE}
/* {spec.key()} */
extern "C" __global__ void {name}({", ".join(args)}) {{
  const long long M = {spec.m}, CHUNKS = {chunks}, N = {spec.n};
  for (long long i = (long long)blockIdx.y * blockDim.y + threadIdx.y; i < M;
       i += (long long)gridDim.y * blockDim.y) {{
    for (long long jc = (long long)blockIdx.x * blockDim.x + threadIdx.x; jc < CHUNKS;
         jc += (long long)gridDim.x * blockDim.x) {{
{head}      for (int jj = 0; jj < {width}; ++jj) {{
        const long long j = jc * {width} + jj;
        if (j >= N) break;
{inner}
      }}
{tail}    }}
  }}
}}
"""


def launch(spec) -> Launch:
    """The grid-stride geometry of `source(spec)`: x over column chunks, y over rows."""
    _check(spec)
    width = _chunk_width(spec)
    return grid_stride_2d(spec.m, (spec.n + width - 1) // width)


def _chunk_width(spec) -> int:
    """Columns per thread: 8 (one mask byte) when the spec writes a bitmask, else 1."""
    return 8 if any(o.layout == "mask" and o.role == "out" for o in spec.operands()) else 1


def supported(spec) -> bool:
    """Whether `source(spec)` can build the spec."""
    try:
        _check(spec)
    except UnsupportedError:
        return False
    return True

