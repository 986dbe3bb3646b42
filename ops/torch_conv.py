"""PyTorch drop-ins for 2-D convolution on the TPP operators (ops.conv).

    import ops.torch_conv as tc             # (ops.torch may re-export these names)
    conv = tc.Conv2d(64, 64, 3, padding=1)  # torch.nn.Conv2d's constructor, parameters, init,
    y = conv(x)                             #   state_dict and repr
    y = tc.conv2d(x, w, b, stride=2, padding=1)   # torch.nn.functional.conv2d's signature

Conv2d subclasses torch.nn.Conv2d and replaces only `forward`. Forward and backward run
ops.conv's BRGEMM nests through an autograd.Function (the forward keeps x, its blocked copy
for the weight gradient, and the weight; the backward computes only the gradients autograd
asks for: data, weight, bias); where autograd records nothing (no_grad, inference_mode, or
no input or parameter requiring a gradient) the forward runs without it, keeping nothing.
Conv2d packs its weight once (forward and, at the first backward, the data gradient's
layout) and repacks when the weight's version counter moves (an in-place update such as an
optimizer step) or the parameter is replaced. 1x1 layers that ops.conv runs as GEMMs on NCHW
(no padding, groups 1, f32 or bf16: ops.conv_pointwise) read the weight as it is: nothing is
packed for them, but for their images of at most 256 output pixels, whose forward (7x7) or
data gradient (7x7, 14x14) takes the blocked nests (ops.conv.serves_pointwise).

CUDA tensors run the same nests on their GPU (ops.conv's device path: the results on the
input's device, the module's packed weights kept per device; tensors on different devices:
ArgumentError naming them).

Served by torch's own implementation instead (same results, torch's autograd): tensors
neither on the CPU nor on a CUDA device, dtypes other than float32 / bfloat16 (float64,
float16, ...) or mixed dtypes, tensor subclasses and other __torch_function__ objects
(torch dispatches them), empty tensors, inputs that are not 3-D or 4-D, padding_mode
other than "zeros" (the module), and a backward that must itself be differentiable
(create_graph=True: the gradients are recomputed with torch's operators). Every groups
value is served (groups 1, grouped and depthwise; the depthwise case runs 1-channel blocks,
correct but not yet fast). Invalid hyper-parameters raise tpp.core.errors.ArgumentError (a
ValueError).
"""
from __future__ import annotations

import torch

from . import _host
from . import conv as _c
from . import replay
from .conv_memo import ForwardMemo
from ._host import wants_grad as _wants_grad, weight_key as _weight_key

__all__ = ["Conv2d", "conv2d", "Conv2dFunction"]

# a remembered call's signature (ops.conv_memo) needs the tensor types known from the start
_host.know_cpu_tensor_types(torch.Tensor, torch.nn.Parameter)
_DTYPES = (torch.float32, torch.bfloat16)
F = torch.nn.functional


def _servable(x, weight, bias) -> bool:
    """Whether the TPP path takes these tensors: f32 / bf16 of one dtype on the CPU or a CUDA
    device (ops.conv runs its nests there; a mix of devices is its ArgumentError); tensor
    subclasses and other __torch_function__ objects are torch's to dispatch."""
    if x.dim() not in (3, 4) or weight.dim() != 4 or x.numel() == 0:
        return False
    if _host.torchs_to_dispatch((x, weight, bias)):
        return False
    for t in (x, weight, bias):
        if t is not None and (t.dtype != x.dtype or t.dtype not in _DTYPES
                              or not (t.is_cpu or t.is_cuda)):
            return False
    return True


def _key(w, groups, fresh=False):
    """The key of a weight's packed copies: _weight_key and the groups they were packed for
    (a module's groups may change after construction), with the device for a weight off the
    CPU (a parameter moved by module.to(...) is packed again, on its new device)."""
    return (groups, _weight_key(w, fresh) if w.is_cpu else (w.device, _weight_key(w, fresh)))


def _d(t):
    return None if t is None else t.detach()


class _Packs:
    """A module's packed weights (forward, and the data gradient's flipped transpose, packed
    at its first backward), valid while the weight's key (storage, version counter, dtype,
    shape, strides) is `key`: an in-place update (an optimizer step) bumps the version."""
    __slots__ = ("key", "src", "forward", "transposed")

    def __init__(self, key, src):
        self.key, self.src, self.forward, self.transposed = key, src, None, None


def _forward(x, weight, bias, stride, padding, dilation, groups, packs, memo=None):
    """(y, xb, wb, packs): ops.conv's forward of x (4-D) and what a backward reuses (see
    ops.conv._conv2d), packs None where the layer ran as GEMMs on the weight as it is (a 1x1
    layer: nothing packed), else with its forward packed weight, made at its first use.
    memo: the module's ops.conv_memo.ForwardMemo (None: the functional form)."""
    def pack():
        if packs.forward is None:
            packs.forward = _c.pack_weight(weight.detach(), groups, _c._host.dtype_of(
                weight, "weight"))
        return packs.forward
    y, xb, wb = _c._conv2d(x.detach(), weight.detach(), _d(bias), stride, padding, dilation,
                           groups, None, None, None if packs is None else pack, memo)
    return y, xb, wb, None if wb is None else packs


class Conv2dFunction(torch.autograd.Function):
    """Conv2dFunction.apply(x, weight, bias, stride, padding, dilation, groups[, packs[,
    memo]]), x 4-D; packs a _Packs of this weight (Conv2d's cache) or None (packed per call);
    memo Conv2d's ForwardMemo or None."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, packs=None, memo=None):
        y, xb, wb, packs = _forward(x, weight, bias, stride, padding, dilation, groups, packs,
                                    memo)
        ctx.save_for_backward(x, weight, bias)
        ctx.hyper = (stride, padding, dilation, groups)
        ctx.packs = packs
        # the blocked x the forward made: the weight gradient reads it (no second conversion);
        # its packed weight where the data gradient's is made from it (conv.pack_transposed)
        ctx.xb = xb if ctx.needs_input_grad[1] else None
        ctx.wb = wb if ctx.needs_input_grad[0] else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors       # (also torch's in-place version check)
        stride, padding, dilation, groups = ctx.hyper
        need = ctx.needs_input_grad[:3]
        xb, wb, packs, ctx.xb, ctx.wb = ctx.xb, ctx.wb, ctx.packs, None, None
        if torch.is_grad_enabled():     # create_graph=True: differentiable torch ops
            return (*_torch_grads(x, weight, bias, ctx.hyper, need, dy),
                    None, None, None, None, None, None)
        packed = None
        if need[0] and not _c.serves_pointwise(x, weight, *ctx.hyper, forward=False):
            cached = packs is not None and packs.key == _key(weight, groups)
            if cached and packs.transposed is not None:
                packed = packs.transposed
            else:
                # a weight packed for this call only goes to the thread's scratch
                packed = _c.pack_transposed(weight.detach(), groups, _c._host.dtype_of(
                    weight, "weight"), wb, scratch=None if cached else "conv_dx_weight")
                if cached:
                    packs.transposed = packed
        dx, dw, db = _c.conv2d_backward(
            dy.contiguous(), x.detach(), weight.detach(), stride=stride, padding=padding,
            dilation=dilation, groups=groups,
            need=(need[0], need[1], bool(need[2]) and bias is not None), packed=packed,
            xb=xb)
        return dx, dw, db, None, None, None, None, None, None


def _torch_grads(x, weight, bias, hyper, need, dy):
    inputs = (x, weight, bias)
    wanted = [t for t, n in zip(inputs, need) if n and t is not None]
    with torch.enable_grad():
        y = F.conv2d(x, weight, bias, *hyper)
        grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=True))
    return tuple(next(grads) if n and t is not None else None for t, n in zip(inputs, need))


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d on the TPP nests (see the module docstring)."""
    return _conv2d(input, weight, bias, stride, padding, dilation, groups, None)


def _conv2d(input, weight, bias, stride, padding, dilation, groups, packs, memo=None):
    # torch takes an int, a pair or a string; ops.conv's (top, bottom, left, right) 4-tuple
    # is torch's to refuse
    if not _servable(input, weight, bias) or (
            isinstance(padding, (tuple, list)) and len(padding) != 2):
        return F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    squeeze = input.dim() == 3
    x = input.unsqueeze(0) if squeeze else input
    if _wants_grad(x, weight, bias):
        y = Conv2dFunction.apply(x, weight, bias, stride, padding, dilation, groups, packs,
                                 memo)
    else:   # nothing to differentiate: the forward without autograd.Function's cost
        y = _forward(x, weight, bias, stride, padding, dilation, groups, packs, memo)[0]
    return y.squeeze(0) if squeeze else y


class Conv2d(torch.nn.Conv2d):
    """torch.nn.Conv2d whose forward runs ops.conv (padding_mode "zeros"; others: torch).
    The weight is packed once and reused until it changes (its version counter: an in-place
    update, e.g. an optimizer step, repacks at the next call; so does a new tensor). A call
    of the same input shape, dtypes and hyper-parameters as the last one skips the checks
    and per-shape decisions that call made (ops.conv_memo); a call without autograd replays
    the nest calls it made, from its input shape's third call (ops.replay: 16 -> 16 channels
    3x3 on one 8 x 8 image, one thread: ~30 -> ~9 us, torch's ~13)."""

    _tpp_packs = None
    _tpp_memo = None

    def forward(self, input):
        if self.padding_mode != "zeros":
            return super().forward(input)
        key = replay.inference_key(self, input, any_mode=True)     # (no dropout here)
        if key is not None:     # an inference call: replayed once seen twice (ops.replay)
            return replay.for_module(self).run(key, self._forward, input)
        return self._forward(input)

    def _forward(self, input):
        w = self.weight
        packs = None
        if (w.is_cpu or w.is_cuda) and w.dtype in _DTYPES and w.dim() == 4:
            key = _key(w, self.groups, _host.training_call(self))   # training: afresh
            packs = self._tpp_packs
            if packs is None or packs.key != key:
                # src shares the weight's storage: holding it keeps the address from reuse
                packs = self._tpp_packs = _Packs(key, w.detach())
        memo = self._tpp_memo
        if memo is None:
            memo = self._tpp_memo = ForwardMemo()
        return _conv2d(input, w, self.bias, self.stride, self.padding, self.dilation,
                       self.groups, packs, memo)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_tpp_packs", None)   # derived data: never pickled or deep-copied
        state.pop("_tpp_memo", None)
        state.pop("_tpp_replay", None)
        return state
