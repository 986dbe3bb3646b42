"""PyTorch drop-ins running on the TPP operators: a Linear layer and an MLP, with autograd
(LayerNorm, RMSNorm and the functional layer_norm, rms_norm and softmax come from
ops.torch_norms, scaled_dot_product_attention and MultiheadAttention from ops.torch_attention;
all are re-exported here).

    import ops.torch
    layer = ops.torch.Linear(768, 3072, activation="gelu")     # torch.nn.Linear's constructor
    y = layer(x)                                               # x (..., 768) -> (..., 3072)
    net = ops.torch.MLP(32, [64, 64, 10], activation="gelu")   # a torch.nn.Sequential of Linear
    y = ops.torch.linear(x, weight, bias, "relu")              # functional form

The forward is ops.mlp_forward (bias and activation fused), or ops.mlp when no gradient is
wanted (under torch.no_grad(), or when nothing requires grad); the backward is
ops.mlp_backward, computing only the gradients autograd asks for. Three cases run on torch's
own operators instead, with torch's results and autograd: shapes with nothing to multiply
(no rows, in_features or out_features 0: y is act(bias) broadcast, or empty), tensor
subclasses and other __torch_function__ objects (torch dispatches them), and a backward
that must itself be differentiable (torch.autograd.grad(..., create_graph=True): gradient
penalties, Hessian-vector products), where the gradients are recomputed in torch ops so that
autograd can differentiate them again, to any order.

Tensors are f32, or bf16 (f32 accumulation, bf16 results, like torch); x, weight and bias of
one dtype, on one device: the CPU, or a GPU, where the same operators run their nests through
the device's backend (tpp_cuda for CUDA tensors; `module.to("cuda")` works as for torch's
modules: the weight is repacked on its new device). Anything else raises a tpp.TPPError
subclass: UnsupportedError for dtypes and for devices no backend can run (a CUDA tensor
without a usable GPU, cupy or NVRTC: the CUDA backend says which), ArgumentError for shapes,
sizes, mismatched dtypes and tensors on different devices.

Linear has torch.nn.Linear's parameters (`weight` (out, in), `bias` (out,)), initialisation
and state_dict keys, so state dicts load both ways. It packs its weight into the GEMM layout
once and reuses the packed copy while the weight's storage and version counter are unchanged
(in-place updates by optimizers, load_state_dict or `with torch.no_grad(): w.copy_(...)` bump
the version), except in training calls (module.training with grad mode on), which pack
afresh: a training loop may update weights through `p.data` (ops._host.training_call). Writes
through `weight.data` outside training bypass the version counter: call
`layer.invalidate_packed()` after them (ops.torch.invalidate_packed(model) for a model).

Linear's common call (a 2-D CPU input of the weight's dtype, the weight packed before) takes a
thin path: its checks are the packed weight's key and a few attribute reads, and it calls the
packed weight's validated plan (ops.linear's thin path) and LinearFunction through the C++
apply (see _apply); everything else goes the checked way above.
"""
from __future__ import annotations

import torch

import ops as _ops
from ops import _host
from ops.matmul import ACTIVATIONS
from ops.mlp import check_packed
from ops.mlp import forward_checked as _forward_checked
from tpp.core import checks
from tpp.core.errors import ArgumentError, ArgumentTypeError, UnsupportedError

__all__ = ["LinearFunction", "Linear", "MLP", "linear", "LayerNorm", "RMSNorm", "layer_norm",
           "rms_norm", "softmax", "scaled_dot_product_attention", "MultiheadAttention",
           "AttentionFunction"]

_DTYPES = (torch.float32, torch.bfloat16)
_TENSOR, _STRIDED = torch.Tensor, torch.strided
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)     # parameters as Linear's thin path takes
_SAVES_OUTPUT = ("sigmoid", "tanh")     # their backward reads the output, not z
_TORCH_ACTIVATION = {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
                     "sigmoid": torch.sigmoid, "tanh": torch.tanh}


_weight_key = _host.weight_key      # (storage, version counter, dtype, shape, strides)


def _check_tensor(t, name):
    """A torch tensor of a supported dtype, on any device (the backend of a device that cannot
    run it raises UnsupportedError when the nests compile or allocate)."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise UnsupportedError(f"{name}: dtype {t.dtype} is not supported; ops.torch supports "
                               f"torch.float32 and torch.bfloat16")


def _check_activation(activation):
    try:
        ok = activation in ACTIVATIONS
    except TypeError:       # unhashable or odd comparisons
        ok = False
    if not ok:
        raise ArgumentError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check(x, weight, bias, activation, packed=None):
    """Validate a linear call up front, with messages in torch's terms."""
    _check_tensor(x, "input")
    _check_tensor(weight, "weight")
    if bias is not None:
        _check_tensor(bias, "bias")
    _check_activation(activation)
    if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)):
        _host.same_device(input=x, weight=weight, bias=bias)
    if weight.dim() != 2:
        raise ArgumentError(f"weight: expected (out_features, in_features), got shape "
                            f"{tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ArgumentError(f"input: expected shape (..., {k}) for a weight of shape "
                            f"{tuple(weight.shape)}, got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ArgumentError(f"input is {x.dtype} but weight is {weight.dtype}; use one dtype "
                            f"(torch.float32 or torch.bfloat16)")
    if bias is not None:
        if bias.dtype != weight.dtype:
            raise ArgumentError(f"bias is {bias.dtype} but weight is {weight.dtype}; use one "
                                f"dtype")
        if tuple(bias.shape) != (n,):
            raise ArgumentError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
    if packed is not None:
        check_packed(packed, weight)


def _size(value, name):
    """A layer size as a Python int >= 0 (numpy integers too), else an ArgumentError."""
    return checks.integer(value, name, minimum=0, error=ArgumentError)


def _plain(t):
    """t as a tensor that is not a view: autograd forbids in-place ops on view outputs of a
    custom Function, and `nn.ReLU(inplace=True)` after a Linear must keep working."""
    return t.detach() if t._is_view() else t


def _packed(packed, weight):
    """packed (a PackedWeight of weight, checked by the caller), or weight packed now."""
    return packed if packed is not None else _ops.pack_nk(weight.detach())


def _torch_linear(x, weight, bias, activation):
    """act(x @ weight.T + bias) in torch's operators, recorded by autograd as usual."""
    return _TORCH_ACTIVATION[activation](torch.nn.functional.linear(x, weight, bias))


class LinearFunction(torch.autograd.Function):
    """y = act(x @ weight.T + bias) on TPPs: LinearFunction.apply(x, weight, bias, activation,
    packed), packed an ops.PackedWeight of weight (or None: packed here); x and weight
    non-empty (ops.torch.linear serves every shape). Differentiable to any order: a backward
    run with create_graph=True computes in torch ops (see _differentiable_grads)."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, packed):
        if x.is_neg() or weight.is_neg():   # torch's lazy negation: the kernels read memory
            x, weight = x.resolve_neg(), weight.resolve_neg()
        if type(packed) is _Checked:
            # from Linear or _linear: x, weight, bias, activation and packed validated, and a
            # gradient wanted (grad mode on, an input requiring grad)
            packed = packed.packed
            if x.dim() == 2 and x.is_contiguous() and weight.is_contiguous():
                # the common call: everything as it is; y is a new tensor, never a view
                y, saved = _forward_checked(x, (x.shape[0],), weight, bias, activation, packed)
            else:
                if x.dim() == 2:
                    lead = (x.shape[0],)
                    x2 = x if x.is_contiguous() else x.contiguous()
                else:
                    x2, lead = _host.rows(x, weight.shape[1], "input")
                y, saved = _forward_checked(x2, lead, weight if weight.is_contiguous() else
                                            weight.contiguous(), bias, activation, packed)
                y = _plain(y)
        elif not any(ctx.needs_input_grad[:3]):
            return _plain(_ops.linear(x, _packed(packed, weight), bias, activation))
        else:
            y, saved = _ops.mlp_forward(x, weight, bias, activation, packed=packed)
            y = _plain(y)
        ctx.activation = activation
        ctx.tpp_saved = saved
        # saved through autograd too, so in-place changes to them before the backward raise
        # torch's usual error instead of giving wrong gradients. The bias is kept aside: the
        # TPP backward never reads it, and torch.nn.Linear lets it change before backward.
        ctx.save_for_backward(x, weight, y if activation in _SAVES_OUTPUT else None)
        ctx.bias = bias
        ctx.bias_version = None if bias is None else bias._version
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, _ = ctx.saved_tensors        # also the version check
        need = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():             # create_graph=True
            grads = _differentiable_grads(ctx, dy, x, weight, need)
        else:
            need_x, need_w, need_b = need
            grads = _ops.mlp_backward(dy.contiguous(), ctx.tpp_saved, need_x=need_x,
                                      need_w=need_w, need_b=need_b)
        return (*grads, None, None)


def _function_apply_internals():
    """(C++ apply of LinearFunction, functorch's unwrap_if_dead, whether functorch transforms
    are active), or None on a torch without them (then _apply is Function.apply)."""
    try:
        return (super(torch.autograd.Function, LinearFunction).apply,
                torch._C._functorch.unwrap_if_dead, torch._C._are_functorch_transforms_active)
    except AttributeError:
        return None


_APPLY_INTERNALS = _function_apply_internals()


def _apply(x, weight, bias, activation, packed):
    """LinearFunction.apply(x, weight, bias, activation, packed), ~2 us faster: what
    torch.autograd.Function.apply does for a Function without setup_context (LinearFunction),
    without its Python wrapper. Outside functorch transforms that is unwrapping dead functorch
    wrappers from the tensor arguments and calling the C++ apply; under a transform (or where
    torch lacks these internals) it is Function.apply itself."""
    internals = _APPLY_INTERNALS
    if internals is None or internals[2]():
        return LinearFunction.apply(x, weight, bias, activation, packed)
    c_apply, unwrap = internals[0], internals[1]
    return c_apply(unwrap(x), unwrap(weight), None if bias is None else unwrap(bias),
                   activation, packed)


def _differentiable_grads(ctx, dy, x, weight, need):
    """(dx, dw, db) of LinearFunction (None where need is False) as torch operations that
    autograd records, from the forward recomputed in torch ops: the gradients are then
    differentiable in x, weight, bias and dy, as torch.nn.Linear's are."""
    bias = ctx.bias
    if bias is not None and bias._version != ctx.bias_version:
        raise ArgumentError("bias was modified in place after the forward; a backward with "
                            "create_graph=True recomputes the forward from it: run the "
                            "forward again after changing the bias")
    inputs = [t for t, needed in zip((x, weight, bias), need) if needed]
    y = _torch_linear(x, weight, bias, ctx.activation)
    grads = iter(torch.autograd.grad(y, inputs, dy, create_graph=True))
    return tuple(next(grads) if needed else None for needed in need)


def linear(x, weight, bias=None, activation=None, *, packed=None, **unknown):
    """act(x @ weight.T + bias) like torch.nn.functional.linear followed by the activation
    (None, "relu", "gelu" (erf form), "sigmoid", "tanh"); differentiable in x, weight, bias,
    to any order. packed: an ops.pack_nk(weight.detach()) to reuse (it must hold weight's
    current values)."""
    _host.reject_unknown(linear, unknown)
    _check(x, weight, bias, activation, packed)
    return _linear(x, weight, bias, activation, lambda _weight: packed)


def _linear(x, weight, bias, activation, pack):
    """The checked call: torch ops when there is nothing to multiply, else the TPP nests, with
    autograd's Function when a gradient is wanted. pack(weight) gives the packed weight (or
    None), called only when the nests run (an empty weight cannot be packed). Tensor
    subclasses and other __torch_function__ objects are torch's to dispatch."""
    if x.numel() == 0 or weight.numel() == 0 or \
            _host.torchs_to_dispatch((x, weight, bias)):
        return _torch_linear(x, weight, bias, activation)
    if not _host.wants_grad(x, weight, bias):   # validated (_check): straight to the GEMM
        return _plain(_ops.linear(x, _packed(pack(weight), weight), bias, activation))
    packed = pack(weight)
    return _apply(x, weight, bias, activation,
                  _Checked(packed if packed is not None else _ops.pack_nk(weight.detach())))


class _Checked:
    """A PackedWeight that _linear hands LinearFunction after validating the call (x, weight,
    bias, activation, packed): its forward then skips the checks mlp_forward makes."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class Linear(torch.nn.Module):
    """torch.nn.Linear on TPPs, with an optional fused activation.

    Linear(in_features, out_features, bias=True, device=None, dtype=None, activation=None):
    parameters `weight` (out_features, in_features) and `bias` (out_features,) initialised as
    torch.nn.Linear does (same random stream), state_dict keys "weight" and "bias". Input
    (..., in_features), output (..., out_features)."""

    __constants__ = ["in_features", "out_features", "activation"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, activation: str | None = None):
        in_features = _size(in_features, "in_features")
        out_features = _size(out_features, "out_features")
        _check_activation(activation)
        if dtype is not None and dtype not in _DTYPES:
            raise UnsupportedError(f"dtype {dtype} is not supported; ops.torch.Linear supports "
                                   f"torch.float32 and torch.bfloat16")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.weight = torch.nn.Parameter(torch.empty((out_features, in_features),
                                                     **factory_kwargs))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self._packed_cache = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.Linear.reset_parameters(self)      # kaiming_uniform_(a=sqrt(5)), fan-in bias
        self._packed_cache = None

    def invalidate_packed(self) -> None:
        """Drop the packed weight (needed only after writes through `weight.data`)."""
        self._packed_cache = None

    def packed_weight(self):
        """The weight packed for the GEMM nests, repacked only when the weight changed."""
        return self._packed_of(self.weight)

    def _packed_of(self, w):
        """packed_weight() for w, the layer's weight (read once by the caller). The key of a
        weight off the CPU names its device too, and never equals a CPU weight's key (so
        _fast_packed, which takes CPU calls only, never matches it): a parameter moved by
        module.to(...) is packed again, on its new device."""
        fresh = _host.training_call(self)
        key = _weight_key(w, fresh) if w.is_cpu else (w.device, _weight_key(w, fresh))
        cache = self._packed_cache
        if cache is not None and cache[0] == key:
            return cache[2].packed
        src = w.detach()        # shares storage and version counter with the weight; holding
        packed = _ops.pack_nk(src)  # it keeps its address from being reused by another tensor
        self._packed_cache = (key, src, _Checked(packed))
        return packed

    def _fast_packed(self, x, weight, bias, activation):
        """The packed weight (the _Checked LinearFunction takes) when this call is the common
        one and every check _check makes holds; None for anything else (other ranks, empty
        batches, tensor subclasses as input, a weight other than the one packed last, other
        devices or dtypes): the checked path then validates, explains and packs.

        The common call: activation one of ACTIVATIONS; x a strided CPU torch.Tensor (M,
        in_features), M >= 1, of the weight's dtype; the weight a CPU tensor with the key
        (storage address, version, dtype, shape, strides) of the one packed last, which
        _check validated before packing it; bias None or a CPU tensor of the weight's dtype
        and shape (out_features,)."""
        cache = self._packed_cache
        if (cache is None or not (activation is None or (type(activation) is str and
                                                          activation in ACTIVATIONS))
                or type(x) is not _TENSOR or not x.is_cpu or x.layout is not _STRIDED
                or type(weight) not in _PLAIN_TYPES or x.dtype is not weight.dtype
                or not weight.is_cpu or cache[0] != _weight_key(weight)):
            return None
        shape, wshape = x.shape, weight.shape
        if len(shape) != 2 or shape[1] != wshape[1] or not shape[0]:
            return None
        if bias is not None and (type(bias) not in _PLAIN_TYPES or not bias.is_cpu
                                 or bias.dtype is not weight.dtype or bias.shape != wshape[:1]):
            return None
        return cache[2]

    def forward(self, x):
        # the parameters read from _parameters: Module.__getattr__ costs ~0.3 us a read; the
        # attribute where they are not there (weight_norm, parametrizations, functional_call
        # with plain tensors move them out)
        params = self._parameters
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else self.bias
        activation = self.activation
        # a training call packs afresh (_packed_of), so it never takes the thin path; nor
        # does a call inside a torch.func transform (torch's own linear takes it)
        packed = None if _host.training_call(self) or _host.transforming() else \
            self._fast_packed(x, weight, bias, activation)
        if packed is None:
            _check(x, weight, bias, activation)     # before packing the weight
            return _linear(x, weight, bias, activation, self._packed_of)
        # the thin path: checks and shapes as _linear's, without its general cases
        if _host.wants_grad(x, weight, bias):
            return _apply(x, weight, bias, activation, packed)
        return _ops.linear(x, packed.packed, bias, activation)  # 2-D: a new tensor, no view

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation!r}")

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_packed_cache"] = None   # derived data: never pickled or deep-copied
        return state


class MLP(torch.nn.Sequential):
    """A stack of ops.torch.Linear layers: layer i maps to hidden_features[i], with
    `activation` fused after every layer but the last (like torchvision.ops.MLP without
    dropout or norm layers).

    MLP(in_features, hidden_features: list[int], activation="gelu", bias=True, dtype=None,
    device=None). state_dict keys: "0.weight", "0.bias", "1.weight", "1.bias", ... (one index
    per Linear; an equivalent torch.nn.Sequential with separate activation modules numbers its
    Linear layers 0, 2, 4, ...)."""

    def __init__(self, in_features: int, hidden_features, activation: str | None = "gelu",
                 bias: bool = True, dtype=None, device=None):
        in_features = _size(in_features, "in_features")
        hidden = _sizes(hidden_features)
        _check_activation(activation)
        layers = []
        width = in_features
        for i, out in enumerate(hidden):
            act = activation if i < len(hidden) - 1 else None
            layers.append(Linear(width, out, bias=bias, device=device, dtype=dtype,
                                 activation=act))
            width = out
        super().__init__(*layers)
        self.in_features = in_features
        self.hidden_features = hidden
        self.activation = activation


def _sizes(hidden_features):
    """MLP's hidden_features as a non-empty list of Python ints >= 0."""
    try:
        hidden = list(hidden_features)
    except TypeError:
        raise ArgumentError(f"hidden_features: expected a list of layer sizes, got "
                            f"{hidden_features!r}") from None
    if not hidden:
        raise ArgumentError("hidden_features: expected at least one layer size, got none")
    return [_size(h, f"hidden_features[{i}]") for i, h in enumerate(hidden)]


# the norm, softmax and attention drop-ins live in their own modules
from ops.torch_attention import (AttentionFunction, MultiheadAttention,  # noqa: E402
                                 scaled_dot_product_attention)
from ops.torch_norms import LayerNorm, RMSNorm, layer_norm, rms_norm, softmax  # noqa: E402
from ops.torch_encoder import TransformerEncoderLayer  # noqa: E402
from ops.torch_conv import Conv2d, conv2d  # noqa: E402
from ops.torch_convert import invalidate_packed, optimize  # noqa: E402

__all__ += ["TransformerEncoderLayer", "optimize", "invalidate_packed", "Conv2d", "conv2d"]
