"""The executable semantics of every primitive, in numpy.

`run(spec, *inputs)` is the definition a backend is tested against. Inputs are the spec's
input operands (role "in" or "inout") in `spec.operands()` order, as arrays of their logical
shape (any strides). It returns the outputs (role "out" or "inout") in the same order: one
array, or a tuple when there are several.

Values are computed in float64 from the exactly widened inputs, rounded once to f32 (the
computation dtype) and then to the output dtype with round-to-nearest-even, so the reference is
the correctly rounded f32 result of the exact math. Element-wise ops (map, map_inv, binary,
compare, a BRGEMM's activation) are not written here: their one definition is in `tpp.core.optable`,
evaluated exactly by `tpp.core.expr_eval` (transcendentals by their exact meaning in `tpp.core.mathlib`).
"""
from __future__ import annotations

import numpy as np

from . import dtypes as _dt
from . import expr_eval, mathlib, optable
from .errors import ArgumentError
from .optable import dropout_scale, dropout_threshold  # noqa: F401  (public here too)

erfc = mathlib.erfc_exact


def dropout_bits(seed: int, m: int, n: int) -> np.ndarray:
    """The counter-based random stream of dropout (`tpp.core.optable.dropout_draw`): one uint32 per
    element (i, j) of an (m, n) block, a function of (seed, i*n + j) only."""
    draw = expr_eval.evaluate([optable.dropout_draw()], m, n, seed=seed)[0]
    return np.ascontiguousarray(draw, np.uint32)


_REDUCE = {
    "reduce_sum": lambda x, axis: np.sum(x, axis=axis),
    "reduce_sumsq": lambda x, axis: np.sum(x * x, axis=axis),
    "reduce_max": lambda x, axis: np.max(x, axis=axis),
    "reduce_min": lambda x, axis: np.min(x, axis=axis),
    "reduce_absmax": lambda x, axis: np.max(np.abs(x), axis=axis),
}


# ---------------------------------------------------------------- helpers
def pack_mask(bits: np.ndarray) -> np.ndarray:
    """A boolean (m, n) array as the library's bitmask layout (m, ceil(n/8)) uint8."""
    return np.packbits(np.asarray(bits, bool), axis=1, bitorder="little")


def unpack_mask(mask: np.ndarray, n: int) -> np.ndarray:
    """The library's bitmask of an n-column block as a boolean (m, n) array."""
    return np.unpackbits(np.asarray(mask, np.uint8), axis=1, count=n, bitorder="little").astype(bool)


def _widen(arr, operand, m, n):
    """The operand's values as a float64 array broadcastable to (m, n)."""
    a = np.asarray(arr)
    if operand.layout == "row":
        a = a.reshape(1, n)
    elif operand.layout == "col":
        a = a.reshape(m, 1)
    elif operand.layout == "scalar":
        a = a.reshape(1, 1)
    return a.astype(np.float64)


def _round(values, dtype: _dt.DType):
    """Round float64 values to f32 (the computation dtype), then to the output dtype."""
    with np.errstate(all="ignore"):
        return np.asarray(values, np.float64).astype(np.float32).astype(dtype.numpy)


def _check_inputs(spec, inputs):
    names = [o.name for o in spec.operands() if o.role in ("in", "inout")]
    if len(inputs) != len(names):
        raise ArgumentError(f"reference.run({spec.op}) takes {len(names)} inputs "
                            f"({', '.join(names)}), got {len(inputs)}")


def run(spec, *inputs, seed: int | None = None):
    """Compute the outputs of `spec` on `inputs` (see the module docstring). For a BRGEMM the
    inputs are the sequence of stored A blocks, the sequence of stored B blocks (equal length,
    possibly 0; a 3-D array is a sequence), then C when beta=1, then the bias row."""
    if spec.family == "equation":
        return spec.reference(*inputs, seed=seed)
    _check_inputs(spec, inputs)
    if spec.family == "binary":
        return _run_elementwise(spec, inputs, seed)
    if spec.family == "brgemm":
        return _run_brgemm(spec, *inputs)
    info, m, n = spec.info, spec.m, spec.n
    p = dict(spec.params)
    ops = spec.operands()
    out_dt = spec.dtype_out
    if info.kind in ("map", "map_inv"):
        return _run_elementwise(spec, inputs, seed)
    if info.kind == "reduce":
        x = np.asarray(inputs[0]).astype(np.float64)
        with np.errstate(all="ignore"):   # inf - inf in a sum is nan, as in the kernel
            return _round(_REDUCE[spec.op](x, 0 if p["axis"] == 0 else 1), out_dt)
    if info.kind == "transpose":
        return np.ascontiguousarray(np.asarray(inputs[0]).T).astype(out_dt.numpy)
    if info.kind == "vnni2":
        x = np.asarray(inputs[0])
        if m % 2:
            x = np.concatenate([x, np.zeros((1, n), x.dtype)])
        return x.reshape((m + 1) // 2, 2, n).transpose(0, 2, 1).reshape((m + 1) // 2, 2 * n).copy()
    if info.kind == "vnni2_inv":
        x = np.asarray(inputs[0]).reshape((m + 1) // 2, n, 2).transpose(0, 2, 1)
        return x.reshape(-1, n)[:m].copy()
    if info.kind == "gather":
        src, idx = np.asarray(inputs[0]), np.asarray(inputs[1])
        return src[idx].copy()
    if info.kind == "scatter":
        src, idx, dst = (np.asarray(a) for a in inputs)
        out = dst.copy()
        out[idx] = src
        return out
    raise AssertionError(info.kind)


def _run_elementwise(spec, inputs, seed):
    """Evaluate the op's definition (`tpp.core.optable`) exactly; round each value output once to
    f32 and then to the output dtype, pack each bitmask output."""
    m, n = spec.m, spec.n
    ops = spec.operands()
    definition = optable.definition(spec.info, spec.params)
    given = dict(zip((o.name for o in ops if o.role in ("in", "inout")), inputs))
    values, masks = {}, {}
    for o in ops:
        if o.role not in ("in", "inout") or o.name not in definition.reads:
            continue
        if o.layout == "mask":
            masks[o.name] = unpack_mask(given[o.name], n)
        else:
            values[o.name] = np.broadcast_to(_widen(given[o.name], o, m, n), (m, n))
    if definition.seeded and seed is None:
        raise ArgumentError(f"{spec.op} needs a seed")
    results = expr_eval.evaluate(definition.outputs, m, n, inputs=values, masks=masks,
                                 seed=seed)
    outs = []
    for o, r in zip((o for o in ops if o.role in ("out", "inout")), results):
        r = np.broadcast_to(r, (m, n))
        outs.append(pack_mask(r) if o.layout == "mask" else _round(r, o.dtype))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _logical_b(spec, blk):
    """One stored B block as the logical (k, n) float64 matrix."""
    blk = np.asarray(blk)
    if spec.vnni_b:
        pairs = blk.reshape(-1, spec.n, 2).transpose(0, 2, 1).reshape(-1, spec.n)
        return pairs[:spec.k].astype(np.float64)
    return (blk.T if spec.trans_b else blk).astype(np.float64)


def _run_brgemm(spec, a_blocks, b_blocks, *rest):
    """act(beta*C + sum_i A_i @ B_i + bias), summed exactly in float64, rounded once to f32 before
    the activation; returns C, or (C, bitmask) for relu with bitmask."""
    if len(a_blocks) != len(b_blocks):
        raise ArgumentError(f"brgemm: {len(a_blocks)} A blocks but {len(b_blocks)} B blocks")
    m, n = spec.m, spec.n
    acc = np.zeros((m, n), np.float64)
    for a, b in zip(a_blocks, b_blocks):
        a = np.asarray(a).astype(np.float64)
        acc += (a.T if spec.trans_a else a) @ _logical_b(spec, b)
    rest = list(rest)
    if spec.beta:
        acc += np.asarray(rest.pop(0)).astype(np.float64)
    if spec.bias:
        acc += np.asarray(rest.pop(0)).astype(np.float64).reshape(
            (m, 1) if spec.bias == "col" else (1, n))
    x = acc.astype(np.float32).astype(np.float64)
    if spec.activation is None:
        return _round(x, spec.dtype_c)
    outputs = optable.definition(*optable.epilogue(spec.activation, spec.bitmask)).outputs
    got = expr_eval.evaluate(outputs, m, n, inputs={"in": x})
    y = _round(np.broadcast_to(got[0], (m, n)), spec.dtype_c)
    return (y, pack_mask(np.broadcast_to(got[1], (m, n)))) if spec.bitmask else y
