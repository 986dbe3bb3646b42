"""Bias + dropout + residual (+ LayerNorm) fused into one equation, forward and backward: the
tail of a transformer block (`norm(residual + dropout(x + bias))`, and the pre-norm variant
that keeps the sum and normalises it for the next block).

    y, h, mean, rstd, keep = residual_layer_norm(x, bias, residual, weight, ln_bias,
                                                 eps=1e-5, p=0.1, seed=7)
    dx, dbias, dres, dweight, dln_bias = residual_layer_norm_backward(
        dy, dh, h, mean, rstd, weight, keep, p=0.1, ln_bias=True, bias=True)
    h, keep = bias_dropout_residual(x, bias, residual, p=0.1, seed=7)   # no norm

With z = x + bias, d = dropout(z, p) (d = z when p == 0) and h = residual + d:
residual_layer_norm gives y = layer_norm(h) * weight + ln_bias over the last axis, and h
itself, the f32 per-row mean and rstd of h and the keep bitmask (None when p == 0) that the
backward reads (want_h=False, stats=False: y alone, for inference). The backward takes the
cotangent dy of y and optionally dh of h (h is also a block output in a pre-norm
transformer); dres = dh + layer_norm's dx (the residual's gradient), dx = dropout's backward
of dres, dbias and the norm's dweight / dln_bias the column sums. bias_dropout_residual is h
alone (its backward is ops.norms.bias_act_dropout_backward with activation None, plus
dres = dh).

Same data conventions and nests as ops.norms (whose machinery this module reuses: its
builders register under their own kinds in ops.norms' nest table): numpy arrays or torch CPU
tensors (or device arrays: ops.norms' device path) of shape (..., n), f32 or bf16 (f32
arithmetic and statistics); bias, weight and ln_bias (n,) of one dtype; dropout from the op
table's counter-based stream with ops.norms' per-block seeds, so results depend on (seed, M,
n) only, never on the threads.

The backward equations are tpp.core.autodiff.grad of the forward graph (the draw of dropout
replaced by the saved bitmask, the sum h, mean and rstd by their saved values), in ops.norms'
two-equation form per block: the row-wise one (dres and dx: per-row reductions) and the
axis-0 one (the partial rows of dweight, dln_bias and dbias).
"""
from __future__ import annotations

import numpy as np

import tpp
from tpp.core import expr as X
from tpp.core import optable
from tpp.core.errors import ArgumentError
from tpp.core.spec import mask_bytes

from . import _host
from . import norm_graphs as _graphs
from . import norm_plans as _plans
from . import norms as _n

__all__ = ["residual_layer_norm", "residual_layer_norm_backward", "bias_dropout_residual"]


# ---------------------------------------------------------------- the equations
def _graph(eq, dt, wdt, has_bias, has_w, has_b, p, saved_keep, norm=True):
    """The forward graph on eq: (nodes by name). saved_keep: dropout reads the bitmask input
    "keep" (the backward's form) instead of drawing."""
    x = eq.input("x", dtype=dt)
    bias = eq.input("bias", dtype=wdt, bcast="row") if has_bias else None
    res = eq.input("residual", dtype=dt)
    z = x + bias if has_bias else x
    keep = None
    if p > 0:
        if saved_keep:
            d = X.select(eq.mask("keep"), z * float(optable.dropout_scale(p)), 0.0)
        else:
            d, keep = eq.op("dropout", z, p=p)
    else:
        d = z
    h = res + d
    out = {"x": x, "bias": bias, "residual": res, "h": h, "keep": keep}
    if not norm:
        return out
    w = eq.input("weight", dtype=wdt, bcast="row") if has_w else None
    b = eq.input("ln_bias", dtype=wdt, bcast="row") if has_b else None
    eps = eq.param("eps")
    mu = eq.mean(h, 1)
    hc = h - mu
    s = eq.sqrt(eq.mean(hc * hc, 1) + eps)
    rstd = 1.0 / s
    y = _graphs.normalized(eq, h, hc, mu, rstd)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    out.update(weight=w, ln_bias=b, mu=mu, s=s, rstd=rstd, y=y)
    return out


def _forward(rows, n, dt, wdt, has_bias, has_w, has_b, p, want_h, stats):
    eq = tpp.equation(rows, n)
    g = _graph(eq, dt, wdt, has_bias, has_w, has_b, p, False)
    outs = {"y": g["y"]}
    dtypes = {"y": dt}
    if want_h:
        outs["h"] = g["h"]
        dtypes["h"] = dt
    if stats:
        outs.update(mean=g["mu"], rstd=g["rstd"])
    if g["keep"] is not None:
        outs["keep"] = g["keep"]
    return (eq.spec(dtypes=dtypes, **outs),)


def _forward_plain(rows, n, dt, wdt, has_bias, p):
    eq = tpp.equation(rows, n)
    g = _graph(eq, dt, wdt, has_bias, False, False, p, False, norm=False)
    outs = {"h": g["h"]}
    if g["keep"] is not None:
        outs["keep"] = g["keep"]
    return (eq.spec(dtypes={"h": dt}, **outs),)


def _backward(rows, n, dt, wdt, has_bias, has_w, has_b, p, has_dh, need):
    """need = (dx, dbias, dres, dweight, dln_bias). One equation: dres (and, with dropout,
    dx) row by row (tpp_cpu's rowwise schedule: each row in L1 across its two passes), the
    column sums dweight, dln_bias and dbias (the column sum of dx) folded into that pass.
    dres is written whenever dres or dx is wanted (dx is dres when p == 0)."""
    scratch = tpp.equation(rows, n)
    g = _graph(scratch, dt, wdt, has_bias, has_w, has_b, p, True)
    dy = X.input("dy")
    outputs, cots = [g["y"]], [dy]
    if has_dh:
        outputs.append(g["h"])
        cots.append(X.input("dh"))
    wrt_names = [nm for nm in ("residual", "x", "weight", "ln_bias") if g[nm] is not None]
    grads = _n._grad(outputs, [g[nm] for nm in wrt_names], cots)
    grads = _graphs._zero_sums(grads, [g["h"] - g["mu"]])      # sum(h - mean(h)) = 0
    mean, rstd = X.input("mean", "col"), X.input("rstd", "col")
    grads = _n._lean(_n._saved(grads, {g["mu"]: mean, g["rstd"]: rstd, g["s"]: 1.0 / rstd,
                                       g["h"]: X.input("h")}))
    named = dict(zip(wrt_names, grads))
    want_dx, want_dbias, want_dres, want_dw, want_db = need
    outs, dtypes = {}, {}
    if want_dres or want_dx:
        outs["dres"] = named["residual"]
    if p > 0 and want_dx:
        outs["dx"] = named["x"]
    dtypes = {k: dt for k in outs}
    if has_w and want_dw:
        outs["dweight"] = named["weight"]
    if has_b and want_db:
        outs["ln_bias_grad"] = named["ln_bias"]
    if has_bias and want_dbias:
        outs["dbias"] = X.reduce("rsum", named["x"] if p > 0 else named["residual"], 0)
    eq = tpp.equation(rows, n)
    for name in ["dy", "h"] + (["dh"] if has_dh else []):
        eq.input(name, dtype=dt)
    eq.input("mean", bcast="col")
    eq.input("rstd", bcast="col")
    if has_w:
        eq.input("weight", dtype=wdt, bcast="row")
    if p > 0:
        eq.mask("keep")
    if "ln_bias_grad" in outs:
        outs["dln_bias"] = outs.pop("ln_bias_grad")
    return (eq.spec(dtypes=dtypes or None, **outs),)


_KINDS = {"rln_fwd": _forward, "rln_bwd": _backward, "bdr_fwd": _forward_plain}
for _kind, _build in _KINDS.items():
    _n._BUILDERS.setdefault(_kind, _build)


# ---------------------------------------------------------------- argument handling
def _seed(seed):
    if seed is None:
        seed = int(np.random.randint(0, 2 ** 62, dtype=np.int64))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ArgumentError(f"seed must be an int, got {seed!r}")
    return int(seed) & ((1 << 64) - 1)


def _inputs(x, bias, residual):
    x2, lead, dt = _n._rows(x, "x")
    m, n = x2.shape
    res = _n._same_rows(residual, x, m, n, "residual", dt)
    bias = _n._vector(bias, n, "bias")
    return x2, lead, dt, m, n, res, bias


def residual_layer_norm(x, bias, residual, weight=None, ln_bias=None, eps=1e-5, p=0.0,
                        seed=None, *, want_h=True, stats=True, **unknown):
    """(y, h, mean, rstd, keep): y = layer_norm(residual + dropout(x + bias, p)) * weight +
    ln_bias; h the normalised sum (None unless want_h), mean and rstd f32 of x's leading shape
    (None unless stats), keep the dropout bitmask (None when p == 0). bias, weight, ln_bias
    may be None; seed: an int (None: a random one from numpy's global stream)."""
    _host.reject_unknown(residual_layer_norm, unknown)
    # without dropout, a call of a signature a checked call served runs that call's nest
    # (ops.norm_plans; 1 x 384 f32 torch tensors: 25.9 -> 19.7 us a call)
    plan = _plans.signature("rln_fwd", x, (bias, residual, weight, ln_bias),
                            (eps, p, want_h, stats)) if p == 0 else None
    r = _n._planned(plan, x, {"x": x, "residual": residual, "bias": bias, "weight": weight,
                              "ln_bias": ln_bias})
    if r is not None:
        return _forward_results(r, x.shape[:-1], x.shape[-1], want_h, stats)
    x2, lead, dt, m, n, res, bias = _inputs(x, bias, residual)
    weight, ln_bias = _n._vector(weight, n, "weight"), _n._vector(ln_bias, n, "ln_bias")
    wdt = _n._param_dtype(weight, ln_bias, dt)
    if bias is not None and _n._param_dtype(None, bias, dt) != wdt and \
            (weight is not None or ln_bias is not None):
        raise ArgumentError("bias, weight and ln_bias must have one dtype")
    if bias is not None and weight is None and ln_bias is None:
        wdt = _n._param_dtype(None, bias, dt)
    p = _n._probability(p)
    arrays = {"x": x2, "residual": res, "eps": _n._scalar(_n._eps(eps))}
    for name, v in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        if v is not None:
            arrays[name] = v
    options = (dt, wdt, bias is not None, weight is not None, ln_bias is not None, p,
               bool(want_h), bool(stats))
    r = _n._run("rln_fwd", n, options, arrays, {}, x2, m,
                seed=_seed(seed) if p > 0 else None, plan=plan)
    return _forward_results(r, lead, n, want_h, stats)


def _forward_results(r, lead, n, want_h, stats):
    """residual_layer_norm's tuple from the nest's results (blocks (m, n), columns (m,))."""
    keep = r.get("keep")
    return (r["y"].reshape(*lead, n),
            r["h"].reshape(*lead, n) if want_h else None,
            r["mean"].reshape(lead) if stats else None,
            r["rstd"].reshape(lead) if stats else None,
            None if keep is None else keep.reshape(*lead, keep.shape[-1]))


def residual_layer_norm_backward(dy, dh, h, mean, rstd, weight=None, keep=None, p=0.0, *,
                                 bias=True, ln_bias=True, need=(True,) * 5, **unknown):
    """(dx, dbias, dres, dweight, dln_bias) of residual_layer_norm: dy the cotangent of y, dh
    that of h (None: h was used only through y); h, mean, rstd, keep the forward's outputs,
    weight its weight (None: it had none), bias / ln_bias whether it had them. dx is dres
    (the same array) when p == 0. Entries are None where need says so or the parameter was
    absent."""
    _host.reject_unknown(residual_layer_norm_backward, unknown)
    h2, lead, dt = _n._rows(h, "h")
    m, n = h2.shape
    need = _n._need(need, 5)
    p = _n._probability(p)
    weight = _n._vector(weight, n, "weight")
    wdt = _n._param_dtype(weight, None, dt)
    has_bias, has_w, has_b = bool(bias), weight is not None, bool(ln_bias)
    need = (need[0], need[1] and has_bias, need[2], need[3] and has_w, need[4] and has_b)
    if not any(need):
        return (None,) * 5
    arrays = {"h": h2, "dy": _n._same_rows(dy, h, m, n, "dy", dt),
              "mean": _n._stats(mean, lead, m, "mean"), "rstd": _n._stats(rstd, lead, m, "rstd"),
              "eps": _n._scalar(0.0)}
    if dh is not None:
        arrays["dh"] = _n._same_rows(dh, h, m, n, "dh", dt)
    if has_w:
        arrays["weight"] = weight
    if p > 0:
        arrays["keep"] = _keep(keep, lead, m, n)
    if need[1] or need[3] or need[4]:
        _n._grad_cols(n, "residual_layer_norm_backward")
    options = (dt, wdt, has_bias, has_w, has_b, p, dh is not None, need)
    r = _n._run("rln_bwd", n, options, arrays, {"dweight": wdt, "dln_bias": wdt, "dbias": wdt},
                h2, m)
    dres = r.get("dres")
    dx = r.get("dx", dres)
    shape = (*lead, n)
    return (dx.reshape(shape) if need[0] and dx is not None else None, r.get("dbias"),
            dres.reshape(shape) if need[2] and dres is not None else None,
            r.get("dweight"), r.get("dln_bias"))


def _keep(keep, lead, m, n):
    if keep is None:
        raise ArgumentError("keep: p > 0 needs the forward's keep bitmask")
    keep = _host.host(keep, "keep", device=True)
    if tuple(keep.shape) != (*lead, mask_bytes(n)) or \
            str(keep.dtype).split(".")[-1] != "uint8":
        raise ArgumentError(f"keep: expected a uint8 bitmask of shape {(*lead, mask_bytes(n))}"
                            f", got {keep.dtype} {tuple(keep.shape)}")
    return _host.contiguous(keep).reshape(m, mask_bytes(n))


def bias_dropout_residual(x, bias, residual, p=0.0, seed=None, **unknown):
    """(h, keep): h = residual + dropout(x + bias, p); keep the bitmask (None when p == 0).
    Backward: dres = dh; (dx, dbias) = ops.norms.bias_act_dropout_backward(dh, x, bias, keep,
    None, p)."""
    _host.reject_unknown(bias_dropout_residual, unknown)
    x2, lead, dt, m, n, res, bias = _inputs(x, bias, residual)
    bdt = _n._param_dtype(None, bias, dt)
    p = _n._probability(p)
    arrays = {"x": x2, "residual": res}
    if bias is not None:
        arrays["bias"] = bias
    r = _n._run("bdr_fwd", n, (dt, bdt, bias is not None, p), arrays, {}, x2, m,
                seed=_seed(seed) if p > 0 else None)
    keep = r.get("keep")
    return (r["h"].reshape(*lead, n),
            None if keep is None else keep.reshape(*lead, keep.shape[-1]))
