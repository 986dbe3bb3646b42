"""The equations of ops.norms: LayerNorm, RMSNorm, softmax and bias + activation + dropout
as tpp.equation graphs over a block of rows, forward and backward.

Each builder `(rows, n, *options) -> tuple of EquationSpecs` gives the equations one step of
an operator's nest calls on a block of `rows` rows, in order; `_BUILDERS` maps the nest kinds
of ops.norms to them. Every backward equation is tpp.grad of the forward graph, with the
forward's statistics replaced by the values the forward saved (`_saved`) and divisions by
per-row values turned into multiplications by one reciprocal per row (`_lean`).
"""
from __future__ import annotations

import dataclasses

import tpp
from tpp.core import dtypes as _dt
from tpp.core import expr as X
from tpp.core.equation_spec import graph_text


# ---------------------------------------------------------------- graph helpers
def _saved(nodes, mapping):
    """nodes with the forward's nodes in mapping replaced by saved values (X.substitute)."""
    return X.substitute(list(nodes), mapping)


def _lean(nodes):
    """nodes rewritten for speed: a block divided by a col, row or scalar value becomes a
    multiplication by its reciprocal (computed once per row or column; 1 / (1 / r) is r), and
    x * 1, x / 1 are x. Changes only the last rounding of such quotients."""
    memo = {}

    def recip(d):
        if d.op == "div" and d.args[0].op == "const" and X.const_value(d.args[0]) == 1.0:
            return d.args[1]
        return X.div(1.0, d)

    def one(n):
        return n.op == "const" and X.const_value(n) == 1.0

    def rebuild(n):
        got = memo.get(n)
        if got is not None:
            return got
        if not n.args:
            out = n
        else:
            args = tuple(rebuild(a) for a in n.args)
            out = None
            if n.op == "div" and one(args[1]):
                out = args[0]
            elif n.op == "mul" and one(args[1]):
                out = args[0]
            elif n.op == "mul" and one(args[0]):
                out = args[1]
            elif n.op == "div" and args[0].shape == "block" and args[1].shape != "block":
                out = X.mul(args[0], recip(args[1]))
            if out is None:
                if all(x is y for x, y in zip(args, n.args)):
                    out = n
                elif n.op in X.REDUCTIONS:
                    out = X.reduce(n.op, args[0], n.attr[0])
                else:
                    out = X.node(n.op, args, n.attr, n.kind)
        memo[n] = out
        return out

    for n in X.topological(nodes):
        rebuild(n)
    return [memo[n] for n in nodes]


def _zero_sums(nodes, zeros):
    """nodes with the row sums of `zeros` (blocks whose sum along a row is 0 by the forward's
    definition: x - mean(x)) taken as 0: a sum along axis 1 whose argument is a sum of terms
    c * z (c per-row or scalar, z in zeros, through add, sub, neg and mul) loses those terms.
    The gradient of LayerNorm's variance reaches x through the mean as such a sum (zero in exact
    arithmetic, a rounding error in f32); computed, it is a second reduction level (one more
    pass over each row) for a term that torch's formula does not have."""
    zeros = set(zeros)

    def terms(e):
        """[(coefficient nodes, sign, block term)] with e = sum of sign * prod(coef) * term."""
        if e in zeros:
            return [((), 1, e)]
        if e.op in ("add", "sub") and e.shape == "block":
            a, b = terms(e.args[0]), terms(e.args[1])
            if e.op == "sub":
                b = [(c, -sg, t) for c, sg, t in b]
            return a + b
        if e.op == "neg" and e.shape == "block":
            return [(c, -sg, t) for c, sg, t in terms(e.args[0])]
        if e.op == "mul" and e.shape == "block":
            a, b = e.args
            if a.shape != "block":
                a, b = b, a
            if b.shape in ("col", "scalar"):
                return [(c + (b,), sg, t) for c, sg, t in terms(a)]
        return [((), 1, e)]

    def rewritten(r):
        parts = terms(r.args[0])
        if not any(t in zeros for _, _, t in parts):
            return r
        total = X.const(0.0)
        for coef, sign, t in parts:
            if t in zeros:
                continue
            value = X.reduce("rsum", t, 1)
            for c in coef:
                value = X.mul(value, c)
            total = X.add(total, value) if sign > 0 else X.sub(total, value)
        return total

    mapping = {}
    for n in X.topological(nodes):
        if n.op == "rsum" and n.attr[0] == 1 and n.args[0].shape == "block":
            got = rewritten(n)
            if got is not n:
                mapping[n] = got
    return X.substitute(list(nodes), mapping) if mapping else list(nodes)


def _grad(outputs, wrt, cotangents, stop=()):
    from tpp.core.autodiff import grad
    return grad(outputs, wrt, cotangents, stop_gradient=stop)


# ---------------------------------------------------------------- the equations
# Each builder takes the block's rows and returns an EquationSpec; operands of the same name
# in every builder of one nest (the nest declares one tensor per operand name).

def normalized(eq, x, xc, mu, rstd):
    """(x - mu) * rstd as the LayerNorm forwards write it: fma(x, rstd, -mu * rstd), one
    operation per element; over one column (eq.n == 1) xc * rstd, exactly 0 where the fma
    form leaves the rounding of mu * rstd (~ulp(x) / sqrt(eps)): LayerNorm over one feature
    returns its bias exactly, as torch's does."""
    return xc * rstd if eq.n == 1 else eq.fma(x, rstd, -(mu * rstd))


def _ln_forward_graph(eq, has_w, has_b, dt, wdt):
    x = eq.input("x", dtype=dt)
    w = eq.input("weight", dtype=wdt, bcast="row") if has_w else None
    b = eq.input("bias", dtype=wdt, bcast="row") if has_b else None
    eps = eq.param("eps")
    mu = eq.mean(x, 1)
    xc = x - mu
    s = eq.sqrt(eq.mean(xc * xc, 1) + eps)
    rstd = 1.0 / s
    y = normalized(eq, x, xc, mu, rstd)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return x, w, b, mu, s, rstd, y


def _ln_forward(rows, n, dt, wdt, has_w, has_b, stats=True):
    """y, and the mean and rstd when stats (the training forward; inference writes y alone:
    fewer tensors make a cheaper call)."""
    eq = tpp.equation(rows, n)
    *_, mu, s, rstd, y = _ln_forward_graph(eq, has_w, has_b, dt, wdt)
    if not stats:
        return (eq.spec(y=y, dtypes={"y": dt}),)
    return (eq.spec(y=y, mean=mu, rstd=rstd, dtypes={"y": dt}),)


def _ln_backward(rows, n, dt, wdt, has_w, has_b, need):
    """One equation: dx (per-row reductions: tpp_cpu's rowwise schedule, each row in L1
    across its two passes) and the weight and bias partial rows (sums down the columns, folded
    into dx's pass)."""
    scratch = tpp.equation(rows, n)       # the forward graph (hash-consed: same nodes)
    x, w, b, mu, s, rstd, y = _ln_forward_graph(scratch, has_w, has_b, dt, wdt)
    dy = X.input("dy")
    grads = _grad([y], [t for t in (x, w, b) if t is not None], [dy])
    grads = _zero_sums(grads, [x - mu])         # sum(x - mean(x)) = 0
    grads = _lean(_saved(grads, {mu: X.input("mean", "col"), rstd: X.input("rstd", "col"),
                                 s: 1.0 / X.input("rstd", "col")}))
    named = dict(zip([nm for nm, t in zip(("dx", "dweight", "dbias"), (x, w, b))
                      if t is not None], grads))
    outputs = {nm: named[nm] for nm, want in zip(("dx", "dweight", "dbias"), need)
               if want and nm in named}
    eq = _declare(rows, n, dt, wdt, has_w and need[0], "x", "dy", "weight", "mean", "rstd")
    return (eq.spec(**outputs, dtypes={"dx": dt} if need[0] else None),)


def _declare(rows, n, dt, wdt, has_w, *names):
    """An equation with the inputs the backward equations read (those of `names`)."""
    eq = tpp.equation(rows, n)
    for name in names:
        if name in ("x", "dy", "y"):
            eq.input(name, dtype=dt)
        elif name == "weight":
            if has_w:
                eq.input(name, dtype=wdt, bcast="row")
        else:
            eq.input(name, bcast="col")
    return eq


def _rms_forward_graph(eq, has_w, dt, wdt):
    x = eq.input("x", dtype=dt)
    w = eq.input("weight", dtype=wdt, bcast="row") if has_w else None
    s = eq.sqrt(eq.mean(x * x, 1) + eq.param("eps"))
    rstd = 1.0 / s
    y = x * rstd
    if w is not None:
        y = y * w
    return x, w, s, rstd, y


def _rms_forward(rows, n, dt, wdt, has_w, stats=True):
    eq = tpp.equation(rows, n)
    *_, s, rstd, y = _rms_forward_graph(eq, has_w, dt, wdt)
    if not stats:
        return (eq.spec(y=y, dtypes={"y": dt}),)
    return (eq.spec(y=y, rstd=rstd, dtypes={"y": dt}),)


def _rms_backward(rows, n, dt, wdt, has_w, need):
    """dx and the weight's partial rows in one equation, as for _ln_backward."""
    x, w, s, rstd, y = _rms_forward_graph(tpp.equation(rows, n), has_w, dt, wdt)
    grads = _grad([y], [x] + ([w] if has_w else []), [X.input("dy")])
    grads = _lean(_saved(grads, {rstd: X.input("rstd", "col"),
                                 s: 1.0 / X.input("rstd", "col")}))
    outputs = {"dx": grads[0]} if need[0] else {}
    if has_w and need[1]:
        outputs["dweight"] = grads[1]
    eq = _declare(rows, n, dt, wdt, has_w and need[0], "x", "dy", "weight", "rstd")
    return (eq.spec(**outputs, dtypes={"dx": dt} if need[0] else None),)


def _softmax_graph(eq, dt, mask, mdt, scaled):
    x = eq.input("x", dtype=dt)
    z = x * eq.param("scale") if scaled else x
    if mask is not None:
        z = z + eq.input("mask", dtype=mdt, bcast=None if mask == "block" else "row")
    mx = eq.max(z, 1)
    # z - max(z) <= 0 (f32 subtraction is monotonic: z <= mx gives z - mx <= 0), -inf where
    # masked, NaN where the row holds a NaN or +inf or is all -inf: the domain of exp_nonpos,
    # which costs 11 vector operations to exp's 15. Not fma(x, scale, -mx): unrounded, it
    # exceeds 0 by up to half an ulp of mx, past exp_nonpos's domain for logits of ~1e9
    e = X.prim("exp_nonpos", z - mx)
    s = eq.sum(e, 1)
    return x, mx, e, s, e / s


def _softmax_forward(rows, n, dt, mask, mdt, scaled):
    """One equation: the row maxima, then exp(z - max) summed (the equation compiler keeps each
    exp in a row buffer for the last pass, so exp runs once per element), then the output."""
    eq = tpp.equation(rows, n)
    x, mx, e, s, y = _softmax_graph(eq, dt, mask, mdt, scaled)
    return (eq.spec(y=_lean([y])[0], dtypes={"y": dt}),)


def _softmax_backward(rows, n, dt, scaled):
    x, mx, e, s, y = _softmax_graph(tpp.equation(rows, n), dt, None, None, scaled)
    eq = tpp.equation(rows, n)
    y_in = eq.input("y", dtype=dt)
    dy = eq.input("dy", dtype=dt)
    if scaled:
        eq.param("scale")
    dx, = _grad([y], [x], [dy], stop=[mx])
    # dx depends on x only through e = exp(z - max) and s = sum(e), and is unchanged when
    # both are scaled by one factor: with the factor 1/s, e is y and s is 1
    dx, = _lean(_saved([dx], {y: y_in, e: y_in, s: X.const(1.0)}))
    return (eq.spec(dx=dx, dtypes={"dx": dt}),)


def _activation(eq, z, activation):
    if activation is None:
        return z
    if activation == "gelu":
        return eq.gelu(z)
    if activation == "gelu_tanh":
        return eq.gelu(z, approximate="tanh")
    if activation == "relu":
        return eq.relu(z)
    if activation == "sigmoid":
        return eq.sigmoid(z)
    if activation == "tanh":
        return eq.tanh(z)
    return z * eq.sigmoid(z)        # silu


def _bad_forward(rows, n, dt, bdt, has_b, activation, p):
    eq = tpp.equation(rows, n)
    z = eq.input("x", dtype=dt)
    if has_b:
        z = z + eq.input("bias", dtype=bdt, bcast="row")
    y = _activation(eq, z, activation)
    if p > 0:
        y, keep = eq.op("dropout", y, p=p)
        return (eq.spec(y=y, keep=keep, dtypes={"y": dt}),)
    return (eq.spec(y=y, dtypes={"y": dt}),)


def _bad_backward(rows, n, dt, bdt, has_b, activation, p, need):
    """dx (element-wise) and the bias's partial rows (the axis-0 sum of x's adjoint, folded
    into the pass that computes it) in one equation."""
    eq = tpp.equation(rows, n)
    x = eq.input("x", dtype=dt)
    b = eq.input("bias", dtype=bdt, bcast="row") if has_b else None
    z = x + b if has_b else x
    y = _activation(eq, z, activation)
    if p > 0:
        # the forward's dropout with its draw replaced by the saved keep bitmask
        y = X.select(eq.mask("keep"), y * float(1.0 / (1.0 - p)), 0.0)
    dy = eq.input("dy", dtype=dt)
    grads = _lean(_grad([y], [x] + ([b] if has_b else []), [dy]))
    outputs = {"dx": grads[0]} if need[0] else {}
    if has_b and need[1]:
        outputs["dbias"] = grads[1]
    return (eq.spec(**outputs, dtypes={"dx": dt} if need[0] else None),)


def per_row_terms(spec):
    """spec with each axis-0 output (a "vector": the sum over the block's rows of a block
    expression, a weight or bias gradient's partial row) replaced by that expression as an f32
    block output of the same name, whose rows a column-sum nest then adds up: the form of the
    equations for backends that reduce along axis 1 only (tpp_cuda). spec itself when it has
    no such output; ValueError for an axis-0 output of another form."""
    if not any(layout == "vector" for _, layout, _, _ in spec.outputs):
        return spec
    nodes, outputs = [], []
    for node, (name, layout, dt, ld) in zip(spec.nodes, spec.outputs):
        if layout == "vector":
            if not (node.op == "rsum" and node.attr[0] == 0 and node.args[0].shape == "block"):
                raise ValueError(f"{name}: an axis-0 output that is not a sum over the rows "
                                 f"({node.op})")
            node, layout, dt, ld = node.args[0], "block", _dt.F32, spec.n
        nodes.append(node)
        outputs.append((name, layout, dt, ld))
    return dataclasses.replace(spec, outputs=tuple(outputs), graph=graph_text(nodes),
                               nodes=tuple(nodes))


_BUILDERS = {"ln_fwd": _ln_forward, "ln_bwd": _ln_backward, "rms_fwd": _rms_forward,
             "rms_bwd": _rms_backward, "sm_fwd": _softmax_forward,
             "sm_bwd": _softmax_backward, "bad_fwd": _bad_forward, "bad_bwd": _bad_backward}
