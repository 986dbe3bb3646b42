"""The generator of equations (tpp.runtime.equations): one kernel for a graph of element-wise nodes and
reductions over an (m, n) block.

The graph's nodes are rendered by tpp_cpu.expr_llvm on `lanes`-wide vectors of a row (full
vectors, then one masked tail vector). A reduction cuts the graph into *levels*: level 0 needs
no reduction, level k the results of level k-1's reductions. Each level is one pass over the
block that evaluates only what its reductions need (recomputing the element-wise chain from the
inputs instead of storing intermediates), and the last pass evaluates the outputs.

Two schedules:
  rowwise  every reduction is along axis 1 of a block: for each row, the passes run over that
           row alone (it stays in L1 between them), accumulators in registers (UNROLL vectors
           per reduction, one per unrolled vector, combined and reduced horizontally once).
  general  any other mix: each pass runs over the whole block; an axis-0 result (n values) and
           an axis-1 result (m values) live in stack arrays, a scalar result in one slot. Within
           a row, the axis-1 reductions of a pass accumulate in registers as in rowwise.

Values that do not vary along a row (per-row or scalar nodes) are computed once per row or once
per kernel, not per vector. A transcendental needed by several passes is computed once and kept
in a stack buffer for the later ones (plan_kept). Tail lanes past n enter reductions as the reduction's identity.
"""
from __future__ import annotations

import math

from llvmlite import ir

from tpp.core import expr as X
from tpp.core.equation_spec import MAX_STAGE_ELEMENTS
from tpp.core.errors import UnsupportedError
from tpp.core.spec import mask_bytes

from . import expr_llvm, irx
from .irx import F32, I32, const, i64, vec

_IDENTITY = {"rsum": -0.0, "rmax": -math.inf, "rmin": math.inf}
UNROLL = 4      # vectors per step of a rowwise reduction loop, each with its own accumulator
KEPT_ELEMENTS = 1 << 14   # f32 a rowwise kernel may keep on its stack (see _Gen.plan_kept)


def _levels(order) -> dict:
    """node -> its level (reductions it depends on, transitively, counting itself)."""
    level = {}
    for nd in order:
        below = max((level[a] for a in nd.args), default=0)
        level[nd] = below + 1 if nd.op in X.REDUCTIONS else below
    return level


def _combine(b, op, x, y):
    if op == "rsum":
        return b.fadd(x, y)
    name = "llvm.maximum" if op == "rmax" else "llvm.minimum"
    fn = irx.intrinsic(b.module, name, x.type, [x.type, y.type])
    return b.call(fn, [x, y], fastmath=("nsz",))


def _tree(b, op, values):
    """Combine accumulators pairwise."""
    values = list(values)
    while len(values) > 1:
        values = [_combine(b, op, values[k], values[k + 1]) if k + 1 < len(values)
                  else values[k] for k in range(0, len(values), 2)]
    return values[0]


def _horizontal(b, op, v):
    """All lanes of v combined, splat back to every lane."""
    w = v.type.count
    width = w
    while width > 1:
        half = width // 2
        hi = irx.shuffle(b, v, None, [half + (k % half) for k in range(w)])
        v = _combine(b, op, v, hi)
        width = half
    return irx.shuffle(b, v, None, [0] * w)


class _Gen:
    def __init__(self, spec, target, symbol):
        self.spec = spec
        self.w = target.lanes
        self.m, self.n = spec.m, spec.n
        operands = spec.operands()
        self.module, self.b, ptrs, scalars = irx.new_kernel(symbol, len(operands),
                                                            len(spec.scalars))
        self.ptr = {op.name: p for op, p in zip(operands, ptrs)}
        self.operand = {op.name: op for op in operands}
        self.seed = scalars[0] if scalars else None
        self.outputs = list(zip(spec.nodes, spec.outputs))
        self.order = X.topological(spec.nodes)
        self.level = _levels(self.order)
        self.reductions = [nd for nd in self.order if nd.op in X.REDUCTIONS]
        self.depth = max((self.level[r] for r in self.reductions), default=0)
        self.rowwise = all(r.attr[0] == 1 and r.args[0].shape == "block"
                           for r in self.reductions)
        self.full, self.tail = divmod(self.n, self.w)
        self.storage = {}
        self.done = set()          # reductions whose stored results are complete (general)
        self.kept = {}             # node -> (row buffer, the pass computing it) (rowwise)

    # ------------------------------------------------------------ leaves
    def leaf_fn(self, row, col, count):
        """The leaf callback of expr_llvm for the vector at (row, col) with `count` lanes
        (None: all); row/col are i64 values or None where the value must not depend on them."""
        b, w = self.b, self.w

        def leaf(nd):
            op = nd.op
            if op == "input":
                name = nd.attr[0]
                o, p = self.operand[name], self.ptr[name]
                if o.layout == "block":
                    return irx.load_f32(b, p, b.add(b.mul(row, i64(o.ld)), col), o.dtype, w, count)
                if o.layout == "row":
                    return irx.load_f32(b, p, col, o.dtype, w, count)
                offset = row if o.layout == "col" else i64(0)
                value = irx.load_scalar(b, p, offset, irx.storage_type(o.dtype))
                return irx.to_f32(b, irx.splat(b, value, w), o.dtype)
            if op == "param":
                value = irx.load_scalar(b, self.ptr[nd.attr[0]], i64(0), F32)
                return irx.splat(b, value, w)
            if op == "extent":
                return const(vec(F32, w), float((self.m, self.n)[nd.attr[0]]))
            if op == "maskbit":
                offset = b.add(b.mul(row, i64(mask_bytes(self.n))), b.udiv(col, i64(8)))
                return irx.load_bits(b, self.ptr[nd.attr[0]], offset, w, count)
            if op == "index":
                which = nd.attr[0]
                lanes = irx.indices(range(w))
                if which == "row":
                    return irx.splat(b, b.trunc(row, I32), w)
                base = col if which == "col" else b.add(b.mul(row, i64(self.n)), col)
                return b.add(irx.splat(b, b.trunc(base, I32), w), lanes)
            if op == "seed":
                word = self.seed if nd.attr[0] == 0 else b.lshr(self.seed, i64(32))
                return irx.splat(b, b.trunc(word, I32), w)
            if op in X.REDUCTIONS:
                return self.load_result(nd, row, col)
            raise AssertionError(op)
        return leaf

    def render(self, nodes, memo, row, col, count=None):
        return expr_llvm.render(nodes, self.b, self.w, self.leaf_fn(row, col, count), memo)

    # ------------------------------------------------------------ reduction results
    def allocate_results(self):
        """Stack storage of every reduction result (general schedule); rowwise keeps each
        row's results in registers (memo) and needs none."""
        b, w = self.b, self.w
        for r in self.reductions:
            length = {"row": self.n, "col": self.m, "scalar": 1}[r.shape]
            if length > MAX_STAGE_ELEMENTS:
                raise UnsupportedError(
                    f"equation: this mix of reductions keeps {length} values per reduction on "
                    f"the stack (at most {MAX_STAGE_ELEMENTS}); use a smaller block")
            padded = -(-length // w) * w if r.shape == "row" else max(length, 1)
            slots = b.alloca(F32, size=padded + w)
            # an untyped pointer like the operands' (irx addresses memory through those)
            self.storage[r] = b.inttoptr(b.ptrtoint(slots, irx.I64), irx.PTR)

    def result_ptr(self, r):
        return self.storage[r]

    def load_result(self, r, row, col):
        b, w = self.b, self.w
        p = self.result_ptr(r)
        if r.shape == "row":
            return irx.load_vec(b, p, col, F32, w)
        offset = row if r.shape == "col" else i64(0)
        return irx.splat(b, irx.load_scalar(b, p, offset, F32), w)

    # ------------------------------------------------------------ kept intermediates
    def plan_kept(self):
        """A transcendental that several passes need (softmax's exp(x - max): the sum's pass
        and the output's) is computed once, in the first of them, and kept for the others in a
        stack buffer instead of being recomputed: a row long in the rowwise schedule (in L1),
        the whole block in the general one (when it fits KEPT_ELEMENTS). Each pass is a
        "stage": 1..depth the reduction levels, depth+1 the outputs."""
        stages = {}
        for level in range(1, self.depth + 2):
            if level <= self.depth:
                targets = [r.args[0] for r in self.reductions if self.level[r] == level]
            else:
                targets = [nd for nd, _ in self.outputs if nd.shape == "block"]
            inside = X.topological(targets, lambda nd: nd.op in X.REDUCTIONS
                                   or nd.shape != "block")
            for nd in inside:
                if nd.op == "prim" and nd.shape == "block":
                    stages.setdefault(nd, []).append(level)
        self.padded = padded = -(-self.n // self.w) * self.w
        size = padded if self.rowwise else self.m * padded
        budget = KEPT_ELEMENTS
        for nd, used in stages.items():
            if len(used) > 1 and size <= budget:
                budget -= size
                slots = self.b.alloca(F32, size=size)
                self.kept[nd] = (self.b.inttoptr(self.b.ptrtoint(slots, irx.I64), irx.PTR),
                                 used[0])

    def chunk_render(self, nodes, memo, row, col, count, stage):
        """render() of one vector in pass `stage`, reading kept values computed by an earlier
        pass and keeping those this pass computes first."""
        chunk = dict(memo)
        if not self.kept or stage is None:
            return self.render(nodes, chunk, row, col, count)
        at = col if self.rowwise else self.b.add(self.b.mul(row, i64(self.padded)), col)
        for nd, (buf, first) in self.kept.items():
            if first < stage:
                chunk[nd] = irx.load_vec(self.b, buf, at, F32, self.w)
        values = self.render(nodes, chunk, row, col, count)
        for nd, (buf, first) in self.kept.items():
            if first == stage and nd in chunk:
                irx.store_vec(self.b, chunk[nd], buf, at)
        return values

    # ------------------------------------------------------------ passes
    def chunks(self, body):
        """body(col, count) for every vector of a row: a loop over the full ones, the tail."""
        if self.full:
            with irx.for_range(self.b, self.full * self.w, step=self.w, name="col") as col:
                body(col, None)
        if self.tail:
            body(i64(self.full * self.w), self.tail)

    def masked(self, r, value, count):
        if count is None:
            return value
        return self.b.select(irx.lane_mask(self.w, count), value,
                             const(value.type, _IDENTITY[r.op]))

    def row_values(self, row, memo):
        """Evaluate into memo every per-row (col) and scalar node whose reductions are known."""
        ready = [nd for nd in self.order if nd.shape in ("col", "scalar") and nd not in memo
                 and nd.op not in X.LEAVES and nd.op != "const" and self._ready(nd, memo)]
        if ready:
            self.render(ready, memo, row, None)

    def _ready(self, nd, memo):
        stack = [nd]
        while stack:
            x = stack.pop()
            if x.op in X.REDUCTIONS and x not in memo and x not in self.done:
                return False
            stack.extend(a for a in x.args if a not in memo)
        return True

    def rowwise_level(self, row, memo, reds, stage=None):
        """Accumulate this level's reductions over one row (UNROLL accumulators each, one per
        vector of an unrolled step); put their splatted results into memo."""
        b, w, k = self.b, self.w, len(reds)
        args = [r.args[0] for r in reds]
        unroll = max(1, min(UNROLL, self.full))
        accs = [const(vec(F32, w), _IDENTITY[r.op]) for r in reds] * unroll
        steps = self.full // unroll
        if steps:
            with irx.for_carry(b, steps * unroll * w, accs, step=unroll * w, name="red") as st:
                new = list(st.values)
                for u in range(unroll):
                    col = b.add(st.index, i64(u * w)) if u else st.index
                    values = self.chunk_render(args, memo, row, col, None, stage)
                    for i, r in enumerate(reds):
                        new[u * k + i] = _combine(b, r.op, new[u * k + i], values[i])
                st.values = new
            accs = st.values
        for j in range(steps * unroll, self.full):       # leftover full vectors
            values = self.chunk_render(args, memo, row, i64(j * w), None, stage)
            u = j % unroll
            for i, r in enumerate(reds):
                accs[u * k + i] = _combine(b, r.op, accs[u * k + i], values[i])
        if self.tail:
            values = self.chunk_render(args, memo, row, i64(self.full * w), self.tail, stage)
            for i, r in enumerate(reds):
                accs[i] = _combine(b, r.op, accs[i], self.masked(r, values[i], self.tail))
        for i, r in enumerate(reds):
            total = _tree(b, r.op, [accs[u * k + i] for u in range(unroll)])
            memo[r] = _horizontal(b, r.op, total)

    def store_outputs(self, memo, row, col, count, shapes, streaming=False, stage=None):
        """Render and store the outputs of the given shapes for the vector at (row, col);
        streaming: full vectors of blocks with non-temporal stores (see irx.with_streaming)."""
        b = self.b
        chosen = [(nd, o) for nd, o in self.outputs if nd.shape in shapes]
        if not chosen:
            return
        values = self.chunk_render([nd for nd, _ in chosen], memo, row, col, count, stage)
        for (nd, (name, layout, dt, ld)), value in zip(chosen, values):
            p = self.ptr[name]
            o = self.operand[name]
            if layout == "mask":
                offset = b.add(b.mul(row, i64(mask_bytes(self.n))), b.udiv(col, i64(8)))
                irx.store_bits(b, value, p, offset, count)
            elif layout == "block":
                irx.store_f32(b, value, p, b.add(b.mul(row, i64(o.ld)), col), dt, count,
                              streaming and count is None)
            elif layout == "vector" and nd.shape == "row":
                irx.store_f32(b, value, p, col, dt, count)
            else:      # col: one value per row; scalar: one value
                offset = row if layout == "col" else i64(0)
                irx.store_f32(b, value, p, offset, dt, 1)

    def generate(self):
        b = self.b
        base = {}
        entry_nodes = [nd for nd in self.order if nd.shape == "scalar"
                       and self.level[nd] == 0 and nd.op != "const"]
        if entry_nodes:
            self.render(entry_nodes, base, None, None)
        self.plan_kept()
        emit = self.emit_rowwise if self.rowwise else self.emit_general
        blocks = [(self.ptr[name], self.m, ld * dt.itemsize)
                  for name, layout, dt, ld in self.spec.outputs if layout == "block"]
        if self.full and blocks:
            irx.with_streaming(b, blocks, lambda streaming: emit(dict(base), streaming),
                               force=self.spec.stream)
        else:
            emit(base, False)
        b.ret_void()
        return self.module

    def emit_rowwise(self, base, streaming):
        b = self.b
        # row-shaped and scalar outputs use no reduction here: once, before the rows
        self.store_outputs(dict(base), i64(0), i64(0), 1, ("scalar",))
        self.chunks(lambda col, count: self.store_outputs(dict(base), None, col, count, ("row",)))
        with irx.for_range(b, self.m, name="row") as row:
            memo = dict(base)
            for level in range(1, self.depth + 1):
                self.row_values(row, memo)
                reds = [r for r in self.reductions if self.level[r] == level]
                self.rowwise_level(row, memo, reds, level)
            self.row_values(row, memo)
            self.store_outputs(memo, row, i64(0), 1, ("col",))
            self.chunks(lambda col, count: self.store_outputs(dict(memo), row, col, count,
                                                              ("block",), streaming,
                                                              self.depth + 1))

    def emit_general(self, base, streaming):
        b, w = self.b, self.w
        self.allocate_results()
        for level in range(1, self.depth + 1):
            reds = [r for r in self.reductions if self.level[r] == level]
            for r in reds:      # every stored value starts at the identity
                length = {"row": -(-self.n // w) * w, "col": self.m, "scalar": 1}[r.shape]
                ident = const(vec(F32, w), _IDENTITY[r.op])
                p = self.result_ptr(r)
                if r.shape == "col":
                    with irx.for_range(b, length, name="init") as k:
                        b.store(const(F32, _IDENTITY[r.op]), irx.element_ptr(b, p, k, F32))
                else:
                    with irx.for_range(b, max(length, 1), step=w, name="init") as k:
                        irx.store_vec(b, ident, p, k)
            by_row = [r for r in reds if r.args[0].shape in ("block", "col")]
            by_col_only = [r for r in reds if r.args[0].shape in ("row", "scalar")]
            if by_col_only:     # args constant down the rows: one pass over a row
                self.chunks(lambda col, count: self.accumulate(by_col_only, dict(base), None,
                                                               col, count))
            if by_row:
                with irx.for_range(b, self.m, name="row") as row:
                    memo = dict(base)
                    self.row_values(row, memo)
                    per_row = [r for r in by_row if r.args[0].shape == "col"]
                    if per_row:
                        self.accumulate(per_row, memo, row, None, None)
                    along = [r for r in by_row if r.args[0].shape == "block" and r.attr[0] == 1]
                    if along:       # along the row: register accumulators, then one store
                        self.rowwise_level(row, memo, along, level)
                        for r in along:
                            lane = b.extract_element(memo.pop(r), ir.Constant(I32, 0))
                            b.store(lane, irx.element_ptr(b, self.result_ptr(r), row, F32))
                    down = [r for r in by_row if r.args[0].shape == "block" and r.attr[0] == 0]
                    if down:        # down the columns: n stored accumulators
                        self.chunks(lambda col, count: self.accumulate(down, dict(memo), row,
                                                                       col, count, level))
            self.done.update(reds)
        self.store_outputs(dict(base), i64(0), i64(0), 1, ("scalar",))
        self.chunks(lambda col, count: self.store_outputs(dict(base), None, col, count, ("row",)))
        with irx.for_range(b, self.m, name="row") as row:
            memo = dict(base)
            self.row_values(row, memo)
            self.store_outputs(memo, row, i64(0), 1, ("col",))
            self.chunks(lambda col, count: self.store_outputs(dict(memo), row, col, count,
                                                              ("block",), streaming,
                                                              self.depth + 1))

    def accumulate(self, reds, memo, row, col, count, stage=None):
        """Fold one vector of each reduction's argument into its stored result (general)."""
        b, w = self.b, self.w
        values = self.chunk_render([r.args[0] for r in reds], memo, row, col, count, stage)
        for r, v in zip(reds, values):
            p = self.result_ptr(r)
            if r.shape == "row":            # axis 0 of a block: n values
                v = self.masked(r, v, count)
                irx.store_vec(b, _combine(b, r.op, irx.load_vec(b, p, col, F32, w), v), p, col)
            elif r.attr[0] == 1:            # axis 1: one value per row (or one value)
                v = _horizontal(b, r.op, self.masked(r, v, count))
                offset = row if r.shape == "col" else i64(0)
                slot = irx.element_ptr(b, p, offset, F32)
                old = b.load(slot, typ=F32)
                lane = b.extract_element(v, ir.Constant(I32, 0))
                b.store(_combine(b, r.op, old, lane), slot)
            else:                            # axis 0 of a column: one value
                slot = irx.element_ptr(b, p, i64(0), F32)
                old = b.load(slot, typ=F32)
                lane = b.extract_element(v, ir.Constant(I32, 0))
                b.store(_combine(b, r.op, old, lane), slot)


def generate(spec, target, symbol: str) -> ir.Module:
    return _Gen(spec, target, symbol).generate()

