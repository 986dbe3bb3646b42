"""The spec of a loop nest: loops, blocked tensors, and the guarded TPP calls of its body.

A loop nest is the PARLOOPER idea. Logical loops are named by letters in declaration order
(a, b, c, ...); the *order string* lists them from outermost to innermost. An upper-case letter
is parallel; a letter that appears again is another blocking level of the same loop. A loop
`Loop(start, stop, step, blocks=(B0, B1, ...))` appears 1 + len(blocks) times: its outermost
occurrence steps by B0, the next by B1, ..., the innermost by `step`, each level covering its
parent's block (and never passing `stop`). The body sees each loop's innermost value.

The body is a sequence of calls to TPP kernels. Each operand address is a tensor plus an affine
offset (in elements) of the loop values; each call may be guarded by affine conditions
(`when=`). Everything is fixed when the spec is built, so it is hashable, is the cache key, and
is checked once: every address every call can touch must lie inside its tensor, or the spec is
rejected with a SpecError (no nest can write outside the arrays it is given).

Parallel letters must be adjacent in the order string: that band of levels is collapsed into
one iteration space split statically across the threads (thread t gets a contiguous range).
Loops outside the band run in every thread, and when there are any, the threads meet at a
barrier after each pass over the band (so an outer reduction step finishes before the next).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import dtypes as _dt
from .errors import SpecError, UnsupportedError

LETTERS = "abcdefghijklmnopqrstuvwxyz"


# ---------------------------------------------------------------- affine expressions
@dataclass(frozen=True)
class Affine:
    """const + sum(coeff * loop value), as stored in a spec (hashable, compared by value)."""
    terms: tuple = ()     # ((letter, coeff), ...) sorted by letter, no zero coefficients
    const: int = 0

    def bounds(self, ranges: dict) -> tuple:
        """(min, max) over loop values in ranges {letter: (lo, hi)} (inclusive)."""
        lo = hi = self.const
        for var, c in self.terms:
            a, b = ranges[var]
            lo += min(c * a, c * b)
            hi += max(c * a, c * b)
        return lo, hi

    def key(self) -> str:
        return "+".join([f"{c}*{v}" for v, c in self.terms] + [str(self.const)])


def _int(value, what):
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{what}: expected an int, got {value!r}")
    return value


class Expr:
    """What users write: loop variables combined with +, - and * by ints. Comparisons
    (<, <=, ==, !=, >, >=) give the conditions `when=` takes."""
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
        terms = tuple(sorted((v, c) for v, c in coeffs.items() if c))
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


@dataclass(frozen=True)
class Cond:
    """affine OP 0, with OP one of < <= == != > >=."""
    expr: Affine
    op: str

    def __bool__(self):
        raise SpecError("a loop condition has no truth value in Python; pass it as when=")

    def key(self) -> str:
        return f"{self.expr.key()}{self.op}0"


# ---------------------------------------------------------------- loops
@dataclass(frozen=True)
class Loop:
    start: int
    stop: int
    step: int = 1
    blocks: tuple = ()

    def __post_init__(self):
        for name in ("start", "stop", "step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(f"loop {name} must be an int, got {v!r}")
        if self.step < 1:
            raise SpecError(f"loop step must be >= 1, got {self.step}")
        if self.stop <= self.start:
            raise SpecError(f"loop range [{self.start}, {self.stop}) is empty")
        sizes = tuple(self.blocks) + (self.step,)
        for outer, inner in zip(sizes, sizes[1:]):
            if isinstance(outer, bool) or not isinstance(outer, int) or outer < 1:
                raise SpecError(f"loop block sizes must be positive ints, got {self.blocks!r}")
            if outer % inner:
                raise SpecError(f"loop block {outer} is not a multiple of the next level's "
                                f"step {inner} (blocks {self.blocks}, step {self.step})")

    @staticmethod
    def of(value) -> "Loop":
        if isinstance(value, Loop):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return Loop(0, value)
        if isinstance(value, tuple) and 2 <= len(value) <= 4:
            if len(value) == 4:
                return Loop(value[0], value[1], value[2], tuple(value[3]))
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
        for call in self.calls:
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
    ranges = {LETTERS[i]: (lp.start, lp.last) for i, lp in enumerate(spec.loops)}
    for cond in when:
        if len(cond.expr.terms) != 1:
            continue
        (var, c), = cond.expr.terms
        if c not in (1, -1):
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
    if op.layout == "block":
        return (op.rows - 1) * op.ld + op.cols
    if op.layout == "mask":
        return op.rows * op.cols
    if op.layout == "col":
        return op.rows
    if op.layout == "scalar":
        return 1
    return op.cols


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
