"""The spec of a loop nest: loops, blocked tensors, and the guarded TPP calls of its body.

A loop nest is the PARLOOPER idea. Logical loops are named by letters in declaration order
(a, b, c, ...); the *order string* lists them from outermost to innermost. An upper-case letter
is parallel; a letter that appears again is another blocking level of the same loop. A loop
`Loop(start, stop, step, blocks=(B0, B1, ...))` appears 1 + len(blocks) times: its outermost
occurrence steps by B0, the next by B1, ..., the innermost by `step`, each level covering its
parent's block (and never passing `stop`). The body sees each loop's innermost value.

The body is a sequence of calls to TPP kernels. Each operand address is a tensor plus an offset
(in elements) built from the loop values with +, -, * by ints and // by positive ints (Python's
floor division); each call may be guarded by comparisons of such expressions (`when=`, joined
with & or given as a tuple: all must hold). Everything is fixed when the spec is built, so it
is hashable, is the cache key, and is checked once, in exact integers: every address every call
can touch must lie inside its tensor, and every value the generated int64 code compares or
divides must be an int64, or the spec is rejected with a SpecError (no nest can write outside
the arrays it is given). Tensors and loop values are bounded by checks.ADDRESS_LIMIT.

Parallel letters must be adjacent in the order string: that band of levels is collapsed into
one iteration space split statically across the threads (thread t gets a contiguous range).
Loops outside the band run in every thread, and when there are any, the threads meet at a
barrier after each pass over the band (so an outer reduction step finishes before the next).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import checks
from . import dtypes as _dt
from .errors import SpecError, UnsupportedError

LETTERS = "abcdefghijklmnopqrstuvwxyz"


# ---------------------------------------------------------------- affine expressions
def _term_order(var) -> tuple:
    """Sort key of a term's variable: loop letters first, then floor terms by their text."""
    return (0, var) if isinstance(var, str) else (1, var.key())


@dataclass(frozen=True)
class Affine:
    """const + sum(coeff * var), as stored in a spec (hashable, compared by value). A var is a
    loop letter or a Floor (the floor division of an Affine by a positive int)."""
    terms: tuple = ()     # ((var, coeff), ...) sorted by _term_order, no zero coefficients
    const: int = 0

    def bounds(self, ranges: dict) -> tuple:
        """(min, max) over loop values in ranges {letter: (lo, hi)} (inclusive), in exact ints.
        Each term is bounded on its own, so the result always contains every value the
        expression takes; it is tight unless a letter appears in more than one term."""
        lo = hi = self.const
        for var, c in self.terms:
            a, b = ranges[var] if isinstance(var, str) else var.bounds(ranges)
            lo += min(c * a, c * b)
            hi += max(c * a, c * b)
        return lo, hi

    def floors(self):
        """The Floor terms of the expression, nested ones included (innermost last)."""
        for var, _ in self.terms:
            if not isinstance(var, str):
                yield var
                yield from var.inner.floors()

    def constants(self):
        """Every integer constant the generated code emits for the expression."""
        yield self.const
        for var, c in self.terms:
            yield c
            if not isinstance(var, str):
                yield var.divisor
                yield from var.inner.constants()

    def key(self) -> str:
        terms = [f"{c}*{v if isinstance(v, str) else v.key()}" for v, c in self.terms]
        return "+".join(terms + [str(self.const)])


@dataclass(frozen=True)
class Floor:
    """floor(inner / divisor) with divisor >= 1 (Python's //, rounding toward minus infinity)."""
    inner: Affine
    divisor: int

    def bounds(self, ranges: dict) -> tuple:
        """(min, max) over the ranges: floor division is monotone, so it maps the inner
        bounds exactly."""
        lo, hi = self.inner.bounds(ranges)
        return lo // self.divisor, hi // self.divisor

    def key(self) -> str:
        return f"({self.inner.key()})//{self.divisor}"


def _int(value, what: str) -> int:
    """value (any integral value) as a Python int, else a SpecError '<what>: expected an int'."""
    n = checks.as_int(value)
    if n is None:
        raise SpecError(f"{what}: expected an int, got {value!r}")
    return n


def _unsupported(symbol: str):
    """An operator method that rejects `symbol` on loop expressions, naming what works."""
    def reject(self, other):
        raise SpecError(f"loop expressions support +, -, * by an int and // by a positive int; "
                        f"{symbol} is not supported")
    return reject


class Expr:
    """What users write: loop variables combined with +, - and * by ints, and floor-divided
    (//) by positive ints. Comparisons (<, <=, ==, !=, >, >=) give the conditions `when=`
    takes; & joins conditions (all must hold)."""
    __slots__ = ("affine",)

    def __init__(self, affine: Affine):
        self.affine = affine

    @staticmethod
    def of(value) -> "Expr":
        if isinstance(value, Expr):
            return value
        return Expr(Affine((), _int(value, "a loop expression is built from loop variables "
                                           "and ints")))

    def _combine(self, other, sign):
        other = Expr.of(other).affine
        coeffs = dict(self.affine.terms)
        for var, c in other.terms:
            coeffs[var] = coeffs.get(var, 0) + sign * c
        terms = tuple(sorted(((v, c) for v, c in coeffs.items() if c),
                             key=lambda t: _term_order(t[0])))
        return Expr(Affine(terms, self.affine.const + sign * other.const))

    def __add__(self, other):
        return self._combine(other, 1)

    __radd__ = __add__

    def __sub__(self, other):
        return self._combine(other, -1)

    def __rsub__(self, other):
        return Expr.of(other)._combine(self, -1)

    def __neg__(self):
        return self * -1

    def __mul__(self, factor):
        factor = _int(factor, "loop expressions are affine: multiply only by ints")
        a = self.affine
        if factor == 0:
            return Expr(Affine())
        return Expr(Affine(tuple((v, c * factor) for v, c in a.terms), a.const * factor))

    __rmul__ = __mul__

    def __floordiv__(self, divisor):
        """floor(self / divisor) for a positive int divisor, as Python's // computes it."""
        d = checks.as_int(divisor)
        if d is None or d < 1:
            raise SpecError(f"a loop expression is floor-divided (//) only by a positive int, "
                            f"got {divisor!r}")
        a = self.affine
        if all(c % d == 0 for _, c in a.terms):     # exact: only the constant is floored
            return Expr(Affine(tuple((v, c // d) for v, c in a.terms), a.const // d))
        return Expr(Affine(((Floor(a, d), 1),), 0))

    __rfloordiv__ = _unsupported("// by a loop expression")
    __truediv__ = __rtruediv__ = _unsupported("/ (use // for floor division)")
    __mod__ = __rmod__ = _unsupported("%")

    def _cond(self, op, other):
        return Cond((self - Expr.of(other)).affine, op)

    def __lt__(self, other):
        return self._cond("<", other)

    def __le__(self, other):
        return self._cond("<=", other)

    def __gt__(self, other):
        return self._cond(">", other)

    def __ge__(self, other):
        return self._cond(">=", other)

    def __eq__(self, other):     # type: ignore[override]
        return self._cond("==", other)

    def __ne__(self, other):     # type: ignore[override]
        return self._cond("!=", other)

    __hash__ = None

    def __repr__(self):
        return f"Expr({self.affine.key()})"


def affine(value) -> Affine:
    return Expr.of(value).affine


class _Condition:
    """A comparison of loop expressions, or several joined with & (all must hold)."""

    conds: tuple    # the comparisons, each a Cond

    def __and__(self, other):
        if not isinstance(other, _Condition):
            raise SpecError(f"& joins loop conditions such as (a == 0) & (b == 0), got {other!r}")
        return All(self.conds + other.conds)

    __rand__ = __and__

    def __or__(self, other):
        raise SpecError("loop conditions join only with & (all must hold); | is not supported: "
                        "make one call per alternative")

    __ror__ = __or__

    def __invert__(self):
        raise SpecError("~ is not supported on loop conditions: write the opposite comparison")

    def __bool__(self):
        raise SpecError("a loop condition has no truth value in Python; pass it as when= (join "
                        "conditions with &, not `and`)")


@dataclass(frozen=True)
class Cond(_Condition):
    """affine OP 0, with OP one of < <= == != > >=."""
    expr: Affine
    op: str

    @property
    def conds(self) -> tuple:
        return (self,)

    def key(self) -> str:
        return f"{self.expr.key()}{self.op}0"


@dataclass(frozen=True)
class All(_Condition):
    """The conjunction c1 & c2 & ...: holds when every Cond holds."""
    conds: tuple


def conditions(when) -> tuple:
    """The Conds of a when= value: one condition, a conjunction (c1 & c2), or a tuple/list of
    them; all must hold."""
    items = when if isinstance(when, (tuple, list)) else (when,)
    if not all(isinstance(w, _Condition) for w in items):
        raise SpecError(f"when= takes loop conditions such as (k == 0), joined with & or in a "
                        f"tuple, got {when!r}")
    return tuple(c for w in items for c in w.conds)


# ---------------------------------------------------------------- loops
@dataclass(frozen=True)
class Loop:
    """range(start, stop, step), blocked at `blocks`. Every number is any integral value,
    stored as a Python int; values, steps and blocks lie within +-ADDRESS_LIMIT (a loop value
    indexes memory, and the generated int64 loop counters then never overflow)."""
    start: int
    stop: int
    step: int = 1
    blocks: tuple = ()

    def __post_init__(self):
        for name in ("start", "stop", "step"):
            object.__setattr__(self, name, checks.integer(getattr(self, name), f"loop {name}"))
        object.__setattr__(self, "blocks", _block_sizes(self.blocks))
        if self.step < 1:
            raise SpecError(f"loop step must be >= 1, got {self.step}")
        if self.stop <= self.start:
            raise SpecError(f"loop range [{self.start}, {self.stop}) is empty")
        limit = checks.ADDRESS_LIMIT
        if max(-self.start, self.stop, self.step, *self.blocks) > limit:
            raise SpecError(f"{self}: loop values, steps and blocks must lie within "
                            f"+-{limit} (2**47, the bytes a process can address)")
        sizes = self.blocks + (self.step,)
        for outer, inner in zip(sizes, sizes[1:]):
            if outer % inner:
                raise SpecError(f"loop block {outer} is not a multiple of the next level's "
                                f"step {inner} (blocks {self.blocks}, step {self.step})")

    @staticmethod
    def of(value) -> "Loop":
        if isinstance(value, Loop):
            return value
        if checks.as_int(value) is not None:
            return Loop(0, value)
        if isinstance(value, tuple) and 2 <= len(value) <= 4:
            return Loop(*value)
        raise SpecError(f"a loop is Loop(start, stop, step=1, blocks=()), an int (range(n)) or "
                        f"a tuple (start, stop[, step[, blocks]]); got {value!r}")

    @property
    def last(self) -> int:
        """The largest value the loop takes."""
        return self.start + (self.stop - 1 - self.start) // self.step * self.step

    def level_step(self, level: int) -> int:
        sizes = tuple(self.blocks) + (self.step,)
        return sizes[level]

    def trips(self, level: int) -> int:
        """Iterations of one pass over occurrence `level`: its parent's block (the whole range
        at level 0) in steps of level_step(level); the last may pass `stop`."""
        span = self.stop - self.start if level == 0 else self.level_step(level - 1)
        return -(-span // self.level_step(level))


def _block_sizes(blocks) -> tuple:
    """A loop's block sizes as a tuple of Python ints >= 1, else a SpecError."""
    sizes = checks.positive_ints(blocks)
    if sizes is None:
        raise SpecError(f"loop block sizes must be positive ints, got {blocks!r}")
    return sizes


@dataclass(frozen=True)
class Level:
    """One occurrence of a loop in the order string."""
    letter: str
    level: int          # 0 = the loop's outermost occurrence
    parallel: bool
    innermost: bool     # this occurrence gives the value the body sees


def parse_order(order: str, loops: tuple) -> tuple:
    """The Levels of an order string, validated against the loops' block counts."""
    if not isinstance(order, str) or not order:
        raise SpecError(f"order must be a non-empty string of loop letters, got {order!r}")
    names = LETTERS[:len(loops)]
    seen: dict = {}
    levels = []
    for ch in order:
        letter = ch.lower()
        if letter not in names:
            raise SpecError(f"order {order!r}: {ch!r} names no loop (loops are {names})")
        lvl = seen.get(letter, 0)
        seen[letter] = lvl + 1
        levels.append([letter, lvl, ch.isupper()])
    for letter, loop in zip(names, loops):
        want = 1 + len(loop.blocks)
        if seen.get(letter, 0) != want:
            raise SpecError(f"order {order!r}: loop {letter!r} has {len(loop.blocks)} block "
                            f"sizes, so it must appear {want} times, got {seen.get(letter, 0)}")
    par = [k for k, lv in enumerate(levels) if lv[2]]
    if par and par != list(range(par[0], par[-1] + 1)):
        raise SpecError(f"order {order!r}: the parallel (upper-case) letters must be adjacent")
    return tuple(Level(letter, lvl, p, lvl == len(loops[LETTERS.index(letter)].blocks))
                 for letter, lvl, p in levels)


# ---------------------------------------------------------------- tensors and calls
@dataclass(frozen=True)
class Tensor:
    """A named array the nest is given at call time: C-contiguous, this shape and dtype."""
    name: str
    shape: tuple
    dtype: _dt.DType

    def __post_init__(self):
        """The shape as Python ints >= 1; the tensor must fit in the address space."""
        shape = checks.positive_ints(self.shape)
        if not shape:
            raise SpecError(f"tensor {self.name!r}: shape must be a tuple of positive ints, got "
                            f"{self.shape!r}")
        object.__setattr__(self, "shape", shape)
        checks.addressable(self.size * self.dtype.itemsize,
                           f"tensor {self.name!r} of shape {shape} ({self.dtype})")

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def strides(self) -> tuple:
        out, acc = [], 1
        for d in reversed(self.shape):
            out.append(acc)
            acc *= d
        return tuple(reversed(out))


@dataclass(frozen=True)
class Address:
    tensor: int          # index into the nest's tensors
    offset: Affine       # in elements of that tensor


@dataclass(frozen=True)
class Call:
    """kernel(spec) called with args in its raw order: Address, Affine (an int64), or None (0)."""
    spec: object
    args: tuple
    when: tuple = ()     # Conds, all of which must hold


@dataclass(frozen=True)
class LoopNestSpec:
    loops: tuple
    order: str
    tensors: tuple
    calls: tuple
    family = "loopnest"
    op = "loopnest"
    kind = "loopnest"
    scalars = ()

    def __post_init__(self):
        object.__setattr__(self, "levels", parse_order(self.order, self.loops))
        _check_band(self)
        for call in self.calls:
            _check_int64(self, call)
            _check_bounds(self, call)

    def key(self) -> str:
        loops = ";".join(f"{lp.start}:{lp.stop}:{lp.step}:{lp.blocks}" for lp in self.loops)
        tensors = ";".join(f"{t.name}{t.shape}{t.dtype}" for t in self.tensors)
        calls = []
        for c in self.calls:
            args = ",".join("0" if a is None else
                            f"T{a.tensor}[{a.offset.key()}]" if isinstance(a, Address) else
                            a.key() for a in c.args)
            calls.append(f"{c.spec.key()}({args})if({'&'.join(w.key() for w in c.when)})")
        return f"loopnest({self.order}|{loops}|{tensors}|{'|'.join(calls)})"

    def kernel_specs(self) -> tuple:
        """The distinct kernel specs the body calls, in first-use order (the call table)."""
        out = []
        for c in self.calls:
            if c.spec not in out:
                out.append(c.spec)
        return tuple(out)

    @property
    def parallel(self) -> bool:
        return any(lv.parallel for lv in self.levels)


# ---------------------------------------------------------------- bounds
def _value_ranges(spec, when) -> dict:
    """{letter: (lo, hi)} of the loop values, narrowed by single-variable guards."""
    ranges = _full_ranges(spec)
    for cond in when:
        if len(cond.expr.terms) != 1:
            continue
        (var, c), = cond.expr.terms
        if c not in (1, -1) or not isinstance(var, str):
            continue
        lo, hi = ranges[var]
        # c*v + k OP 0
        bound = -cond.expr.const * c       # v OP' bound
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
        ranges[var] = (lo, hi)
    return ranges


def operand_extent(op) -> int:
    """Elements one operand of a primitive spans from its first element."""
    if op.rows == -1 or op.layout == "index":
        raise UnsupportedError(f"operand {op.name!r} ({op.layout}) cannot be called in a nest")
    return op.extent


BRGEMM_RAW = ("a", "b", "c", "bias", "mask")   # the raw ABI's pointer arguments, in order


def raw_operands(spec) -> tuple:
    """The Operand behind each raw argument of a primitive's compiled function, in order
    (None for a scalar, and for BRGEMM's bias/mask pointers when the spec has none)."""
    ops = spec.operands()
    if spec.family != "brgemm":
        return tuple(ops) + (None,) * len(spec.scalars)
    by_name = {o.name: o for o in ops}
    return tuple(by_name.get(name) for name in BRGEMM_RAW) + (None,) * len(spec.scalars)


def call_extents(spec, args) -> list:
    """Per raw argument: the elements the call may touch from that address (None: a scalar)."""
    ext = [None if op is None else operand_extent(op) for op in raw_operands(spec)]
    if spec.family == "brgemm":      # stride mode: count blocks, arg_a/arg_b elements apart
        count, arg_a, arg_b = (a.const for a in args[5:8])
        ext[0] += (count - 1) * arg_a
        ext[1] += (count - 1) * arg_b
    return ext


def _full_ranges(spec) -> dict:
    """{letter: (first, last)} of every loop's values, unguarded."""
    return {LETTERS[i]: (lp.start, lp.last) for i, lp in enumerate(spec.loops)}


def _check_band(spec):
    """SpecError unless the generated code can split the parallel band's iterations over
    MAX_THREADS threads in int64 (thread t starts at t * total // threads)."""
    total = 1
    for lv in spec.levels:
        if lv.parallel:
            total *= spec.loops[LETTERS.index(lv.letter)].trips(lv.level)
    if total * checks.MAX_THREADS > checks.INT64_MAX:
        raise SpecError(f"order {spec.order!r}: the parallel band has {total} iterations, more "
                        f"than {checks.INT64_MAX // checks.MAX_THREADS} (int64 / MAX_THREADS)")


def _check_int64(spec, call):
    """SpecError unless the generated int64 code evaluates every expression of the call
    exactly: each constant is an int64, and every value compared (guards), passed as a scalar
    or floor-divided lies in int64 over the loop ranges. (An address may wrap around in
    between: its final value is bounds-checked and wrapping addition is exact modulo 2**64.)"""
    ranges = _full_ranges(spec)
    exprs = [(f"condition {c.key()}", c.expr, True) for c in call.when]
    for k, arg in enumerate(call.args):
        if isinstance(arg, Address):
            exprs.append((f"argument {k} (address)", arg.offset, False))
        elif arg is not None:
            exprs.append((f"argument {k} (scalar)", arg, True))
    for what, expr, whole in exprs:
        if not all(checks.fits_int64(c, c) for c in expr.constants()):
            raise SpecError(f"call {call.spec.op} {what}: a constant of {expr.key()} does not "
                            f"fit in int64")
        for part in ([expr] if whole else []) + [f.inner for f in expr.floors()]:
            lo, hi = part.bounds(ranges)
            if not checks.fits_int64(lo, hi):
                raise SpecError(f"call {call.spec.op} {what}: {part.key()} takes values in "
                                f"[{lo}, {hi}] over the loop ranges, beyond the int64 the "
                                f"generated code computes in")


def _check_bounds(spec, call):
    ranges = _value_ranges(spec, call.when)
    if any(lo > hi for lo, hi in ranges.values()):
        return   # the guard never holds: the call never runs
    for k, (arg, ext) in enumerate(zip(call.args, call_extents(call.spec, call.args))):
        if not isinstance(arg, Address):
            continue
        tensor = spec.tensors[arg.tensor]
        lo, hi = arg.offset.bounds(ranges)
        if lo < 0 or hi + ext > tensor.size:
            raise SpecError(
                f"call {call.spec.op} argument {k}: tensor {tensor.name!r} {tensor.shape} "
                f"holds {tensor.size} elements, but this call may touch elements "
                f"[{lo}, {hi + ext}) over the loop ranges")
