"""The rowwise equation schedule software-pipelined over the rows (see tpp_cpu.equation's
"Pipelined rows"): whether a kernel takes it, how heavy its passes are, and the loop that runs
pass 1 of row t beside pass 2 of row t - 1 ... and the outputs of row t - depth.

Pipelining is a mixin of tpp_cpu.equation's generator: it uses the generator's row passes
(row_values, rowwise_level, rowwise_rows, store_outputs, prefetch) and state (depth, heavy,
reductions, level, down, kept_stages, streams, prefetching)."""
from __future__ import annotations

from tpp.core import expr as X

from . import expr_llvm, irx
from .irx import i64

PIPE_PREFETCH = 2         # the pipelined loop prefetches this many rows ahead of pass 1 (0: none)
PIPE_STREAMS = 1          # ... when it reads this many blocks or fewer


class Pipelining:
    def pipelined(self, whole):
        """Whether the rowwise rows run pipelined (emit_pipelined): rows one at a time, more
        rows than passes, a pass of PIPE_OPS vector operations or more (compute-bound: the
        pipeline overlaps its ports and memory with the other passes; passes of a few
        operations, LayerNorm's and RMSNorm's, measured no faster or slower, their rows' L1
        sets crowded by the rows in flight), the pass-2 prefetch replaced by the pipeline's
        own where planned (one input block), and every kept value read only by the pass
        after the one computing it (the next row's pass overwrites it one row later)."""
        if not self.heavy or whole < self.depth + 2:
            return False
        if self.prefetching and self.streams > PIPE_STREAMS:
            return False
        return all(last == first + 1 for first, last in self.kept_stages.values())

    def heaviest_pass(self):
        """The most vector operations per vector of block that one pass evaluates, a
        transcendental counted by its expansion (softmax's exp pass: 16; LayerNorm's, RMSNorm's
        passes: 4 or fewer). The sums down the columns folded into the output pass are not
        counted (the thresholds were measured so: counting them would pipeline LayerNorm's
        backward, whose dweight and dbias terms are a multiply each)."""
        most = 0
        for _, inside in self.pass_nodes(folded=False):
            most = max(most, expr_llvm.vector_ops(
                nd for nd in inside if nd.shape == "block" and nd.op not in X.REDUCTIONS))
        return most

    def emit_pipelined(self, base, streaming, whole):
        """The rowwise passes software-pipelined over the rows: one loop over a row's columns
        runs pass 1 (reading it from memory) on row t, pass 2 on row t - 1, ..., the outputs
        on row t - depth, so that the memory reads of one row overlap the computation on the
        others, and passes that use different execution ports share them (softmax's maxima
        beside its exp beside its outputs). Each row
        gets the same operations as in the plain schedule; kept values of the outputs' pass
        are read (older row) before the pass computing them writes (newer row) at each
        column. The first and last `depth` rows fill and drain the pipeline, pass by pass."""
        b, depth = self.b, self.depth
        levels = {s: self.level_reductions(s)
                  for s in range(1, depth + 1)}
        # prologue: row j completes its levels 1 .. depth - j
        pending = {}
        for j in range(depth):
            row, memo = i64(j), dict(base)
            for s in range(1, depth - j + 1):
                self.row_values(row, memo)
                self.rowwise_level([row], [memo], levels[s], s)
            pending[depth - j] = memo        # k = t - row at t = depth: levels 1 .. k done

        def pack(memo_of):
            return [memo_of(k)[r] for k in range(1, depth + 1) for s in range(1, k + 1)
                    for r in levels[s]]

        def unpack(values):
            memos, at = {}, 0
            for k in range(1, depth + 1):
                memo = dict(base)
                for s in range(1, k + 1):
                    for r in levels[s]:
                        memo[r] = values[at]
                        at += 1
                memos[k] = memo
            return memos

        with irx.for_carry(b, whole, pack(lambda k: pending[k]), start=depth,
                           name="row") as st:
            t = st.index
            memos = unpack(st.values)
            memos[0] = dict(base)
            rows = {k: b.sub(t, i64(k)) if k else t for k in range(depth + 1)}
            for k in range(depth + 1):
                self.row_values(rows[k], memos[k])
            last, last_memo = rows[depth], memos[depth]
            self.store_outputs(last_memo, last, i64(0), 1, ("col",))

            def body(col, count):
                self.store_outputs(dict(last_memo), last, col, count, ("block",), streaming,
                                   depth + 1, 0, self.down)
                if count is None and self.streams <= PIPE_STREAMS and PIPE_PREFETCH:
                    self.prefetch(t, col, None, PIPE_PREFETCH)
            # the passes of older rows first: each reads its kept values before a newer row's
            # pass overwrites them
            parts = [([rows[k]], [memos[k]], levels[k + 1], k + 1)
                     for k in range(depth - 1, -1, -1)]
            (r0, m0, red0, s0), rest = parts[0], parts[1:]
            self.rowwise_level(r0, m0, red0, s0, rest, extra=body)
            st.values = pack(lambda k: memos[k - 1])
        done = unpack(st.values)
        for k in range(depth, 0, -1):        # drain: row whole - k has its levels 1 .. k
            self.rowwise_rows([i64(whole - k)], [done[k]], streaming, start=k + 1)
