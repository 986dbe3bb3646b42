"""PyTorch drop-ins for attention on the fused TPP operator (ops.attention).

    import ops.torch_attention as ta            # (ops.torch re-exports these names)
    out = ta.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                          is_causal=False, scale=None, enable_gqa=False)
    mha = ta.MultiheadAttention(768, 12, dropout=0.1, batch_first=True)
    y, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)

scaled_dot_product_attention has torch.nn.functional.scaled_dot_product_attention's signature
and semantics: query (..., L, E), key and value (..., S, E) with the same leading dims (the
last of them, dim -3, is the head dim); attn_mask bool (True: takes part) or additive float,
broadcastable to (..., L, S); is_causal the top-left lower triangle (row i attends to keys
0..i); scale None: 1 / sqrt(E); enable_gqa: key and value may have fewer heads than query
(a divisor of them), each serving query heads // key heads consecutive query heads. The call
maps the leading dims to (B, H) (B the product of all but the last) and runs
ops.flash_attention.attention_forward / attention_backward through AttentionFunction (autograd:
the forward keeps q, k, v, the output and the f32 log-sum-exp rows, the backward computes
only the gradients autograd asks for). dropout_p > 0 drops attention probabilities inside
the operator, seeded by a number drawn from torch's default CPU generator at each call
(torch.randint), so torch.manual_seed makes a call reproducible (the pattern is the
operator's, not torch's: the same seed does not give torch's mask); the backward reuses the
call's seed, hence its mask.

Contract differences with torch, by design:
  - is_causal=True together with an attn_mask raises RuntimeError, as torch documents (and as
    its math kernel does; its CPU flash kernel happens to combine the two).

Served by torch's own scaled_dot_product_attention instead (torch's results, autograd and
errors): tensors neither on the CPU nor on a CUDA device the CUDA backend runs (cupy and a
GPU: then the same operator runs there, see ops.flash_attention), tensors on different
devices, dtypes other than float32 / bfloat16, nested tensors,
tensor subclasses and modes with __torch_function__, inputs of fewer than 2 dims or of
different ranks, leading dims that differ between query and key/value other than by GQA heads
(torch broadcasts them), a value head size other than the query's, empty sizes, a mask that
requires grad (the operator has no mask gradient), a mask of another dtype than bool,
float32 or the query's, or one that does not broadcast to (..., L, S), dropout_p outside
[0, 1), and head counts torch rejects (so that torch raises its own error). A backward that
must itself be differentiable (create_graph=True) recomputes the forward with torch's math
kernel and differentiates that, to any order; with dropout it raises UnsupportedError (the
dropout mask lives inside the operator).

MultiheadAttention subclasses torch.nn.MultiheadAttention (constructor, parameters
in_proj_weight / in_proj_bias / out_proj / bias_k / bias_v, initialisation and state_dict keys
are torch's own) and replaces forward. With need_weights=False it runs the fused path: the
in-projection as one GEMM when query is key is value (two when only key is value, three
otherwise) through ops.torch.linear, the attention through scaled_dot_product_attention above
(module.dropout applied in training mode), and the out-projection through ops.torch.linear;
batch_first both ways, unbatched inputs, key_padding_mask and attn_mask (2-D (L, S) or 3-D
(N * num_heads, L, S), bool or float) and is_causal with torch's semantics (True in a bool
mask means "masked out" there; is_causal is a hint that attn_mask is causal: without a
key_padding_mask the causal mask replaces attn_mask, with one attn_mask is used as given).
need_weights=True, kdim/vdim other than embed_dim, add_bias_kv, add_zero_attn, tensors the
TPP path does not take (as above), masks of a floating dtype other than the query's or
requiring grad, a bool mask next to a float one (torch warns about it), autocast, and every
input torch rejects, run torch's own forward: its exact results, and its errors.
"""
from __future__ import annotations

import functools
import importlib
import math
import numbers

import torch

from tpp.core.errors import UnsupportedError

from . import _host
from ._host import wants_grad as _wants_grad

__all__ = ["scaled_dot_product_attention", "MultiheadAttention", "AttentionFunction"]

F = torch.nn.functional
_DTYPES = (torch.float32, torch.bfloat16)
_SEED_HIGH = 2 ** 31 - 1        # dropout seeds are drawn from [0, _SEED_HIGH)
_CAUSAL_WITH_MASK = ("_scaled_dot_product_attention: Explicit attn_mask should not be set when "
                     "is_causal=True")


@functools.cache
def _operator():
    """The fused attention operator module, ops.flash_attention (imported at the first call,
    then remembered: import_module on every call cost ~1.5 us of a ~30 us short-sequence call)."""
    return importlib.import_module("ops.flash_attention")


def _plain(t):
    """A non-view tensor (autograd forbids in-place ops on view outputs of a Function)."""
    return t.detach() if t._is_view() else t


def _d(t):
    return None if t is None else t.detach()


def _takes(t) -> bool:
    """Whether the TPP path takes this tensor: a plain strided tensor, f32 or bf16, on the CPU
    or on a CUDA device the CUDA backend runs (_device_runs)."""
    return (isinstance(t, torch.Tensor) and not t.is_nested and t.layout is torch.strided
            and t.dtype in _DTYPES and (t.is_cpu or (t.is_cuda and _device_runs(t.device))))


_RUNS: dict = {}        # torch.device -> whether the CUDA backend runs there


def _device_runs(device) -> bool:
    """Whether the CUDA backend (tpp_cuda, through the registry) can run on this CUDA device
    (cupy and a GPU); torch's own kernels serve CUDA tensors where it cannot."""
    runs = _RUNS.get(device)
    if runs is None:
        try:
            from tpp.runtime import registry
            from tpp.runtime.device import Device
            index = device.index if device.index is not None else torch.cuda.current_device()
            runs = bool(registry.for_device(Device("cuda", index)).available())
        except Exception:   # noqa: BLE001 - no backend, no driver: torch serves the call
            runs = False
        _RUNS[device] = runs
    return runs


def _one_device(*tensors) -> bool:
    """Whether the tensors (None skipped) live on one device."""
    for t in tensors:
        if t is not None and not t.is_cpu:
            break
    else:
        return True
    return len({t.device for t in tensors if t is not None}) == 1


# ---------------------------------------------------------------- scaled_dot_product_attention
class _Plan:
    """A call of scaled_dot_product_attention the operator serves: q (B, H, L, E), k and v
    (B, Hk, S, E), mask broadcastable to (B, H, L, S) or None, and the output's shape."""

    __slots__ = ("q", "k", "v", "mask", "shape", "scale", "dropout_p")

    def __init__(self, q, k, v, mask, shape, scale, dropout_p):
        self.q, self.k, self.v, self.mask = q, k, v, mask
        self.shape, self.scale, self.dropout_p = shape, scale, dropout_p


def _plan(query, key, value, attn_mask, dropout_p, scale, enable_gqa):
    """The _Plan of a call, or None when torch's own kernel must serve it (see the module
    docstring's list; torch then computes the call or raises its own error)."""
    if not (_takes(query) and _takes(key) and _takes(value)):
        return None
    if not (query.is_cpu and key.is_cpu and value.is_cpu) and not _one_device(query, key, value):
        return None
    if query.dtype != key.dtype or query.dtype != value.dtype:
        return None
    if _host.torchs_to_dispatch((query, key, value)):
        return None
    nd = query.dim()
    if nd < 2 or key.dim() != nd or value.dim() != nd or key.shape != value.shape:
        return None
    *lead, length, e = query.shape
    *lead_k, s, e_k = key.shape
    if e_k != e or lead[:-1] != lead_k[:-1]:
        return None
    heads, heads_k = (lead[-1], lead_k[-1]) if lead else (1, 1)
    if heads != heads_k and not (enable_gqa and heads_k and heads % heads_k == 0):
        return None
    batch = math.prod(lead[:-1])
    if not (batch and heads and heads_k and length and s and e):
        return None
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        return None
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(e)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) \
            or not math.isfinite(scale):
        return None         # (torch computes an inf or nan scale as given)
    mask = None
    if attn_mask is not None:
        mask = _mask4(attn_mask, query, (*lead, length, s), batch)
        if mask is None:
            return None
    if nd == 4:     # as they are: a reshape would add a view node to autograd's graph each
        q, k, v = query, key, value
    else:
        q = query.reshape(batch, heads, length, e)
        k = key.reshape(batch, heads_k, s, e)
        v = value.reshape(batch, heads_k, s, e)
    return _Plan(q, k, v, mask, query.shape, float(scale), dropout_p)


def _mask4(mask, query, full, batch):
    """attn_mask as a 4-D tensor broadcastable to (B, H, L, S) (a view where its batch dims
    are all 1 or all full), or None when torch must serve it (see _plan)."""
    if not (isinstance(mask, torch.Tensor) and not mask.is_nested and _one_device(query, mask)
            and mask.layout is torch.strided):
        return None
    if mask.dtype not in (torch.bool, torch.float32, query.dtype) or _wants_grad(mask):
        return None
    if _host.torchs_to_dispatch((mask,)) or not 2 <= mask.dim() <= len(full):
        return None         # (torch refuses a mask of fewer than two dims: its error)
    shape = (1,) * (len(full) - mask.dim()) + tuple(mask.shape)
    if any(m not in (1, f) for m, f in zip(shape, full)):
        return None
    if len(shape) == mask.dim() == 4:     # (B or 1, ..): already the operator's form
        return mask
    m = mask.reshape(shape)
    if len(full) == 2:
        return m.reshape(1, 1, *shape)
    batch_dims = shape[:-3]
    if all(b == 1 for b in batch_dims):
        return m.reshape(1, *shape[-3:])
    return m.expand(*full[:-3], *shape[-3:]).reshape(batch, *shape[-3:])


def _draw_seed() -> int:
    """A dropout seed from torch's default CPU generator (torch.manual_seed governs it)."""
    return int(torch.randint(_SEED_HIGH, (1,)).item())


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention on the fused TPP operator.

    softmax(query @ key^T * scale + mask) @ value over the last two dims, with dropout on the
    probabilities when dropout_p > 0. Returns a tensor of query's shape, dtype and device (the
    value head size equals the query's on the TPP path). See the module docstring for the
    cases torch's own kernel serves; is_causal with an attn_mask raises RuntimeError."""
    if type(is_causal) is not bool:         # torch's own answer (a TypeError for a tensor)
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                              is_causal, scale=scale, enable_gqa=enable_gqa)
    if is_causal and attn_mask is not None:
        raise RuntimeError(_CAUSAL_WITH_MASK)
    plan = _plan(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    if plan is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                              is_causal, scale=scale, enable_gqa=enable_gqa)
    causal = bool(is_causal)
    seed = _draw_seed() if plan.dropout_p > 0.0 else None
    if _wants_grad(query, key, value):
        out = AttentionFunction.apply(plan.q, plan.k, plan.v, plan.mask, causal, plan.scale,
                                      plan.dropout_p, seed)
    else:
        out = _plain(_operator().attention(
            plan.q.detach(), plan.k.detach(), plan.v.detach(), mask=_d(plan.mask),
            causal=causal, scale=plan.scale, dropout_p=plan.dropout_p, seed=seed))
    return out if out.dim() == len(plan.shape) else out.reshape(plan.shape)


class AttentionFunction(torch.autograd.Function):
    """out = attention(q, k, v) on the fused operator, differentiable in q, k and v:
    AttentionFunction.apply(q, k, v, mask, causal, scale, dropout_p, seed) with q (B, H, L, E),
    k and v (B, Hk, S, E), H % Hk == 0, one dtype (f32 or bf16), mask None or a bool/float
    tensor broadcastable to (B, H, L, S) that does not require grad, scale a float,
    0 <= dropout_p < 1 and seed an int when dropout_p > 0 (else None). The backward reuses
    the forward's seed (hence its dropout mask); run with create_graph=True it computes in
    torch ops (differentiable again) and rejects dropout with UnsupportedError."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, dropout_p, seed):
        # (the operator copies non-contiguous inputs itself)
        out, lse = _operator().attention_forward(
            q.detach(), k.detach(), v.detach(), mask=_d(mask), causal=causal, scale=scale,
            dropout_p=dropout_p, seed=seed)
        out = _plain(out)
        # the inputs as given (with their autograd history: a create_graph backward
        # differentiates through them), so in-place changes before the backward raise torch's
        # usual error
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.options = (causal, scale, dropout_p, seed)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        need = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        causal, scale, dropout_p, seed = ctx.options
        if torch.is_grad_enabled():         # create_graph=True: torch ops, differentiable
            return (*_differentiable_grads(ctx, dout, (q, k, v), mask, need),
                    None, None, None, None, None)
        grads = _operator().attention_backward(
            dout, q.detach(), k.detach(), v.detach(), out, lse, mask=_d(mask), causal=causal,
            scale=scale, dropout_p=dropout_p, seed=seed, need=need)
        grads = tuple(g if n else None for g, n in zip(grads, need))
        return (*grads, None, None, None, None, None)


def _differentiable_grads(ctx, dout, inputs, mask, need):
    """(dq, dk, dv) (None where need is False) as torch operations autograd records: the
    forward recomputed by torch's math kernel from the saved inputs (with their history),
    differentiated with create_graph=True, so the gradients are differentiable again in q, k,
    v and dout, to any order."""
    causal, scale, dropout_p, _ = ctx.options
    if dropout_p > 0.0:
        raise UnsupportedError("a differentiable backward (create_graph=True) through attention "
                               "with dropout is not supported: the dropout mask is drawn inside "
                               "the TPP operator; use dropout_p=0 or torch's own "
                               "scaled_dot_product_attention for higher-order gradients")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, _ = inputs
    wanted = [t for t, n in zip(inputs, need) if n]
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*inputs, mask, 0.0, causal, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        grads = iter(torch.autograd.grad(out, wanted, dout, create_graph=True))
    return tuple(next(grads) if n else None for n in need)


# ---------------------------------------------------------------- MultiheadAttention
def _linear(x, weight, bias, packed=None):
    """x @ weight.T + bias through ops.torch.linear (TPP GEMMs, autograd; packed: weight's
    ops.pack_nk copy, reused); imported at the call (ops.torch re-exports this module)."""
    from ops.torch import linear
    return linear(x, weight, bias, packed=packed)


def _autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled()
    except TypeError:       # a torch whose is_autocast_enabled takes no device
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


class MultiheadAttention(torch.nn.MultiheadAttention):
    """torch.nn.MultiheadAttention whose need_weights=False forward runs on TPPs: the
    in-projection and out-projection through ops.torch.linear, the attention through
    ops.torch_attention.scaled_dot_product_attention. Everything else, and every call the
    fused path does not take (see the module docstring), is torch's own forward."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        fused = None
        if not need_weights:
            fused = self._fused(query, key, value, key_padding_mask, attn_mask, is_causal)
        if fused is None:
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        return fused, None

    def _takes_module(self) -> bool:
        """Whether the module's configuration is one the fused path computes."""
        return (self._qkv_same_embed_dim and self.bias_k is None and self.bias_v is None
                and not self.add_zero_attn and _takes(self.in_proj_weight)
                and _takes(self.out_proj.weight) and not _autocast())

    def _fused(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        """The attention output of the fused path, or None where torch's forward must run."""
        if not self._takes_module():
            return None
        dtype = self.in_proj_weight.dtype
        tensors = (query, key, value)
        if not all(_takes(t) and t.dtype == dtype for t in tensors):
            return None
        if _host.torchs_to_dispatch(tensors):
            return None
        nd = query.dim()
        if nd not in (2, 3) or key.dim() != nd or key.shape != value.shape:
            return None
        if query.shape[-1] != self.embed_dim or key.shape[-1] != self.embed_dim:
            return None
        batch_first = self.batch_first or nd == 2
        if nd == 2:                          # unbatched: a batch of one, batch first
            query, key, value = _unsqueezed(query, key, value)
            if key_padding_mask is not None:
                if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dim() != 1:
                    return None
                key_padding_mask = key_padding_mask.unsqueeze(0)
        bdim = 0 if batch_first else 1
        n, length, s = query.shape[bdim], query.shape[1 - bdim], key.shape[1 - bdim]
        if key.shape[bdim] != n or not (n and length and s):
            return None
        heads = self.num_heads
        if not _one_device(query, key, value, self.in_proj_weight, self.out_proj.weight,
                           key_padding_mask if isinstance(key_padding_mask, torch.Tensor)
                           else None,
                           attn_mask if isinstance(attn_mask, torch.Tensor) else None):
            return None
        mask, causal = _mha_mask(key_padding_mask, attn_mask, is_causal, dtype, n, heads,
                                 length, s)
        if mask is False:
            return None
        q, k, v = self._in_projection(query, key, value, bdim)
        dropout_p = self.dropout if self.training else 0.0
        out = scaled_dot_product_attention(q, k, v, mask, dropout_p, causal)  # (N, H, L, Dh)
        # to the input's layout, heads merged: (N, L, E) or (L, N, E)
        out = out.permute(0, 2, 1, 3) if batch_first else out.permute(2, 0, 1, 3)
        out = self._projection("out", out.reshape(*out.shape[:2], self.embed_dim),
                               self.out_proj.weight, self.out_proj.bias)
        return out.squeeze(0) if nd == 2 else out

    def _projection(self, name, x, w, b):
        """x @ w.T + b with w's packed copy kept by the module (ops._host.packed_copy: repacked
        when the parameter changed, as optimizer steps do): packing a weight costs more than
        a short sequence's projection."""
        import ops
        packed = _host.packed_copy(self, name, (w,), lambda: ops.pack_nk(w.detach()))
        return _linear(x, w, b, packed)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_tpp_packed", None)      # derived data: never pickled or deep-copied
        return state

    def _in_projection(self, query, key, value, bdim):
        """q, k, v as (N, H, L|S, head_dim) views of the projections (one GEMM when query is
        key is value, as torch packs them; two when only key is value)."""
        w, b, e = self.in_proj_weight, self.in_proj_bias, self.embed_dim
        proj = self._projection
        if query is key and key is value:
            q, k, v = proj("qkv", query, w, b).unflatten(-1, (3, e)).unbind(-2)
        elif key is value:
            q = proj("q", query, w[:e], None if b is None else b[:e])
            k, v = proj("kv", key, w[e:], None if b is None else b[e:]).unflatten(
                -1, (2, e)).unbind(-2)
        else:
            q, k, v = (proj("qkv"[i], x, w[i * e:(i + 1) * e], None if b is None else
                            b[i * e:(i + 1) * e]) for i, x in enumerate((query, key, value)))
        return tuple(self._heads(t, bdim) for t in (q, k, v))

    def _heads(self, t, bdim):
        """(N, L, E) or (L, N, E) -> (N, H, L, head_dim), a view."""
        t = t.unflatten(-1, (self.num_heads, self.head_dim))
        return t.permute(0, 2, 1, 3) if bdim == 0 else t.permute(1, 2, 0, 3)


def _unsqueezed(*tensors):
    """The inputs with a batch dim of one in front, keeping which of them are the same."""
    out = []
    for t in tensors:
        same = next((o for o, src in zip(out, tensors) if src is t), None)
        out.append(same if same is not None else t.unsqueeze(0))
    return out


def _mha_mask(key_padding_mask, attn_mask, is_causal, dtype, n, heads, length, s):
    """(mask, causal) for scaled_dot_product_attention from MultiheadAttention's masks, with
    torch's semantics (its bool masks mean "masked out"; a float mask is added; is_causal
    replaces attn_mask when there is no key_padding_mask, and is dropped when there is one);
    mask is False where the fused path does not take the masks (torch's forward then runs:
    it computes them or raises its error). Bool masks stay bool (inverted, combined with &);
    next to a float one they become -inf additive masks, as torch makes them."""
    for m in (key_padding_mask, attn_mask):
        if m is not None and not (isinstance(m, torch.Tensor) and _mask_taken(m, dtype)):
            return False, False
    if is_causal and attn_mask is None:
        return False, False                 # torch raises: is_causal needs attn_mask
    if (key_padding_mask is not None and attn_mask is not None
            and (key_padding_mask.dtype == torch.bool) != (attn_mask.dtype == torch.bool)):
        return False, False                 # torch warns about mixed mask types
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (n, s):
        return False, False
    if attn_mask is not None and tuple(attn_mask.shape) not in ((length, s),
                                                               (n * heads, length, s)):
        return False, False
    if is_causal and key_padding_mask is None:
        return None, True
    masks = []
    if attn_mask is not None:
        masks.append(attn_mask.reshape(n, heads, length, s) if attn_mask.dim() == 3
                     else attn_mask.reshape(1, 1, length, s))
    if key_padding_mask is not None:
        masks.append(key_padding_mask.reshape(n, 1, 1, s))
    if not masks:
        return None, False
    if masks[0].dtype == torch.bool:
        keep = ~masks[0]
        for m in masks[1:]:
            keep = keep & ~m
        return keep, False
    total = masks[0]
    for m in masks[1:]:
        total = total + m
    return total, False


def _mask_taken(mask, dtype) -> bool:
    """Whether the fused path takes a MultiheadAttention mask: a plain tensor (on the inputs'
    device: _fused checks), bool or of the module's dtype, not requiring grad."""
    return (not mask.is_nested and mask.layout is torch.strided
            and mask.dtype in (torch.bool, dtype) and not _wants_grad(mask)
            and not _host.torchs_to_dispatch((mask,)))
