"""Hugging Face `transformers` BERT-family encoder blocks on the TPP operators: converters for
ops.torch.optimize (registered with ops.torch_convert.register_converter when this module is
imported; optimize imports it when `transformers` is importable).

    import ops.torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path)          # BERT, RoBERTa, MiniLM, ...
    fast = ops.torch.optimize(model)                 # a converted copy (inplace=True: in place)

Three blocks and the layer holding them are converted, each matched by its STRUCTURE
(attribute names, child types and forward signature, not its class name), so BERT, RoBERTa,
MiniLM, ... blocks that transformers writes the same way convert alike:

  self-attention (BertSelfAttention: `query`, `key`, `value` Linear of one in_features,
  `dropout`, `num_attention_heads`, `attention_head_size`, `all_head_size`, forward
  (hidden_states, attention_mask, <cache>, **kwargs) -> (attn_output, attn_weights),
  transformers 5's form, the cache argument named past_key_values up to 5.23 and cache from
  5.24):
      qkv = linear(x, [Wq; Wk; Wv], [bq; bk; bv])     ONE GEMM (the concatenated weight is
                                                      rebuilt and repacked only when one of
                                                      the six parameters' version changes)
      out = scaled_dot_product_attention(q, k, v, mask, dropout_p (training), scaling)
                                                      ops.torch_attention (fused flash)
  and returns (out, None) as transformers' forward does without output_attentions. The mask
  is the one the model builds (transformers' create_bidirectional_mask: None, bool (B, 1, L, S)
  with True "attend", or additive float); a (B, 1, L, S) mask whose rows are all equal (a
  padding mask) is reduced to its key row (B, 1, 1, S), which the operator applies per key
  block instead of per (query block, key block).

  intermediate (BertIntermediate: `dense` Linear, `intermediate_act_fn`, forward
  (hidden_states)): one GEMM with the bias and the activation fused in its epilogue for exact
  (erf) gelu and relu (transformers' GELUActivation, nn.GELU(approximate="none"), F.gelu,
  nn.ReLU, F.relu); any other activation runs in torch after the TPP GEMM.

  output / self-output (BertOutput, BertSelfOutput: `dense` Linear, `dropout`, `LayerNorm`,
  forward (hidden_states, input_tensor)): y = LayerNorm(input_tensor + dropout(x W^T + b)) as
  a GEMM without bias, then bias + dropout + residual + LayerNorm in ONE equation
  (ops.residual_norm through ops.torch_encoder.ResidualNormFunction).

And the layer that holds them (BertLayer), whose forward calls the converted blocks directly:
ops.torch_hf_layer, imported and registered with this module.

How a block is converted: the new module is an instance of a subclass of the original's class
(TPP<ClassName>, built once per class) holding the same __dict__ (shallow copies of its
parameter, buffer, module and hook dicts): children and parameters are the ORIGINAL objects
(shared, not copied), so state_dict keys and values are unchanged, optimizers built on the
original parameters keep training the converted model, and isinstance checks (transformers'
output recording hooks for output_attentions, its weight init) still match. Only forward is
replaced; every call the fused path does not serve runs the original class's forward:

  output_attentions (or any other recording of attention weights), a head_mask, a
  key/value cache (past_key_values or cache), cross-attention inputs, causal / decoder
  self-attention, masks that are not plain tensors (flex attention's BlockMask), tensors not
  on the CPU or not f32 / bf16, an input dtype other than the parameters', autocast, children
  that carry forward hooks or pre-hooks, children replaced by types other than torch's
  Linear / LayerNorm / Dropout (or the ops.torch drop-ins), and dropout probabilities >= 1
  in training.

Conversion refuses (raises ops.torch_convert.CannotServe, so optimize leaves the block as it
is) modules whose forward signature is not the one above (older transformers versions), with
relative position embeddings (`distance_embedding`), decoders (`is_causal` / `is_decoder`),
and sizes that do not fit (head sizes, LayerNorm over other than dense's out_features).

Dropout in training draws its seeds from torch's default generator (torch.manual_seed makes a
step reproducible) but the keep masks are the TPP operators' own, not torch's: a converted
model trained with dropout follows a different random stream than the original.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import types

import torch

import ops as _ops
from ops import _host
from ops.torch_hf_packed import reduced_mask
from ops._host import wants_grad as _wants_grad

__all__ = ["CONVERTERS", "register", "SelfAttentionMixin", "IntermediateMixin", "OutputMixin",
           "converted_class"]

F = torch.nn.functional
_DTYPES = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------- shared helpers
def _cannot_serve(reason):
    """ops.torch_convert.CannotServe(reason) (a ValueError stand-in before that module lands)."""
    try:
        from ops.torch_convert import CannotServe
    except ImportError:
        return ValueError(reason)
    return CannotServe(reason)


def _d(t):
    return None if t is None else t.detach()


def _takes(t) -> bool:
    """A plain strided CPU tensor (or Parameter) of f32 / bf16."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided
            and t.is_cpu and t.dtype in _DTYPES)


def _autocast() -> bool:
    return _late().autocast()


@functools.cache
def _late():
    """The ops.torch* names the converted forwards call, imported once on first use (those
    modules import this one: a module-level import would be circular; an import statement
    per call cost ~1 us each, several per block)."""
    from ops import torch_attention, torch_encoder, torch_norms
    from ops import residual_norm
    from ops.torch import Linear, linear
    from ops.torch import _linear as checked_linear
    return types.SimpleNamespace(
        autocast=torch_attention._autocast, draw_seed=torch_attention._draw_seed,
        sdpa=torch_attention.scaled_dot_product_attention, linear=linear,
        checked_linear=checked_linear,
        linear_forwards=(torch.nn.Linear.forward, Linear.forward),
        norm_forwards=(torch.nn.LayerNorm.forward, torch_norms.LayerNorm.forward),
        residual_norm=(torch_encoder.ResidualNormFunction, residual_norm))


def _linear_like(m) -> bool:
    """torch.nn.Linear or ops.torch.Linear without a fused activation (subclasses with their
    own forward, e.g. quantised or LoRA layers, are not), its weight a registered 2-D
    parameter and its bias a registered one or None (what _weights reads)."""
    if not (isinstance(m, torch.nn.Module) and type(m).forward in _late().linear_forwards
            and _registered(m)):
        return False
    # the instance's own attribute, else the class's: nn.Linear has none, and getattr would
    # go through nn.Module.__getattr__ and raise and catch an AttributeError (~1 us)
    act = m.__dict__["activation"] if "activation" in m.__dict__ else \
        getattr(type(m), "activation", None)
    w = m._parameters["weight"]
    return act is None and isinstance(w, torch.Tensor) and w.dim() == 2


def _registered(m) -> bool:
    """Whether m's weight and bias are registered parameters (None allowed: no bias, no
    affine), not plain attributes set in their place, which _weights would not see."""
    found = m._parameters
    return "weight" in found and "bias" in found


def _children(module, *names):
    """module's registered submodules of these names (None where there is none): what
    attribute access returns for them, read from its _modules without going through
    nn.Module.__getattr__ (~0.3 us a name, tens of names a converted block call)."""
    found = module._modules
    return tuple(found.get(name) for name in names)


def _weights(m):
    """(weight, bias) of a Linear or LayerNorm whose parameters are _registered (each None
    where the module has none), read like _children."""
    found = m._parameters
    return found["weight"], found["bias"]


def _layer_norm_like(m) -> bool:
    return (isinstance(m, torch.nn.LayerNorm)
            and type(m).forward in _late().norm_forwards
            and len(m.normalized_shape) == 1 and _registered(m))


def _dropout_like(m) -> bool:
    return type(m) is torch.nn.Dropout


def _hooked(*modules) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _params(sig_owner):
    """The forward's parameter names (without self) and whether it takes **kwargs."""
    try:
        sig = inspect.signature(type(sig_owner).forward)
    except (TypeError, ValueError):
        return (), False
    names = tuple(p.name for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))[1:]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def _linear_call(x, w, b, activation, packed):
    """ops.torch.linear(x, w, b, activation, packed=packed) for a call its converted forward
    validated (x and w plain CPU tensors of one dtype, x (M, K) with w (N, K), activation one
    of ops.torch's, packed this module's packed copy of w): without that function's argument
    checks (~2 us a call, four calls a layer), once the bias is (N,) of w's dtype; any other
    bias goes through the checked call, whose error explains it."""
    late = _late()
    if b is not None and (b.dtype != w.dtype or b.shape != (w.shape[0],)):
        return late.linear(x, w, b, activation, packed=packed)
    return late.checked_linear(x, w, b, activation, lambda _w: packed)


def _rows(x, n):
    """x (..., n) as contiguous (M, n) rows."""
    x2 = x.reshape(-1, n)
    return x2 if x2.is_contiguous() else x2.contiguous()


def _seed(p):
    return _late().draw_seed() if p > 0.0 else None


# ---------------------------------------------------------------- the derived classes
_DERIVED: dict = {}


def converted_class(cls, mixin):
    """The subclass TPP<cls.__name__> of (mixin, cls), built once per pair."""
    key = (cls, mixin)
    sub = _DERIVED.get(key)
    if sub is None:
        name = f"TPP{cls.__name__}"
        sub = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name,
                                        "_tpp_base": cls, "_tpp_mixin": mixin.__name__,
                                        "_tpp_mixin_module": mixin.__module__})
        _DERIVED[key] = sub
    return sub


def _rebuild(mixin_name, base, module=__name__):
    """Unpickling: an empty instance of converted_class(base, mixin) (state set after); the
    mixin is found by name in its module (this one unless given)."""
    mixin = getattr(importlib.import_module(module), mixin_name)
    return object.__new__(converted_class(base, mixin))


def _swap(module, mixin):
    """A new module of converted_class(type(module), mixin) sharing module's children,
    parameters and buffers (its dicts are shallow copies)."""
    new = object.__new__(converted_class(type(module), mixin))
    state = {}
    for k, v in module.__dict__.items():
        state[k] = type(v)(v) if isinstance(v, dict) else v
    state["_tpp_packed"] = {}
    new.__dict__.update(state)
    return new


class _Converted:
    """What every converted block shares: the packed-weight cache (derived data, never
    pickled, as a layer's replays are not) and pickling by (mixin, original class)."""

    _tpp_base = None
    _tpp_mixin = None
    _tpp_mixin_module = __name__

    def _packed(self, name, key_tensors, make):
        """The packed weight `make()` builds, cached under name while key_tensors (storage,
        version, dtype, shape, strides) are unchanged (ops._host.packed_copy)."""
        return _host.packed_copy(self, name, key_tensors, make)

    def _linear(self, name, x, linear, bias=True, activation=None):
        """act(x @ linear.weight^T (+ linear.bias)) through ops.torch.linear with the weight's
        packed copy cached."""
        w = linear.weight
        packed = self._packed(name, (w,), lambda: _ops.pack_nk(w.detach()))
        return _linear_call(x, w, linear.bias if bias else None, activation, packed)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tpp_packed"] = {}
        state.pop("_tpp_replay", None)      # a converted layer's replays (ops.replay)
        return state

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self._tpp_mixin, self._tpp_base, self._tpp_mixin_module),
                self.__getstate__())


# ---------------------------------------------------------------- self-attention
def _split_heads(qkv, b, length, heads):
    """qkv rows (B * L, 3 * E) -> q, k, v contiguous (B, H, L, Dh)."""
    dh = qkv.shape[-1] // (3 * heads)
    t = _host.contiguous(qkv.view(b, length, 3, heads, dh).permute(2, 0, 3, 1, 4))
    return t[0], t[1], t[2]


class _SplitHeads(torch.autograd.Function):
    """_split_heads with a backward that writes dq, dk, dv into one (B * L, 3 * E) tensor."""

    @staticmethod
    def forward(ctx, qkv, b, length, heads):
        ctx.dims = (b, length, heads)
        return _split_heads(qkv, b, length, heads)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        b, length, heads = ctx.dims
        ref = next(g for g in (dq, dk, dv) if g is not None)
        dh = ref.shape[-1]
        out = _host.torch_empty(b, length, 3, heads, dh, dtype=ref.dtype, like=ref)
        view = out.permute(2, 0, 3, 1, 4)
        for i, g in enumerate((dq, dk, dv)):
            if g is None:
                view[i].zero_()
            else:
                view[i].copy_(g)
        return out.view(-1, 3 * heads * dh), None, None, None


# the cache argument's names: past_key_values in transformers 5.0-5.23, cache from 5.24
_CACHE_ARGUMENTS = ("past_key_values", "cache")
_SELF_ATTENTION_SIGNATURES = tuple(("hidden_states", "attention_mask", cache)
                                   for cache in _CACHE_ARGUMENTS)


def _self_attention_matches(m) -> bool:
    names, _ = _params(m)
    return (all(_linear_like(getattr(m, n, None)) for n in ("query", "key", "value"))
            and isinstance(getattr(m, "num_attention_heads", None), int)
            and isinstance(getattr(m, "attention_head_size", None), int)
            and isinstance(getattr(m, "all_head_size", None), int)
            and isinstance(getattr(m, "dropout", None), torch.nn.Module)
            and names[:2] == ("hidden_states", "attention_mask"))


def _self_attention_convert(m):
    names, var_kw = _params(m)
    if names not in _SELF_ATTENTION_SIGNATURES or not var_kw:
        raise _cannot_serve(
            f"{type(m).__name__}.forward{names}: only transformers 5's self-attention forward "
            f"(hidden_states, attention_mask, past_key_values | cache, **kwargs) is converted")
    if getattr(m, "is_causal", False) or getattr(m, "is_decoder", False):
        raise _cannot_serve("causal / decoder self-attention (is_causal or is_decoder)")
    if hasattr(m, "distance_embedding") or getattr(m, "position_embedding_type",
                                                   "absolute") not in (None, "absolute"):
        raise _cannot_serve("relative position embeddings")
    if not _dropout_like(m.dropout):
        raise _cannot_serve(f"dropout is a {type(m.dropout).__name__}, not torch.nn.Dropout")
    heads, dh, e = m.num_attention_heads, m.attention_head_size, m.all_head_size
    q, k, v = m.query, m.key, m.value
    if heads * dh != e or heads <= 0 or any(t.weight.shape[0] != e for t in (q, k, v)) or \
            len({t.weight.shape[1] for t in (q, k, v)}) != 1:
        raise _cannot_serve(f"sizes: {heads} heads of {dh} vs all_head_size {e} and query/key/"
                            f"value weights {[tuple(t.weight.shape) for t in (q, k, v)]}")
    if (q.bias is None) != (k.bias is None) or (q.bias is None) != (v.bias is None):
        raise _cannot_serve("query, key and value must all have a bias or none")
    return _swap(m, SelfAttentionMixin)


class SelfAttentionMixin(_Converted):
    """forward of a converted BERT-family self-attention block (see the module docstring)."""

    # measured: one fused QKV GEMM vs three ops.torch.linear calls (see bench/suites/model.py)
    fused_qkv = True

    def forward(self, hidden_states, attention_mask=None, *cache, **kwargs):
        # the cache goes on under whichever name (or position) the caller gave it: the base
        # class's forward knows its own name for it
        out = None if any(c is not None for c in cache) else \
            self._fused(hidden_states, attention_mask, kwargs)
        if out is None:
            return super().forward(hidden_states, attention_mask, *cache, **kwargs)
        return out, None

    def _fused(self, x, mask, kwargs, packed=None):
        """The block's output, or None where the fused path does not serve. packed: the
        ops.torch_hf_packed.Packing of a (B, L) batch when x (1, T, E) holds its T attended
        tokens; the result is then (1, T, E) too."""
        if kwargs.get("output_attentions") or \
                any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
            return None
        for name in ("head_mask", "encoder_hidden_states", "encoder_attention_mask"):
            if kwargs.get(name) is not None:
                return None
        q, k, v, drop = _children(self, "query", "key", "value", "dropout")
        if not (_linear_like(q) and _linear_like(k) and _linear_like(v) and _dropout_like(drop)):
            return None
        if _hooked(q, k, v, drop) or _autocast():
            return None
        weights = (_weights(q), _weights(k), _weights(v))
        wq = weights[0][0]
        dtype = wq.dtype
        params = [t for pair in weights for t in pair if t is not None]
        if not (_takes(x) and x.dim() == 3 and x.dtype == dtype
                and all(_takes(t) and t.dtype == dtype for t in params)):
            return None
        if _host.torchs_to_dispatch((x, *params)):
            return None
        b, length, e_in = x.shape
        if not (b and length) or e_in != wq.shape[1] or (packed and not self.fused_qkv):
            return None
        if packed:
            b, length = packed.b, packed.length
        p = drop.p if self.training else 0.0
        if not 0.0 <= p < 1.0:
            return None
        mask = reduced_mask(mask, b, length)
        if mask is False:
            return None
        heads, e = self.num_attention_heads, self.all_head_size
        x2 = _rows(x, e_in)
        grad = _wants_grad(x2, *params)
        scaled_dot_product_attention = _late().sdpa
        if self.fused_qkv:
            qkv = self._qkv(x2, weights, grad)
            if packed:
                qh, kh, vh = packed.heads(qkv, heads)
            elif grad:
                qh, kh, vh = _SplitHeads.apply(qkv, b, length, heads)
            else:
                qh, kh, vh = _split_heads(qkv, b, length, heads)
        else:
            qh, kh, vh = (self._linear(n, x2, lin).view(b, length, heads, -1).transpose(1, 2)
                          for n, lin in (("query", q), ("key", k), ("value", v)))
        o = scaled_dot_product_attention(qh, kh, vh, mask, p, False,
                                         scale=getattr(self, "scaling", None)).permute(0, 2, 1, 3)
        return packed.merge(o) if packed else _host.contiguous(o).view(b, length, e)

    def _qkv(self, x2, weights, grad):
        """x2 @ [Wq; Wk; Wv]^T + [bq; bk; bv] as one GEMM; weights: the (weight, bias) pairs
        of query, key and value."""
        ws, bs = zip(*weights)
        has_b = bs[0] is not None
        if grad:
            # autograd routes the gradient of the concatenation back to the three parameters;
            # the packed copy is reused while none of them changed (several forwards a step)
            w = torch.cat(ws)
            bias = torch.cat(bs) if has_b else None
            packed = self._packed("qkv_grad", ws, lambda: _ops.pack_nk(w.detach()))
            return _linear_call(x2, w, bias, None, packed)

        def make():
            w = torch.cat([t.detach() for t in ws])
            bias = torch.cat([t.detach() for t in bs]) if has_b else None
            return w, bias, _ops.pack_nk(w)
        w, bias, packed = self._packed("qkv", ws + (bs if has_b else ()), make)
        return _linear_call(x2, w, bias, None, packed)


# ---------------------------------------------------------------- intermediate
def _activation_name(act):
    """"gelu" (exact, erf), "relu" or None for the activation callables BERT-family configs
    give (transformers.activations.ACT2FN values, torch modules and functions)."""
    if act is F.gelu or (type(act) is torch.nn.GELU and act.approximate == "none"):
        return "gelu"
    if act is F.relu or act is torch.relu or type(act) is torch.nn.ReLU:
        return "relu"
    name = type(act).__name__
    if name == "GELUActivation" and isinstance(act, torch.nn.Module) and \
            type(act).forward.__qualname__ == "GELUActivation.forward":
        inner = getattr(act, "act", None)
        if inner is F.gelu or getattr(inner, "__name__", "") == "_gelu_python":
            return "gelu"       # both the erf form
    return None


def _intermediate_matches(m) -> bool:
    names, _ = _params(m)
    return (_linear_like(getattr(m, "dense", None)) and callable(getattr(m, "intermediate_act_fn",
                                                                        None))
            and names == ("hidden_states",) and not hasattr(m, "LayerNorm"))


def _intermediate_convert(m):
    return _swap(m, IntermediateMixin)


class IntermediateMixin(_Converted):
    """forward of a converted BERT-family intermediate block: act(dense(x)) with the bias and
    an exact-gelu / relu activation fused into the GEMM."""

    def forward(self, hidden_states):
        dense, = _children(self, "dense")
        x = hidden_states
        if not (_linear_like(dense) and _takes(x) and x.dim() >= 2 and not _hooked(dense)):
            return super().forward(hidden_states)
        w, bias = _weights(dense)
        if not (x.dtype == w.dtype and _takes(w)
                and (bias is None or (_takes(bias) and bias.dtype == w.dtype))
                and x.shape[-1] == w.shape[1] and x.numel() and not _autocast()):
            return super().forward(hidden_states)
        act = self.intermediate_act_fn
        name = _activation_name(act)
        y = self._linear("dense", _rows(x, x.shape[-1]), dense, activation=name)
        if name is None:
            y = act(y)
        return y.view(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------- output / self-output
def _output_matches(m) -> bool:
    names, _ = _params(m)
    return (_linear_like(getattr(m, "dense", None)) and _layer_norm_like(getattr(m, "LayerNorm",
                                                                                None))
            and isinstance(getattr(m, "dropout", None), torch.nn.Module)
            and names == ("hidden_states", "input_tensor"))


def _output_convert(m):
    if not _dropout_like(m.dropout):
        raise _cannot_serve(f"dropout is a {type(m.dropout).__name__}, not torch.nn.Dropout")
    if m.LayerNorm.normalized_shape != (m.dense.weight.shape[0],):
        raise _cannot_serve(f"LayerNorm over {m.LayerNorm.normalized_shape} after a dense "
                            f"layer of {m.dense.weight.shape[0]} features")
    return _swap(m, OutputMixin)


class OutputMixin(_Converted):
    """forward of a converted BERT-family output block: LayerNorm(input_tensor +
    dropout(dense(x))), the dense GEMM then one bias + dropout + residual + norm equation."""

    def forward(self, hidden_states, input_tensor):
        out = self._fused(hidden_states, input_tensor)
        if out is None:
            return super().forward(hidden_states, input_tensor)
        return out

    def _fused(self, x, res):
        dense, norm, drop = _children(self, "dense", "LayerNorm", "dropout")
        if not (_linear_like(dense) and _layer_norm_like(norm) and _dropout_like(drop)):
            return None
        if _hooked(dense, norm, drop) or _autocast():
            return None
        (w, bias), (nw, nb) = _weights(dense), _weights(norm)
        dtype = w.dtype
        params = [t for t in (w, bias, nw, nb) if t is not None]
        n = w.shape[0]
        if not (_takes(x) and _takes(res) and x.dtype == dtype and res.dtype == dtype
                and x.dim() >= 2 and x.shape[-1] == w.shape[1]
                and res.shape == (*x.shape[:-1], n) and x.numel()
                and all(_takes(t) and t.dtype == dtype for t in params)
                and norm.normalized_shape == (n,)):
            return None
        if _host.torchs_to_dispatch((x, res, *params)):
            return None
        p = drop.p if self.training else 0.0
        if not 0.0 <= p < 1.0:
            return None
        x2, r2 = _rows(x, x.shape[-1]), _rows(res, n)
        function, rn = _late().residual_norm
        z = self._linear("dense", x2, dense, bias=False)
        if _wants_grad(x2, r2, *params):
            y, _ = function.apply(z, bias, r2, nw, nb, norm.eps, p, _seed(p))
        else:
            y = rn.residual_layer_norm(z.detach(), _d(bias), r2.detach(), _d(nw), _d(nb),
                                       norm.eps, p, _seed(p), want_h=False, stats=False)[0]
        return y.view(res.shape)


# ---------------------------------------------------------------- registration
# (name, matches, convert), in the order optimize should try them
CONVERTERS = (
    ("hf_bert_self_attention", _self_attention_matches, _self_attention_convert),
    ("hf_bert_intermediate", _intermediate_matches, _intermediate_convert),
    ("hf_bert_output", _output_matches, _output_convert),
)


def register(converters=CONVERTERS, descend=False):
    """Register converters ((name, matches, convert) triples; this module's CONVERTERS by
    default) with ops.torch_convert (done at import; False where that module is not there)."""
    try:
        from ops import torch_convert
    except ImportError:
        return False
    for name, matches, convert in converters:
        torch_convert.register_converter(name, matches, convert, descend=descend)
    return True


_REGISTERED = register()
# the layer's converter, which registers itself (it imports this module's blocks)
from ops import torch_hf_layer  # noqa: E402,F401
