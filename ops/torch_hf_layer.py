"""The Hugging Face BERT-family layer for ops.torch.optimize: a converted BertLayer whose
forward calls its converted blocks (ops.torch_hf) one after the other.

A layer is matched by its STRUCTURE, as the blocks are: `attention` with `self` and `output`,
`intermediate`, `output`, `chunk_size_feed_forward`, `feed_forward_chunk`, and transformers
5.24's forward (hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
cache, **kwargs) returning a tensor. Earlier 5.x layers (the cache named past_key_values,
tuple returns), decoders and cross-attention layers are refused with a reason, and their
blocks are converted one by one. The converter is registered with descend=True: optimize goes
on into the layer's children and converts its blocks, which LayerMixin then calls.

Where the time goes with short sequences (all-MiniLM-L6-v2, sentences one at a time, 16-128
tokens, 2 threads, Zen 5; probes timing every nest call): the compiled nests take 132 ms of
the 32 sentences in f32 and 82 ms in bf16 (1.61x), but Python took ~62 ms in both, so the
whole ran at 1.32-1.50x in bf16 before this layer (which took 3-8% off those runs). Per
BertLayer at 16 tokens: ~60 us in transformers' module calls (BertAttention,
apply_chunking_to_forward's inspect.signature, the hooks dispatch: what LayerMixin skips),
~133 us in the blocks' forwards and the operators they call (checks, plans, allocation,
views), ~50 us in the nests' own argument checks (CompiledNest._fast_table: 7 calls, 17
arrays for attention). The bf16 GEMMs there run 25-37% slower than with their weights hot
(each layer's 3.5 MB of weights comes from L3 every sentence), and the attention nest is as
fast in bf16 as in f32 at these lengths (its per-head transforms and exp, not its products,
dominate).

So an inference call without a mask replays its recorded nest calls (ops.replay) once the
layer has seen that input shape twice: the key (~1 us) and the layer's state check
(replay.StateWatch, ~10 us) are what is left of the ~230 us of Python a 16-token layer took
(the same 32 sentences, one thread: Python 51 -> 14-17 ms in all, bf16 182 -> 148-151 ms,
f32 298 -> 254 ms).
"""
from __future__ import annotations

import inspect
import sys

import torch

from ops import replay
from ops import torch_hf_packed as _packing
from ops.torch_hf import (IntermediateMixin, OutputMixin, SelfAttentionMixin, _cannot_serve,
                          _children, _Converted, _params, _swap)
from ops.torch_hf import register as _register_converters

__all__ = ["CONVERTER", "LayerMixin", "register"]


# transformers 5.24's BertLayer.forward (earlier 5.x name the cache past_key_values and are
# not converted here: their blocks still are, one by one)
_LAYER_SIGNATURE = ("hidden_states", "attention_mask", "encoder_hidden_states",
                    "encoder_attention_mask", "cache")


def _layer_matches(m) -> bool:
    att = getattr(m, "_modules", {}).get("attention")
    names, _ = _params(m)
    return (isinstance(att, torch.nn.Module) and {"self", "output"} <= att._modules.keys()
            and {"intermediate", "output"} <= m._modules.keys()
            and hasattr(m, "chunk_size_feed_forward")
            and callable(getattr(m, "feed_forward_chunk", None))
            and names[:2] == ("hidden_states", "attention_mask"))


def _layer_convert(m):
    names, var_kw = _params(m)
    if names != _LAYER_SIGNATURE or not var_kw:
        raise _cannot_serve(f"{type(m).__name__}.forward{names}: only transformers 5.24's "
                            f"layer forward {_LAYER_SIGNATURE} + **kwargs is converted (its "
                            f"blocks are, one by one)")
    ret = inspect.signature(type(m).forward).return_annotation
    if ret not in (torch.Tensor, "torch.Tensor"):
        raise _cannot_serve(f"{type(m).__name__}.forward returns {ret!r}, not a tensor")
    if getattr(m, "is_decoder", False) or getattr(m, "add_cross_attention", False) or \
            getattr(m.attention, "is_cross_attention", False):
        raise _cannot_serve("decoder / cross-attention layer")
    new = _swap(m, LayerMixin)
    new.__dict__["_tpp_attention_class"] = type(m.attention)
    return new


class LayerMixin(_Converted):
    """forward of a converted BERT-family layer: its four converted blocks called one after
    the other, as the layer's own forward would (self-attention, self-output, intermediate,
    output), without the module calls between them (BertAttention's forward, the hooks
    dispatch of four modules, apply_chunking_to_forward's signature inspection: 40-50 us a
    layer, ~14% of a 16-token MiniLM layer). Served when the blocks are this module's
    converted ones without hooks, the attention the class seen at conversion, no
    feed-forward chunking, no cross-attention inputs and no cache; every other call, and one
    whose self-attention block declines (output_attentions, a head mask, ...), runs the
    original forward. With _tpp_skip_padding (optimize's skip_padding) and a padding mask,
    the blocks run on the attended tokens only and the padding positions come out zero."""

    _tpp_attention_class = None
    _tpp_skip_padding = False   # optimize(..., skip_padding=True): see ops.torch_hf_packed

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, *cache, **kwargs):
        out = None
        if encoder_hidden_states is None and encoder_attention_mask is None and \
                all(c is None for c in cache):
            key = self._replay_key(hidden_states, attention_mask, kwargs)
            if key is None:
                out = self._fused(hidden_states, attention_mask, kwargs)
            else:
                out = replay.for_module(self).run(key, self._fused_alone, hidden_states)
        if out is None:
            return super().forward(hidden_states, attention_mask, encoder_hidden_states,
                                   encoder_attention_mask, *cache, **kwargs)
        return out

    def _replay_key(self, x, mask, kwargs):
        """The signature under which an inference call replays its nests (ops.replay), or
        None: no mask, no other inputs (replay.inference_key has the rest)."""
        if mask is not None or any(v is not None for v in kwargs.values()) or \
                not _capture_idle():
            return None
        return replay.inference_key(self, x)

    def _fused_alone(self, x):
        return self._fused(x, None, {})

    def _fused(self, x, mask, kwargs):
        if self.chunk_size_feed_forward:
            return None
        att, inter, out = _children(self, "attention", "intermediate", "output")
        if type(att) is not self._tpp_attention_class:
            return None
        sa, so = _children(att, "self", "output")
        if not (isinstance(sa, SelfAttentionMixin) and isinstance(so, OutputMixin)
                and isinstance(inter, IntermediateMixin) and isinstance(out, OutputMixin)):
            return None
        if _live_hooks(att, sa, so, inter, out):
            return None
        packed = None
        if self._tpp_skip_padding and x.dim() == 3:
            b, length = x.shape[:2]
            packed = _packing.packing(_packing.reduced_mask(mask, b, length), b, length)
        if packed is None:
            a = sa._fused(x, mask, kwargs)
        else:       # the attended tokens only (ops.torch_hf_packed)
            x = packed.gather(x)
            a = sa._fused(x, mask, kwargs, packed)
        if a is None:
            return None
        # past the attention, a block that declines runs its original forward (what the
        # layer's own forward would have called)
        h = so._fused(a, x)
        if h is None:
            h = so._tpp_base.forward(so, a, x)
        i = inter.forward(h)
        y = out._fused(i, h)
        if y is None:
            y = out._tpp_base.forward(out, i, h)
        return y if packed is None else packed.scatter(y)


def _live_hooks(*modules) -> bool:
    """Whether a forward hook of these modules would do anything now. transformers' output
    capturing hooks, installed for good on every layer and self-attention block by one call
    with output_hidden_states or output_attentions, do nothing while no capture is under way:
    only then are they left out (so that one such call does not leave the model on its
    original forward for good)."""
    for m in modules:
        if m._forward_pre_hooks:
            return True
        for hook in m._forward_hooks.values():
            if not (getattr(hook, "__name__", None) == "output_capturing_hook"
                    and getattr(hook, "__module__", None) == _CAPTURING and _capture_idle()):
                return True
    return False


_CAPTURING = "transformers.utils.output_capturing"


def _capture_idle() -> bool:
    """Whether no transformers output capture is under way on this thread (the collector of
    the model's call is None or an empty dict: nothing requested)."""
    collector = getattr(sys.modules.get(_CAPTURING), "_active_collector", None)
    return collector is None or not collector.get()


# (name, matches, convert); optimize goes on into the layer's blocks (descend)
CONVERTER = ("hf_bert_layer", _layer_matches, _layer_convert)


def register():
    """Register CONVERTER with ops.torch_convert, descending (done at import; False where that
    module is not there)."""
    return _register_converters((CONVERTER,), descend=True)


_REGISTERED = register()
