"""Padding masks: their reduction to a key row (reduced_mask), and a converted BERT-family
layer's token-wise work on its attended tokens only (Packing: ops.torch.optimize(model,
skip_padding=True)).

A padded batch (B, L) of sentences spends a layer's projections, feed-forward GEMMs and norms
on its padding tokens as on its words. Those positions never change a word's result: they are
keys no query attends to (a padding mask), and everything else is per token. With
skip_padding a converted layer (ops.torch_hf_layer.LayerMixin) given a right-padding mask
packs the T attended tokens into one (1, T, E) batch, runs the QKV GEMM, the output
projection, the feed-forward and the norms on those rows, attention on the padded (B, L)
layout (the heads unpacked there, zeros at the padding, which the mask hides), and returns
(B, L, E) with ZEROS at the padding positions, as torch's nested-tensor encoder path and
transformers' unpadded flash attention leave them. The attended tokens' values are the padded
computation's (the same operators on the same rows, to rounding); what differs is the padding
positions' output, which a model that pools with its mask (sentence-transformers' mean
pooling, [CLS] pooling) never reads. The gradients of the parameters and of the inputs are the
padded computation's wherever the loss does not read padding positions.
all-MiniLM-L6-v2, B32 L128 (2261 attended tokens of 4096), 2 threads, Sapphire Rapids, f32
against torch eager: inference 1.11x -> 1.49-1.87x, training step 1.41x -> 1.90-1.96x (bf16
inference 1.06x -> 1.20-1.62x; its training step level: attention, still padded, and these
moves' ~200 slice copies a layer weigh more there).

A padding mask is one whose query rows are all equal (reduced_mask gives its key row, (B or 1,
1, 1, L)): bool (True: attend) or float with every value either 0 (attend) or at most half the
dtype's lowest value (transformers' finfo.min, or -inf). Packing serves right padding (each
sequence's attended tokens first, the tokenizers' default); any other mask, a batch without
padding and a mask of another length run as without the option.
"""
from __future__ import annotations

import weakref

import torch


_MASK_CACHE: list = [None]      # (weakref to the model's mask, its version, the reduced mask)


def reduced_mask(mask, b, length):
    """The attention mask for the operator: None, or a tensor broadcastable to (B, H, L, S);
    a (.., L, S) mask whose query rows are all equal (a padding mask) becomes its key row
    (.., 1, S). False where the fused path does not take it. The last reduction is cached
    (every layer gets the same mask tensor)."""
    if mask is None:
        return None
    if not (type(mask) is torch.Tensor and mask.layout is torch.strided and mask.is_cpu
            and not mask.requires_grad and mask.dim() in (2, 3, 4)):
        return False
    inference = mask.is_inference()     # no version counter: reduced afresh, never cached
    cached = _MASK_CACHE[0]
    if not inference and cached is not None and cached[0]() is mask \
            and cached[1] == mask._version:
        return cached[2]
    m = mask
    if m.dim() >= 2 and m.shape[-2] > 1 and m.shape[-2] == length:
        if m.stride(-2) == 0 or bool((m == m[..., :1, :]).all()):
            m = m[..., :1, :]
    if not inference:
        try:
            _MASK_CACHE[0] = (weakref.ref(mask), mask._version, m)
        except TypeError:
            pass
    return m


class Packing:
    """The attended tokens of a right-padded (b, length) batch: sequence i's first lengths[i]
    positions, at rows offsets[i] .. offsets[i + 1] - 1 of the packed (T, ...) rows. The moves
    copy one slice per sequence (faster than torch's index kernels here: the heads' layout of
    32 x 128 tokens, 2 threads, 1.4 ms against 8 ms for index_copy and a permuted copy; their
    backward by accumulating index_put was slower than the whole layer), each an autograd
    Function whose backward is the opposite move."""

    def __init__(self, keep):
        self.b, self.length = keep.shape
        self.lengths = keep.sum(1).tolist()
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.tokens = self.offsets[-1]

    def spans(self):
        """(sequence, its attended tokens, its first packed row) for each sequence."""
        return zip(range(self.b), self.lengths, self.offsets)

    def pack(self, x):
        """x (b, length, *rest) -> (T, *rest): the attended tokens' rows."""
        return _Move.apply(x, self, _pack, _unpack) if x.requires_grad else _pack(x, self)

    def unpack(self, t):
        """t (T, *rest) -> (b, length, *rest): t's rows at their tokens, zeros at the padding."""
        return _Move.apply(t, self, _unpack, _pack) if t.requires_grad else _unpack(t, self)

    def gather(self, x):
        """x (b, length, E) -> (1, T, E)."""
        return self.pack(x).unsqueeze(0)

    def scatter(self, t):
        """t (..., T, E) -> (b, length, E), zeros at the padding."""
        return self.unpack(t.reshape(-1, t.shape[-1]))

    def heads(self, qkv, heads: int):
        """qkv rows (T, 3 * E) -> q, k, v (b, heads, length, E / heads), zeros at the padding
        (keys the mask hides: they must be finite)."""
        out = _Heads.apply(qkv, self, heads) if qkv.requires_grad else \
            _heads(qkv, self, heads)
        return out[0], out[1], out[2]

    def merge(self, o):
        """o (b, length, heads, dh) (a view of attention's output) -> (1, T, heads * dh)."""
        return self.pack(o).reshape(1, self.tokens, -1)


def _pack(x, p):
    out = x.new_empty(p.tokens, *x.shape[2:])
    for i, n, at in p.spans():
        out[at:at + n] = x[i, :n]
    return out


def _unpack(t, p):
    out = t.new_empty(p.b, p.length, *t.shape[1:])
    for i, n, at in p.spans():
        out[i, :n] = t[at:at + n]
        out[i, n:] = 0
    return out


def _heads(qkv, p, heads):
    dh = qkv.shape[-1] // (3 * heads)
    out = qkv.new_empty(3, p.b, heads, p.length, dh)
    for i, n, at in p.spans():
        out[:, i, :, :n] = qkv[at:at + n].view(n, 3, heads, dh).permute(1, 2, 0, 3)
        out[:, i, :, n:] = 0
    return out


def _heads_grad(g, p):
    """The gradient of _heads' qkv rows from g (3, b, heads, length, dh)."""
    _, _, heads, _, dh = g.shape
    out = g.new_empty(p.tokens, 3, heads, dh)
    for i, n, at in p.spans():
        out[at:at + n] = g[:, i, :, :n].permute(2, 0, 1, 3)
    return out.view(p.tokens, 3 * heads * dh)


class _Move(torch.autograd.Function):
    """A move (_pack or _unpack) whose backward is the other one."""

    @staticmethod
    def forward(ctx, x, p, move, back):
        ctx.p, ctx.back = p, back
        return move(x, p)

    @staticmethod
    def backward(ctx, g):
        return ctx.back(g, ctx.p), None, None, None


class _Heads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, p, heads):
        ctx.p = p
        return _heads(qkv, p, heads)

    @staticmethod
    def backward(ctx, g):
        return _heads_grad(g, ctx.p), None, None


def packing(mask, b: int, length: int):
    """The Packing of a (b, length) batch under `mask` (a reduced attention mask: None, False,
    or a tensor broadcastable to (b, H, length, length)), or None where that is not a
    right-padding mask of that length (every sequence's attended tokens first) or pads
    nothing."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or \
            tuple(mask.shape[-2:]) != (1, length):
        return None
    if any(d != 1 for d in mask.shape[1:-2]):       # per-head masks differ by head
        return None
    key = mask.reshape(-1, length)
    if key.shape[0] not in (1, b) or (mask.dim() == 2 and key.shape[0] != 1):
        return None
    if key.dtype is torch.bool:
        keep = key
    elif key.is_floating_point():
        keep = key == 0
        if not bool((keep | (key <= torch.finfo(key.dtype).min / 2)).all()):
            return None                              # a bias, not a padding mask
    else:
        return None
    keep = keep.expand(b, length)
    if bool(keep.all()):
        return None
    first = torch.arange(length, device=keep.device) < keep.sum(1, keepdim=True)
    if not torch.equal(keep, first):
        return None                                  # left padding, holes
    return Packing(keep)
