"""The complete safety check of a loop nest, in exact integers, for given sizes.

`check(spec, env, error)` proves, for one assignment of the nest's sizes (env maps '$M' to
(v, v); {} for a nest without sizes), that

- every loop's values lie within +-ADDRESS_LIMIT (stops that are size expressions included),
- the parallel band's iteration count times MAX_THREADS fits in int64 (the split's products),
- every value the generated int64 code compares, passes as a scalar or floor-divides lies in
  int64 over the loop ranges (an address may wrap in between: its final value is checked),
- BRGEMM counts and strides are ints in [0, 2**63),
- every address every call can touch lies inside its tensor.

It costs O(calls x terms): never O(iterations). Each address's range is bounded term by term
over the loop ranges (narrowed by single-variable guards), which always contains every value
the address takes. A nest without sizes runs it once, when the spec is built (SpecError); a
nest with sizes when it is called with sizes not seen before (ArgumentError, cached per sizes
by tpp.runtime.loops.CompiledNest). When a loop has no iteration for these sizes, nothing runs and
nothing is checked but the loop bounds.
"""
from __future__ import annotations

from . import checks
from .errors import SpecError
from .loop_expr import COMPARE
from .loop_spec import LETTERS, Address, operand_extent, raw_operands, text


def check(spec, env: dict, error=SpecError):
    """Raise `error` unless a call of the nest with these sizes stays in bounds (see above)."""
    where = _where(spec, env)
    ranges = _loop_ranges(spec, env, error, where)
    if ranges is None:
        return               # a loop with no iteration: the body never runs
    _check_band(spec, env, error, where)
    for call in spec.calls:
        _check_int64(call, ranges, error, where)
        _check_bounds(spec, call, ranges, error, where)


def check_constants(call):
    """SpecError unless every constant of every expression of the call is an int64."""
    exprs = [c.expr for c in call.when] + [a.offset if isinstance(a, Address) else a
                                           for a in call.args if a is not None]
    for expr in exprs:
        if not all(checks.fits_int64(c, c) for c in expr.constants()):
            raise SpecError(f"call {call.spec.op}: a constant of {expr.key()} does not fit in "
                            f"int64")


def _where(spec, env) -> str:
    if not env:
        return ""
    return "with " + ", ".join(f"{name}={env['$' + name][0]}" for name in spec.sizes) + ": "


def _loop_ranges(spec, env, error, where):
    """{letter: (first, last)} of every loop's values plus env's sizes, or None when some loop
    has no iteration."""
    ranges = dict(env)
    limit = checks.ADDRESS_LIMIT
    empty = False
    for i, lp in enumerate(spec.loops):
        if lp.symbolic:
            stop = lp.stop_at(env)
            if abs(stop) > limit:
                raise error(f"{where}loop {LETTERS[i]} stops at {text(lp.stop)} = {stop}, "
                            f"beyond +-{limit} (2**47, the bytes a process can address)")
        first, last = lp.start, lp.last(env)
        empty = empty or last < first
        ranges[LETTERS[i]] = (first, last)
    return None if empty else ranges


def _check_band(spec, env, error, where):
    """`error` unless the generated code can split the parallel band's iterations over
    MAX_THREADS threads in int64 (thread t starts at t * total // threads)."""
    total = 1
    for lv in spec.levels:
        if lv.parallel:
            total *= spec.loops[LETTERS.index(lv.letter)].trips(lv.level, env)
    if total * checks.MAX_THREADS > checks.INT64_MAX:
        raise error(f"{where}order {spec.order!r}: the parallel band has {total} iterations, "
                    f"more than {checks.INT64_MAX // checks.MAX_THREADS} (int64 / MAX_THREADS)")


def _check_int64(call, ranges, error, where):
    """`error` unless the generated int64 code evaluates every expression of the call
    exactly: every value compared (guards), passed as a scalar or floor-divided lies in int64
    over the loop ranges."""
    exprs = [(f"condition {c.key()}", c.expr, True) for c in call.when]
    for k, arg in enumerate(call.args):
        if isinstance(arg, Address):
            exprs.append((f"argument {k} (address)", arg.offset, False))
        elif arg is not None:
            exprs.append((f"argument {k} (scalar)", arg, True))
    for what, expr, whole in exprs:
        for part in ([expr] if whole else []) + [f.inner for f in expr.floors()]:
            lo, hi = part.bounds(ranges)
            if not checks.fits_int64(lo, hi):
                raise error(f"{where}call {call.spec.op} {what}: {part.key()} takes values in "
                            f"[{lo}, {hi}] over the loop ranges, beyond the int64 the "
                            f"generated code computes in")


def _guarded_ranges(ranges, when):
    """ranges narrowed by the single-variable guards of `when` (sizes count as constants),
    or None when a guard never holds (the call never runs)."""
    ranges = dict(ranges)
    for cond in when:
        loop_terms, fixed = cond.expr.split()
        k = fixed.value(ranges)
        if not loop_terms:
            if not COMPARE[cond.op](k, 0):
                return None
            continue
        if len(loop_terms) != 1:
            continue
        (var, c), = loop_terms
        if c not in (1, -1) or not isinstance(var, str):
            continue
        lo, hi = ranges[var]
        bound = -k * c       # c*v + k OP 0  <=>  v OP' bound
        op = cond.op if c == 1 else {"<": ">", "<=": ">=", ">": "<", ">=": "<=",
                                      "==": "==", "!=": "!="}[cond.op]
        if op == "<":
            hi = min(hi, bound - 1)
        elif op == "<=":
            hi = min(hi, bound)
        elif op == ">":
            lo = max(lo, bound + 1)
        elif op == ">=":
            lo = max(lo, bound)
        elif op == "==":
            lo, hi = max(lo, bound), min(hi, bound)
        if lo > hi:
            return None
        ranges[var] = (lo, hi)
    return ranges


def call_extents(spec, args, env, error=SpecError) -> list:
    """Per raw argument: the elements the call may touch from that address (None: a scalar,
    or nothing touched)."""
    ext = [None if op is None else operand_extent(op) for op in raw_operands(spec)]
    if spec.family == "brgemm":      # stride mode: count blocks, arg_a/arg_b elements apart
        count, arg_a, arg_b = (a.value(env) for a in args[5:8])
        for name, v in (("count", count), ("stride_a", arg_a), ("stride_b", arg_b)):
            if not 0 <= v <= checks.INT64_MAX:
                raise error(f"brgemm {name} is {v}; it must be an int in [0, 2**63)")
        if count == 0:
            ext[0] = ext[1] = None   # no pair is read
        else:
            ext[0] += (count - 1) * arg_a
            ext[1] += (count - 1) * arg_b
    return ext


def _check_bounds(spec, call, ranges, error, where):
    ranges = _guarded_ranges(ranges, call.when)
    if ranges is None:
        return   # the guard never holds: the call never runs
    for k, (arg, ext) in enumerate(zip(call.args, call_extents(call.spec, call.args, ranges,
                                                                error))):
        if not isinstance(arg, Address) or ext is None:
            continue
        tensor = spec.tensors[arg.tensor]
        size = tensor.elements(ranges)
        lo, hi = arg.offset.bounds(ranges)
        if lo < 0 or hi + ext > size:
            raise error(
                f"{where}call {call.spec.op} argument {k}: tensor {tensor.name!r} "
                f"{tensor.shape_at(ranges)} holds {size} elements, but this call may touch "
                f"elements [{lo}, {hi + ext}) over the loop ranges")
