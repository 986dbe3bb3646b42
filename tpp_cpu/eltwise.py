"""The generator of elementwise kernels: unary maps, their backward (*_inv), binary ops, compares.

Shape of the code: a loop over the m rows; in each row a loop over full vectors of `lanes`
columns and, when n is not a multiple of lanes, one masked tail vector. Every input is widened to
f32, the op's definition (`tpp.core.optable`, rendered by `mapops`) is applied, and the result is
narrowed to the output dtype.
Broadcast inputs are loaded once where they do not depend on the loop: a scalar before the row
loop, a column element per row, a row vector per column chunk.

Outputs larger than irx.STREAM_BYTES cannot stay in cache anyway: for them the kernel checks at
run time that every output row is aligned to the vector size and then writes with non-temporal
stores, which skip the read-for-ownership and so save a third of the memory traffic of a
map. Outputs not aligned to 16 bytes take the ordinary loop. Inputs not at 64-byte boundaries
(numpy's arrays are at 16) load their 64-byte vectors as halves where there are two such
inputs or more (irx.by_input_alignment): 4096 x 1024 f32 add from numpy's boundaries, one
thread: 58-60 -> 82-83 GB/s. Maps of one input (relu, gelu, exp) measured level misaligned,
and exp 5 % slower as halves: they load whole vectors.
A heavy map (gelu: irx.MAP_PREFETCH_OPS operations per vector or more) prefetches its block
inputs rows ahead on eager_prefetch targets, as the equations do (tpp_cpu.equation, Prefetch).
"""
from __future__ import annotations

from llvmlite import ir

from tpp.core.spec import mask_bytes

from . import irx, mapops
from .irx import I32, i64


def generate(spec, target, symbol: str) -> ir.Module:
    operands = spec.operands()
    info = spec.info
    module, b, ptrs, scalars = irx.new_kernel(symbol, len(operands), len(spec.scalars))
    seed = scalars[0] if spec.scalars else None
    lanes = target.lanes
    m, n = spec.m, spec.n
    full, tail = divmod(n, lanes)
    n_bytes = mask_bytes(n)

    hoisted = {}
    for k, op in enumerate(operands):
        if op.role != "out" and op.layout == "scalar":
            value = irx.load_scalar(b, ptrs[k], i64(0), irx.storage_type(op.dtype))
            hoisted[k] = irx.to_f32(b, irx.splat(b, value, lanes), op.dtype)

    halves = [False]       # loads as halves (irx.by_input_alignment chooses)
    prefetching = (target.eager_prefetch and full > 0
                   and mapops.vector_ops(info, spec.params) >= irx.MAP_PREFETCH_OPS)

    def chunk(row, col, count, streaming=False):
        w = lanes
        values = {}
        for k, op in enumerate(operands):
            if op.role == "out":
                continue
            if op.layout == "block":
                value = irx.load_f32(b, ptrs[k], b.add(b.mul(row, i64(op.ld)), col),
                                     op.dtype, w, count, halves=halves[0])
                if prefetching and count is None:
                    ahead = b.add(row, i64(irx.map_rows_ahead(op.ld * op.dtype.itemsize)))
                    irx.prefetch(b, ptrs[k], b.add(b.mul(ahead, i64(op.ld)), col),
                                 irx.storage_type(op.dtype))
            elif op.layout == "row":
                value = irx.load_f32(b, ptrs[k], col, op.dtype, w, count)
            elif op.layout == "col":
                scalar = irx.load_scalar(b, ptrs[k], row, irx.storage_type(op.dtype))
                value = irx.to_f32(b, irx.splat(b, scalar, w), op.dtype)
            elif op.layout == "scalar":
                value = hoisted[k]
            elif op.layout == "mask":
                offset = b.add(b.mul(row, i64(n_bytes)), b.udiv(col, i64(8)))
                value = irx.load_bits(b, ptrs[k], offset, w, count)
            values[op.name] = value

        def flat_index():
            base = b.trunc(b.add(b.mul(row, i64(n)), col), I32)
            lane = irx.indices(range(w))
            return b.add(irx.splat(b, base, w), lane)

        results = mapops.render(info, spec.params, b, w, values, flat_index, seed)
        outs = [(k, op) for k, op in enumerate(operands) if op.role in ("out", "inout")]
        for (k, op), value in zip(outs, results):
            if op.layout == "mask":
                offset = b.add(b.mul(row, i64(n_bytes)), b.udiv(col, i64(8)))
                irx.store_bits(b, value, ptrs[k], offset, count)
            else:
                irx.store_f32(b, value, ptrs[k], b.add(b.mul(row, i64(op.ld)), col),
                              op.dtype, count, streaming and op.layout == "block")

    def rows(streaming):
        with irx.for_range(b, m, name="row") as row:
            if full:
                with irx.for_range(b, full * lanes, step=lanes, name="col") as col:
                    chunk(row, col, None, streaming)
            if tail:
                chunk(row, i64(full * lanes), tail)

    blocks_out = [(ptrs[k], op.rows, op.ld * op.dtype.itemsize)
                  for k, op in enumerate(operands) if op.role == "out" and op.layout == "block"]

    def body(as_halves):
        halves[0] = as_halves
        if full:
            irx.with_streaming(b, blocks_out, rows)
        else:
            rows(False)
    if full:
        irx.by_input_alignment(b, [(p, op) for p, op in zip(ptrs, operands)
                                   if op.role != "out"], lanes, body, least=2)
    else:
        body(False)
    b.ret_void()
    return module
