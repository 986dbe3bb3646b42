"""Issue 12, ops reliability: double backward through the torch drop-ins, zero-size layers,
out= tensors that require grad, wrong types and unknown keywords at the ops entry points, and
sizes given as numpy integers. Each test failed before its fix."""
import numpy as np
import pytest

import ops
import ops.blocked
import tpp
from tpp import ArgumentError, TPPError

torch = pytest.importorskip("torch")
import ops.torch as ot  # noqa: E402

F = torch.nn.functional
ACTIVATIONS = [None, "relu", "gelu", "tanh", "sigmoid"]
TORCH_ACT = {None: lambda t: t, "relu": torch.relu, "gelu": F.gelu, "sigmoid": torch.sigmoid,
             "tanh": torch.tanh}
TOL = dict(rtol=1e-4, atol=1e-4)


def _f(*shape):
    return np.ones(shape, np.float32)


def _pair(k, n, bias=True, activation=None, seed=0):
    """(ops.torch.Linear, the torch function it replaces) holding the same parameters."""
    torch.manual_seed(seed)
    ours = ot.Linear(k, n, bias=bias, activation=activation)
    ref = torch.nn.Linear(k, n, bias=bias)
    ref.load_state_dict(ours.state_dict())
    return ours, ref, lambda t: TORCH_ACT[activation](ref(t))


def _penalised_grads(layer, params, x, dy):
    """A gradient penalty (the WGAN-GP / double-backward pattern): the first-order gradients
    built with create_graph=True, then d/d(x, params) of y·dy + |dL/dx|² + |dL/dW|²."""
    x = x.clone().requires_grad_()
    y = layer(x)
    gx, gw = torch.autograd.grad(y, (x, params[0]), dy, create_graph=True)
    loss = (y * dy).sum() + gx.square().sum() + gw.square().sum()
    second = torch.autograd.grad(loss, (x, *params))
    return (gx, gw), second


# --- 1. double backward ----------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_double_backward_linear_matches_torch(activation, bias):
    ours, ref, ref_fn = _pair(4, 3, bias, activation)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, generator=g)
    dy = torch.randn(5, 3, generator=g)
    first, second = _penalised_grads(ours, list(ours.parameters()), x, dy)
    want_first, want_second = _penalised_grads(ref_fn, list(ref.parameters()), x, dy)
    for got, want in zip(first + second, want_first + want_second):
        torch.testing.assert_close(got, want, **TOL)


def test_double_backward_example_from_the_issue():
    # grad(y.sum(), x, create_graph=True) on Linear(4, 3, activation="tanh"), then a loss on
    # that gradient: x.grad was silently the first-order part only
    ours, _, ref_fn = _pair(4, 3, True, "tanh")
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (ours, ref_fn):
        xx = x.clone().requires_grad_()
        y = fn(xx)
        gx, = torch.autograd.grad(y.sum(), xx, create_graph=True)
        (gx.square().sum() + xx.sum()).backward()
        grads.append(xx.grad)
    torch.testing.assert_close(grads[0], grads[1], **TOL)


def test_gradient_with_respect_to_the_incoming_gradient():
    # a Hessian-vector style product: the backward differentiated in dy (grad_outputs)
    ours, _, ref_fn = _pair(6, 5, True, "gelu")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 6, generator=g)
    got = []
    for fn in (ours, ref_fn):
        xx = x.clone().requires_grad_()
        v = torch.randn(3, 5, generator=torch.Generator().manual_seed(4), requires_grad=True)
        gx, = torch.autograd.grad(fn(xx), xx, v, create_graph=True)
        got.append(torch.autograd.grad(gx.sin().sum(), (v, xx)))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, **TOL)


def test_third_derivative_matches_torch():
    ours, _, ref_fn = _pair(1, 1, True, "tanh")
    x = torch.tensor([[0.3]])
    got = []
    for fn in (ours, ref_fn):
        xx = x.clone().requires_grad_()
        d1, = torch.autograd.grad(fn(xx).sum(), xx, create_graph=True)
        d2, = torch.autograd.grad(d1.sum(), xx, create_graph=True)
        d3, = torch.autograd.grad(d2.sum(), xx)
        got.append((d1, d2, d3))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, **TOL)


def test_double_backward_functional_linear_bf16():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, generator=g).bfloat16()
    w = torch.randn(6, 8, generator=g).bfloat16()
    b = torch.randn(6, generator=g).bfloat16()
    got = []
    for fn in (lambda *a: ot.linear(*a, "sigmoid"), lambda *a: torch.sigmoid(F.linear(*a))):
        xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
        gx, = torch.autograd.grad(fn(xx, ww, bb).sum(), xx, create_graph=True)
        got.append(torch.autograd.grad(gx.float().square().sum(), (xx, ww, bb)))
    for a, c in zip(*got):
        torch.testing.assert_close(a, c, rtol=2e-2, atol=2e-2)


def test_double_backward_mlp_matches_torch():
    torch.manual_seed(6)
    ours = ot.MLP(5, [7, 4], activation="gelu")
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 4))
    ref.load_state_dict({k.replace("1.", "2."): v for k, v in ours.state_dict().items()})
    x = torch.randn(3, 5)
    dy = torch.randn(3, 4)
    first, second = _penalised_grads(ours, list(ours.parameters()), x, dy)
    want_first, want_second = _penalised_grads(ref, list(ref.parameters()), x, dy)
    for got, want in zip(first + second, want_first + want_second):
        torch.testing.assert_close(got, want, **TOL)


def test_first_order_backward_still_runs_on_tpps(monkeypatch):
    calls = []
    real = ops.mlp_backward
    monkeypatch.setattr(ops, "mlp_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours, _, ref_fn = _pair(4, 3, True, "tanh")
    x = torch.randn(2, 4)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ours(xs[0]).sum().backward()
    ref_fn(xs[1]).sum().backward()
    assert calls == [1]
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **TOL)


def test_bias_changed_before_a_differentiable_backward():
    # the first-order backward never reads the bias: changing it in place is fine, as in torch;
    # a create_graph backward recomputes the forward from it: refused, not silently wrong
    lin = ot.Linear(4, 3, activation="gelu")
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    with torch.no_grad():
        lin.bias.add_(1.0)
    torch.autograd.grad(y.sum(), x, retain_graph=True)
    with pytest.raises(ArgumentError, match="bias was modified in place"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


# --- 2. zero-size layers ---------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("activation", [None, "sigmoid"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k,n,lead", [(0, 3, (2,)), (4, 0, (2,)), (0, 0, (2,)), (4, 3, (0,)),
                                      (4, 3, (2, 0)), (0, 3, (0,))])
def test_zero_sizes_match_torch_linear(k, n, lead, bias, activation):
    ours, ref, ref_fn = _pair(k, n, bias, activation)
    assert {n: p.shape for n, p in ours.state_dict().items()} == \
        {n: p.shape for n, p in ref.state_dict().items()}
    ref.load_state_dict(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(*lead, k)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ys = [ours(xs[0]), ref_fn(xs[1])]
    torch.testing.assert_close(ys[0], ys[1], **TOL)
    for y in ys:
        y.sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **TOL)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref_fn(x), **TOL)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_zero_width_mlp_layer():
    torch.manual_seed(7)
    ours = ot.MLP(3, [0, 2], activation="relu")
    ref = torch.nn.Sequential(torch.nn.Linear(3, 0), torch.nn.ReLU(), torch.nn.Linear(0, 2))
    ref.load_state_dict({k.replace("1.", "2."): v for k, v in ours.state_dict().items()})
    x = torch.randn(4, 3)
    torch.testing.assert_close(ours(x), ref(x), **TOL)


# --- 3. out= tensors that require grad -------------------------------------------------------

def test_matmul_out_requiring_grad_is_refused_on_every_call():
    a, b = torch.randn(5, 4), torch.randn(4, 3)
    out = torch.zeros(5, 3, requires_grad=True)
    with pytest.raises(ArgumentError, match="out: the output tensor requires grad"):
        ops.matmul(a, b, out=out)
    ops.matmul(a, b, out=torch.zeros(5, 3))           # the plan is cached now
    pw = ops.pack_kn(b)
    with pytest.raises(ArgumentError, match="requires grad"):
        ops.matmul(a, pw, out=out)
    assert torch.count_nonzero(out) == 0
    with torch.no_grad():                              # as torch: allowed without autograd
        ops.matmul(a, pw, out=out)
    torch.testing.assert_close(out.detach(), a @ b, **TOL)


def test_blocked_outputs_requiring_grad_are_refused():
    x = torch.randn(3, 2)
    with pytest.raises(ArgumentError, match="requires grad"):
        ops.blocked.transpose(x, torch.zeros(2, 3, requires_grad=True))
    with pytest.raises(ArgumentError, match="requires grad"):
        ops.blocked.map_rows("relu", [x], torch.zeros(3, 2, requires_grad=True))
    with pytest.raises(ArgumentError, match="requires grad"):
        ops.blocked.column_sums(x, torch.zeros(2, requires_grad=True))


# --- 4. wrong types at the mlp entry points --------------------------------------------------

def _saved():
    return ops.mlp_forward(_f(5, 7), _f(3, 7), _f(3), "relu")


@pytest.mark.parametrize("saved", [None, "saved", lambda: _saved(), lambda: vars(_saved()[1])],
                         ids=["None", "str", "forward's tuple", "dict"])
def test_mlp_backward_wants_the_saved_object(saved):
    saved = saved() if callable(saved) else saved
    with pytest.raises(ArgumentError, match=r"saved: expected the ops.Saved that "
                                            r"ops.mlp_forward returns second"):
        ops.mlp_backward(_f(5, 3), saved)


def test_mlp_backward_flags_are_bools():
    with pytest.raises(ArgumentError, match="need_w must be True or False, got 'no'"):
        ops.mlp_backward(_f(5, 3), _saved()[1], need_w="no")
    dx, dw, db = ops.mlp_backward(_f(5, 3), _saved()[1], need_x=np.bool_(False))
    assert dx is None and dw.shape == (3, 7) and db.shape == (3,)


@pytest.mark.parametrize("fn", [ops.mlp, ops.mlp_forward])
@pytest.mark.parametrize("packed,match", [
    ("p", "packed: expected an ops.PackedWeight"),
    (lambda: ops.pack_nk(_f(4, 7)), r"does not match a weight of shape \(3, 7\)"),
    (lambda: ops.pack_nk(_f(3, 6)), r"does not match a weight of shape \(3, 7\)"),
    (lambda: ops.pack_nk(torch.ones(3, 7, dtype=torch.bfloat16)), "dtype f32"),
], ids=["str", "other N", "other K", "other dtype"])
def test_mlp_packed_must_match_the_weight(fn, packed, match):
    packed = packed() if callable(packed) else packed
    with pytest.raises(ArgumentError, match=match):
        fn(_f(5, 7), _f(3, 7), None, packed=packed)


def test_blocked_wrong_types():
    with pytest.raises(ArgumentError, match="x: expected an array"):
        ops.blocked.transpose("x", _f(2, 3))
    with pytest.raises(ArgumentError, match="out: expected an array"):
        ops.blocked.column_sums(_f(3, 2), None)
    with pytest.raises(ArgumentError, match="inputs: expected a list of arrays"):
        ops.blocked.map_rows("relu", _f(3, 2), _f(3, 2))
    with pytest.raises(TPPError, match="unknown keyword"):    # binary ops take no params
        ops.blocked.map_rows("add", [_f(3, 2), _f(3, 2)], _f(3, 2), alpha=2.0)


# --- 5. unknown keywords ---------------------------------------------------------------------

def _torch_args():
    return torch.ones(5, 7), torch.ones(3, 7)


UNKNOWN = [
    ("ops.matmul", lambda: ops.matmul(_f(5, 7), _f(7, 3), transpose_b=True)),
    ("ops.linear", lambda: ops.linear(_f(5, 7), _f(3, 7), transpose_b=True)),
    ("ops.mlp", lambda: ops.mlp(_f(5, 7), _f(3, 7), transpose_b=True)),
    ("ops.mlp_forward", lambda: ops.mlp_forward(_f(5, 7), _f(3, 7), transpose_b=True)),
    ("ops.mlp_backward", lambda: ops.mlp_backward(_f(5, 3), _saved()[1], transpose_b=True)),
    ("ops.torch.linear", lambda: ot.linear(*_torch_args(), transpose_b=True)),
    ("ops.blocked.transpose", lambda: ops.blocked.transpose(_f(3, 2), _f(2, 3), transpose_b=1)),
    ("ops.blocked.column_sums", lambda: ops.blocked.column_sums(_f(3, 2), _f(2), transpose_b=1)),
]


@pytest.mark.parametrize("where,call", UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_unknown_keywords_are_argument_errors(where, call):
    with pytest.raises(ArgumentError, match=rf"^{where}: unknown keyword argument\(s\) "
                                            r"'transpose_b'; accepted: "):
        call()


def test_unknown_keyword_lists_the_accepted_ones():
    with pytest.raises(ArgumentError) as info:
        ops.matmul(_f(5, 7), _f(7, 3), transpose_b=True)
    assert str(info.value).endswith("accepted: a, activation, b, bias, blocking, out, "
                                    "out_dtype")


def test_torch_constructors_keep_torch_type_errors():
    # drop-ins behave like what they replace: nn.Linear(4, 3, foo=1) is a TypeError
    for cls in (torch.nn.Linear, ot.Linear):
        with pytest.raises(TypeError):
            cls(4, 3, foo=1)
    with pytest.raises(TypeError):
        ot.MLP(4, [3], foo=1)


# --- 6. numpy integer sizes ------------------------------------------------------------------

def test_numpy_integer_sizes():
    torch.manual_seed(8)
    lin = ot.Linear(np.int64(4), np.int32(3))
    assert type(lin.in_features) is int and type(lin.out_features) is int
    torch.manual_seed(8)
    ref = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    torch.testing.assert_close(lin(x), ref(x), **TOL)
    assert "in_features=4, out_features=3" in repr(lin)
    net = ot.MLP(np.int64(4), [np.int64(5), np.int16(2)])
    assert net.in_features == 4 and all(type(h) is int for h in net.hidden_features)
    assert net(x).shape == (2, 2)
    a, b = _f(5, 8), _f(8, 3)
    y = ops.matmul(a, b, blocking=ops.Blocking(np.int64(2), np.int64(4)))
    np.testing.assert_allclose(y, a @ b, rtol=1e-6)


@pytest.mark.parametrize("bad", [-1, 4.0, True, "4"])
def test_bad_layer_sizes_are_argument_errors(bad):
    with pytest.raises(ArgumentError, match="in_features must be"):
        ot.Linear(bad, 3)
    with pytest.raises(ArgumentError, match=r"hidden_features\[1\] must be"):
        ot.MLP(4, [3, bad])
    with pytest.raises(ArgumentError, match="hidden_features: expected a list"):
        ot.MLP(4, 3)


def test_cached_plan_still_checks_blocking_types():
    # Blocking(4.0, 4) == Blocking(4, 4) as a plan key: the types are checked before the lookup
    a, b = _f(5, 8), _f(8, 3)
    ops.matmul(a, b, blocking=ops.Blocking(4, 4))
    for bad in (ops.Blocking(4.0, 4), ops.Blocking(4, True)):
        with pytest.raises(ArgumentError, match="must be a positive int"):
            ops.matmul(a, b, blocking=bad)


def test_packing_unknown_keywords_are_argument_errors():
    w = np.ones((4, 4), np.float32)
    for pack in (ops.pack_kn, ops.pack_nk):
        with pytest.raises(ArgumentError, match="'block_n'"):
            pack(w, block_n=4)


def test_clear_caches_empties_the_blocked_nests():
    from ops import blocked
    x = np.ones((4, 4), np.float32)
    blocked.transpose(x, np.empty_like(x))
    assert blocked._transpose_nest.cache_info().currsize >= 1
    tpp.clear_caches()
    assert blocked._transpose_nest.cache_info().currsize == 0
