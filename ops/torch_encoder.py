"""torch.nn.TransformerEncoderLayer on the TPP operators, with its fusions.

    import ops.torch
    layer = ops.torch.TransformerEncoderLayer(768, 12, 3072, dropout=0.1, activation="gelu",
                                              batch_first=True)
    y = layer(x, src_mask=None, src_key_padding_mask=pad, is_causal=False)

TransformerEncoderLayer subclasses torch.nn.TransformerEncoderLayer: constructor, children
(self_attn, linear1, linear2, norm1, norm2, dropout, dropout1, dropout2), parameters,
initialisation and state_dict keys are torch's own (state dicts load both ways), and forward
has torch's signature and semantics. The fused forward (post-norm, norm_first=False):

    qkv = linear(x, in_proj_weight, in_proj_bias)        one GEMM for q, k and v
    a   = attention(q, k, v, mask, self_attn.dropout)     ops.torch.scaled_dot_product_attention
    z   = linear(a, out_proj.weight)                      GEMM, no bias
    x1  = norm1(x + dropout1(z + out_proj.bias))          ONE equation (ops.residual_norm)
    f   = act(linear(x1, linear1.weight, linear1.bias))   bias + relu/gelu in the GEMM epilogue
                                                          (training with dropout.p > 0: the
                                                          GEMM, then bias + act + dropout as
                                                          one equation, ops.bias_act_dropout)
    z2  = linear(f, linear2.weight)                       GEMM, no bias
    out = norm2(x1 + dropout2(z2 + linear2.bias))         ONE equation

and with norm_first=True: a = attention(norm1(x)); (h, n2) = (x + dropout1(z + b), norm2(h))
from one equation (it writes the sum and its norm); out = h + dropout2(z2 + b2), one
equation. Autograd: every piece is a torch.autograd.Function whose backward computes only
the gradients asked for (the residual-norm backward is tpp.grad of its forward equation: the
residual's gradient, the GEMM output's through dropout, the biases' and the norm's column
sums from one pass over the rows); q, k and v leave the QKV rows as contiguous head-major
copies and their gradients go back into one (rows, 3 * d_model) tensor. A backward with
create_graph=True recomputes the fused pieces in torch ops (differentiable again).

Masks have torch's semantics: src_mask (L, S) or (N * nhead, L, S) and src_key_padding_mask
(N, S), bool (True: masked out) or float (added); as torch does, both are made float masks
of src's dtype first (F._canonical_mask), and is_causal=True with a src_mask and no
key_padding_mask runs the causal kernel instead of the mask. Dropout draws from torch's
default CPU generator (a seed per fused call), so torch.manual_seed makes a training step
reproducible; the masks are the TPP operators' own, not torch's.

Served by torch's own forward instead (its results, autograd and errors): tensors not on the
CPU, dtypes other than float32 / bfloat16 (src and every parameter of one dtype), nested
tensors, tensor subclasses and __torch_function__ modes, src of other than 2 or 3 dims,
an activation other than relu / gelu (F.relu, F.gelu, torch.relu, nn.ReLU, nn.GELU with
approximate="none"; a callable of your own runs torch's forward), children that are not the
types torch builds (or their ops.torch drop-ins) or that carry forward hooks or
pre-hooks, self_attn with kdim/vdim, add_bias_kv or add_zero_attn, norms other than
LayerNorm over (d_model,), dropout probabilities >= 1 in training, autocast, masks that
_mha_mask of ops.torch_attention does not take (masks requiring grad, other shapes), and
is_causal=True without a src_mask (torch raises). In eval mode under torch.no_grad() torch's
own forward would take its fast path (torch._transformer_encoder_layer_fwd); this one runs
the fused TPP path instead, with the same results up to rounding.
"""
from __future__ import annotations

import torch

import ops as _ops
from ops import _host
from ops._host import wants_grad as _wants_grad
from ops import norms as _norms
from ops import residual_norm as _rn
from ops import torch_attention as _ta
from ops import replay

__all__ = ["TransformerEncoderLayer", "ResidualNormFunction", "BiasDropoutResidualFunction",
           "BiasActDropoutFunction"]

F = torch.nn.functional
_DTYPES = (torch.float32, torch.bfloat16)
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _d(t):
    return None if t is None else t.detach()


def _plain(t):
    return t.detach() if t._is_view() else t


def _seed(p):
    return _ta._draw_seed() if p > 0.0 else None


def _keep_bool(keep, n):
    """The (…, ceil(n/8)) uint8 keep bitmask as a bool tensor (…, n)."""
    bits = (keep.unsqueeze(-1) >> _SHIFTS) & 1
    return bits.reshape(*keep.shape[:-1], -1)[..., :n].bool()


def _torch_dropout(z, keep, p):
    """dropout(z) with the saved mask, in torch ops (differentiable)."""
    if p == 0.0:
        return z
    return torch.where(_keep_bool(keep, z.shape[-1]), z * (1.0 / (1.0 - p)), 0.0)


def _torch_grads(fn, inputs, need, cotangents):
    """Gradients of fn(*inputs) for need, as torch ops autograd records (create_graph)."""
    wanted = [t for t, n in zip(inputs, need) if n and t is not None]
    outs, cots = [], []
    with torch.enable_grad():
        for o, c in zip(fn(*inputs), cotangents):
            if c is not None:
                outs.append(o)
                cots.append(c)
        grads = iter(torch.autograd.grad(outs, wanted, cots, create_graph=True,
                                         allow_unused=True))
    out = []
    for t, n in zip(inputs, need):
        g = next(grads) if n and t is not None else None
        out.append(torch.zeros_like(t) if g is None and n and t is not None else g)
    return tuple(out)


# ---------------------------------------------------------------- autograd Functions
class ResidualNormFunction(torch.autograd.Function):
    """(y, h) with h = residual + dropout(x + bias, p), y = layer_norm(h, weight, ln_bias,
    eps) over the last dim: ResidualNormFunction.apply(x, bias, residual, weight, ln_bias,
    eps, p, seed); x and residual (M, n) contiguous, one dtype; bias / weight / ln_bias (n,)
    or None; seed an int when p > 0."""

    @staticmethod
    def forward(ctx, x, bias, residual, weight, ln_bias, eps, p, seed):
        y, h, mean, rstd, keep = _rn.residual_layer_norm(
            x.detach(), _d(bias), residual.detach(), _d(weight), _d(ln_bias), eps, p, seed)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(weight, h, mean, rstd, keep)
        ctx.options = (eps, p, bias is not None, ln_bias is not None)
        ctx.inputs = (x, bias, residual, ln_bias)      # (create_graph only)
        return _plain(y), _plain(h)

    @staticmethod
    def backward(ctx, dy, dh):
        weight, h, mean, rstd, keep = ctx.saved_tensors
        eps, p, has_bias, has_lnb = ctx.options
        need = ctx.needs_input_grad[:5]
        none = (None,) * 3
        if dy is None and dh is None:
            return (None,) * 5 + none
        if torch.is_grad_enabled():                 # create_graph=True
            x, bias, residual, ln_bias = ctx.inputs

            def fn(x, bias, residual, weight, ln_bias):
                hh = residual + _torch_dropout(x if bias is None else x + bias, keep, p)
                return F.layer_norm(hh, hh.shape[-1:], weight, ln_bias, eps), hh
            return (*_torch_grads(fn, (x, bias, residual, weight, ln_bias), need,
                                  (dy, dh)), *none)
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dbias, dres, dw, dlb = _rn.residual_layer_norm_backward(
            dy.contiguous(), None if dh is None else dh.contiguous(), h, mean, rstd,
            _d(weight), keep, p, bias=has_bias, ln_bias=has_lnb,
            need=(need[0], need[1], need[2], need[3], need[4]))
        if dx is not None and dx is dres:
            dx = dx.clone() if need[2] else dx    # two inputs, two gradient tensors
        return dx, dbias, dres, dw, dlb, *none


class BiasDropoutResidualFunction(torch.autograd.Function):
    """h = residual + dropout(x + bias, p): BiasDropoutResidualFunction.apply(x, bias,
    residual, p, seed); x and residual (M, n) contiguous, bias (n,) or None."""

    @staticmethod
    def forward(ctx, x, bias, residual, p, seed):
        h, keep = _rn.bias_dropout_residual(x.detach(), _d(bias), residual.detach(), p, seed)
        ctx.save_for_backward(x, bias, keep)
        ctx.p = p
        return _plain(h)

    @staticmethod
    def backward(ctx, dh):
        x, bias, keep = ctx.saved_tensors
        p = ctx.p
        need_x, need_b, need_r = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():
            residual = torch.zeros((), dtype=x.dtype)   # unused: dres = dh

            def fn(x, bias, _r):
                return (_torch_dropout(x if bias is None else x + bias, keep, p),)
            dx, db, _ = _torch_grads(fn, (x, bias, residual), (need_x, need_b, False), (dh,))
            return dx, db, dh if need_r else None, None, None
        dh = dh.contiguous()
        dx = db = None
        if need_x or need_b:
            if p > 0.0:
                dx, db = _norms.bias_act_dropout_backward(
                    dh, x.detach(), _d(bias), keep, None, p, need=(need_x, need_b))
            else:
                dx = dh.clone() if need_x and need_r else (dh if need_x else None)
                db = dh.sum(0, dtype=torch.float32).to(dh.dtype) if need_b and \
                    bias is not None else None
        return dx, db, dh if need_r else None, None, None


class BiasActDropoutFunction(torch.autograd.Function):
    """y = dropout(act(x + bias), p): BiasActDropoutFunction.apply(x, bias, activation, p,
    seed) on ops.bias_act_dropout; x (M, n) contiguous, bias (n,) or None."""

    @staticmethod
    def forward(ctx, x, bias, activation, p, seed):
        y, keep = _norms.bias_act_dropout(x.detach(), _d(bias), activation, p, seed)
        ctx.save_for_backward(x, bias, keep)
        ctx.options = (activation, p)
        return _plain(y)

    @staticmethod
    def backward(ctx, dy):
        x, bias, keep = ctx.saved_tensors
        activation, p = ctx.options
        need = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():
            act = {"relu": F.relu, "gelu": F.gelu}[activation]

            def fn(x, bias):
                return (_torch_dropout(act(x if bias is None else x + bias), keep, p),)
            return (*_torch_grads(fn, (x, bias), need, (dy,)), None, None, None)
        dx, db = _norms.bias_act_dropout_backward(dy.contiguous(), x.detach(), _d(bias), keep,
                                                  activation, p, need=tuple(need))
        return dx, db, None, None, None


class _SplitHeads(torch.autograd.Function):
    """qkv rows (M, 3E), M = N * L (batch_first) or L * N, -> q, k, v contiguous
    (N, H, L, Dh); the backward writes dq, dk, dv into one (M, 3E) tensor."""

    @staticmethod
    def forward(ctx, qkv, n, length, heads, batch_first):
        ctx.dims = (n, length, heads, batch_first)
        return _split_heads(qkv, n, length, heads, batch_first)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        n, length, heads, batch_first = ctx.dims
        ref = next(g for g in (dq, dk, dv) if g is not None)
        dh = ref.shape[-1]
        if batch_first:
            out = _host.torch_empty(n, length, 3, heads, dh, dtype=ref.dtype, like=ref)
            view = out.permute(2, 0, 3, 1, 4)
        else:
            out = _host.torch_empty(length, n, 3, heads, dh, dtype=ref.dtype, like=ref)
            view = out.permute(2, 1, 3, 0, 4)
        for i, g in enumerate((dq, dk, dv)):
            if g is None:
                view[i].zero_()
            else:
                view[i].copy_(g)
        return out.view(-1, 3 * heads * dh), None, None, None, None


def _split_heads(qkv, n, length, heads, batch_first):
    dh = qkv.shape[-1] // (3 * heads)
    if batch_first:
        t = qkv.view(n, length, 3, heads, dh).permute(2, 0, 3, 1, 4)
    else:
        t = qkv.view(length, n, 3, heads, dh).permute(2, 1, 3, 0, 4)
    t = _host.contiguous(t)
    return t[0], t[1], t[2]


# ---------------------------------------------------------------- the layer
def _activation_name(act):
    if act is F.relu or act is torch.relu or type(act) is torch.nn.ReLU:
        return "relu"
    if act is F.gelu or (type(act) is torch.nn.GELU and act.approximate == "none"):
        return "gelu"
    return None


def _takes(t) -> bool:
    return (isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter)
            and not t.is_nested and t.layout is torch.strided and t.is_cpu
            and t.dtype in _DTYPES)


def _linear_types():
    from ops.torch import Linear
    return (torch.nn.Linear, Linear)


def _layer_norm_types():
    from ops.torch_norms import LayerNorm
    return (torch.nn.LayerNorm, LayerNorm)


class TransformerEncoderLayer(torch.nn.TransformerEncoderLayer):
    """torch.nn.TransformerEncoderLayer whose forward runs the fused TPP path (see the module
    docstring); everything it does not serve runs torch's own forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tpp_packed = {}

    # ------------------------------------------------------------ packed weights
    def _packed(self, name, w):
        """ops.pack_nk(w) cached by w's (storage, version, dtype, shape, strides)."""
        return _host.packed_copy(self, name, (w,), lambda: _ops.pack_nk(w.detach()))

    def _linear(self, name, x, w, b, act=None):
        from ops.torch import linear
        return linear(x, w, b, act, packed=self._packed(name, w))

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tpp_packed"] = {}       # derived data: never pickled or deep-copied
        state.pop("_tpp_replay", None)
        return state

    # ------------------------------------------------------------ forward
    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        key = None if src_mask is not None or src_key_padding_mask is not None or \
            is_causal is not False else replay.inference_key(self, src)
        if key is None:
            out = self._fused(src, src_mask, src_key_padding_mask, is_causal)
        else:       # an inference call without masks: replayed once seen twice (ops.replay)
            out = replay.for_module(self).run(key, self._fused_alone, src)
        if out is None:
            return super().forward(src, src_mask=src_mask,
                                   src_key_padding_mask=src_key_padding_mask,
                                   is_causal=is_causal)
        return out

    def _fused_alone(self, src):
        return self._fused(src, None, None, False)

    def tpp_serves(self, src, src_mask=None, src_key_padding_mask=None,
                   is_causal=False) -> bool:
        """Whether forward(src, ...) would run the fused TPP path (vs torch's forward)."""
        return self._plan(src, src_mask, src_key_padding_mask, is_causal) is not None

    def unsupported_reason(self):
        """Why the fused path never serves this module's configuration (a sentence), or None
        when it serves it (calls may still fall back: see the module docstring)."""
        if _activation_name(self.activation) is None:
            return (f"activation {self.activation!r} is not relu or gelu (erf): torch's "
                    f"forward runs it")
        attn = self.self_attn
        if not (isinstance(attn, torch.nn.MultiheadAttention)
                and type(attn).forward in (torch.nn.MultiheadAttention.forward,
                                           _ta.MultiheadAttention.forward)):
            return f"self_attn is a {type(attn).__name__}, not torch's MultiheadAttention"
        if not attn._qkv_same_embed_dim or attn.bias_k is not None or attn.add_zero_attn:
            return "self_attn has kdim/vdim, add_bias_kv or add_zero_attn"
        lin, lns = _linear_types(), _layer_norm_types()
        for name in ("linear1", "linear2"):
            m = getattr(self, name)
            if type(m) not in lin or getattr(m, "activation", None):
                return f"{name} is a {type(m).__name__}, not a plain Linear"
        e = attn.embed_dim
        for name in ("norm1", "norm2"):
            m = getattr(self, name)
            if type(m) not in lns or m.normalized_shape != (e,):
                return f"{name} is not a LayerNorm over (d_model,)"
        for name in ("dropout", "dropout1", "dropout2"):
            if type(getattr(self, name)) is not torch.nn.Dropout:
                return f"{name} is not a torch.nn.Dropout"
        params = self._params()
        w = attn.in_proj_weight
        for t in params:
            if not _takes(t):
                return (f"a parameter is {t.dtype} on {t.device}; the TPP path takes CPU "
                        f"float32 / bfloat16 tensors")
            if t.dtype != w.dtype:
                return "the parameters are not all of one dtype"
        return None

    def _params(self):
        attn = self.self_attn
        return [t for t in (attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
                            attn.out_proj.bias, self.linear1.weight, self.linear1.bias,
                            self.linear2.weight, self.linear2.bias, self.norm1.weight,
                            self.norm1.bias, self.norm2.weight, self.norm2.bias)
                if t is not None]

    def _config(self):
        """(activation name, dtype) when this call's module state is one the fused path
        computes, else None."""
        if self.unsupported_reason() is not None or _ta._autocast():
            return None
        attn = self.self_attn
        if self.training and not (attn.dropout < 1.0 and all(
                d.p < 1.0 for d in (self.dropout, self.dropout1, self.dropout2))):
            return None
        for m in self.modules():
            if m is not self and (m._forward_hooks or m._forward_pre_hooks):
                return None
        if _host.torchs_to_dispatch(self._params()):
            return None
        return _activation_name(self.activation), attn.in_proj_weight.dtype

    def _plan(self, src, src_mask, src_key_padding_mask, is_causal):
        """(activation, src as 3-D, batch_first, unbatched, mask, causal) or None."""
        config = self._config()
        if config is None:
            return None
        act, dtype = config
        if not (_takes(src) and src.dtype == dtype) or _host.torchs_to_dispatch(
                (src,)):
            return None
        attn = self.self_attn
        nd = src.dim()
        if nd not in (2, 3) or src.shape[-1] != attn.embed_dim:
            return None
        for m in (src_mask, src_key_padding_mask):
            if m is not None and not isinstance(m, torch.Tensor):
                return None
        try:
            kpm = F._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                                    other_type=F._none_or_dtype(src_mask),
                                    other_name="src_mask", target_type=src.dtype)
            mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None,
                                     other_name="", target_type=src.dtype, check_other=False)
        except (AssertionError, RuntimeError, TypeError):
            return None                 # torch's forward raises its own error
        batch_first = attn.batch_first
        if nd == 2:
            src, batch_first = src.unsqueeze(0), True
            if kpm is not None:
                if kpm.dim() != 1:
                    return None
                kpm = kpm.unsqueeze(0)
        bdim = 0 if batch_first else 1
        n, length = src.shape[bdim], src.shape[1 - bdim]
        if not (n and length):
            return None
        m4, causal = _ta._mha_mask(kpm, mask, is_causal, dtype, n, attn.num_heads, length,
                                   length)
        if m4 is False:
            return None
        return act, src, batch_first, nd == 2, m4, causal

    def _fused(self, src, src_mask, src_key_padding_mask, is_causal):
        plan = self._plan(src, src_mask, src_key_padding_mask, is_causal)
        if plan is None:
            return None
        act, src3, batch_first, unbatched, mask, causal = plan
        attn = self.self_attn
        e, heads = attn.embed_dim, attn.num_heads
        bdim = 0 if batch_first else 1
        n, length = src3.shape[bdim], src3.shape[1 - bdim]
        training = self.training
        p_attn = attn.dropout if training else 0.0
        p1 = self.dropout1.p if training else 0.0
        p2 = self.dropout2.p if training else 0.0
        p_ff = self.dropout.p if training else 0.0
        x = src3.reshape(-1, e)
        if not x.is_contiguous():
            x = x.contiguous()
        n1, n2 = self.norm1, self.norm2
        grad = _wants_grad(x, *self.parameters())

        def attention_block(a):
            qkv = self._linear("in_proj", a, attn.in_proj_weight, attn.in_proj_bias)
            if grad:
                q, k, v = _SplitHeads.apply(qkv, n, length, heads, batch_first)
            else:
                q, k, v = _split_heads(qkv, n, length, heads, batch_first)
            o = _ta.scaled_dot_product_attention(q, k, v, mask, p_attn, causal)  # N,H,L,Dh
            o = _host.contiguous(o.permute(0, 2, 1, 3) if batch_first else o.permute(2, 0, 1, 3))
            o = o.view(-1, e)
            return self._linear("out_proj", o, attn.out_proj.weight, None)

        def ff_block(a):
            if p_ff > 0.0:
                f = self._linear("linear1", a, self.linear1.weight, None)
                f = (BiasActDropoutFunction.apply if grad else _bad_plain)(
                    f, self.linear1.bias, act, p_ff, _seed(p_ff))
            else:
                f = self._linear("linear1", a, self.linear1.weight, self.linear1.bias, act)
            return self._linear("linear2", f, self.linear2.weight, None)

        def residual_norm(z, bias, res, norm, p, want_h):
            eps = norm.eps
            if grad:
                y, h = ResidualNormFunction.apply(z, bias, res, norm.weight, norm.bias, eps,
                                                  p, _seed(p))
                return y, h
            y, h, *_ = _rn.residual_layer_norm(z.detach(), _d(bias), res.detach(),
                                               _d(norm.weight), _d(norm.bias), eps, p,
                                               _seed(p), want_h=want_h, stats=False)
            return y, h

        if self.norm_first:
            from ops.torch_norms import layer_norm
            a = layer_norm(x, (e,), n1.weight, n1.bias, n1.eps)
            z = attention_block(a)
            y2, h = residual_norm(z, attn.out_proj.bias, x, n2, p1, True)
            z2 = ff_block(y2)
            if grad:
                out = BiasDropoutResidualFunction.apply(z2, self.linear2.bias, h, p2, _seed(p2))
            else:
                out, _ = _rn.bias_dropout_residual(z2.detach(), _d(self.linear2.bias),
                                                   h.detach(), p2, _seed(p2))
        else:
            z = attention_block(x)
            y1, _ = residual_norm(z, attn.out_proj.bias, x, n1, p1, False)
            z2 = ff_block(y1)
            out, _ = residual_norm(z2, self.linear2.bias, y1, n2, p2, False)
        out = out.view(src3.shape)
        return out.squeeze(0) if unbatched else out


def _bad_plain(x, bias, act, p, seed):
    return _norms.bias_act_dropout(x.detach(), _d(bias), act, p, seed)[0]
