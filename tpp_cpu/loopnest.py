"""Generator: a LoopNestSpec -> one function running the whole nest and its TPP calls.

The compiled entry is `void f(int64 table)`, the address of an int64 table (see `layout`):

    [0]                      threads requested
    [1 .. 1+T)               tensor base addresses, in spec.tensors order
    [1+T .. 1+T+K)           kernel function addresses, in spec.kernel_specs() order
    [1+T+K .. 1+T+K+4)       GOMP_parallel, omp_get_thread_num, omp_get_num_threads, GOMP_barrier
    [1+T+K+4 .. +S)          the values of the sizes, in spec.sizes order

Kernel and runtime addresses arrive at call time, so the compiled nest is independent of the
process it runs in and can live in the disk cache. With a parallel band and more than one
thread the entry hands `run` to GOMP_parallel; otherwise it runs `run(table, 0, 1)` itself.
Loop trip counts are compile-time constants, except where a loop's stop is a size expression:
then it, the addresses and conditions that use sizes, and the parallel band's iteration count
(hence each thread's share) are computed from the size slots when the nest runs. The kernels
called keep their compile-time shapes. Blocked levels stop at their parent's block end or the
loop's stop, whichever comes first.
"""
from __future__ import annotations

from llvmlite import ir

from tpp.core.loop_spec import LETTERS, SIZE, Address

from . import irx
from .irx import I32, I64, PTR

RUNTIME = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads", "GOMP_barrier")


def layout(spec) -> dict:
    """Slot indices of the table: {'tensors': first, 'kernels': first, 'runtime': first}."""
    t, k, s = len(spec.tensors), len(spec.kernel_specs()), len(spec.sizes)
    return {"tensors": 1, "kernels": 1 + t, "runtime": 1 + t + k, "sizes": 1 + t + k + 4,
            "size": 1 + t + k + 4 + s}


class _Gen:
    def __init__(self, spec, module):
        self.spec = spec
        self.module = module
        self.slots = layout(spec)
        self.kernels = spec.kernel_specs()
        self.band = [k for k, lv in enumerate(spec.levels) if lv.parallel]

    # ------------------------------------------------------------ table access
    def slot(self, b, table, index):
        return b.load(b.gep(table, [irx.i64(index)], source_etype=I64), typ=I64)

    def runtime_fn(self, b, table, name, fnty):
        """The runtime function in the table's slot for name, callable with b.call."""
        return _callee(b, self.slot(b, table, self.slots["runtime"] + RUNTIME.index(name)), fnty)

    # ------------------------------------------------------------ the nest
    def emit_run(self, fn):
        table, tid, nt = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.table, self.tid, self.nt = table, tid, nt
        sizes = {SIZE + name: self.slot(b, table, self.slots["sizes"] + k)
                 for k, name in enumerate(self.spec.sizes)}
        self.emit_levels(b, 0, sizes)
        b.ret_void()

    def emit_levels(self, b, index, values):
        levels = self.spec.levels
        if index == len(levels):
            self.emit_body(b, values)
            return
        if self.band and index == self.band[0]:
            self.emit_band(b, values)
            return
        lv = levels[index]
        loop = self.spec.loops[LETTERS.index(lv.letter)]
        step = loop.level_step(lv.level)
        stop = self.stop(b, loop, values)
        if lv.level == 0:
            start, end = irx.i64(loop.start), stop
        else:
            start = values[lv.letter]
            limit = b.add(start, irx.i64(loop.level_step(lv.level - 1)))
            end = b.select(b.icmp_signed("<", limit, stop), limit, stop)
        with irx.for_range(b, end, step=step, start=start, name=f"{lv.letter}{lv.level}") as v:
            self.emit_levels(b, index + 1, {**values, lv.letter: v})

    def emit_band(self, b, values):
        """The parallel levels, collapsed; this thread's contiguous share of the iterations."""
        levels = [self.spec.levels[k] for k in self.band]
        trips = [self.trips(b, lv, values) for lv in levels]
        total = irx.i64(1)
        for t in trips:
            total = b.mul(total, t)
        lo = b.sdiv(b.mul(self.tid, total), self.nt)
        hi = b.sdiv(b.mul(b.add(self.tid, irx.i64(1)), total), self.nt)
        fn = b.block.function
        with irx.for_range(b, hi, start=lo, name="flat") as flat:
            digits, rest = [], flat
            for t in reversed(trips):
                digits.append(b.srem(rest, t))
                rest = b.sdiv(rest, t)
            digits.reverse()
            inner = dict(values)
            valid = None
            for lv, digit in zip(levels, digits):
                loop = self.spec.loops[LETTERS.index(lv.letter)]
                offset = b.mul(digit, irx.i64(loop.level_step(lv.level)))
                base = irx.i64(loop.start) if lv.level == 0 else inner[lv.letter]
                inner[lv.letter] = b.add(base, offset, name=f"{lv.letter}{lv.level}")
                if lv.level > 0:
                    ok = b.icmp_signed("<", inner[lv.letter], self.stop(b, loop, inner))
                    valid = ok if valid is None else b.and_(valid, ok)
            if valid is not None:
                run = fn.append_basic_block("band.run")
                skip = fn.append_basic_block("band.skip")
                b.cbranch(valid, run, skip)
                b.position_at_end(run)
                self.emit_levels(b, self.band[-1] + 1, inner)
                b.branch(skip)
                b.position_at_end(skip)
            else:
                self.emit_levels(b, self.band[-1] + 1, inner)
        if self.band[0] > 0:     # enclosing sequential loops: finish this pass together
            many = b.icmp_signed(">", self.nt, irx.i64(1))
            with b.if_then(many):
                b.call(self.runtime_fn(b, self.table, "GOMP_barrier",
                                       ir.FunctionType(ir.VoidType(), [])), [])

    def stop(self, b, loop, values):
        """A loop's stop: a constant, or computed from the sizes."""
        return irx.i64(loop.stop) if not loop.symbolic else self.affine(b, loop.stop, values)

    def trips(self, b, lv, values):
        """Iterations of one pass over a band level (loop_spec.Loop.trips): a constant, or
        max(0, ceil((stop - start) / step)) from the sizes."""
        loop = self.spec.loops[LETTERS.index(lv.letter)]
        if lv.level > 0 or not loop.symbolic:
            return irx.i64(loop.trips(lv.level, {}))
        step = irx.i64(loop.level_step(0))
        span = b.sub(self.stop(b, loop, values), irx.i64(loop.start))
        count = b.sdiv(b.add(span, b.sub(step, irx.i64(1))), step)
        return b.select(b.icmp_signed(">", span, irx.i64(0)), count, irx.i64(0))

    # ------------------------------------------------------------ the body
    def affine(self, b, expr, values):
        """The int64 value of an Affine at the loop values (LoopNestSpec checked that it and
        every floor-divided part fit in int64)."""
        acc = irx.i64(expr.const)
        for var, c in expr.terms:
            value = values[var] if isinstance(var, str) else self.floor(b, var, values)
            acc = b.add(acc, b.mul(value, irx.i64(c)))
        return acc

    def floor(self, b, term, values):
        """floor(inner / divisor) for a Floor term (divisor >= 1): sdiv rounds toward zero,
        so a negative remainder steps the quotient down by one."""
        x = self.affine(b, term.inner, values)
        d = irx.i64(term.divisor)
        q, r = b.sdiv(x, d), b.srem(x, d)
        return b.sub(q, b.zext(b.icmp_signed("<", r, irx.i64(0)), I64))

    def emit_body(self, b, values):
        fn = b.block.function
        for call in self.spec.calls:
            skip = None
            if call.when:
                ok = None
                for cond in call.when:
                    test = b.icmp_signed(cond.op, self.affine(b, cond.expr, values), irx.i64(0))
                    ok = test if ok is None else b.and_(ok, test)
                run = fn.append_basic_block("call.run")
                skip = fn.append_basic_block("call.skip")
                b.cbranch(ok, run, skip)
                b.position_at_end(run)
            args = []
            for arg in call.args:
                if arg is None:
                    args.append(irx.i64(0))
                elif isinstance(arg, Address):
                    tensor = self.spec.tensors[arg.tensor]
                    base = self.slot(b, self.table, self.slots["tensors"] + arg.tensor)
                    offset = self.affine(b, arg.offset, values)
                    args.append(b.add(base, b.mul(offset, irx.i64(tensor.dtype.itemsize))))
                else:
                    args.append(self.affine(b, arg, values))
            fnty = ir.FunctionType(ir.VoidType(), [I64] * len(args))
            kaddr = self.slot(b, self.table, self.slots["kernels"] + self.kernels.index(call.spec))
            b.call(_callee(b, kaddr, fnty), args)
            if skip is not None:
                b.branch(skip)
                b.position_at_end(skip)


def _callee(b, address, fnty):
    """An indirect callee from an int64 address. llvmlite's call() reads `function_type` from
    its callee, which an opaque pointer does not have, so the pointer is wrapped with it."""
    return _Callee(b.inttoptr(address, PTR), fnty)


class _Callee:
    def __init__(self, pointer, fnty):
        self.pointer, self.function_type, self.type = pointer, fnty, PTR

    def get_reference(self):
        return self.pointer.get_reference()


def generate(spec, target, symbol: str) -> ir.Module:
    module = ir.Module(name=symbol)
    run_ty = ir.FunctionType(ir.VoidType(), [PTR, I64, I64])
    run = ir.Function(module, run_ty, name=f"{symbol}_run")
    run.linkage = "internal"
    gen = _Gen(spec, module)
    gen.emit_run(run)
    # the OpenMP outlined body: every thread of the team runs `run` with its id
    body = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR]), name=f"{symbol}_omp")
    body.linkage = "internal"
    b = ir.IRBuilder(body.append_basic_block("entry"))
    table = body.args[0]
    i32fn = ir.FunctionType(I32, [])
    tid = b.sext(b.call(gen.runtime_fn(b, table, "omp_get_thread_num", i32fn), []), I64)
    nt = b.sext(b.call(gen.runtime_fn(b, table, "omp_get_num_threads", i32fn), []), I64)
    b.call(run, [table, tid, nt])
    b.ret_void()

    entry = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64]), name=symbol)
    entry.attributes.add("nounwind")
    b = ir.IRBuilder(entry.append_basic_block("entry"))
    table = b.inttoptr(entry.args[0], PTR)
    if spec.parallel:
        threads = gen.slot(b, table, 0)
        many = b.icmp_signed(">", threads, irx.i64(1))
        with b.if_else(many) as (then, otherwise):
            with then:
                par_ty = ir.FunctionType(ir.VoidType(), [PTR, PTR, I32, I32])
                par = gen.runtime_fn(b, table, "GOMP_parallel", par_ty)
                b.call(par, [body, table, b.trunc(threads, I32), ir.Constant(I32, 0)])
            with otherwise:
                b.call(run, [table, irx.i64(0), irx.i64(1)])
    else:
        b.call(run, [table, irx.i64(0), irx.i64(1)])
    b.ret_void()
    return module
