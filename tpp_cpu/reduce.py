"""The generator of reductions: reduce_sum, reduce_sumsq, reduce_max, reduce_min, reduce_absmax.

The input block (m, n, ldi) is widened to f32 and accumulated in f32; the result vector is
narrowed to dtype_out once. max, min and absmax use llvm.maximum / llvm.minimum, which propagate
NaN like numpy; they carry `nsz`, so when the result is a zero its sign is unspecified (numpy
returns whichever zero it meets first), which keeps the AVX2 lowering to vmaxps + NaN blend.
Sums are f32 sums in a fixed but unspecified association order (several accumulators, then a
tree), so they differ from the reference's f64 sum by rounding only.

axis=1 (over the columns, m results): per row, `lanes`-wide vectors are folded into up to
`_ROW_ACCS` independent accumulators (a loop over groups of them for long rows, the leftover
full vectors and one masked tail vector emitted straight-line); the tail's inactive lanes hold
the op's identity (the masked load's 0 for the sums and absmax, -inf / +inf for max / min).
The accumulators are combined, then reduced horizontally with a shufflevector halving tree,
and the row's scalar is stored.

axis=0 (over the rows, n results): the columns are cut into groups of up to `_COL_GROUP_*`
vectors that stay in registers while a loop runs over all m rows; an outer loop runs over the
full groups, and one last group holds the leftover vectors and the masked tail vector. Lanes past
the tail are never stored, so their value does not matter.

Accumulators live in allocas that LLVM's SROA promotes to registers (loop phis).
"""
from __future__ import annotations

import math

from llvmlite import ir

from . import irx
from .irx import F32, I32, i64, vec

_ROW_ACCS = 4        # independent accumulators along a row (axis=1)
_COL_GROUP_SUM = 8   # column vectors kept in registers per group (axis=0), sums
# the same for max/min/absmax: each NaN-propagating max is a chain of ~7 cycles a row on Zen 5
# (vmaxps, a compare of the accumulator with itself, a masked move), and 4 of them left the
# loop latency-bound. 256 x 1024 f32 reduce_max over the rows, one thread, in L2, 4 -> 8:
# AVX-512 65-68 -> 91-94 GB/s (64 x 4096: 74-76 -> 99-101), AVX2 code 44 -> 79 (55 -> 83),
# as fast as the sums; AVX2's lowering of 8 still fits its 16 registers (no spills)
_COL_GROUP_CMP = 8

_IDENTITY = {
    "reduce_sum": -0.0,      # -0.0 + x == x for every x, so LLVM drops the first add
    "reduce_sumsq": -0.0,
    "reduce_max": -math.inf,
    "reduce_min": math.inf,
    "reduce_absmax": 0.0,    # |x| >= 0, so 0 is neutral (and a zero-filled tail lane is already it)
}


def _combine(b, op, x, y):
    """acc `op` y for two accumulators (or two halves of one)."""
    if op in ("reduce_sum", "reduce_sumsq"):
        return b.fadd(x, y)
    name = "llvm.maximum" if op in ("reduce_max", "reduce_absmax") else "llvm.minimum"
    # nsz: NaN still propagates, but -0.0 and +0.0 need not be ordered (numpy's max/min return
    # whichever zero comes first), which saves AVX2 two blends per step
    fn = irx.intrinsic(b.module, name, x.type, [x.type, y.type])
    return b.call(fn, [x, y], fastmath=("nsz",))


def _accumulate(b, op, acc, x):
    """Fold an input vector (already f32) into an accumulator."""
    if op == "reduce_sumsq":
        return irx.fma(b, x, x, acc)
    if op == "reduce_absmax":
        x = irx.fabs(b, x)
    return _combine(b, op, acc, x)


def _horizontal(b, op, v):
    """Reduce a vector to a <1 x float> by halving with shufflevector."""
    w = v.type.count
    while w > 1:
        half = w // 2
        lo = b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                              ir.Constant(vec(I32, half), list(range(half))))
        hi = b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                              ir.Constant(vec(I32, half), list(range(half, w))))
        v = _combine(b, op, lo, hi)
        w = half
    return v


def _tree(b, op, values):
    """Combine a list of accumulators pairwise."""
    values = list(values)
    while len(values) > 1:
        nxt = [_combine(b, op, values[k], values[k + 1]) for k in range(0, len(values) - 1, 2)]
        if len(values) % 2:
            nxt.append(values[-1])
        values = nxt
    return values[0]


class _Accs:
    """A set of vector accumulators held in allocas (promoted to registers by SROA)."""

    def __init__(self, b, count, w):
        self.b = b
        self.ty = vec(F32, w)
        self.slots = [b.alloca(self.ty, name=f"acc{k}") for k in range(count)]

    def init(self, value):
        for slot in self.slots:
            self.b.store(irx.const(self.ty, value), slot)

    def get(self, k):
        return self.b.load(self.slots[k], typ=self.ty)

    def set(self, k, value):
        self.b.store(value, self.slots[k])

    def all(self):
        return [self.get(k) for k in range(len(self.slots))]


def generate(spec, target, symbol: str) -> ir.Module:
    op = spec.op
    if op not in _IDENTITY:
        raise AssertionError(f"reduce generator called for {op!r}")
    axis = spec.param("axis")
    module, b, ptrs, _ = irx.new_kernel(symbol, 2)
    src, dst = ptrs
    if axis == 1:
        _rows(b, spec, target.lanes, src, dst)
    else:
        _columns(b, spec, target.lanes, src, dst)
    b.ret_void()
    return module


def _load(b, spec, src, offset, w, count, identity_fill):
    x = irx.load_f32(b, src, offset, spec.dtype_in, w, count)
    # masked lanes load as +0.0, neutral for the sums and absmax; max and min need +-inf there
    if count is not None and count < w and identity_fill:
        x = b.select(irx.lane_mask(w, count), x, irx.const(vec(F32, w), _IDENTITY[spec.op]))
    return x


def _rows(b, spec, w, src, dst):
    """axis=1: out[i] = reduce(in[i, :])."""
    op, n, ldi = spec.op, spec.n, spec.ldi
    identity = _IDENTITY[op]
    full, tail = divmod(n, w)
    k_accs = max(1, min(_ROW_ACCS, full))
    accs = _Accs(b, k_accs, w)
    looped = (full // k_accs) * k_accs if full >= 2 * k_accs else 0   # vectors done by the loop
    with irx.for_range(b, spec.m, name="row") as row:
        base = b.mul(row, i64(ldi))
        accs.init(identity)
        if looped:
            with irx.for_range(b, looped * w, step=k_accs * w, name="col") as col:
                start = b.add(base, col)
                for k in range(k_accs):
                    x = _load(b, spec, src, b.add(start, i64(k * w)), w, None, False)
                    accs.set(k, _accumulate(b, op, accs.get(k), x))
        for v in range(looped, full):
            k = (v - looped) % k_accs
            x = _load(b, spec, src, b.add(base, i64(v * w)), w, None, False)
            accs.set(k, _accumulate(b, op, accs.get(k), x))
        if tail:
            k = (full - looped) % k_accs
            x = _load(b, spec, src, b.add(base, i64(full * w)), w, tail, identity != 0.0)
            accs.set(k, _accumulate(b, op, accs.get(k), x))
        total = _horizontal(b, op, _tree(b, op, accs.all()))
        irx.store_f32(b, total, dst, row, spec.dtype_out)


def _columns(b, spec, w, src, dst):
    """axis=0: out[j] = reduce(in[:, j])."""
    op, m, n, ldi = spec.op, spec.m, spec.n, spec.ldi
    identity = _IDENTITY[op]
    group = _COL_GROUP_SUM if op in ("reduce_sum", "reduce_sumsq") else _COL_GROUP_CMP
    full, tail = divmod(n, w)
    n_groups, left = divmod(full, group)
    accs = _Accs(b, max(1, min(group, full + (1 if tail else 0))), w)

    def do_group(col0, counts):
        """Reduce columns [col0, col0 + w*len(counts)) over all rows; counts[k] is None for a
        full vector, else the active lanes of the tail vector."""
        accs.init(identity)
        with irx.for_range(b, m, name="row") as row:
            start = b.add(b.mul(row, i64(ldi)), col0)
            for k, count in enumerate(counts):
                x = _load(b, spec, src, b.add(start, i64(k * w)), w, count, False)
                accs.set(k, _accumulate(b, op, accs.get(k), x))
        for k, count in enumerate(counts):
            irx.store_f32(b, accs.get(k), dst, b.add(col0, i64(k * w)), spec.dtype_out, count)

    if n_groups:
        with irx.for_range(b, n_groups * group * w, step=group * w, name="grp") as col0:
            do_group(col0, [None] * group)
    counts = [None] * left + ([tail] if tail else [])
    if counts:
        do_group(i64(n_groups * group * w), counts)
