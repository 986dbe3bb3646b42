"""Loop expressions: affine forms over loop values and runtime sizes, and their conditions.

What users write inside a nest: loop variables (`a, b, c = nest.vars`) and sizes
(`M = nest.size("M")`) combined with +, - and * by ints, and floor-divided (//) by positive
ints. Comparisons of expressions are the conditions `when=` takes (joined with &: all must
hold). Stored in a spec as frozen, hashable `Affine` forms whose variables are loop letters
('a', 'b', ...), size symbols ('$M': a size named M) or `Floor` terms; every number is an exact
Python int, and `Affine.bounds` bounds a form over value ranges in exact ints.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import checks
from .errors import SpecError

SIZE = "$"     # a size named M is the variable "$M" in an Affine


def is_size_term(var) -> bool:
    """Whether a term's variable is fixed for a whole call: a size, or a Floor of sizes only."""
    if isinstance(var, str):
        return var.startswith(SIZE)
    return all(is_size_term(v) for v, _ in var.inner.terms)


def _term_order(var) -> tuple:
    """Sort key of a term's variable: loop letters and sizes first, then floor terms."""
    return (0, var) if isinstance(var, str) else (1, var.key())


@dataclass(frozen=True)
class Affine:
    """const + sum(coeff * var), as stored in a spec (hashable, compared by value). A var is a
    loop letter, a size symbol ('$M') or a Floor (the floor division of an Affine by a
    positive int)."""
    terms: tuple = ()     # ((var, coeff), ...) sorted by _term_order, no zero coefficients
    const: int = 0

    def bounds(self, ranges: dict) -> tuple:
        """(min, max) over variable values in ranges {var: (lo, hi)} (inclusive; a size has
        lo == hi), in exact ints. Each term is bounded on its own, so the result always
        contains every value the expression takes; it is tight unless a letter appears in
        more than one term."""
        lo = hi = self.const
        for var, c in self.terms:
            a, b = ranges[var] if isinstance(var, str) else var.bounds(ranges)
            lo += min(c * a, c * b)
            hi += max(c * a, c * b)
        return lo, hi

    def value(self, ranges: dict) -> int:
        """The exact value of an expression of sizes only (ranges gives each size (v, v))."""
        return self.bounds(ranges)[0]

    @property
    def fixed(self) -> bool:
        """Whether the expression uses no loop variable (sizes and ints only)."""
        return all(is_size_term(v) for v, _ in self.terms)

    def split(self) -> tuple:
        """(loop terms, the rest as an Affine of sizes and the constant)."""
        loop = tuple(t for t in self.terms if not is_size_term(t[0]))
        fixed = tuple(t for t in self.terms if is_size_term(t[0]))
        return loop, Affine(fixed, self.const)

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

    def text(self) -> str:
        """The expression as users write it (M//64*64 + 3), for messages."""
        parts = []
        for v, c in self.terms:
            name = v.lstrip(SIZE) if isinstance(v, str) else f"({v.inner.text()})//{v.divisor}"
            parts.append(name if c == 1 else f"{c}*{name}")
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts).replace("+ -", "- ")


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
    """What users write: loop variables and sizes combined with +, - and * by ints, and
    floor-divided (//) by positive ints. Comparisons (<, <=, ==, !=, >, >=) give the
    conditions `when=` takes; & joins conditions (all must hold)."""
    __slots__ = ("affine",)

    def __init__(self, affine: Affine):
        self.affine = affine

    @staticmethod
    def of(value) -> "Expr":
        if isinstance(value, Expr):
            return value
        return Expr(Affine((), _int(value, "a loop expression is built from loop variables, "
                                           "sizes and ints")))

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
        """self * factor, factor an int (or an expression without variables); a product of
        two variable expressions (a loop value times a size) is not affine: SpecError."""
        if isinstance(factor, Expr):
            if factor.affine.terms and self.affine.terms:
                raise SpecError(f"loop expressions are affine: {self.affine.text()} times "
                                f"{factor.affine.text()} is not (multiply only by ints)")
            if factor.affine.terms:
                return factor * self.affine.const
            factor = factor.affine.const
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


def size_symbol(name: str) -> Expr:
    """The expression of the size named `name` (what LoopNest.size returns)."""
    return Expr(Affine(((SIZE + name, 1),), 0))


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


COMPARE = {"<": int.__lt__, "<=": int.__le__, "==": int.__eq__, "!=": int.__ne__,
           ">": int.__gt__, ">=": int.__ge__}


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
