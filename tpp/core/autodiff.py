"""Reverse-mode differentiation of expression graphs (`tpp.core.expr`): the backward of any f32
expression, built in the same IR, so that it renders on every backend like a hand-written one.

    grad(outputs, wrt, grads=None, *, simplify=True, stop_gradient=()) -> list[Node]

Contract:
  - `outputs` is an f32 node or a list of them; `wrt` a list of f32 leaves to differentiate by:
    `input(name, shape)` of any shape, or `param(name)`.
  - `grads` gives one cotangent per output (an f32 node of the output's shape, or None for an
    output that receives none); by default output i gets the new input `d<i>` of its shape.
  - The result holds one node per `wrt` leaf: the sum over the outputs of cotangent times
    derivative (a vector-Jacobian product), indexed like that leaf. Where a leaf was broadcast
    in the forward (a "row" input added to a block), its adjoint is reduced back: over axis 0
    for a row, axis 1 for a col, both for a scalar or a param. The node is never wider than
    the leaf; it may be narrower, since the IR has no broadcast node (x used only through
    rsum(x, 0) has a row adjoint; a leaf that no output depends on gets the constant 0): it
    broadcasts to the leaf's shape.
  - Gradients flow through f32 arithmetic only. Integer and bool subgraphs carry none: a
    select's condition or a compare may depend on the leaves. An f32 value computed from a
    leaf through integer bit operations (fbits of bits(x), as in the expansions of
    `tpp.core.mathlib`) has no derivative: differentiate before expanding transcendentals.
  - `stop_gradient` lists nodes treated as constants, as jax.lax.stop_gradient does: e.g. the
    row maximum subtracted in a softmax for range, whose exact contribution is zero.
  - Errors (`tpp.core.errors.SpecError`): a `wrt` entry that is not an f32 input or param, an
    output that is not f32, a cotangent of another shape or count, and a node on a path from a
    leaf to an output whose op or transcendental has no rule in `RULES`.

How: one walk over `X.topological(outputs)` in reverse, accumulating each node's adjoint from
its users' contributions by the rules of `RULES`. A contribution is indexed over the
broadcast of its user's and its argument's shapes (its *domain*); contributions of one domain
are summed first and then reduced once to the argument's shape (a contribution constant along
a reduced axis is multiplied by that extent instead). Only nodes that depend on a `wrt` leaf
get adjoints, and an absent contribution is never materialised as a zero node. Common
subexpressions are shared by hash-consing (a rule that reuses the forward node, as exp' = exp
does, gets the forward node itself), and with `simplify` the adjoint arithmetic drops x*1,
x/1, x+0 and double negations, moves negations outwards (-a*b -> -(a*b), rsum(-a) ->
-rsum(a), select(c, -a, 0) -> -select(c, a, -0)) so that they end up in a sum as a
subtraction, and writes x*(1/y) as x/y. None of these rewrites changes a value except for the
sign of a zero and the last rounding of x*(1/y); x*0 is never replaced by 0 (it is not 0 for
an infinite or NaN x).

The derivative conventions at non-smooth points:
  - abs: sign(x), 0 at x = 0 (and at NaN).
  - min, max: the whole adjoint goes to the argument the op chose; on a tie, or where either
    argument is NaN (the result is NaN then), it goes to the first argument.
  - rmax, rmin: adjoint * (x == result): on a tie every maximal (minimal) element receives
    the full adjoint (torch's amax splits it evenly instead); where the reduced values hold a
    NaN (so the result is NaN) no element receives any.
  - select: the chosen branch receives the adjoint, the other none, the condition none.
  - round_f32: the identity.
  - The rules of the second derivatives gelu_grad' and gelu_tanh_grad' give NaN at +-inf.
"""
from __future__ import annotations

import math

from . import expr as X
from .errors import SpecError
from .expr import Node

__all__ = ["grad", "count_ops", "RULES"]


# ---------------------------------------------------------------- adjoint arithmetic
def _is_const(n, value) -> bool:
    return n.op == "const" and X.const_value(n) == value


class _Builder:
    """Builds adjoint nodes; with simplify, applies the value-preserving rewrites of the
    module docstring. Arguments may be numbers (constants)."""

    def __init__(self, simplify: bool):
        self.simplify = simplify

    def neg(self, a):
        a = X.as_node(a)
        if self.simplify:
            if a.op == "neg":
                return a.args[0]
            if a.op == "const":
                return X.const(-X.const_value(a))
        return X.neg(a)

    def add(self, a, b):
        a, b = X.as_node(a), X.as_node(b)
        if self.simplify:
            if _is_const(a, 0.0):
                return b
            if _is_const(b, 0.0):
                return a
            if b.op == "neg":
                return self.sub(a, b.args[0])
            if a.op == "neg":
                return self.sub(b, a.args[0])
        return X.add(a, b)

    def sub(self, a, b):
        a, b = X.as_node(a), X.as_node(b)
        if self.simplify:
            if _is_const(b, 0.0):
                return a
            if _is_const(a, 0.0):
                return self.neg(b)
            if b.op == "neg":
                return self.add(a, b.args[0])
            if a.op == "neg":
                return self.neg(self.add(a.args[0], b))
        return X.sub(a, b)

    def mul(self, a, b):
        a, b = X.as_node(a), X.as_node(b)
        if self.simplify:
            for x, y in ((a, b), (b, a)):
                if _is_const(x, 1.0):
                    return y
                if _is_const(x, -1.0):
                    return self.neg(y)
                if x.op == "neg":
                    return self.neg(self.mul(x.args[0], y))
                if x.op == "div" and _is_const(x.args[0], 1.0):
                    return self.div(y, x.args[1])
        return X.mul(a, b)

    def div(self, a, b):
        a, b = X.as_node(a), X.as_node(b)
        if self.simplify:
            if _is_const(b, 1.0):
                return a
            if a.op == "neg":
                return self.neg(self.div(a.args[0], b))
        return X.div(a, b)

    def select(self, cond, a, b):
        a, b = X.as_node(a), X.as_node(b)
        if self.simplify and "neg" in (a.op, b.op) \
                and all(t.op == "neg" or _is_const(t, 0.0) for t in (a, b)):
            return self.neg(X.select(cond, self.neg(a), self.neg(b)))   # 0 becomes -0.0
        return X.select(cond, a, b)

    def rsum(self, a, axis):
        if self.simplify and a.op == "neg":
            return self.neg(self.rsum(a.args[0], axis))
        return X.reduce("rsum", a, axis)

    def total(self, terms):
        """The sum of a non-empty list of terms."""
        acc = terms[0]
        for t in terms[1:]:
            acc = self.add(acc, t)
        return acc


# ---------------------------------------------------------------- the rules
RULES: dict = {}
"""Derivative rules, keyed by op ("mul", "rsum", ...) or ("prim", name) for a transcendental.
A rule(b, y, dy) takes a builder b (`_Builder`), the forward node y and y's adjoint dy, and
returns one contribution per argument of y (None: no contribution), indexed over the
broadcast of y's and that argument's shapes."""


def _rule(*keys):
    def register(fn):
        for key in keys:
            RULES[key] = fn
        return fn
    return register


def _derivative(name):
    """Registers f'(x) of a one-argument transcendental f; fn(b, x, y) builds it from the
    argument x and the forward value y = f(x). The contribution is dy * f'(x)."""
    def register(fn):
        RULES[("prim", name)] = lambda b, y, dy: (b.mul(dy, fn(b, y.args[0], y)),)
        return fn
    return register


_ZERO = X.const(0.0)


@_rule("add")
def _add(b, y, dy):
    return dy, dy


@_rule("sub")
def _sub(b, y, dy):
    return dy, b.neg(dy)


@_rule("mul")
def _mul(b, y, dy):
    p, q = y.args
    return b.mul(dy, q), b.mul(dy, p)


@_rule("fma")
def _fma(b, y, dy):
    p, q, _ = y.args
    return b.mul(dy, q), b.mul(dy, p), dy


@_rule("div")
def _div(b, y, dy):
    _, q = y.args
    dp = b.div(dy, q)                       # d(p/q) = dp/q - (dp/q)(p/q) dq
    return dp, b.neg(b.mul(dp, y))


@_rule("neg")
def _neg(b, y, dy):
    return (b.neg(dy),)


@_rule("round_f32")
def _round_f32(b, y, dy):
    return (dy,)


@_rule("abs")
def _abs(b, y, dy):
    x = y.args[0]
    return (b.select(x > 0.0, dy, b.select(x < 0.0, b.neg(dy), _ZERO)),)


@_rule("sqrt")
def _sqrt(b, y, dy):
    return (b.div(b.mul(dy, 0.5), y),)


@_rule("min", "max")
def _min_max(b, y, dy):
    p, q = y.args
    q_chosen = X.compare("lt" if y.op == "min" else "gt", q, p)    # false on ties and NaN
    return b.select(q_chosen, _ZERO, dy), b.select(q_chosen, dy, _ZERO)


@_rule("select")
def _select(b, y, dy):
    cond = y.args[0]
    return None, b.select(cond, dy, _ZERO), b.select(cond, _ZERO, dy)


@_rule("rsum")
def _rsum(b, y, dy):
    return (dy,)                            # broadcast back over the reduced axis


@_rule("rmax", "rmin")
def _rmax_rmin(b, y, dy):
    return (b.select(X.compare("eq", y.args[0], y), dy, _ZERO),)


def _sigmoid_slope(b, s):
    """s * (1 - s): sigmoid' in terms of the sigmoid s."""
    return b.mul(s, b.sub(1.0, s))


def _gaussian(b, x, scale):
    """exp(scale * x*x), the kernel of erf' and of the normal density."""
    return X.prim("exp", b.mul(b.mul(x, x), scale))


@_derivative("exp")
def _exp(b, x, y):
    return y


@_derivative("exp_nonpos")
def _exp_nonpos(b, x, y):
    return y                                # e^x on its domain, like exp


@_derivative("expm1")
def _expm1(b, x, y):
    return X.prim("exp", x)


@_derivative("log")
def _log(b, x, y):
    return b.div(1.0, x)


@_derivative("sigmoid")
def _sigmoid(b, x, y):
    return _sigmoid_slope(b, y)


@_derivative("tanh")
def _tanh(b, x, y):
    return b.sub(1.0, b.mul(y, y))


@_derivative("erf")
def _erf(b, x, y):
    return b.mul(_gaussian(b, x, -1.0), 2.0 / math.sqrt(math.pi))


@_derivative("erfc")
def _erfc(b, x, y):
    return b.neg(_erf(b, x, y))


@_derivative("gelu")
def _gelu(b, x, y):
    return X.prim("gelu_grad", x)


@_derivative("gelu_grad")
def _gelu_grad(b, x, y):
    # gelu' = Phi(x) + x phi(x), so gelu'' = 2 phi(x) - x^2 phi(x) = phi(x) (2 - x^2)
    phi = b.mul(_gaussian(b, x, -0.5), 1.0 / math.sqrt(2.0 * math.pi))
    return b.mul(phi, b.sub(2.0, b.mul(x, x)))


_GELU_TANH_C = math.sqrt(2.0 / math.pi)
_GELU_TANH_K = 0.044715


@_derivative("gelu_tanh")
def _gelu_tanh(b, x, y):
    return X.prim("gelu_tanh_grad", x)


@_derivative("gelu_tanh_grad")
def _gelu_tanh_grad(b, x, y):
    # gelu_tanh(x) = x s with s = sigmoid(2u), u = c (x + k x^3), u' = c (1 + 3k x^2), and
    # sigma = s (1 - s): gelu_tanh' = s + 2 x u' sigma, whose derivative is
    #     sigma (4 u' + 4 x u'^2 (1 - 2s) + 2 x u''),  u'' = 6 c k x
    c, k = _GELU_TANH_C, _GELU_TANH_K
    xx = b.mul(x, x)
    u = b.mul(b.add(x, b.mul(b.mul(xx, x), k)), c)
    du = b.mul(b.add(b.mul(xx, 3.0 * k), 1.0), c)
    s = X.prim("sigmoid", b.mul(u, 2.0))
    sigma = _sigmoid_slope(b, s)
    bend = b.mul(b.mul(b.mul(x, b.mul(du, du)), b.sub(1.0, b.mul(s, 2.0))), 4.0)
    return b.mul(sigma, b.add(b.add(b.mul(du, 4.0), bend), b.mul(xx, 12.0 * c * k)))


# ---------------------------------------------------------------- the walk
def _varies(shape: str, axis: int) -> bool:
    """Whether values of this shape class differ along the axis (0: down the rows)."""
    return shape in (("col", "block") if axis == 0 else ("row", "block"))


def _reduce_to(b, c, domain: str, shape: str):
    """A contribution indexed over `domain`, summed over the axes along which `shape` (the
    argument's) is broadcast."""
    for axis in (0, 1):
        if _varies(domain, axis) and not _varies(shape, axis):
            c = b.rsum(c, axis) if _varies(c.shape, axis) else b.mul(c, X.extent(axis))
    return c


def _rule_for(n: Node):
    key = ("prim", n.attr[0]) if n.op == "prim" else n.op
    rule = RULES.get(key)
    if rule is None:
        what = f"the transcendental {n.attr[0]!r}" if n.op == "prim" else f"the op {n.op!r}"
        why = " (an f32 value computed through integer bit operations)" \
            if n.op == "fbits" else ""
        raise SpecError(f"no derivative rule for {what}{why}, on the path from a wrt leaf to "
                        f"an output: {n!r}")
    return rule


def _as_outputs(outputs) -> list:
    outs = [outputs] if isinstance(outputs, Node) else list(outputs)
    for i, o in enumerate(outs):
        if not isinstance(o, Node) or o.kind != "f32":
            raise SpecError(f"output {i} must be an f32 expression node, got {o!r}")
    return outs


def _cotangents(outputs, grads) -> list:
    if grads is None:
        names = {n.attr[0] for n in X.leaves(outputs, "input")}
        grads = []
        for i, o in enumerate(outputs):
            if f"d{i}" in names:
                raise SpecError(f"the default cotangent input 'd{i}' is already an input of "
                                f"the outputs; pass grads")
            grads.append(X.input(f"d{i}", o.shape))
        return grads
    grads = [grads] if isinstance(grads, Node) else list(grads)
    if len(grads) != len(outputs):
        raise SpecError(f"grads needs one cotangent per output ({len(outputs)}), got "
                        f"{len(grads)}")
    for i, (o, g) in enumerate(zip(outputs, grads)):
        if g is None:
            continue
        if not isinstance(g, Node) or g.kind != "f32" or g.shape != o.shape:
            raise SpecError(f"the cotangent of output {i} must be an f32 node of the output's "
                            f"shape {o.shape!r}, got {g!r}"
                            + (f" of shape {g.shape!r}" if isinstance(g, Node) else ""))
    return grads


def grad(outputs, wrt, grads=None, *, simplify: bool = True, stop_gradient=()) -> list:
    """The adjoints of the `wrt` leaves (see the module docstring for the contract)."""
    outputs = _as_outputs(outputs)
    wrt = [wrt] if isinstance(wrt, Node) else list(wrt)
    for i, w in enumerate(wrt):
        if not isinstance(w, Node) or w.op not in ("input", "param"):
            raise SpecError(f"wrt[{i}] must be an f32 leaf (an input or a param), got {w!r}")
    grads = _cotangents(outputs, grads)
    b = _Builder(simplify)
    leaves, stopped = set(wrt), set(stop_gradient)

    order = X.topological(outputs)
    live = set()                    # nodes whose value depends on a wrt leaf
    for n in order:
        if n not in stopped and (n in leaves or any(a in live for a in n.args)):
            live.add(n)

    pending: dict = {}              # node -> {domain shape: [contributions]}

    def contribute(node, domain, c):
        pending.setdefault(node, {}).setdefault(domain, []).append(c)

    for o, g in zip(outputs, grads):
        if g is not None and o in live:
            contribute(o, o.shape, g)

    adjoint = {}
    for n in reversed(order):
        groups = pending.pop(n, None)
        if groups is None:
            continue
        dn = b.total([_reduce_to(b, b.total(cs), domain, n.shape)
                      for domain, cs in groups.items()])
        if n in leaves:
            adjoint[n] = dn
            continue
        for arg, c in zip(n.args, _rule_for(n)(b, n, dn)):
            if c is not None and arg in live:
                contribute(arg, X._join_shapes((n.shape, arg.shape)), c)
    return [adjoint.get(w, _ZERO) for w in wrt]


def count_ops(outputs) -> int:
    """The number of distinct non-leaf nodes the outputs depend on (their cost in ops)."""
    outs = [outputs] if isinstance(outputs, Node) else list(outputs)
    return sum(1 for n in X.topological(outs) if n.op not in X.LEAVES)
