"""CUDA C source for equations (tpp.runtime.equations): one kernel, one warp per row.

The kernel's arguments are one pointer per operand of `spec.operands()` (inputs, params,
outputs) and the int64 seed when the graph draws random bits: the CPU ABI's order. Each warp
(threadIdx.y) takes rows in a grid-stride loop; for a row, every reduction level is one loop of
the 32 lanes over the columns (lane j, j+32, ...) folding the reduction's argument into a
per-lane accumulator, then a butterfly of __shfl_xor_sync leaves the result in every lane; the
last loop computes and stores the block outputs (8 columns per lane when a bitmask is read or
written, so one lane owns each mask byte). Nodes render through tpp_cuda.expr_cuda, so the
element-wise arithmetic and the transcendentals are the CPU backend's; sums are f32 in another
order than the CPU's (lane-strided, then a tree), so they agree to rounding.

Supported: reductions along axis 1 of block expressions (LayerNorm, RMSNorm, softmax and their
input gradients), in the kernel and in the block form `block_function(spec, threads)` (a
device function whose block's warps stride over the rows, tpp_cuda.cooperative). Reductions
along axis 0 (over the rows, e.g. a LayerNorm weight gradient)
are CPU-only for now: UnsupportedError.
"""
from __future__ import annotations

import hashlib

from tpp.core import expr as X
from tpp.core.errors import UnsupportedError
from tpp.core.spec import mask_bytes

from . import expr_cuda
from .cooperative import BLOCK_PREAMBLE, KERNEL, Block, Form
from .eltwise import _CTYPE, _LOAD, _PREAMBLE, _STORE
from .launch import MAX_GRID_X, Launch

_WARPS = 4            # rows (warps) per block
_COMBINE = {"rsum": "__fadd_rn", "rmax": "tpp_fmaximum", "rmin": "tpp_fminimum"}
_IDENTITY = {"rsum": "-0.0f", "rmax": "__uint_as_float(0xff800000u)",
             "rmin": "__uint_as_float(0x7f800000u)"}


def _check(spec):
    if spec.family != "equation":
        raise UnsupportedError(f"tpp_cuda.equation builds equations, not {spec.family}")
    for nd in X.topological(spec.nodes):
        if nd.op in X.REDUCTIONS and not (nd.attr[0] == 1 and nd.args[0].shape == "block"):
            raise UnsupportedError("on CUDA, an equation reduces along axis 1 of the block "
                                   "only (reductions over the rows are CPU-only for now)")


def supported(spec) -> bool:
    try:
        _check(spec)
    except UnsupportedError:
        return False
    return True


def _ident(name: str) -> str:
    """The C identifier of an operand: its name behind a prefix, so that a name that is a C
    keyword or a built-in of the kernel ("do", "int", "i") still compiles."""
    return f"op_{name}"


def kernel_name(spec) -> str:
    return "tpp_eq_" + hashlib.sha256(spec.key().encode()).hexdigest()[:20]


def launch(spec) -> Launch:
    _check(spec)
    blocks = max(1, min((spec.m + _WARPS - 1) // _WARPS, MAX_GRID_X, 65535))
    return Launch((blocks, 1, 1), (32, _WARPS, 1))


class _Leaves:
    """C expressions of the leaves at row i, column j (both `long long` in the source)."""

    def __init__(self, spec):
        self.spec = spec
        self.ops = {o.name: o for o in spec.operands()}

    def __call__(self, nd):
        op, spec = nd.op, self.spec
        if op == "input":
            name = nd.attr[0]
            if name.startswith("__r"):
                return name[2:]                 # a reduction's per-row value: r<k>
            o = self.ops[name]
            at = {"block": f"i * {o.ld} + j", "row": "j", "col": "i", "scalar": "0"}[o.layout]
            return _LOAD[o.dtype.name].format(f"{_ident(name)}[{at}]")
        if op == "param":
            return f"{_ident(nd.attr[0])}[0]"
        if op == "extent":
            return expr_cuda.float_literal(float((spec.m, spec.n)[nd.attr[0]]))
        if op == "maskbit":
            name = nd.attr[0]
            return f"((({_ident(name)}[i * {mask_bytes(spec.n)} + (j >> 3)] >> (j & 7)) & 1u) != 0u)"
        if op == "index":
            return {"flat": f"(unsigned int)(i * {spec.n} + j)", "row": "(unsigned int)i",
                    "col": "(unsigned int)j"}[nd.attr[0]]
        if op == "seed":
            return ("(unsigned int)((unsigned long long)seed)" if nd.attr[0] == 0 else
                    "(unsigned int)((unsigned long long)seed >> 32)")
        raise ValueError(f"no CUDA leaf for {op!r}")


def _indent(lines, depth):
    return [" " * depth + line for line in lines]


def source(spec) -> str:
    """The CUDA C source of one equation kernel."""
    _check(spec)
    return f"{_PREAMBLE}\n/* {spec.key()} */\n" + _function(spec, KERNEL)


def block_function(spec, threads: int) -> Block:
    """The spec's block form (tpp_cuda.cooperative): the block's warps stride over the rows."""
    _check(spec)
    form = Form(threads)
    text = f"{_PREAMBLE}{BLOCK_PREAMBLE}\n/* {spec.key()} */\n" + _function(spec, form)
    return Block(form.name(kernel_name(spec)), text)


def _function(spec, form) -> str:
    """The C function of the equation in `form`: a warp (tiy) per row, rows grid-strided."""
    leaves = _Leaves(spec)
    order = X.topological(spec.nodes)
    reductions = [nd for nd in order if nd.op in X.REDUCTIONS]
    holder = {r: X.input(f"__r{k}", r.shape) for k, r in enumerate(reductions)}
    reduced_args = X.substitute([r.args[0] for r in reductions], holder) if reductions else []
    outputs = X.substitute(list(spec.nodes), holder)
    args = []
    for o in spec.operands():
        ctype = _CTYPE[o.dtype.name]
        args.append(f"{'const ' if o.role == 'in' else ''}{ctype}* __restrict__ {_ident(o.name)}")
    if spec.scalars:
        args.append("long long seed")
    body = []
    for k, (r, arg) in enumerate(zip(reductions, reduced_args)):
        lines, (value,) = expr_cuda.render([arg], leaves, prefix=f"a{k}_")
        body += [f"float acc{k} = {_IDENTITY[r.op]};",
                 "for (long long j = lane; j < N; j += 32) {",
                 *_indent(lines, 2),
                 f"  acc{k} = {_COMBINE[r.op]}(acc{k}, {value});",
                 "}",
                 "for (int off = 16; off > 0; off >>= 1)",
                 f"  acc{k} = {_COMBINE[r.op]}(acc{k}, __shfl_xor_sync(0xffffffffu, acc{k}, off));",
                 f"const float r{k} = acc{k};"]
    pairs = list(zip(outputs, spec.outputs))
    body += _stores([p for p in pairs if p[0].shape == "col"], leaves, "if (lane == 0) {", "o")
    body += _stores([p for p in pairs if p[0].shape == "scalar"], leaves,
                    "if (i == 0 && lane == 0) {", "s")
    row_outs = [p for p in pairs if p[0].shape == "row"]
    if row_outs:
        body += ["if (i == 0) {", "  for (long long j = lane; j < N; j += 32) {"]
        body += _indent(_store_lines(row_outs, leaves, "v"), 4) + ["  }", "}"]
    body += _block_pass([p for p in pairs if p[0].shape == "block"], leaves, spec)
    inner = "\n".join(_indent(body, 4))
    prologue = form.prologue() if form.kernel else form.prologue(*form.split(32))
    text = f"""{prologue}  const long long M = {spec.m}, N = {spec.n};
  const long long lane = tix;
  for (long long i = (long long)bix * bdy + tiy; i < M; i += (long long)gdx * bdy) {{
{inner}
  }}
"""
    return form.function(kernel_name(spec), args, text)


def _store_lines(pairs, leaves, prefix):
    """Compute and store outputs at (i, j) (or i, or 0); bitmask outputs excluded."""
    lines, values = expr_cuda.render([nd for nd, _ in pairs], leaves, prefix=prefix)
    for (nd, (name, layout, dt, ld)), value in zip(pairs, values):
        at = {"block": f"i * {ld} + j", "col": "i", "vector": "j" if nd.shape == "row" else "0",
              "scalar": "0"}[layout]
        lines.append(f"{_ident(name)}[{at}] = " + _STORE[dt.name].format(value) + ";")
    return lines


def _stores(pairs, leaves, guard, prefix):
    if not pairs:
        return []
    return [guard, *_indent(_store_lines(pairs, leaves, prefix), 2), "}"]


def _block_pass(pairs, leaves, spec):
    """The loop over the columns computing and storing the block outputs."""
    if not pairs:
        return []
    uses_masks = any(o.layout == "mask" for o in spec.operands())
    values_out = [p for p in pairs if p[1][1] != "mask"]
    masks_out = [p for p in pairs if p[1][1] == "mask"]
    if not uses_masks:
        return ["for (long long j = lane; j < N; j += 32) {",
                *_indent(_store_lines(values_out, leaves, "v"), 2), "}"]
    lines, values = expr_cuda.render([nd for nd, _ in pairs], leaves, prefix="v")
    stores = []
    for (nd, (name, layout, dt, ld)), value in zip(pairs, values):
        if layout == "mask":
            stores.append(f"bits_{name} |= ({value} ? 1u : 0u) << jj;")
        else:
            stores.append(f"{_ident(name)}[i * {ld} + j] = " + _STORE[dt.name].format(value) + ";")
    chunks = (spec.n + 7) // 8
    out = [f"for (long long jc = lane; jc < {chunks}; jc += 32) {{"]
    out += [f"  unsigned int bits_{name} = 0u;" for _, (name, *_rest) in masks_out]
    out += ["  for (int jj = 0; jj < 8; ++jj) {", "    const long long j = jc * 8 + jj;",
            "    if (j >= N) break;", *_indent(lines + stores, 4), "  }"]
    out += [f"  {_ident(name)}[i * {mask_bytes(spec.n)} + jc] = (unsigned char)bits_{name};"
            for _, (name, *_rest) in masks_out]
    out.append("}")
    return out
