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
           Sums (max, min) down the columns of a block that are outputs and nothing else (the
           partial rows of a weight gradient beside dx) may join them: each accumulates in a
           stack row (n values, in L1) during the output pass, and is stored after the last
           row. 4096 x 1024 LayerNorm backward, dx and the dweight, dbias partial rows in one
           equation: 1.95 -> 1.8 ms (two equations, the second re-reading the block from L2).
  general  any other mix: each pass runs over the whole block; an axis-0 result (n values) and
           an axis-1 result (m values) live in stack arrays, a scalar result in one slot. Within
           a row, the axis-1 reductions of a pass accumulate in registers as in rowwise.

Row groups (kernels without a heavy pass, see Pipelined rows): a short row (GROUP_VECTORS vectors or fewer) is mostly per-row latency: the
horizontal reductions, the reciprocal, the broadcasts, each waiting for the pass before. A
rowwise kernel with one block input then runs ROW_GROUP rows together, each pass over both
(their chains interleaved, accumulators and kept row buffers of their own). 32768 x 128 f32,
one thread: softmax 2.0 -> 1.65 ms, LayerNorm 1.57 -> 1.21 ms, RMSNorm 1.07 -> 0.84 ms; with
two block inputs (the backward kernels) it measured 10-30 % slower, and groups of 4 were
slower than none. Long rows (GROUP_DOWN_COLUMNS or more) of a kernel with GROUP_DOWN sums
down the columns or more (the backward of LayerNorm and of the residual LayerNorm with their
weight and bias gradients: per row two reductions, a chain of scalar divisions, two partial
rows updated) run in groups too, their serial stretches interleaved. 16 MB of f32 rows, one
thread, Zen 5, both kernels compiled in one process, 21-41 interleaved calls: LayerNorm's
backward 1.14-1.49x faster at 512-4096 columns, the residual one's 1.18-1.57x at 512-1024
(without dropout and h's own gradient: with them its passes are heavy, and pipelined);
AVX2 code 1.17-1.29x at 512 and 768; bf16 1.05-1.26x. Not grouped, as measured: AVX2 at
256-384 columns (0.94-1.00x), 128 columns (0.84x), RMSNorm's backward (one such sum: level,
and 8% slower within `tpp-bench norm`), softmax's backward (none: 11-37% slower).

Prefetch: in the rowwise schedule, a row's first pass reads it from memory and the later ones
from L1, where no load misses and the hardware prefetchers (which stop at each 4 KiB page, a row
of 1024 f32) do not run ahead into the next row. When the second pass computes enough per
vector (PREFETCH_OPS block operations or more: LayerNorm's and RMSNorm's dx, not their
forward), it prefetches the next row of every block input, a line per vector, so that memory
works while the core computes (4096 x 1024 f32 LayerNorm dx, one thread: 1.8 -> 1.5 ms;
passes of 2-3 operations, softmax's and the forwards', lost 5-10 % with it on AMD's Zen).
On targets with eager_prefetch (Intel's cores) every second pass prefetches, EAGER_AHEAD rows
(groups) ahead: a Sapphire Rapids, whose hardware prefetchers also stop at each page, gained
7-18 % on the light passes (4096 x 1024 f32, one thread: LayerNorm forward 1.70 -> 1.39 ms,
softmax backward 2.35 -> 1.96; one row ahead: 1.45 and 2.2), level on the heavy ones.
There a kernel without reductions (one pass, a map) whose pass is heavy (irx.MAP_PREFETCH_OPS
operations per vector or more: bias + gelu, + dropout) prefetches its block inputs whole rows
ahead, at least irx.MAP_AHEAD_BYTES: its loop is compute-bound, and the few loads it keeps in
flight do not cover memory's latency (the element-wise TPPs do the same, tpp_cpu.eltwise).
4096 x 1024 and 32768 x 128 f32, one thread, interleaved processes: bias + gelu 2.8-3.2 ->
1.42-1.56 ms from 64-byte boundaries (1.8-2.0 -> 1.45-1.58 from numpy's 16), bias + gelu +
dropout 3.0-3.1 -> 2.5-2.7; one row (512 bytes) ahead at 128 columns 1.8 ms, 4 KiB 1.5.
Light maps (add, dropout alone) measured level with it and do not.

Pipelined rows: a rowwise kernel with a heavy pass (PIPE_OPS vector operations per vector or
more, a transcendental counted by its expansion: softmax's exp pass) runs its rows one at a
time, software-pipelined: one loop over the columns evaluates pass 1 of row t (reading it from
memory, PIPE_PREFETCH rows ahead prefetched), pass 2 of row t - 1, ..., and the outputs of row
t - depth (emit_pipelined). The passes are compute-bound on different ports (softmax: the max
on the FADD ports, exp on the FMA ones) and the memory reads of one row overlap the arithmetic
on the others; PIPE_UNROLL accumulators per reduction (in every row of such a kernel), the
other rows' work filling their latency. f32 softmax, one thread, the bench's figures:
4096 x 1024 x1.80 -> x2.17 torch, 32768 x 128 (instead of row groups) x1.60 -> x2.04. Two
accumulators rather than one: a NaN-propagating max (llvm.maximum: vmaxps, a compare of the
accumulator with itself, a masked move) is a ~7-cycle chain per vector on Zen 5, longer than
the rest of softmax's loop body; 4096 x 1024 softmax forward 60.4-60.5 -> 67.7-71.6 GB/s
(32768 x 128 and attention level; four accumulators measured as two). Light
kernels (LayerNorm's, RMSNorm's passes: 2-4 operations) measured 5-30 % slower pipelined
(three or more rows of a block in flight crowd the L1 sets that rows 4 KiB apart share) and
keep the plain schedule.

Sums of products: a sum along a row of a * b accumulates with one fma per full vector (one
rounding instead of two; the multiply and add then use one FMA port slot instead of an FMA
and an FADD one): LayerNorm's variance pass, its backward's sums (4096 x 1024 LayerNorm
forward 3-4 % faster).

Values that do not vary along a row (per-row or scalar nodes) are computed once per row or once
per kernel, not per vector. A transcendental needed by several passes is computed once and kept
in a stack buffer for the later ones (plan_kept). Tail lanes past n enter reductions as the reduction's identity.

Modules: this one (the generator, its rowwise schedule), equation_general (the general
schedule), equation_pipeline (the pipelined rows), equation_reduce (vector reductions).
"""
from __future__ import annotations

from llvmlite import ir

from tpp.core import expr as X
from tpp.core.equation_spec import MAX_STAGE_ELEMENTS
from tpp.core.errors import UnsupportedError
from tpp.core.spec import mask_bytes

from . import expr_llvm, irx
from .equation_general import GeneralSchedule
from .equation_pipeline import PIPE_STREAMS, Pipelining
from .equation_reduce import IDENTITY as _IDENTITY
from .equation_reduce import combine as _combine, horizontal as _horizontal, tree as _tree
from .irx import F32, I32, const, i64, vec

UNROLL = 4      # vectors per step of a rowwise reduction loop, each with its own accumulator
KEPT_ELEMENTS = 1 << 14   # f32 a rowwise kernel may keep on its stack (see _Gen.plan_kept)
ROW_GROUP = 2             # rows a rowwise kernel with short rows processes together (group)
GROUP_VECTORS = 16        # "short": at most this many vectors per row
GROUP_DOWN = 2            # a kernel with this many sums down the columns or more ...
GROUP_DOWN_COLUMNS = 512  # ... runs its rows of this many columns or more in groups too
PREFETCH_OPS = 4          # block operations per vector from which pass 2 prefetches (plan_prefetch)
EAGER_AHEAD = 2           # rows (groups) ahead that pass 2 prefetches on eager_prefetch targets
FMA_SUMS = True           # sums of products accumulate with fma (_product)
PIPELINE = True           # software-pipeline the rowwise passes over the rows (emit_pipelined)
PIPE_OPS = 8              # ... when one of its passes does this many vector operations or more
PIPE_UNROLL = 2           # accumulators per reduction in the pipelined loop
PIPE_LOCALITY = 3         # llvm.prefetch's locality for those


def _aligned(slots):
    """A stack buffer at a cache-line boundary: its vectors are read and written whole (LLVM
    otherwise aligns an f32 array to 16 bytes, so that every vector spans two lines and, as
    the stack falls, some span two pages: 32768 x 128 softmax's kept exp rows took 1.4 or
    2.7 ms by the size of the process's environment)."""
    slots.align = 64
    return slots


def _levels(order) -> dict:
    """node -> its level (reductions it depends on, transitively, counting itself)."""
    level = {}
    for nd in order:
        below = max((level[a] for a in nd.args), default=0)
        level[nd] = below + 1 if nd.op in X.REDUCTIONS else below
    return level


def _product(r):
    """Whether the reduction r is a sum of products of blocks that its full vectors accumulate
    with one fma (acc + a * b rounded once: the multiplication on an FMA port instead of a
    multiply there and an add on an FADD port; 4096 x 1024 LayerNorm's variance pass)."""
    a = r.args[0]
    return FMA_SUMS and r.op == "rsum" and a.op == "mul" and a.shape == "block"


class _Gen(GeneralSchedule, Pipelining):
    def __init__(self, spec, target, symbol):
        self.spec = spec
        self.w = target.lanes
        self.eager_prefetch = target.eager_prefetch
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
        along = [r for r in self.reductions if r.attr[0] == 1 and r.args[0].shape == "block"]
        used = {a for nd in self.order for a in nd.args}
        self.down = [r for r in self.reductions if r.attr[0] == 0 and r.args[0].shape == "block"
                     and r not in used]
        self.rowwise = len(along) + len(self.down) == len(self.reductions)
        if self.rowwise and self.down:      # folded in the output pass: no pass of their own
            self.depth = max((self.level[r] for r in along), default=0)
        self.full, self.tail = divmod(self.n, self.w)
        self.storage = {}
        self.done = set()          # reductions whose stored results are complete (general)
        self.kept = {}             # node -> (row buffer, the pass computing it) (rowwise)
        self.kept_stages = {}      # node -> (the pass computing it, the last pass reading it)
        self.prefetching = False   # pass 2 prefetches the next row (plan_prefetch)
        self.halves = False        # block inputs load as halves (aligned_or_halves)
        self.pipelining = False    # the rows run pipelined (emit_pipelined)
        vectors = -(-self.n // self.w)
        self.streams = streams = sum(1 for o in operands if o.role == "in"
                                     and o.layout == "block")
        grouped = (vectors <= GROUP_VECTORS and streams == 1) or (
            len(self.down) >= GROUP_DOWN and self.n >= GROUP_DOWN_COLUMNS)
        self.group = ROW_GROUP if (self.rowwise and self.depth and grouped
                                   and self.m >= ROW_GROUP) else 1
        # a rowwise kernel with a pass of PIPE_OPS operations or more: pipelined rows (from
        # depth + 2 rows; see pipelined), no groups, PIPE_UNROLL accumulators (in every row,
        # pipelined or not: a row's sums do not depend on where it falls)
        self.heavy = bool(PIPELINE and self.rowwise and self.depth
                          and self.heaviest_pass() >= PIPE_OPS)
        if self.heavy:
            self.group = 1

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
                    return irx.load_f32(b, p, b.add(b.mul(row, i64(o.ld)), col), o.dtype, w,
                                        count, halves=self.halves)
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
            slots = _aligned(b.alloca(F32, size=padded + w))
            # an untyped pointer like the operands' (irx addresses memory through those)
            self.storage[r] = b.inttoptr(b.ptrtoint(slots, irx.I64), irx.PTR)

    def allocate_down(self):
        """A stack row for each sum down the columns (rowwise schedule)."""
        padded = -(-self.n // self.w) * self.w
        if padded > MAX_STAGE_ELEMENTS:
            raise UnsupportedError(
                f"equation: a reduction along axis 0 keeps {padded} values on the stack (at "
                f"most {MAX_STAGE_ELEMENTS})")
        for r in self.down:
            slots = _aligned(self.b.alloca(F32, size=padded + self.w))
            self.storage[r] = self.b.inttoptr(self.b.ptrtoint(slots, irx.I64), irx.PTR)

    def fold_down(self, values, col, count):
        """Fold one vector of each sum down the columns into its stack row."""
        b, w = self.b, self.w
        for r, v in zip(self.down, values):
            p = self.storage[r]
            v = self.masked(r, v, count)
            irx.store_vec(b, _combine(b, r.op, irx.load_vec(b, p, col, F32, w), v), p, col)

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
    def level_reductions(self, level):
        """The reductions that the pass of reduction level `level` accumulates: those of that
        level, less (rowwise) the sums down the columns, which the output pass folds in."""
        return [r for r in self.reductions if self.level[r] == level
                and not (self.rowwise and r in self.down)]

    def pass_nodes(self, folded=True):
        """(stage, the block-shaped nodes that stage's pass evaluates) for each pass: 1..depth
        the reduction levels, depth+1 the outputs (rowwise: with the arguments of the sums
        down the columns folded into it, unless folded=False)."""
        folded = [r.args[0] for r in self.down] if self.rowwise and folded else []
        for level in range(1, self.depth + 2):
            if level <= self.depth:
                targets = [r.args[0] for r in self.level_reductions(level)]
            else:
                targets = [nd for nd, _ in self.outputs if nd.shape == "block"] + folded
            yield level, X.topological(targets, lambda nd: nd.op in X.REDUCTIONS
                                       or nd.shape != "block")

    def plan_kept(self):
        """A transcendental that several passes need (softmax's exp(x - max): the sum's pass
        and the output's) is computed once, in the first of them, and kept for the others in a
        stack buffer instead of being recomputed: a row long in the rowwise schedule (in L1),
        the whole block in the general one (when it fits KEPT_ELEMENTS). Each pass is a
        "stage": 1..depth the reduction levels, depth+1 the outputs."""
        stages = {}
        for level, inside in self.pass_nodes():
            for nd in inside:
                if nd.op == "prim" and nd.shape == "block":
                    stages.setdefault(nd, []).append(level)
        self.padded = padded = -(-self.n // self.w) * self.w
        size = padded * self.group if self.rowwise else self.m * padded
        budget = KEPT_ELEMENTS
        for nd, used in stages.items():
            if len(used) > 1 and size <= budget:
                budget -= size
                self.kept_stages[nd] = (used[0], used[-1])
                slots = _aligned(self.b.alloca(F32, size=size))
                self.kept[nd] = (self.b.inttoptr(self.b.ptrtoint(slots, irx.I64), irx.PTR),
                                 used[0])

    def plan_prefetch(self):
        """Whether the second pass over a row (rowwise) prefetches the next row: see the module
        docstring. Counts the block operations that pass evaluates per vector."""
        if not self.rowwise:
            return
        if not self.depth:
            self.prefetching = (self.eager_prefetch and self.full > 0
                                and self.heaviest_pass() >= irx.MAP_PREFETCH_OPS)
            return
        if self.depth >= 2:
            targets = [r.args[0] for r in self.level_reductions(2)]
        else:
            targets = [nd for nd, _ in self.outputs if nd.shape == "block"]
        inside = X.topological(targets, lambda nd: nd.op in X.REDUCTIONS or nd.shape != "block")
        ops = sum(1 for nd in inside if nd.shape == "block" and nd.op not in X.LEAVES
                  and nd.op not in X.REDUCTIONS)
        self.prefetching = ops >= PREFETCH_OPS or (self.eager_prefetch and ops > 0)

    def prefetch(self, row, col, stage, ahead=None):
        """In pass 2 (when planned), prefetch the vector at (row + group, col) of every block
        input, EAGER_AHEAD groups ahead on eager_prefetch targets (past the block's last row:
        the caller's next block, or nothing); ahead: that many rows ahead, whatever the pass
        (the pipelined schedule's)."""
        if ahead is None and (not self.prefetching or stage != min(2, self.depth + 1)):
            return
        b = self.b
        for name, o in self.operand.items():
            if o.layout == "block" and o.role == "in":
                rows = ahead or self.group * (EAGER_AHEAD if self.eager_prefetch else 1)
                if not self.depth and not ahead:
                    rows = irx.map_rows_ahead(o.ld * o.dtype.itemsize)
                offset = b.add(b.mul(b.add(row, i64(rows)), i64(o.ld)), col)
                irx.prefetch(b, self.ptr[name], offset, irx.storage_type(o.dtype),
                             PIPE_LOCALITY if ahead else 3)

    def chunk_render(self, nodes, memo, row, col, count, stage, slot=0):
        """render() of one vector in pass `stage`, reading kept values computed by an earlier
        pass and keeping those this pass computes first (rowwise: in the row buffer `slot`,
        the row's place in its group)."""
        chunk = dict(memo)
        if not self.kept or stage is None:
            return self.render(nodes, chunk, row, col, count)
        if self.rowwise:
            at = self.b.add(col, i64(slot * self.padded)) if slot else col
        else:
            at = self.b.add(self.b.mul(row, i64(self.padded)), col)
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

    def rowwise_level(self, rows, memos, reds, stage=None, ahead=None, extra=None):
        """Accumulate this level's reductions over each row of `rows` (a group processed
        together; UNROLL accumulators per reduction and row, one per vector of an unrolled
        step); put their splatted results into that row's memo. ahead: more (rows, memos, reds,
        stage) accumulated in the same loop, in this order after the first (the pipelined
        schedule: the passes of later rows); extra(col, count): more per-vector work of the
        loop, emitted first at each column (the pipelined schedule's outputs of an earlier
        row)."""
        b, w = self.b, self.w
        parts = [(rows, memos, reds, stage)] + list(ahead or ())
        unroll = max(1, min(PIPE_UNROLL if self.heavy else UNROLL, self.full))
        slots = {}
        accs = []
        for p, (p_rows, _, p_reds, _) in enumerate(parts):
            for g in range(len(p_rows)):
                for u in range(unroll):
                    for i, r in enumerate(p_reds):
                        slots[p, g, u, i] = len(accs)
                        accs.append(const(vec(F32, w), _IDENTITY[r.op]))

        def fold(accs, u, col, count):
            if extra is not None:
                extra(col, count)
            for p, (p_rows, p_memos, p_reds, p_stage) in enumerate(parts):
                fused = [count is None and _product(r) for r in p_reds]
                args = []
                for r, f in zip(p_reds, fused):
                    args += list(r.args[0].args) if f else [r.args[0]]
                for g, (row, memo) in enumerate(zip(p_rows, p_memos)):
                    values = self.chunk_render(args, memo, row, col, count, p_stage, g)
                    if count is None:
                        self.prefetch(row, col, p_stage)
                    k = 0
                    for i, (r, f) in enumerate(zip(p_reds, fused)):
                        at = slots[p, g, u, i]
                        if f:       # a sum of products: one fma per vector
                            accs[at] = irx.fma(b, values[k], values[k + 1], accs[at])
                            k += 2
                            continue
                        v = self.masked(r, values[k], count)
                        k += 1
                        accs[at] = _combine(b, r.op, accs[at], v)

        steps = self.full // unroll
        if steps:
            with irx.for_carry(b, steps * unroll * w, accs, step=unroll * w, name="red") as st:
                new = list(st.values)
                for u in range(unroll):
                    fold(new, u, b.add(st.index, i64(u * w)) if u else st.index, None)
                st.values = new
            accs = list(st.values)
        for j in range(steps * unroll, self.full):       # leftover full vectors
            fold(accs, j % unroll, i64(j * w), None)
        if self.tail:
            fold(accs, 0, i64(self.full * w), self.tail)
        for p, (p_rows, p_memos, p_reds, _) in enumerate(parts):
            for g, memo in enumerate(p_memos):
                for i, r in enumerate(p_reds):
                    total = _tree(b, r.op, [accs[slots[p, g, u, i]] for u in range(unroll)])
                    memo[r] = _horizontal(b, r.op, total)

    def store_outputs(self, memo, row, col, count, shapes, streaming=False, stage=None, slot=0,
                      down=()):
        """Render and store the outputs of the given shapes for the vector at (row, col);
        streaming: full vectors of blocks with non-temporal stores (see irx.with_streaming);
        down: the sums down the columns folded in here (rowwise)."""
        b = self.b
        chosen = [(nd, o) for nd, o in self.outputs if nd.shape in shapes]
        if not chosen and not down:
            return
        values = self.chunk_render([nd for nd, _ in chosen] + [r.args[0] for r in down], memo,
                                   row, col, count, stage, slot)
        if down:
            self.fold_down(values[len(chosen):], col, count)
        if count is None and row is not None:
            self.prefetch(row, col, stage)
        for (nd, (name, layout, dt, ld)), value in zip(chosen, values):
            p = self.ptr[name]
            o = self.operand[name]
            if layout == "mask":
                offset = b.add(b.mul(row, i64(mask_bytes(self.n))), b.udiv(col, i64(8)))
                irx.store_bits(b, value, p, offset, count)
            elif layout == "block":
                offset = b.add(b.mul(row, i64(o.ld)), col)
                if streaming == "whole" and count is None:
                    irx.store_whole_nt(b, irx.from_f32(b, value, dt), p, offset, dt)
                else:
                    irx.store_f32(b, value, p, offset, dt, count, streaming and count is None)
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
        self.plan_prefetch()
        if self.rowwise and self.down:
            self.allocate_down()
        emit = self.emit_rowwise if self.rowwise else self.emit_general
        blocks = [(self.ptr[name], self.m, ld * dt.itemsize)
                  for name, layout, dt, ld in self.spec.outputs if layout == "block"]

        def body():
            if self.full and blocks:
                irx.with_streaming(b, blocks, lambda streaming: irx.whole_or_pieces(
                    b, blocks, streaming, lambda how: emit(dict(base), how)),
                    force=self.spec.stream)
            else:
                emit(dict(base), False)
        self.aligned_or_halves(body)
        b.ret_void()
        return self.module

    def aligned_or_halves(self, body):
        """body() for the alignment of the call's block inputs (irx.by_input_alignment): a
        light kernel (memory-bound: every pass under PIPE_OPS operations per vector) loads
        whole vectors where every f32 block input is at a 64-byte boundary, as halves where one
        is not (irx.HALF_BYTES tells why); a heavy one loads whole vectors whatever the
        alignment. 4096 x 1024 f32 at numpy's 16-byte boundaries, one thread, Zen 5, two
        interleaved runs: LayerNorm forward 27-29 -> 67-77 GB/s, RMSNorm 32-35 -> 77-79,
        RMSNorm backward 32-33 -> 49-50 (aligned, either code: 48-75, 72-78, 45-58); 128 to
        4096 columns alike. The heavy kernels (softmax, bias + gelu) lost under 10 %
        misaligned and measured level or slower as halves."""
        if not self.full or self.heaviest_pass() >= PIPE_OPS:
            body()
            return

        def variant(halves):
            self.halves = halves
            body()
            self.halves = False
        irx.by_input_alignment(self.b, [(self.ptr[o.name], o) for o in self.operand.values()
                                        if o.role == "in"], self.w, variant)

    def emit_rowwise(self, base, streaming):
        b = self.b
        # row-shaped and scalar outputs use no reduction here: once, before the rows
        self.store_outputs(dict(base), i64(0), i64(0), 1, ("scalar",))
        row_outputs = lambda col, count: self.store_outputs(  # noqa: E731
            dict(base), None, col, count, ("row",))
        for r in self.down:         # each stack row starts at the identity
            with irx.for_range(b, -(-self.n // self.w) * self.w, step=self.w, name="init") as k:
                irx.store_vec(b, const(vec(F32, self.w), _IDENTITY[r.op]), self.storage[r], k)
        if not self.down:
            self.chunks(row_outputs)
        group = self.group
        whole = self.m - self.m % group
        if whole and self.pipelined(whole):
            self.pipelining, self.prefetching = True, False     # it prefetches its own way
            self.emit_pipelined(base, streaming, whole)
        elif whole:
            with irx.for_range(b, whole, step=group, name="row") as row:
                rows = [row] + [b.add(row, i64(g)) for g in range(1, group)]
                self.rowwise_rows(rows, [dict(base) for _ in rows], streaming)
        for r in range(whole, self.m):      # rows past the last group, one at a time
            self.rowwise_rows([i64(r)], [dict(base)], streaming)
        if self.down:       # the row-shaped outputs, the sums down the columns among them
            self.chunks(row_outputs)

    def rowwise_rows(self, rows, memos, streaming, start=1):
        """The passes of the rowwise schedule over a group of rows, together, from reduction
        level `start` (the earlier ones are in memos)."""
        for level in range(start, self.depth + 1):
            for row, memo in zip(rows, memos):
                self.row_values(row, memo)
            reds = self.level_reductions(level)
            self.rowwise_level(rows, memos, reds, level)
        for row, memo in zip(rows, memos):
            self.row_values(row, memo)
            self.store_outputs(memo, row, i64(0), 1, ("col",))

        def body(col, count):
            for g, (row, memo) in enumerate(zip(rows, memos)):
                self.store_outputs(dict(memo), row, col, count, ("block",), streaming,
                                   self.depth + 1, g, self.down)
        self.chunks(body)

def generate(spec, target, symbol: str) -> ir.Module:
    return _Gen(spec, target, symbol).generate()

