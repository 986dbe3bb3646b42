"""Deep-learning operators built only from TPPs, composed in compiled loop nests.

    import ops
    y = ops.matmul(a, b)                      # a (M, K) @ b (K, N), f32 or bf16
    y = ops.linear(x, w, bias, "gelu")        # torch.nn.functional.linear + activation
    y, saved = ops.mlp_forward(x, w, bias, "gelu"); dx, dw, db = ops.mlp_backward(dy, saved)

    y = ops.layer_norm(x, w, b); y = ops.rms_norm(x, w); p = ops.softmax(x, mask=m, scale=s)
                                              # equations over row blocks (ops.norms)
    out, lse = ops.attention_forward(q, k, v, causal=True)   # fused flash attention
    dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, causal=True)

PyTorch drop-ins live in ops.torch (imported on demand: torch is optional).

Bad input is a tpp.TPPError subclass at every entry point: a wrong type, shape or dtype, an
out= torch tensor that requires grad while autograd records, and an unknown keyword argument
(an ArgumentError naming the accepted ones, never a TypeError). Sizes may be numpy integers.
"""
from .conv import conv2d, conv2d_backward
from .flash_attention import attention, attention_backward, attention_forward
from .matmul import ACTIVATIONS, Blocking, choose_blocking, linear, matmul
from .mlp import Saved, mlp, mlp_backward, mlp_forward
from .norms import (bias_act_dropout, bias_act_dropout_backward, layer_norm,
                    layer_norm_backward, layer_norm_forward, rms_norm, rms_norm_backward,
                    rms_norm_forward, softmax, softmax_backward)
from .packing import PackedWeight, pack_kn, pack_nk
from .autotune import tune

__all__ = ["matmul", "linear", "Blocking", "choose_blocking", "PackedWeight", "pack_kn",
           "pack_nk", "ACTIVATIONS", "mlp", "mlp_forward", "mlp_backward", "Saved",
           "layer_norm", "layer_norm_forward", "layer_norm_backward", "rms_norm",
           "rms_norm_forward", "rms_norm_backward", "softmax", "softmax_backward",
           "bias_act_dropout", "bias_act_dropout_backward", "attention", "attention_forward",
           "attention_backward", "conv2d", "conv2d_backward", "tune"]
