"""The general schedule of tpp_cpu.equation's generator (equations that are not rowwise):
reductions accumulated in stored results (rows, columns, scalars) over whole passes of the
block, then the outputs in one more pass. A mixin of the generator: it uses its row passes
(row_values, rowwise_level, chunks, chunk_render, store_outputs, masked) and state."""
from __future__ import annotations

from llvmlite import ir

from . import irx
from .equation_reduce import IDENTITY, combine, horizontal
from .irx import F32, I32, const, i64, vec


class GeneralSchedule:
    def emit_general(self, base, streaming):
        b, w = self.b, self.w
        self.allocate_results()
        for level in range(1, self.depth + 1):
            reds = [r for r in self.reductions if self.level[r] == level]
            for r in reds:      # every stored value starts at the identity
                length = {"row": -(-self.n // w) * w, "col": self.m, "scalar": 1}[r.shape]
                ident = const(vec(F32, w), IDENTITY[r.op])
                p = self.result_ptr(r)
                if r.shape == "col":
                    with irx.for_range(b, length, name="init") as k:
                        b.store(const(F32, IDENTITY[r.op]), irx.element_ptr(b, p, k, F32))
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
                        self.rowwise_level([row], [memo], along, level)
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
                irx.store_vec(b, combine(b, r.op, irx.load_vec(b, p, col, F32, w), v), p, col)
            elif r.attr[0] == 1:            # axis 1: one value per row (or one value)
                v = horizontal(b, r.op, self.masked(r, v, count))
                offset = row if r.shape == "col" else i64(0)
                slot = irx.element_ptr(b, p, offset, F32)
                old = b.load(slot, typ=F32)
                lane = b.extract_element(v, ir.Constant(I32, 0))
                b.store(combine(b, r.op, old, lane), slot)
            else:                            # axis 0 of a column: one value
                slot = irx.element_ptr(b, p, i64(0), F32)
                old = b.load(slot, typ=F32)
                lane = b.extract_element(v, ir.Constant(I32, 0))
                b.store(combine(b, r.op, old, lane), slot)
