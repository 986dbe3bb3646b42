"""PyTorch drop-ins for LayerNorm, RMSNorm and softmax on the TPP operators (ops.norms).

    import ops.torch_norms as tn            # (ops.torch re-exports these names)
    ln = tn.LayerNorm(768)                  # torch.nn.LayerNorm's constructor, parameters,
    y = ln(x)                               #   state_dict keys, reset_parameters, repr
    rms = tn.RMSNorm(768)                   # torch.nn.RMSNorm's
    y = tn.layer_norm(x, (768,), w, b, 1e-5)
    y = tn.rms_norm(x, (768,), w)           # eps=None: torch.finfo(torch.float32).eps
    p = tn.softmax(scores, dim=-1)          # torch.nn.functional.softmax(input, dim, dtype=None)

The modules subclass torch.nn.LayerNorm / torch.nn.RMSNorm and replace only `forward`, so
constructors, parameters, initialisation, state dicts (both ways) and extra_repr are torch's
own. Forward and backward run ops.norms' nests (autograd.Function: the forward keeps x and the
f32 per-row statistics, the backward computes only the gradients autograd asks for); f32 or
bf16 tensors (bf16 with f32 statistics; weight and bias f32 or bf16).

A normalized_shape of several dimensions is flattened into one (the input's trailing
dimensions and the weight are reshaped views; autograd sees the reshapes). Softmax over a dim
that is not the last one transposes it to the last (a copy), runs, and transposes back.

CUDA tensors run the same nests on their GPU (ops.norms' device path: the results on the
input's device; parameters on another device than the input: ArgumentError naming them).

Served by torch's own implementation instead (same results, torch's autograd): tensors
neither on the CPU nor on a CUDA device, dtypes other than float32 / bfloat16 (float64,
float16, ...), tensor subclasses and other __torch_function__ objects (torch dispatches
them), empty tensors, a 0-d softmax input, rows wider than ops.norms.MAX_GRAD_COLS
(65536) when the weight or bias requires grad, and a backward that must itself be
differentiable (create_graph=True: the gradients are recomputed with torch's operators so
that autograd can differentiate them again). Shapes that do not match (normalized_shape vs
the input's trailing dimensions, a weight of another shape) raise
tpp.core.errors.ArgumentError (a ValueError, and a RuntimeError as torch's error is).
"""
from __future__ import annotations

import math

import torch

from tpp.core.errors import ArgumentError, ArgumentTypeError

from . import _host
from . import norm_plans as _plans
from . import norms as _n
from ._host import wants_grad as _wants_grad

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm", "softmax", "LayerNormFunction",
           "RMSNormFunction", "SoftmaxFunction"]

_DTYPES = (torch.float32, torch.bfloat16)
# rms_norm's eps=None: the epsilon of the type torch computes in (its "opmath" type, f32 for
# f32, bf16 and f16 input), not of the input's dtype as its documentation says: bf16 input
# gets 1.19e-07, not bf16's 0.0078 (which moves an output of rows at 0.1 by up to 0.8)
_DEFAULT_RMS_EPS = torch.finfo(torch.float32).eps
# the planned calls take the modules' Parameters as they are (ops._host would learn both
# types at its first sight of each; a planned call's signature needs them known now)
_host.know_cpu_tensor_types(torch.Tensor, torch.nn.Parameter)
F = torch.nn.functional


def _servable(*tensors) -> bool:
    """Whether the TPP path takes these tensors (None entries ignored): f32 / bf16 on the CPU
    or a CUDA device (ops.norms runs its nests there; a mix of devices is its ArgumentError);
    tensor subclasses and other __torch_function__ objects are torch's to dispatch."""
    if _host.torchs_to_dispatch(tensors):
        return False
    for t in tensors:
        if t is None:
            continue
        if t.dtype not in _DTYPES or not (t.is_cpu or t.is_cuda):
            return False
    return True


def _plain(t):
    """A non-view tensor (autograd forbids in-place ops on view outputs of a Function)."""
    return t.detach() if t._is_view() else t


def _normalized(normalized_shape):
    if isinstance(normalized_shape, (int,)) and not isinstance(normalized_shape, bool):
        return (int(normalized_shape),)
    try:
        return tuple(int(d) for d in normalized_shape)
    except TypeError:
        raise ArgumentError(f"normalized_shape must be an int or a sequence of ints, got "
                            f"{normalized_shape!r}") from None


def _check_shapes(x, shape, weight, bias):
    k = len(shape)
    if k == 0 or x.dim() < k or tuple(x.shape[x.dim() - k:]) != shape:
        raise ArgumentError(f"input: expected a shape ending in {list(shape)} "
                            f"(normalized_shape), got {list(x.shape)}")
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None and tuple(t.shape) != shape:
            raise ArgumentError(f"{name}: expected shape {list(shape)} (normalized_shape), "
                                f"got {list(t.shape)}")


def _flat(x, shape, weight, bias):
    """x as (..., n) and weight, bias as (n,) for a normalized_shape of several dims."""
    if len(shape) == 1:
        return x, weight, bias
    n = math.prod(shape)
    lead = x.shape[:x.dim() - len(shape)]
    return (x.reshape(*lead, n), None if weight is None else weight.reshape(n),
            None if bias is None else bias.reshape(n))


def _too_wide(shape, *params) -> bool:
    """Whether parameter gradients may be wanted for rows wider than the equations' axis-0
    reductions take (ops.norms.MAX_GRAD_COLS): then torch serves the call."""
    return math.prod(shape) > _n.MAX_GRAD_COLS and _wants_grad(*params)


# ---------------------------------------------------------------- layer norm
class LayerNormFunction(torch.autograd.Function):
    """y = layer_norm(x, weight, bias, eps) over the last dim; x (..., n), weight/bias (n,) or
    None: LayerNormFunction.apply(x, weight, bias, eps)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _n.layer_norm_forward(x.detach(), _d(weight), _d(bias), eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.eps = eps
        return _plain(y)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():     # create_graph=True: differentiable torch ops
            return (*_torch_grads(lambda a, w, b: F.layer_norm(a, a.shape[-1:], w, b, ctx.eps),
                                  (x, weight, bias), need, dy), None)
        dx, dw, db = _n.layer_norm_backward(dy.contiguous(), x.detach(), mean, rstd,
                                            _d(weight), bias=bias is not None,
                                            need=tuple(need))
        return dx, dw, db, None


def _d(t):
    return None if t is None else t.detach()


def _torch_grads(fn, inputs, need, dy):
    """The gradients of fn(*inputs) (the saved inputs, with their autograd history) for
    `need`, as torch operations that autograd records (a backward with create_graph=True)."""
    wanted = [t for t, n in zip(inputs, need) if n and t is not None]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(fn(*inputs), wanted, dy, create_graph=True))
    return tuple(next(grads) if n and t is not None else None for t, n in zip(inputs, need))


def _planned(kind, input, last, normalized_shape, params, eps):
    """y of a call that needs no autograd, with a 1-D normalized_shape of the input's last
    dim, whose signature ops.norm_plans has a plan for (a checked call served it before), or
    None: the caller's checked path decides."""
    if (type(normalized_shape) is int and normalized_shape == last) or (
            type(normalized_shape) is tuple and len(normalized_shape) == 1
            and normalized_shape[0] == last):
        plan = _plans.signature(kind, input, tuple(params.values()), (eps, False))
        if plan is not None and not _wants_grad(input, *params.values()):
            res = _n._planned(plan, input, dict(params, x=input))
            if res is not None:
                return res["y"].reshape(input.shape)
    return None


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.layer_norm on TPPs (see the module docstring for the fallbacks)."""
    if type(input) is torch.Tensor and input.dim():
        y = _planned("ln_fwd", input, input.shape[-1], normalized_shape,
                     {"weight": weight, "bias": bias}, eps)
        if y is not None:
            return y
    shape = _normalized(normalized_shape)
    if not isinstance(input, torch.Tensor):
        raise ArgumentTypeError(f"input: expected a torch.Tensor, got {type(input).__name__}")
    if not _servable(input, weight, bias) or input.numel() == 0 or _too_wide(shape, weight,
                                                                               bias):
        return F.layer_norm(input, shape, weight, bias, eps)
    _check_shapes(input, shape, weight, bias)
    eps = _n._eps(eps)
    x, w, b = _flat(input, shape, weight, bias)
    if _wants_grad(x, w, b):
        y = LayerNormFunction.apply(x, w, b, eps)
    else:
        y = _plain(_n.layer_norm(x.detach(), _d(w), _d(b), eps))
    return y.reshape(input.shape) if len(shape) > 1 else y


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm whose forward runs on TPPs (ops.torch_norms.layer_norm)."""

    def forward(self, input):
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


# ---------------------------------------------------------------- rms norm
class RMSNormFunction(torch.autograd.Function):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim: .apply(x, weight, eps)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _n.rms_norm_forward(x.detach(), _d(weight), eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return _plain(y)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():
            return (*_torch_grads(lambda a, w: F.rms_norm(a, a.shape[-1:], w, ctx.eps),
                                  (x, weight), need, dy), None)
        dx, dw = _n.rms_norm_backward(dy.contiguous(), x.detach(), rstd, _d(weight),
                                      need=tuple(need))
        return dx, dw, None


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """torch.nn.functional.rms_norm on TPPs; eps None: torch.finfo(torch.float32).eps (what
    torch uses for f32 and bf16 input alike)."""
    if type(input) is torch.Tensor and input.dim() and input.dtype in _DTYPES:
        y = _planned("rms_fwd", input, input.shape[-1], normalized_shape, {"weight": weight},
                     _DEFAULT_RMS_EPS if eps is None else eps)
        if y is not None:
            return y
    shape = _normalized(normalized_shape)
    if not isinstance(input, torch.Tensor):
        raise ArgumentTypeError(f"input: expected a torch.Tensor, got {type(input).__name__}")
    if not _servable(input, weight) or input.numel() == 0 or _too_wide(shape, weight):
        return F.rms_norm(input, shape, weight, eps)
    _check_shapes(input, shape, weight, None)
    eps = _n._eps(_DEFAULT_RMS_EPS if eps is None else eps)
    x, w, _ = _flat(input, shape, weight, None)
    if _wants_grad(x, w):
        y = RMSNormFunction.apply(x, w, eps)
    else:
        y = _plain(_n.rms_norm(x.detach(), _d(w), eps))
    return y.reshape(input.shape) if len(shape) > 1 else y


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose forward runs on TPPs (ops.torch_norms.rms_norm)."""

    def forward(self, x):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


# ---------------------------------------------------------------- softmax
class SoftmaxFunction(torch.autograd.Function):
    """softmax over the last dim: SoftmaxFunction.apply(x); the backward reads the output."""

    @staticmethod
    def forward(ctx, x):
        y = _plain(_n.softmax(x.detach()))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, = ctx.saved_tensors
        if torch.is_grad_enabled():     # create_graph: y * (dy - sum(dy * y)) in torch ops
            return y * (dy - (dy * y).sum(-1, keepdim=True))
        return _n.softmax_backward(dy.contiguous(), y)


def softmax(input, dim=None, _stacklevel=3, dtype=None):
    """torch.nn.functional.softmax(input, dim, dtype=dtype) on TPPs (its signature; dtype:
    input is cast to it first; dim=None takes torch's own path, with its implicit-dim rule)."""
    if not isinstance(input, torch.Tensor):
        raise ArgumentTypeError(f"input: expected a torch.Tensor, got {type(input).__name__}")
    if dim is None:
        return F.softmax(input, dim, _stacklevel + 1, dtype=dtype)
    if type(input) is torch.Tensor and dtype is None and type(dim) is int and (
            dim == -1 or dim == input.dim() - 1) and not _wants_grad(input):
        res = _n._planned(_plans.signature("sm_fwd", input, (), ()), input, {"x": input})
        if res is not None:
            return res["y"].reshape(input.shape)
    if dtype is not None:
        input = input.to(dtype)
    if not _servable(input) or input.dim() == 0 or input.numel() == 0:
        return F.softmax(input, dim)
    nd = input.dim()
    if isinstance(dim, bool) or not isinstance(dim, int) or not -nd <= dim < nd:
        return F.softmax(input, dim)        # torch's own error (IndexError, TypeError)
    dim %= nd
    x = input if dim == nd - 1 else input.transpose(dim, -1)
    if _wants_grad(x):
        y = SoftmaxFunction.apply(x.contiguous() if dim != nd - 1 else x)
    else:
        y = _plain(_n.softmax(x.detach()))
    return y if dim == nd - 1 else y.transpose(dim, -1)
