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
with & or given as a tuple: all must hold).

Sizes: a nest may declare named sizes (`LoopNest.size("M")`), fixed for one call and given at
run time. A loop's stop, a tensor's dimensions, a BRGEMM count and any address or condition may
use them (affine, like the loop values; a loop's start, step and blocks are ints). A nest
without sizes is checked once, when its spec is built, in exact integers: every address every
call can touch must lie inside its tensor, and every value the generated int64 code compares or
divides must be an int64, or the spec is a SpecError. A nest with sizes gets the same complete
check at call time, for the sizes of that call (`tpp.core.loop_bounds.check`, an ArgumentError):
no nest can read or write outside the arrays it is given. Tensors and loop values are bounded
by checks.ADDRESS_LIMIT; a loop whose stop (a size expression) is at or before its start runs
no iteration, and then the body never runs.

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
from .loop_expr import (SIZE, Affine, All, Cond, Expr, Floor, affine, conditions,  # noqa: F401
                        is_size_term, size_symbol)

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _size_expr(value, what: str):
    """value as an int, or as an Affine of sizes only (an Expr using sizes), else SpecError."""
    if isinstance(value, Affine):
        value = Expr(value)
    if isinstance(value, Expr):
        a = value.affine
        if not a.terms:
            return a.const
        if not a.fixed:
            raise SpecError(f"{what} is an int or an expression of the nest's sizes "
                            f"(nest.size), not of loop variables: got {a.text()}")
        return a
    return checks.integer(value, what)


def evaluate(value, env: dict) -> int:
    """An int, or an Affine of sizes at env {'$M': (v, v)}, as an exact int."""
    return value if isinstance(value, int) else value.value(env)


def text(value) -> str:
    return str(value) if isinstance(value, int) else value.text()


# ---------------------------------------------------------------- loops
@dataclass(frozen=True)
class Loop:
    """range(start, stop, step), blocked at `blocks`. Every number is any integral value,
    stored as a Python int; stop may also be an expression of the nest's sizes (then it is
    known at call time, and the range may be empty). Values, steps and blocks lie within
    +-ADDRESS_LIMIT (a loop value indexes memory, and the generated int64 loop counters then
    never overflow): checked here for numbers, at call time for size expressions."""
    start: int
    stop: object        # int, or an Affine of sizes
    step: int = 1
    blocks: tuple = ()

    def __post_init__(self):
        for name in ("start", "step"):
            object.__setattr__(self, name, checks.integer(getattr(self, name), f"loop {name}"))
        object.__setattr__(self, "stop", _size_expr(self.stop, "loop stop"))
        object.__setattr__(self, "blocks", _block_sizes(self.blocks))
        if self.step < 1:
            raise SpecError(f"loop step must be >= 1, got {self.step}")
        if not self.symbolic and self.stop <= self.start:
            raise SpecError(f"loop range [{self.start}, {self.stop}) is empty")
        limit = checks.ADDRESS_LIMIT
        stop = 0 if self.symbolic else self.stop
        if max(-self.start, self.start, stop, self.step, *self.blocks) > limit:
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
        if checks.as_int(value) is not None or isinstance(value, Expr):
            return Loop(0, value)
        if isinstance(value, tuple) and 2 <= len(value) <= 4:
            return Loop(*value)
        raise SpecError(f"a loop is Loop(start, stop, step=1, blocks=()), an int or a size "
                        f"expression (range(n)) or a tuple (start, stop[, step[, blocks]]); "
                        f"got {value!r}")

    @property
    def symbolic(self) -> bool:
        """Whether the stop is a size expression (known at call time)."""
        return not isinstance(self.stop, int)

    def stop_at(self, env: dict) -> int:
        return evaluate(self.stop, env)

    def last(self, env: dict) -> int:
        """The largest value the loop takes for the sizes in env (start > last: none)."""
        return self.start + (self.stop_at(env) - 1 - self.start) // self.step * self.step

    def level_step(self, level: int) -> int:
        sizes = tuple(self.blocks) + (self.step,)
        return sizes[level]

    def trips(self, level: int, env: dict) -> int:
        """Iterations of one pass over occurrence `level`: its parent's block (the whole range
        at level 0, none when empty) in steps of level_step(level); the last may pass `stop`."""
        span = self.stop_at(env) - self.start if level == 0 else self.level_step(level - 1)
        return max(0, -(-span // self.level_step(level)))

    def key(self) -> str:
        return f"{self.start}:{text(self.stop) if self.symbolic else self.stop}:{self.step}:" \
               f"{self.blocks}"


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
    """A named array the nest is given at call time: C-contiguous, this shape and dtype. A
    dimension is an int >= 1 or an expression of the nest's sizes (>= 0 at call time)."""
    name: str
    shape: tuple
    dtype: _dt.DType

    def __post_init__(self):
        """The shape as Python ints >= 1 and size Affines; a fixed tensor must fit in the
        address space (one with sizes is given as an array, which does)."""
        try:
            dims = tuple(_size_expr(d, "dim") for d in self.shape)
        except (SpecError, TypeError):
            dims = None
        if not dims or any(isinstance(d, int) and d < 1 for d in dims):
            raise SpecError(f"tensor {self.name!r}: shape must be a tuple of positive ints or "
                            f"size expressions, got {self.shape!r}")
        object.__setattr__(self, "shape", dims)
        if not self.symbolic:
            checks.addressable(self.size * self.dtype.itemsize,
                               f"tensor {self.name!r} of shape {dims} ({self.dtype})")

    @property
    def symbolic(self) -> bool:
        return any(not isinstance(d, int) for d in self.shape)

    def shape_at(self, env: dict) -> tuple:
        return tuple(evaluate(d, env) for d in self.shape)

    @property
    def size(self) -> int:
        """Elements of a tensor without sizes."""
        return self.elements({})

    def elements(self, env: dict) -> int:
        n = 1
        for d in self.shape_at(env):
            n *= d
        return n

    def strides(self) -> tuple:
        """Element strides per dimension, as Exprs (a stride may use a size); SpecError when
        one would be a product of sizes (not affine)."""
        out, acc = [], Expr.of(1)
        for k in range(len(self.shape) - 1, -1, -1):
            out.append(acc)
            if k:
                d = self.shape[k]
                acc = acc * (Expr(d) if isinstance(d, Affine) else d)
        return tuple(reversed(out))

    def shape_text(self) -> str:
        """The declared shape as written: (M, 768)."""
        return f"({', '.join(map(text, self.shape))}{',' if len(self.shape) == 1 else ''})"

    def key(self) -> str:
        return f"{self.name}{self.shape_text()}{self.dtype}"


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
    sizes: tuple = ()    # the size names, in declaration order (the table's size slots)
    family = "loopnest"
    op = "loopnest"
    kind = "loopnest"
    scalars = ()

    def __post_init__(self):
        from . import loop_bounds
        object.__setattr__(self, "levels", parse_order(self.order, self.loops))
        for call in self.calls:
            loop_bounds.check_constants(call)
        if not self.sizes:
            loop_bounds.check(self, {}, SpecError)

    def key(self) -> str:
        loops = ";".join(lp.key() for lp in self.loops)
        tensors = ";".join(t.key() for t in self.tensors)
        calls = []
        for c in self.calls:
            args = ",".join("0" if a is None else
                            f"T{a.tensor}[{a.offset.key()}]" if isinstance(a, Address) else
                            a.key() for a in c.args)
            calls.append(f"{c.spec.key()}({args})if({'&'.join(w.key() for w in c.when)})")
        sizes = ",".join(self.sizes)
        return f"loopnest({self.order}|{sizes}|{loops}|{tensors}|{'|'.join(calls)})"

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


def sizes_in(affines) -> set:
    """The size names the Affines use (inside floor terms too)."""
    names = set()
    for a in affines:
        for var, _ in a.terms:
            if isinstance(var, str):
                if var.startswith(SIZE):
                    names.add(var[len(SIZE):])
            else:
                names |= sizes_in([var.inner])
    return names


def seed_only_sizes(spec: LoopNestSpec) -> frozenset:
    """The sizes that only calls' seed arguments use (a per-call seed passed as a size): they
    take part in no loop bound, shape, address, count or condition."""
    seeds, other = [], [lp.stop for lp in spec.loops if lp.symbolic]
    other += [d for t in spec.tensors for d in t.shape if isinstance(d, Affine)]
    for call in spec.calls:
        other += [c.expr for c in call.when]
        names = call.spec.scalars
        first_scalar = len(call.args) - len(names)
        for k, a in enumerate(call.args):
            if a is None:
                continue
            seed = k >= first_scalar and names[k - first_scalar] == "seed"
            (seeds if seed else other).append(a.offset if isinstance(a, Address) else a)
    return frozenset(sizes_in(seeds) - sizes_in(other))
