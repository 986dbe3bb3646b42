"""ops.torch_attention: scaled_dot_product_attention and MultiheadAttention against torch's own
(forward and backward, masks of each kind, causal, GQA, scale, ranks, dropout, fallbacks,
errors), and the attention bench suite in its tiny mode. Small shapes: the file runs in well
under a minute on two cores."""
import contextlib
import importlib
import json
import math
import os

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import ops.torch_attention as ta                    # noqa: E402
from tpp.core.errors import TPPError, UnsupportedError   # noqa: E402


# ---------------------------------------------------------------- the operator
@pytest.fixture(scope="module")
def operator():
    """ops.attention, the fused operator the drop-ins call (spied on by some tests)."""
    return importlib.import_module("ops.flash_attention")


@contextlib.contextmanager
def spy(operator, name):
    """Record the keyword arguments of every call of operator.<name>."""
    calls, original = [], getattr(operator, name)

    def wrapper(*args, **kw):
        calls.append(kw)
        return original(*args, **kw)
    setattr(operator, name, wrapper)
    try:
        yield calls
    finally:
        setattr(operator, name, original)


# ---------------------------------------------------------------- helpers
TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _qkv(shape_q, shape_k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g).to(dtype)
    k = torch.randn(shape_k, generator=g).to(dtype)
    v = torch.randn(shape_k, generator=g).to(dtype)
    return q, k, v


def _both(fn_ours, fn_torch, inputs, dtype, grad=True, seed=1):
    """Forward of ours and of torch on copies of inputs, then (grad) the backward of a random
    dout; the torch side runs in f32 on the same (rounded) values."""
    g = torch.Generator().manual_seed(seed)
    ours = [t.clone().requires_grad_(grad) for t in inputs]
    ref = [t.float().clone().requires_grad_(grad) for t in inputs]
    out, want = fn_ours(*ours), fn_torch(*ref)
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.float(), want.detach(), **TOL[dtype])
    if grad:
        dout = torch.randn(want.shape, generator=g).to(dtype)
        out.backward(dout)
        want.backward(dout.float())
        for a, b in zip(ours, ref):
            assert a.grad.dtype == dtype
            torch.testing.assert_close(a.grad.float(), b.grad, **TOL[dtype])
    return out


def _masks(b, h, length, s, seed=3):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, h, length, s, generator=g) > 0.3
    keep[..., 0] = True                                   # no row entirely masked
    return {
        "none": None,
        "bool_2d": keep[0, 0],
        "bool_b1": keep[:, :1],
        "bool_full": keep,
        "float_full": torch.randn(b, h, length, s, generator=g),
        "float_row": torch.randn(1, 1, 1, s, generator=g),
        "float_neg_inf": torch.zeros(length, s).masked_fill(~keep[0, 0], -math.inf),
    }


# ---------------------------------------------------------------- scaled_dot_product_attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mask", list(_masks(1, 1, 1, 1)))
def test_sdpa_masks_forward_backward(dtype, mask, operator):
    b, h, length, s, e = 2, 2, 7, 9, 16
    q, k, v = _qkv((b, h, length, e), (b, h, s, e), dtype)
    m = _masks(b, h, length, s)[mask]
    with spy(operator, "attention_forward") as calls:
        _both(lambda *t: ta.scaled_dot_product_attention(*t, attn_mask=m),
              lambda *t: F.scaled_dot_product_attention(*t, attn_mask=m), (q, k, v), dtype)
    assert len(calls) == 1          # the fused operator ran (not torch's kernel)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_fully_masked_rows(kind):
    """A query row with no key taking part: torch (2.x, CPU) gives zeros and zero gradients."""
    q, k, v = _qkv((1, 2, 4, 16), (1, 2, 5, 16))
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[1] = False
    m = keep if kind == "bool" else torch.zeros(4, 5).masked_fill(~keep, -math.inf)
    out = _both(lambda *t: ta.scaled_dot_product_attention(*t, attn_mask=m),
                lambda *t: F.scaled_dot_product_attention(*t, attn_mask=m), (q, k, v),
                torch.float32)
    assert torch.all(out[:, :, 1] == 0)


@pytest.mark.parametrize("length, s", [(8, 8), (5, 11), (11, 5)])
def test_sdpa_causal_and_scale(length, s):
    """is_causal is torch's top-left triangle, also for L != S; scale replaces 1/sqrt(E)."""
    q, k, v = _qkv((2, 2, length, 16), (2, 2, s, 16))
    for scale in (None, 0.3):
        _both(lambda *t: ta.scaled_dot_product_attention(*t, is_causal=True, scale=scale),
              lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, scale=scale),
              (q, k, v), torch.float32)


def test_sdpa_gqa(operator):
    q, k, v = _qkv((2, 2, 5, 16), (2, 1, 7, 16))
    with spy(operator, "attention_forward") as calls:
        _both(lambda *t: ta.scaled_dot_product_attention(*t, enable_gqa=True),
              lambda *t: F.scaled_dot_product_attention(*t, enable_gqa=True), (q, k, v),
              torch.float32)
    assert len(calls) == 1
    # without the flag one kv head broadcasts (torch's matmul rule): torch's kernel serves it
    torch.testing.assert_close(ta.scaled_dot_product_attention(q, k, v),
                               F.scaled_dot_product_attention(q, k, v))
    q4, k2, v2 = _qkv((2, 4, 5, 16), (2, 2, 7, 16))
    with pytest.raises(RuntimeError):           # torch's error: heads differ without the flag
        ta.scaled_dot_product_attention(q4, k2, v2)
    with pytest.raises(RuntimeError):           # 2 heads are not a multiple of 4
        ta.scaled_dot_product_attention(k2, q4, q4, enable_gqa=True)


@pytest.mark.parametrize("shape_q, shape_k", [
    ((6, 16), (9, 16)),                     # 2-D: one head
    ((2, 6, 16), (2, 9, 16)),               # 3-D (N, L, E)
    ((2, 3, 2, 6, 16), (2, 3, 2, 9, 16)),   # 5-D: the leading dims folded into the batch
])
def test_sdpa_ranks(shape_q, shape_k):
    q, k, v = _qkv(shape_q, shape_k)
    m = torch.rand(shape_q[-2], shape_k[-2]) > 0.2
    m[:, 0] = True
    _both(lambda *t: ta.scaled_dot_product_attention(*t, attn_mask=m),
          lambda *t: F.scaled_dot_product_attention(*t, attn_mask=m), (q, k, v), torch.float32)


def test_sdpa_mask_broadcast_over_leading_dims():
    """A 5-D mask that varies over the first batch dim only is expanded to the folded batch."""
    q, k, v = _qkv((2, 3, 2, 5, 16), (2, 3, 2, 6, 16))
    m = torch.randn(2, 1, 1, 5, 6)
    _both(lambda *t: ta.scaled_dot_product_attention(*t, attn_mask=m),
          lambda *t: F.scaled_dot_product_attention(*t, attn_mask=m), (q, k, v), torch.float32)


def test_sdpa_only_needed_grads_and_no_grad(operator):
    q, k, v = _qkv((1, 2, 5, 16), (1, 2, 6, 16))
    q.requires_grad_()
    with spy(operator, "attention_backward") as calls:
        ta.scaled_dot_product_attention(q, k, v).sum().backward()
    assert [c["need"] for c in calls] == [(True, False, False)]
    assert q.grad is not None and k.grad is None
    with spy(operator, "attention") as calls, torch.no_grad():
        out = ta.scaled_dot_product_attention(q, k, v)
    assert len(calls) == 1 and not out.requires_grad
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v).detach(),
                               **TOL[torch.float32])


def test_sdpa_non_contiguous_inputs():
    q, k, v = _qkv((2, 5, 2, 16), (2, 6, 2, 16))
    _both(lambda *t: ta.scaled_dot_product_attention(*(x.transpose(1, 2) for x in t)),
          lambda *t: F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in t)),
          (q, k, v), torch.float32)


def test_sdpa_dropout_reproducible():
    q, k, v = _qkv((2, 2, 6, 16), (2, 2, 7, 16))
    torch.manual_seed(0)
    a = ta.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    b = ta.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    c = ta.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, c) and not torch.equal(a, b)
    assert not torch.allclose(a, ta.scaled_dot_product_attention(q, k, v))


def test_sdpa_dropout_statistics():
    """With value all ones every output is (sum of the kept probabilities) / (1 - p): mean 1
    over many rows, and each row's kept probabilities are a subset of the row's."""
    p, s = 0.5, 32
    q, k, _ = _qkv((16, 2, 64, 16), (16, 2, s, 16))
    v = torch.ones(16, 2, s, 16)
    torch.manual_seed(1)
    out = ta.scaled_dot_product_attention(q, k, v, dropout_p=p)[..., 0]
    assert out.min() >= 0 and out.max() <= 1 / (1 - p) + 1e-5
    # per row: variance of sum(P * keep) / (1-p) is p / (1-p) * sum(P^2) <= p / (1-p)
    assert abs(out.mean().item() - 1) < 4 * math.sqrt(p / (1 - p) / out.numel()) + 0.02


def test_sdpa_dropout_backward_uses_the_forward_mask():
    """value = identity makes the output the dropped probability matrix itself, which gives
    the mask; torch's math with that mask must give the same gradients as ours."""
    p, s = 0.5, 16
    q, k, _ = _qkv((1, 2, 5, s), (1, 2, s, s))
    v = torch.eye(s).expand(1, 2, s, s).contiguous()
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    out = ta.scaled_dot_product_attention(*ours, dropout_p=p)
    keep = (out.detach() != 0)
    assert 0 < keep.float().mean() < 1
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    probs = torch.softmax(ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(s), -1)
    want = (probs * keep / (1 - p)) @ ref[2]
    torch.testing.assert_close(out.detach(), want.detach(), **TOL[torch.float32])
    want.backward(dout)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, **TOL[torch.float32])


def test_sdpa_double_backward():
    q, k, v = _qkv((1, 2, 4, 16), (1, 2, 5, 16))
    m = torch.rand(4, 5) > 0.3
    m[:, 0] = True

    def grad_of_grad(fn):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins, attn_mask=m)
        gq, = torch.autograd.grad((out ** 2).sum(), ins[0], create_graph=True)
        return torch.autograd.grad(gq.sum(), ins)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):      # torch's CPU flash kernel has no double backward
        want = grad_of_grad(F.scaled_dot_product_attention)
    for a, b in zip(grad_of_grad(ta.scaled_dot_product_attention), want):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ta.scaled_dot_product_attention(*ins, dropout_p=0.5)
    with pytest.raises(UnsupportedError, match="dropout"):
        torch.autograd.grad(out.sum(), ins[0], create_graph=True)


def test_sdpa_fallbacks_are_torch(operator):
    """f64 and f16, Ev != E, broadcast batch dims, masks requiring grad: torch's kernel."""
    q, k, v = _qkv((2, 2, 5, 8), (2, 2, 6, 8), torch.float64)
    with spy(operator, "attention_forward") as calls, spy(operator, "attention") as calls2:
        torch.testing.assert_close(ta.scaled_dot_product_attention(q, k, v),
                                   F.scaled_dot_product_attention(q, k, v))
        h = [t.half() for t in (q, k, v)]
        torch.testing.assert_close(ta.scaled_dot_product_attention(*h),
                                   F.scaled_dot_product_attention(*h))
        f = [t.float() for t in (q, k, v)]
        v3 = torch.randn(2, 2, 6, 3)
        torch.testing.assert_close(ta.scaled_dot_product_attention(f[0], f[1], v3),
                                   F.scaled_dot_product_attention(f[0], f[1], v3))
        torch.testing.assert_close(ta.scaled_dot_product_attention(f[0], f[1][:1], f[2][:1]),
                                   F.scaled_dot_product_attention(f[0], f[1][:1], f[2][:1]))
        m = torch.randn(5, 6, requires_grad=True)
        m2 = m.detach().clone().requires_grad_()
        ta.scaled_dot_product_attention(*f, attn_mask=m).sum().backward()
        F.scaled_dot_product_attention(*f, attn_mask=m2).sum().backward()
        torch.testing.assert_close(m.grad, m2.grad)
    assert not calls and not calls2


def test_sdpa_saved_input_changed_in_place():
    q, k, v = _qkv((1, 2, 3, 16), (1, 2, 3, 16))
    q.requires_grad_()
    k2 = k.clone()
    out = ta.scaled_dot_product_attention(q, k2, v)
    k2.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("case", ["causal_with_mask", "heads", "mask_shape", "mask_dtype",
                                  "dtypes", "dropout", "rank1", "not_tensor"])
def test_sdpa_errors_are_torchs(case):
    """Bad calls raise what torch raises (same exception type); is_causal with a mask raises
    RuntimeError as torch documents (its CPU flash kernel accepts it)."""
    q, k, v = _qkv((2, 4, 5, 8), (2, 4, 6, 8))
    args, kw = {
        "causal_with_mask": ((q, k, v), dict(attn_mask=torch.ones(5, 6, dtype=torch.bool),
                                             is_causal=True)),
        "heads": ((q, k[:, :3], v[:, :3]), {}),
        "mask_shape": ((q, k, v), dict(attn_mask=torch.ones(5, 7))),
        "mask_dtype": ((q, k, v), dict(attn_mask=torch.ones(5, 6, dtype=torch.int32))),
        "dtypes": ((q, k.bfloat16(), v), {}),
        "dropout": ((q, k, v), dict(dropout_p=1.5)),
        "rank1": ((q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]), {}),
        "not_tensor": (([1.0], k, v), {}),
    }[case]
    with pytest.raises(Exception) as ours:
        ta.scaled_dot_product_attention(*args, **kw)
    if case == "causal_with_mask":
        assert ours.type is RuntimeError and "is_causal" in str(ours.value)
        return
    with pytest.raises(Exception) as theirs:
        F.scaled_dot_product_attention(*args, **kw)
    assert ours.type is theirs.type or issubclass(ours.type, TPPError)


# ---------------------------------------------------------------- MultiheadAttention
E, H = 32, 2          # head dim 16, as the SDPA tests: fewer nests to compile


def _pair(seed=0, **kw):
    """(ours, torch's) with the same parameters (ours loaded from torch's state dict)."""
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(E, H, **kw)
    ours = ta.MultiheadAttention(E, H, **kw)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def test_mha_state_dict_both_ways():
    torch.manual_seed(0)
    ours = ta.MultiheadAttention(E, H, batch_first=True)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True)
    assert isinstance(ours, torch.nn.MultiheadAttention)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())
    for (n, a), (m, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert n == m and torch.equal(a, b)
    torch.manual_seed(3)       # torch's initialisation, same random stream
    a = ta.MultiheadAttention(E, H)
    torch.manual_seed(3)
    b = torch.nn.MultiheadAttention(E, H)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                   b.state_dict().values()))


def _inputs(kind, batch_first, n=3, length=5, s=7, seed=0):
    g = torch.Generator().manual_seed(seed)

    def x(rows):
        return torch.randn((n, rows, E) if batch_first else (rows, n, E), generator=g)
    q = x(length)
    if kind == "self":
        return q, q, q, length
    kv = x(s)
    if kind == "kv":
        return q, kv, kv, s
    return q, kv, x(s), s


def _mha_masks(kind, n, length, s, seed=4):
    g = torch.Generator().manual_seed(seed)
    pad = torch.zeros(n, s, dtype=torch.bool)
    pad[0, -2:] = True
    pad[1, -1] = True
    blocked = torch.rand(length, s, generator=g) > 0.7
    blocked[:, 0] = False
    blocked3 = torch.rand(n * H, length, s, generator=g) > 0.7
    blocked3[..., 0] = False
    fl = torch.zeros(length, s).masked_fill(blocked, -math.inf)
    causal = torch.ones(length, s, dtype=torch.bool).triu(1)
    return {
        "none": {},
        "kpm_bool": dict(key_padding_mask=pad),
        "kpm_float": dict(key_padding_mask=torch.zeros(n, s).masked_fill(pad, -1e9)),
        "attn_bool_2d": dict(attn_mask=blocked),
        "attn_bool_3d": dict(attn_mask=blocked3),
        "attn_float_2d": dict(attn_mask=fl + torch.randn(length, s, generator=g)),
        "attn_float_3d": dict(attn_mask=torch.randn(n * H, length, s, generator=g)),
        "both_bool": dict(attn_mask=blocked, key_padding_mask=pad),
        "both_float": dict(attn_mask=fl, key_padding_mask=torch.zeros(n, s).masked_fill(
            pad, -math.inf)),
        "causal": dict(attn_mask=causal, is_causal=True),
        "causal_kpm": dict(attn_mask=causal, is_causal=True, key_padding_mask=pad),
    }[kind]


def _mha_compare(ours, theirs, args, kw, grad=True):
    """Output and gradients (inputs and parameters) of ours == torch's, need_weights=False."""
    q_ours = [a.clone().requires_grad_(grad) for a in args]
    q_ref = [a.clone().requires_grad_(grad) for a in args]
    # keep "query is key is value" as given
    for i in range(3):
        for j in range(i):
            if args[i] is args[j]:
                q_ours[i], q_ref[i] = q_ours[j], q_ref[j]
    out, w = ours(*q_ours, need_weights=False, **kw)
    want, _ = theirs(*q_ref, need_weights=False, **kw)
    assert w is None
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    if not grad:
        return out
    dout = torch.randn_like(want)
    out.backward(dout)
    want.backward(dout)
    for a, b in zip(q_ours, q_ref):
        torch.testing.assert_close(a.grad, b.grad, **TOL[torch.float32])
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, **TOL[torch.float32], msg=name)
    return out


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("kind", ["self", "kv", "cross"])
def test_mha_projections_and_layouts(batch_first, kind, operator):
    ours, theirs = _pair(batch_first=batch_first)
    q, k, v, _ = _inputs(kind, batch_first)
    with spy(operator, "attention_forward") as calls:
        out = _mha_compare(ours, theirs, (q, k, v), {})
    assert len(calls) == 1 and out.is_contiguous()


@pytest.mark.parametrize("kind", ["self", "kv", "cross"])
def test_mha_packed_weights_follow_the_parameters(kind):
    """The projections' packed weights (kept by the module) are rebuilt when an optimizer
    step or an in-place write changes a parameter, and never pickled or deep-copied."""
    import copy
    import io
    ours, theirs = _pair(batch_first=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    q, k, v, _ = _inputs(kind, True)
    for _ in range(3):
        outs = [m(q, k, v, need_weights=False)[0] for m in (ours, theirs)]
        torch.testing.assert_close(outs[0], outs[1], **TOL[torch.float32])
        for out, opt in zip(outs, opts):
            opt.zero_grad()
            (out ** 2).mean().backward()
            opt.step()
    assert ours.__dict__["_tpp_packed"]
    with torch.no_grad():
        for m in (ours, theirs):
            m.in_proj_weight.mul_(-0.5)
            m.out_proj.weight.add_(0.25)
        torch.testing.assert_close(ours(q, k, v, need_weights=False)[0],
                                   theirs(q, k, v, need_weights=False)[0], **TOL[torch.float32])
    clone = copy.deepcopy(ours)
    assert "_tpp_packed" not in clone.__dict__
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    with torch.no_grad():
        for m in (clone, back):
            torch.testing.assert_close(m(q, k, v, need_weights=False)[0],
                                       theirs(q, k, v, need_weights=False)[0],
                                       **TOL[torch.float32])


@pytest.mark.parametrize("masks", ["kpm_bool", "kpm_float", "attn_bool_2d", "attn_bool_3d",
                                   "attn_float_2d", "attn_float_3d", "both_bool", "both_float",
                                   "causal", "causal_kpm"])
def test_mha_masks(masks, operator):
    ours, theirs = _pair(batch_first=True)
    q, k, v, s = _inputs("kv", True)
    kw = _mha_masks(masks, 3, q.shape[1], s)
    with spy(operator, "attention_forward") as calls:
        _mha_compare(ours, theirs, (q, k, v), kw)
    assert len(calls) == 1
    if masks == "causal":
        assert calls[0]["causal"] and calls[0]["mask"] is None


def test_mha_eval_and_unbatched():
    ours, theirs = _pair(batch_first=False)
    ours.eval(), theirs.eval()
    q, k, v, s = _inputs("cross", False)
    with torch.no_grad():       # torch takes its native fast path here
        _mha_compare(ours, theirs, (q, k, v), _mha_masks("kpm_bool", 3, 5, s), grad=False)
    x = torch.randn(5, E)
    pad = torch.zeros(5, dtype=torch.bool)
    pad[-1] = True
    _mha_compare(ours, theirs, (x, x, x), dict(key_padding_mask=pad))


def test_mha_bias_false_and_bf16():
    ours, theirs = _pair(batch_first=True, bias=False)
    q, k, v, _ = _inputs("self", True)
    _mha_compare(ours, theirs, (q, k, v), {})
    ours, theirs = _pair(batch_first=True, dtype=torch.bfloat16)
    x = torch.randn(2, 6, E).bfloat16()
    out, _ = ours(x, x, x, need_weights=False)
    want, _ = theirs(x, x, x, need_weights=False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=5e-2, atol=5e-2)


def test_mha_need_weights_is_torchs_forward(operator):
    ours, theirs = _pair(batch_first=True)
    q, k, v, s = _inputs("kv", True)
    pad = _mha_masks("kpm_bool", 3, 5, s)["key_padding_mask"]
    with spy(operator, "attention_forward") as calls:
        for avg in (True, False):
            a = ours(q, k, v, key_padding_mask=pad, average_attn_weights=avg)
            b = theirs(q, k, v, key_padding_mask=pad, average_attn_weights=avg)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not calls


@pytest.mark.parametrize("kw", [dict(kdim=8, vdim=12), dict(add_bias_kv=True),
                                dict(add_zero_attn=True)], ids=["kdim", "bias_kv", "zero_attn"])
def test_mha_unhandled_configurations_are_torchs(kw, operator):
    ours, theirs = _pair(batch_first=True, **kw)
    q = torch.randn(2, 5, E)
    k = torch.randn(2, 6, kw.get("kdim", E))
    v = torch.randn(2, 6, kw.get("vdim", E))
    with spy(operator, "attention_forward") as calls:
        a, _ = ours(q, k, v, need_weights=False)
    b, _ = theirs(q, k, v, need_weights=False)
    assert torch.equal(a, b) and not calls


def test_mha_dropout_training():
    """module.dropout drops inside the fused path in training mode only: reproducible under
    torch.manual_seed, different from call to call, unbiased (the mean of many calls tends to
    the eval output), and the parameter gradients follow the same masks."""
    ours, _ = _pair(batch_first=True, dropout=0.5)
    x = torch.randn(2, 6, E)
    ours.eval()
    with torch.no_grad():
        base, _ = ours(x, x, x, need_weights=False)
        ours.train()
        torch.manual_seed(0)
        a, _ = ours(x, x, x, need_weights=False)
        b, _ = ours(x, x, x, need_weights=False)
        torch.manual_seed(0)
        c, _ = ours(x, x, x, need_weights=False)
        assert torch.equal(a, c) and not torch.equal(a, b)
        assert not torch.allclose(a, base)
        mean = sum(ours(x, x, x, need_weights=False)[0] for _ in range(400)) / 400
    spread = (a - base).abs().mean().item()
    assert (mean - base).abs().mean().item() < spread / 5
    grads = []
    for _ in range(2):
        ours.zero_grad()
        torch.manual_seed(5)
        ours(x, x, x, need_weights=False)[0].square().sum().backward()
        grads.append([p.grad.clone() for p in ours.parameters()])
    assert all(torch.equal(g, h) for g, h in zip(*grads))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads[0])


@pytest.mark.parametrize("case", ["causal_without_mask", "kpm_shape", "attn_shape", "rank"])
def test_mha_errors_are_torchs(case):
    ours, theirs = _pair(batch_first=True)
    q, k, v, s = _inputs("kv", True)
    kw = {"causal_without_mask": dict(is_causal=True),
          "kpm_shape": dict(key_padding_mask=torch.zeros(3, s + 1, dtype=torch.bool)),
          "attn_shape": dict(attn_mask=torch.zeros(4, s, dtype=torch.bool)),
          "rank": {}}[case]
    if case == "rank":
        q = q[None]
    with pytest.raises(Exception) as mine:
        ours(q, k, v, need_weights=False, **kw)
    with pytest.raises(Exception) as torchs:
        theirs(q, k, v, need_weights=False, **kw)
    assert mine.type is torchs.type


# ---------------------------------------------------------------- the bench suite
def test_bench_attention_suite_tiny(tmp_path, capsys, monkeypatch):
    """tpp-bench attention --tiny: every case for tpp and torch, verified, with ratios and
    peak fractions in the records (no speed asserted: a shared machine's figures)."""
    from bench import cli
    from bench.records import SCHEMA
    import tpp
    for var in cli.THREAD_ENV:       # main() pins threads: put the variables back afterwards
        monkeypatch.setenv(var, os.environ.get(var, ""))
        if not os.environ[var]:
            monkeypatch.delenv(var)
    threads = torch.get_num_threads()
    path = tmp_path / "attention.json"
    try:
        rc = cli.main(["attention", "--tiny", "-q", "--plain", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
        tpp.set_num_threads(None)
    assert rc == 0
    assert "attention" in capsys.readouterr().out
    records = json.loads(path.read_text())
    for r in records:
        assert set(r) == set(SCHEMA)
    att = [r for r in records if r["suite"] == "attention"]
    got = {(r["case"], r["dtype"], r["provider"]) for r in att}
    for case in ("fwd f32", "fwd+bwd f32", "causal fwd f32", "causal fwd+bwd f32"):
        assert (case, "f32", "tpp") in got and (case, "f32", "torch") in got, case
    assert ("fwd+bwd bf16", "bf16", "tpp") in got
    for r in att:
        assert r["metric"] == "compute" and r["unit"] == "GFLOP/s" and r["median"] > 0
        assert r["extra"]["threads"] == 2 and r["peak_fraction"] is not None
        assert len(r["shape"]) == 4 and r["extra"]["flops_per_call"] > 0
        if r["provider"] == "tpp":
            assert set(r["ratios"]) == {"torch"} and r["extra"]["verified"] is True, r
            if r["case"].startswith("causal"):
                assert r["extra"]["vs_noncausal"] > 0
            if r["dtype"] == "bf16":
                assert r["extra"]["vs_f32"] > 0
