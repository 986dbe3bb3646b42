"""tpp.core.autodiff: the backward of expression graphs, checked against central finite differences
of the exact (float64) evaluation for every op and transcendental with a rule, against torch
autograd on whole layers, and for leanness against hand-written backwards in the same IR."""
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tpp.core import expr as X
from tpp.core import mathlib
from tpp.core.autodiff import RULES, count_ops, grad
from tpp.core.errors import SpecError
from tpp.core.expr_eval import evaluate

M, N = 3, 4
_DIMS = {"block": (M, N), "row": (1, N), "col": (M, 1), "scalar": (1, 1)}
_PARAM_STEP = 2.0 ** -12        # params are rounded to f32: perturb them on the f32 grid


def _draw(rng, outputs, positive=(), low=-2.0, high=2.0):
    """Random values for the inputs and params of the outputs; names in `positive` (and every
    param) are drawn from [0.5, 2), the others from [low, high)."""
    values = {}
    for leaf in X.leaves(outputs, "input"):
        name = leaf.attr[0]
        lo, hi = (0.5, 2.0) if name in positive else (low, high)
        values[name] = rng.uniform(lo, hi, _DIMS[leaf.shape])
    params = {p.attr[0]: np.round(rng.uniform(0.5, 2.0) / _PARAM_STEP) * _PARAM_STEP
              for p in X.leaves(outputs, "param")}
    return values, params


def _loss(outputs, cotangents, inputs, params, masks):
    outs = evaluate(outputs, M, N, inputs=inputs, params=params, masks=masks)
    return sum(float(np.sum(o * c)) for o, c in zip(outs, cotangents))


def _numeric(outputs, leaf, cotangents, inputs, params, masks, h):
    """Central differences of sum(output * cotangent) by every element of the leaf."""
    if leaf.op == "param":
        name, step = leaf.attr[0], _PARAM_STEP
        hi = _loss(outputs, cotangents, inputs, {**params, name: params[name] + step}, masks)
        lo = _loss(outputs, cotangents, inputs, {**params, name: params[name] - step}, masks)
        return np.full((1, 1), (hi - lo) / (2 * step))
    name = leaf.attr[0]
    base = inputs[name]
    out = np.zeros_like(base)
    for idx in np.ndindex(base.shape):
        vals = []
        for sign in (1, -1):
            moved = base.copy()
            moved[idx] += sign * h
            vals.append(_loss(outputs, cotangents, {**inputs, name: moved}, params, masks))
        out[idx] = (vals[0] - vals[1]) / (2 * h)
    return out


def check_fd(outputs, wrt, *, positive=(), seed=0, masks=None, h=1e-6, rtol=1e-6,
             atol=1e-7, simplify=True, low=-2.0, high=2.0):
    """grad(outputs, wrt) evaluated exactly equals central finite differences."""
    outputs = [outputs] if isinstance(outputs, X.Node) else list(outputs)
    rng = np.random.default_rng(seed)
    inputs, params = _draw(rng, outputs, positive, low, high)
    cot_nodes = [X.input(f"d{i}", o.shape) for i, o in enumerate(outputs)]
    cots = [rng.uniform(-1.0, 1.0, _DIMS[o.shape]) for o in outputs]
    adjoints = grad(outputs, wrt, simplify=simplify)
    for leaf, adj in zip(wrt, adjoints):
        assert X._join_shapes((adj.shape, leaf.shape)) == leaf.shape, (adj, leaf)
    got = evaluate(adjoints, M, N, inputs={**inputs, **{c.attr[0]: v for c, v in
                                                       zip(cot_nodes, cots)}},
                   params=params, masks=masks)
    for leaf, g in zip(wrt, got):
        want = _numeric(outputs, leaf, cots, inputs, params, masks, h)
        np.testing.assert_allclose(np.broadcast_to(g, want.shape), want, rtol=rtol, atol=atol,
                                   err_msg=f"d/d{leaf!r}")
    return adjoints


# ------------------------------------------------------------------ single ops
_BINARY = {"add": X.add, "sub": X.sub, "mul": X.mul, "div": X.div, "min": X.minimum,
           "max": X.maximum}


@pytest.mark.parametrize("op", sorted(_BINARY))
@pytest.mark.parametrize("sa,sb", list(itertools.product(X.SHAPES, X.SHAPES)))
def test_binary_ops_every_broadcast(op, sa, sb):
    a, b = X.input("a", sa), X.input("b", sb)
    check_fd(_BINARY[op](a, b), [a, b], positive=("b",) if op == "div" else ())


@pytest.mark.parametrize("shapes", list(itertools.product(X.SHAPES, repeat=3)))
def test_fma_every_broadcast(shapes):
    a, b, c = (X.input(name, s) for name, s in zip("abc", shapes))
    check_fd(X.fma(a, b, c), [a, b, c])


@pytest.mark.parametrize("op", ["neg", "abs", "sqrt"])
@pytest.mark.parametrize("shape", X.SHAPES)
def test_unary_ops(op, shape):
    x = X.input("x", shape)
    used = {"neg": X.neg, "abs": X.fabs, "sqrt": X.sqrt}[op](x) * X.input("w", "block")
    check_fd(used, [x], positive=("x",) if op == "sqrt" else ())


def test_round_f32_is_the_identity():
    x, dy = X.input("x"), X.input("dy")
    assert grad(X.round_f32(x), [x], [dy]) == [dy]
    # finite differences through the f32 rounding need a step well above its ulp
    check_fd(X.round_f32(x) * x, [x], h=1e-3, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("sa,sb", list(itertools.product(X.SHAPES, X.SHAPES)))
def test_select_gets_no_gradient_into_its_condition(sa, sb):
    a, b, c = X.input("a", sa), X.input("b", sb), X.input("c", "block")
    cond = X.and_(X.compare("lt", a, b), c > 0.0)        # the condition depends on a and b
    check_fd(X.select(cond, a * a, b * 3.0), [a, b, c])  # c: no gradient at all
    assert grad(X.select(c > 0.0, a, b), [c], [X.input("d", "block")]) == [X.const(0.0)]


@pytest.mark.parametrize("op", X.REDUCTIONS)
@pytest.mark.parametrize("shape,axis", [("block", 0), ("block", 1), ("row", 1), ("col", 0)])
def test_reductions(op, shape, axis):
    x, w = X.input("x", shape), X.input("w", "block")
    r = X.reduce(op, x, axis)
    check_fd(r, [x])
    check_fd(r * w + x, [x, w])                # the reduction's result used in a block again


def test_reduction_of_a_broadcast_leaf():
    """A scalar and a row leaf broadcast into a block that is reduced along both axes: their
    adjoints are multiplied by the extents they were broadcast over."""
    s, r, x = X.input("s", "scalar"), X.input("r", "row"), X.input("x")
    total = X.reduce("rsum", X.reduce("rsum", s + r * x, 1), 0)
    check_fd(total, [s, r, x])
    check_fd(X.reduce("rmax", X.reduce("rsum", s * r + x, 0), 1), [s, r, x])


def test_every_prim_and_op_has_a_rule():
    assert {("prim", name) for name in mathlib.PRIMS} <= set(RULES)
    differentiable = set(_BINARY) | {"fma", "neg", "abs", "sqrt", "round_f32", "select"}
    assert differentiable | set(X.REDUCTIONS) <= set(RULES)


_POSITIVE_DOMAIN = {"log"}


@pytest.mark.parametrize("name", sorted(mathlib.PRIMS))
@pytest.mark.parametrize("shape", ["block", "row"])
def test_prims(name, shape):
    x = X.input("x", shape)
    y = X.prim(name, x)
    positive = ("x",) if name in _POSITIVE_DOMAIN else ()
    check_fd(y * X.input("w"), [x], positive=positive)
    check_fd(y, [x], positive=positive, seed=1, low=-5.0, high=5.0)     # into the tails


def test_prims_derivatives_reuse_the_forward_nodes():
    x, dy = X.input("x"), X.input("dy")
    e = X.prim("exp", x)
    assert grad(e, [x], [dy]) == [dy * e]
    assert grad(X.prim("expm1", x), [x], [dy]) == [dy * e]
    assert grad(X.prim("gelu", x), [x], [dy]) == [dy * X.prim("gelu_grad", x)]
    assert grad(X.prim("log", x), [x], [dy]) == [dy / x]


def test_params_and_multiple_outputs():
    x, p, q = X.input("x"), X.param("p"), X.param("q")
    y0 = x * p + p * p
    y1 = X.reduce("rsum", X.prim("tanh", x * q), 1)
    check_fd([y0, y1, p], [x, p, q])


def test_shared_subexpressions_and_repeated_use():
    x, r = X.input("x"), X.input("r", "row")
    t = x * r + x
    y = t * t / (t * t + 1.0) + X.prim("sigmoid", t) * t
    check_fd([y, t], [x, r])
    check_fd([y, t], [x, r], simplify=False)


# ------------------------------------------------------------------ conventions
def _eval1(node, **inputs):
    return evaluate([node], M, N, inputs={k: np.asarray(v, np.float64)
                                          for k, v in inputs.items()})[0]


def test_min_max_ties_and_nans_go_to_the_first_argument():
    a, b, dy = X.input("a"), X.input("b"), X.input("dy")
    va = np.array([[1.0, 2.0, np.nan, 5.0]] * M)
    vb = np.array([[1.0, 3.0, 4.0, np.nan]] * M)
    for op, fn in (("min", X.minimum), ("max", X.maximum)):
        da, db = grad(fn(a, b), [a, b], [dy])
        ga = _eval1(da, a=va, b=vb, dy=np.ones((M, N)))[0]
        gb = _eval1(db, a=va, b=vb, dy=np.ones((M, N)))[0]
        chose_a = 1.0 if op == "min" else 0.0
        np.testing.assert_array_equal(ga, [1.0, chose_a, 1.0, 1.0], err_msg=op)
        np.testing.assert_array_equal(ga + gb, [1.0] * 4, err_msg=op)


def test_rmax_ties_get_the_full_adjoint_abs_has_zero_slope_at_zero():
    x, dy = X.input("x"), X.input("dy", "col")
    (dx,) = grad(X.reduce("rmax", x, 1), [x], [dy])
    vx = np.array([[1.0, 3.0, 3.0, 0.0], [1.0, 2.0, 0.0, 0.0], [np.nan, 1.0, 2.0, 0.0]])
    got = _eval1(dx, x=vx, dy=np.ones((M, 1)))
    np.testing.assert_array_equal(got, [[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    (da,) = grad(X.fabs(x), [x], [X.input("d")])
    np.testing.assert_array_equal(_eval1(da, x=[[-2.0, 0.0, -0.0, 3.0]] * M,
                                         d=np.ones((M, N)))[0], [-1.0, 0.0, 0.0, 1.0])


def test_a_zero_factor_is_not_folded_away():
    x, dy = X.input("x"), X.input("dy")
    (dx,) = grad(x * 0.0, [x], [dy])
    assert dx is dy * 0.0                          # inf * 0 is nan, as in torch
    assert np.isnan(_eval1(dx, dy=np.full((M, N), np.inf))).all()


def test_unused_leaves_and_stopped_nodes_get_zero():
    x, y, dy = X.input("x"), X.input("y"), X.input("dy")
    t = x * 2.0
    assert grad(t + y, [x, y], [dy]) == [dy * 2.0, dy]
    assert grad(t + y, [x, y], [dy], stop_gradient=[t]) == [X.const(0.0), dy]
    assert grad(t, [y], [dy]) == [X.const(0.0)]


def test_default_cotangents_are_new_inputs():
    x = X.input("x")
    (dx,) = grad([x * 3.0, X.reduce("rsum", x, 0)], [x])
    assert dx.op == "add" and set(dx.args) == {X.input("d0") * 3.0, X.input("d1", "row")}


# ------------------------------------------------------------------ against torch autograd
def _run(adjoints, m, n, inputs, params=None, masks=None):
    return evaluate(adjoints, m, n, inputs=inputs, params=params, masks=masks)


def _t(a):
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def _mean(x, axis=1):
    return X.reduce("rsum", x, axis) / X.extent(axis)


def _layer_norm(x, g, b, eps):
    xc = x - _mean(x)
    rstd = 1.0 / X.sqrt(_mean(xc * xc) + eps)
    return xc * rstd * g + b, xc * rstd, rstd


def test_layer_norm_matches_torch():
    m, n, eps = 5, 8, 1e-5
    x, g, b, dy = X.input("x"), X.input("g", "row"), X.input("b", "row"), X.input("dy")
    y, _, _ = _layer_norm(x, g, b, eps)
    rng = np.random.default_rng(3)
    vals = {"x": rng.normal(size=(m, n)) * 3 + 1, "g": rng.normal(size=(1, n)),
            "b": rng.normal(size=(1, n)), "dy": rng.normal(size=(m, n))}
    tx, tg, tb = _t(vals["x"]), _t(vals["g"][0]), _t(vals["b"][0])
    ty = F.layer_norm(tx, (n,), tg, tb, X.f32(eps))
    ty.backward(torch.tensor(vals["dy"]))
    np.testing.assert_allclose(_run([y], m, n, vals)[0], ty.detach().numpy(), rtol=1e-12)
    got = _run(grad(y, [x, g, b], [dy]), m, n, vals)
    for ours, theirs in zip(got, (tx.grad, tg.grad[None], tb.grad[None])):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-10, atol=1e-12)


def test_rms_norm_matches_torch():
    m, n, eps = 4, 6, 1e-6
    x, g, dy = X.input("x"), X.input("g", "row"), X.input("dy")
    y = x / X.sqrt(_mean(x * x) + eps) * g
    rng = np.random.default_rng(4)
    vals = {"x": rng.normal(size=(m, n)), "g": rng.normal(size=(1, n)),
            "dy": rng.normal(size=(m, n))}
    tx, tg = _t(vals["x"]), _t(vals["g"][0])
    F.rms_norm(tx, (n,), tg, X.f32(eps)).backward(torch.tensor(vals["dy"]))
    dx, dg = _run(grad(y, [x, g], [dy]), m, n, vals)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dg, tg.grad[None].numpy(), rtol=1e-10, atol=1e-12)


def _softmax(z, axis=1):
    mx = X.reduce("rmax", z, axis)
    e = X.prim("exp", z - mx)
    return e / X.reduce("rsum", e, axis), mx


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("stop_max", [False, True])
def test_softmax_matches_torch(axis, stop_max):
    m, n = 4, 7
    x, dy = X.input("x"), X.input("dy")
    y, mx = _softmax(x, axis)
    rng = np.random.default_rng(5)
    vals = {"x": rng.normal(size=(m, n)) * 4, "dy": rng.normal(size=(m, n))}
    tx = _t(vals["x"])
    F.softmax(tx, dim=axis).backward(torch.tensor(vals["dy"]))
    (dx,) = _run(grad(y, [x], [dy], stop_gradient=[mx] if stop_max else ()), m, n, vals)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-14)


def test_masked_scaled_softmax_matches_torch():
    m, n = 4, 6
    x, scale, dy = X.input("x"), X.param("scale"), X.input("dy")
    keep = X.maskbit("keep")
    y, _ = _softmax(X.select(keep, x * scale, -np.inf))
    rng = np.random.default_rng(6)
    vals = {"x": rng.normal(size=(m, n)), "dy": rng.normal(size=(m, n))}
    mask = rng.uniform(size=(m, n)) < 0.6
    mask[:, 0] = True                              # every row keeps one element
    tx, ts = _t(vals["x"]), _t(0.375)
    ty = torch.where(torch.tensor(mask), tx * ts, -torch.inf).softmax(dim=1)
    ty.backward(torch.tensor(vals["dy"]))
    dx, dscale = _run(grad(y, [x, scale], [dy]), m, n, vals, {"scale": 0.375},
                      {"keep": mask})
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(dscale[0, 0], ts.grad.item(), rtol=1e-9)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_bias_chain_matches_torch(approximate):
    m, n = 3, 5
    x, b, w, dy = X.input("x"), X.input("b", "row"), X.input("w", "col"), X.input("dy")
    name = "gelu" if approximate == "none" else "gelu_tanh"
    y = X.prim(name, X.prim(name, x + b) * w)
    rng = np.random.default_rng(7)
    vals = {"x": rng.normal(size=(m, n)) * 2, "b": rng.normal(size=(1, n)),
            "w": rng.normal(size=(m, 1)), "dy": rng.normal(size=(m, n))}
    tx, tb, tw = _t(vals["x"]), _t(vals["b"]), _t(vals["w"])
    ty = F.gelu(F.gelu(tx + tb, approximate=approximate) * tw, approximate=approximate)
    ty.backward(torch.tensor(vals["dy"]))
    got = _run(grad(y, [x, b, w], [dy]), m, n, vals)
    for ours, theirs in zip(got, (tx.grad, tb.grad, tw.grad)):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-9, atol=1e-12)


def test_second_derivative_of_gelu_matches_torch():
    x, dy = X.input("x"), X.input("dy")
    vals = {"x": np.linspace(-6, 6, M * N).reshape(M, N), "dy": np.ones((M, N))}
    for approximate, name in (("none", "gelu"), ("tanh", "gelu_tanh")):
        (dx,) = grad(X.prim(name, x), [x], [dy])
        (ddx,) = grad(dx, [x], [dy])
        tx = _t(vals["x"])
        (g1,) = torch.autograd.grad(F.gelu(tx, approximate=approximate).sum(), tx,
                                    create_graph=True)
        g1.sum().backward()
        # the rule's constants (1/sqrt(2 pi), ...) are f32 constants of the IR
        np.testing.assert_allclose(_run([ddx], M, N, vals)[0], tx.grad.numpy(), rtol=1e-6,
                                   atol=1e-7, err_msg=name)


# ------------------------------------------------------------------ leanness
def test_layer_norm_backward_is_about_as_lean_as_a_hand_written_one():
    x, g, b, dy = X.input("x"), X.input("g", "row"), X.input("b", "row"), X.input("dy")
    y, xhat, rstd = _layer_norm(x, g, b, 1e-5)
    dyg = dy * g
    hand_dx = rstd * (dyg - _mean(dyg) - xhat * _mean(dyg * xhat))
    hand = [hand_dx, X.reduce("rsum", dy * xhat, 0), X.reduce("rsum", dy, 0)]
    auto = grad(y, [x, g, b], [dy])
    assert count_ops(auto[0]) <= 1.5 * count_ops(hand_dx), (count_ops(auto[0]),
                                                             count_ops(hand_dx))
    assert count_ops(auto) <= 1.5 * count_ops(hand)
    assert count_ops(grad(y, [x, g, b], [dy], simplify=False)) > count_ops(auto)
    rng = np.random.default_rng(8)
    vals = {"x": rng.normal(size=(M, N)), "g": rng.normal(size=(1, N)),
            "b": rng.normal(size=(1, N)), "dy": rng.normal(size=(M, N))}
    for ours, theirs in zip(_run(auto, M, N, vals), _run(hand, M, N, vals)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)


def test_softmax_backward_is_about_as_lean_as_a_hand_written_one():
    x, dy = X.input("x"), X.input("dy")
    y, mx = _softmax(x)
    hand = y * (dy - X.reduce("rsum", dy * y, 1))
    (auto,) = grad(y, [x], [dy], stop_gradient=[mx])   # the max's exact contribution is 0
    assert count_ops(auto) <= 1.5 * count_ops(hand), (count_ops(auto), count_ops(hand))
    # through the max as well (what torch autograd does for this graph): 5 ops more
    (full,) = grad(y, [x], [dy])
    assert count_ops(full) <= count_ops(auto) + 5
    rng = np.random.default_rng(9)
    vals = {"x": rng.normal(size=(M, N)), "dy": rng.normal(size=(M, N))}
    for ours in _run([auto, full], M, N, vals):
        np.testing.assert_allclose(ours, _run([hand], M, N, vals)[0], rtol=1e-9, atol=1e-14)


# ------------------------------------------------------------------ errors
def test_wrt_must_be_an_f32_leaf():
    x = X.input("x")
    for bad in (x * 2.0, X.index("row"), X.const(1.0), X.extent(0), "x"):
        with pytest.raises(SpecError, match=r"wrt\[0\] must be an f32 leaf"):
            grad(x * x, [bad])


def test_outputs_and_cotangents_are_checked():
    x = X.input("x")
    with pytest.raises(SpecError, match="cotangent of output 0 must be an f32 node of the "
                                        "output's shape 'block'.*'row'"):
        grad(x * x, [x], [X.input("dy", "row")])
    with pytest.raises(SpecError, match="one cotangent per output"):
        grad(x * x, [x], [X.input("dy"), X.input("dz")])
    with pytest.raises(SpecError, match="output 0 must be an f32"):
        grad(x > 0.0, [x])
    with pytest.raises(SpecError, match="'d0' is already an input"):
        grad(x * X.input("d0"), [x])


def test_an_op_without_a_rule_is_an_error(monkeypatch):
    x, dy = X.input("x"), X.input("dy")
    monkeypatch.setitem(mathlib.PRIMS, "no_rule",
                        mathlib.Prim("no_rule", 1, np.negative, 0.0))
    with pytest.raises(SpecError, match="no derivative rule for the transcendental 'no_rule'"):
        grad(X.prim("no_rule", x) + x, [x], [dy])
    assert grad(X.prim("no_rule", dy) + x, [x], [dy]) == [dy]   # off the path: no need
    with pytest.raises(SpecError, match="no derivative rule for the op 'fbits'.*integer bit"):
        grad(X.fbits(X.bits(x)), [x], [dy])
