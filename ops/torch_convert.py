"""One call to run a PyTorch model on the TPP drop-ins: ops.torch.optimize.

    import ops.torch
    fast = ops.torch.optimize(model)                      # a converted copy; model untouched
    model = ops.torch.optimize(model, inplace=True)       # converts model's own tree
    fast, summary = ops.torch.optimize(model, report=True)
    print(summary)                                        # what was swapped, what was left

optimize walks the module tree depth-first (parents before children) and replaces every
module a converter serves with its TPP version. The built-in converters, tried in this order:

    torch.nn.TransformerEncoderLayer -> ops.torch.TransformerEncoderLayer   (as a whole: its
                                        children stay as they are; if it cannot be served,
                                        its children are converted one by one instead)
    torch.nn.MultiheadAttention      -> ops.torch.MultiheadAttention
    torch.nn.Linear                  -> ops.torch.Linear
    torch.nn.LayerNorm               -> ops.torch.LayerNorm
    torch.nn.RMSNorm                 -> ops.torch.RMSNorm
    torch.nn.Conv2d                  -> ops.torch.Conv2d (padding_mode "zeros")

Only these exact classes match (a subclass may override forward, so it is left alone, and so
are parametrized or lazy modules, whose classes differ). The new module is a new object of the
TPP class holding the same attributes: the SAME Parameter and buffer objects (not copies),
the same children, hooks, training flag and state_dict hooks, so state_dict keys are
unchanged and state dicts load both ways; an optimizer built on the old model's parameters
updates the new one (the converted modules key their packed weights on each parameter's
version counter and on the count of optimizer steps taken, fused ones included, and pack
afresh in training calls, whatever updates the weights between steps: ops._host.weight_key,
training_call). Outside training, writes that
bypass the version counter (through `p.data`, or a numpy view of a parameter) are not seen
by the packed copies: call invalidate_packed(model) after them. A module reachable under
several paths is converted once (the same new object everywhere); the root itself may be
replaced, so always use the returned model.

inplace=False (the default) deep-copies the model first and converts the copy: the original
model is untouched and shares nothing with the result. inplace=True converts the model's own
tree: the parents' children are replaced, and the new modules share the parameters with the
old module objects (which stay valid, but are no longer in the tree).

Use with DistributedDataParallel: optimize the model first, then wrap it (DDP registers its
gradient hooks on the parameters, which the converted modules share and produce gradients for
through autograd as usual).

Converters: register_converter(name, matches, convert, descend=False): matches(module) ->
bool says whether the converter is for this module; convert(module) -> the new module, or
raises CannotServe(reason) when it cannot serve this one (dtype, device, an option). optimize
tries the matching converters in registration order and uses the first that converts; the
new module's children are then left as they are, unless the converter was registered with
descend=True: then optimize goes on into them (a container whose forward calls its converted
children directly, such as ops.torch_hf_layer's BERT layer). Registering a name again
replaces that converter in its place. Another module may register its own at import:
optimize imports ops.torch_hf (the Hugging Face BERT converters; it imports the layer's,
ops.torch_hf_layer) before walking,
when the `transformers` package is importable and that module exists (an ImportError there
is noted in the summary and skipped).

The summary (report=True): `swapped`, a list of (path, old class, new class, converter);
`left`, a list of (path, class, reason) for each module a converter matched but could not
serve, and each module holding parameters itself that no converter matched ("no
converter"); `notes`, other messages. str(summary) is a readable table; the root's path is
"(root)".
"""
from __future__ import annotations

import copy
import importlib
import importlib.util

import torch

__all__ = ["optimize", "register_converter", "unregister_converter", "converters",
           "CannotServe", "Summary"]

_DTYPES = (torch.float32, torch.bfloat16)


class CannotServe(ValueError):
    """Raised by a converter that matched a module but cannot serve it; str() is the
    reason (a ValueError)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Converter:
    __slots__ = ("name", "matches", "convert", "descend")

    def __init__(self, name, matches, convert, descend=False):
        self.name, self.matches, self.convert = name, matches, convert
        self.descend = bool(descend)

    def __repr__(self):
        return f"<converter {self.name!r}>"


_CONVERTERS: list = []


def register_converter(name: str, matches, convert, descend: bool = False) -> None:
    """Add a converter (see the module docstring); a name registered before is replaced in
    its place in the order. descend: optimize converts the new module's children too."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(matches) or not callable(convert):
        raise TypeError("matches and convert must be callables")
    conv = _Converter(name, matches, convert, descend)
    for i, c in enumerate(_CONVERTERS):
        if c.name == name:
            _CONVERTERS[i] = conv
            return
    _CONVERTERS.append(conv)


def unregister_converter(name: str) -> bool:
    """Remove the converter of this name; whether there was one."""
    for i, c in enumerate(_CONVERTERS):
        if c.name == name:
            del _CONVERTERS[i]
            return True
    return False


def converters() -> list:
    """The registered converters' names, in the order optimize tries them."""
    return [c.name for c in _CONVERTERS]


# ---------------------------------------------------------------- the summary
class Summary:
    """What optimize did: swapped (path, old class, new class, converter), left (path,
    class, reason), notes."""

    def __init__(self):
        self.swapped: list = []
        self.left: list = []
        self.notes: list = []

    def __str__(self):
        lines = [f"ops.torch.optimize: {len(self.swapped)} module(s) swapped, "
                 f"{len(self.left)} left"]
        if self.swapped:
            lines.append("swapped:")
            lines += [f"  {path}: {old} -> {new}" for path, old, new, _ in self.swapped]
        if self.left:
            lines.append("left as they were:")
            lines += [f"  {path}: {cls} ({why})" for path, cls, why in self.left]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self):
        return f"<Summary swapped={len(self.swapped)} left={len(self.left)}>"


def _name(cls) -> str:
    mod = cls.__module__
    if mod.startswith("torch.nn.modules"):
        mod = "torch.nn"
    return f"{mod}.{cls.__qualname__}"


# ---------------------------------------------------------------- the walk
def _load_plugins(summary):
    if importlib.util.find_spec("transformers") is None:
        return
    try:
        importlib.import_module("ops.torch_hf")
    except ImportError as exc:          # not written yet, or transformers too old for it
        if not (isinstance(exc, ModuleNotFoundError) and exc.name == "ops.torch_hf"):
            summary.notes.append(f"ops.torch_hf not loaded: {exc}")


def optimize(model: torch.nn.Module, *, inplace: bool = False, report: bool = False,
             skip_padding: bool = False):
    """model with every module a converter serves replaced by its TPP version (see the
    module docstring). Returns the model (a converted deep copy unless inplace=True), or
    (model, Summary) with report=True. skip_padding=True: converted modules that can (the
    BERT-family layers) skip the padding tokens of a padded batch and output zeros there
    (ops.torch_hf_packed)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"optimize takes a torch.nn.Module, got {type(model).__name__}")
    if type(skip_padding) is not bool:
        raise TypeError(f"skip_padding must be True or False, got {skip_padding!r}")
    summary = Summary()
    _load_plugins(summary)
    if not inplace:
        model = copy.deepcopy(model)
    done: dict = {}             # id(old module) -> new module (or the old one: kept)
    root = _walk(model, "", summary, done)
    _set_skip_padding(root, skip_padding, summary)
    return (root, summary) if report else root


def _set_skip_padding(root, on, summary):
    """Set the skip_padding option on every module of root whose class declares it (a class
    attribute _tpp_skip_padding); noted in the summary when on."""
    served = 0
    for m in root.modules():
        if hasattr(type(m), "_tpp_skip_padding"):
            m._tpp_skip_padding = on
            served += 1
    if on:
        summary.notes.append(f"skip_padding: {served} module(s) skip padding tokens "
                             f"(their outputs are zero there)")


def _walk(module, path, summary, done):
    got = done.get(id(module))
    if got is not None:
        return got
    label = path or "(root)"
    new, reasons, matched, descend = None, [], False, False
    for conv in list(_CONVERTERS):
        try:
            if not conv.matches(module):
                continue
        except Exception:       # noqa: BLE001 - a matcher that cannot judge: not its module
            continue
        matched = True
        try:
            new = conv.convert(module)
        except CannotServe as exc:
            reasons.append(exc.reason)
            continue
        if new is None:
            reasons.append(f"converter {conv.name!r} returned None")
            continue
        summary.swapped.append((label, _name(type(module)), _name(type(new)), conv.name))
        descend = conv.descend
        break
    if new is not None:
        done[id(module)] = new
        return _walk_children(new, path, summary, done) if descend else new
    done[id(module)] = module
    if matched:
        summary.left.append((label, _name(type(module)), "; ".join(reasons)))
    elif module._parameters and any(p is not None for p in module._parameters.values()):
        summary.left.append((label, _name(type(module)), "no converter"))
    return _walk_children(module, path, summary, done)


def _walk_children(module, path, summary, done):
    """_walk each child of module, replacing it where it was converted; returns module."""
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        new_child = _walk(child, f"{path}.{name}" if path else name, summary, done)
        if new_child is not child:
            module._modules[name] = new_child
    return module


# ---------------------------------------------------------------- building the new modules
def rebuild(module, cls, **attrs):
    """A new `cls` object with module's attributes: its parameters, buffers, children and
    hooks the same objects (the dicts holding them copied, so that the new module's tree can
    change without touching the old one's), plus attrs."""
    new = cls.__new__(cls)
    state = {}
    for k, v in module.__dict__.items():
        state[k] = copy.copy(v) if isinstance(v, (dict, set)) else v
    new.__dict__.update(state)
    for k, v in attrs.items():
        object.__setattr__(new, k, v)
    return new


def _check_tensors(module, tensors):
    for t in tensors:
        if t is None:
            continue
        if not t.is_cpu:
            raise CannotServe(f"tensors on {t.device}; the TPP modules run on the CPU")
        if t.dtype not in _DTYPES:
            raise CannotServe(f"dtype {t.dtype}; the TPP modules take float32 and bfloat16")
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise CannotServe(f"a parameter is a {type(t).__name__} (tensor subclass)")


def _exact(cls):
    return lambda m: type(m) is cls


def _convert_linear(m):
    from ops.torch import Linear
    if "weight" not in m._parameters:
        raise CannotServe("its weight is not a registered parameter")
    _check_tensors(m, (m.weight, m.bias))
    if m.bias is not None and m.bias.dtype != m.weight.dtype:
        raise CannotServe("weight and bias of different dtypes")
    return rebuild(m, Linear, activation=None, _packed_cache=None)


def _convert_norm(cls_name):
    def convert(m):
        import ops.torch_norms as tn
        _check_tensors(m, list(m._parameters.values()))
        return rebuild(m, getattr(tn, cls_name))
    return convert


def _convert_mha(m):
    from ops.torch_attention import MultiheadAttention
    if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
        raise CannotServe("kdim/vdim other than embed_dim, add_bias_kv or add_zero_attn: "
                          "torch's forward would run every call")
    _check_tensors(m, list(m.parameters()))
    return rebuild(m, MultiheadAttention)


def _convert_encoder_layer(m):
    from ops.torch_encoder import TransformerEncoderLayer
    new = rebuild(m, TransformerEncoderLayer, _tpp_packed={})
    reason = new.unsupported_reason()
    if reason is not None:
        raise CannotServe(reason)
    return new


def _convert_conv2d(m):
    from ops.torch_conv import Conv2d
    if m.padding_mode != "zeros":
        raise CannotServe(f"padding_mode {m.padding_mode!r}: ops.conv pads with zeros")
    _check_tensors(m, (m.weight, m.bias))
    return rebuild(m, Conv2d)


register_converter("TransformerEncoderLayer", _exact(torch.nn.TransformerEncoderLayer),
                   _convert_encoder_layer)
register_converter("MultiheadAttention", _exact(torch.nn.MultiheadAttention), _convert_mha)
register_converter("Linear", _exact(torch.nn.Linear), _convert_linear)
register_converter("LayerNorm", _exact(torch.nn.LayerNorm), _convert_norm("LayerNorm"))
if hasattr(torch.nn, "RMSNorm"):
    register_converter("RMSNorm", _exact(torch.nn.RMSNorm), _convert_norm("RMSNorm"))
register_converter("Conv2d", _exact(torch.nn.Conv2d), _convert_conv2d)


def invalidate_packed(model: torch.nn.Module) -> None:
    """Drop every packed weight copy the TPP modules in model keep (Linear's, Conv2d's, and
    the ops._host.packed_copy caches of the attention, encoder and BERT blocks): the next
    call packs the weights as they are now. Needed only after writes that bypass the
    version counters (module docstring)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"invalidate_packed takes a torch.nn.Module, got "
                        f"{type(model).__name__}")
    for m in model.modules():
        d = m.__dict__
        if "_packed_cache" in d:
            d["_packed_cache"] = None
        if d.get("_tpp_packs") is not None:
            d["_tpp_packs"] = None
        if d.get("_tpp_packed"):
            d["_tpp_packed"] = {}
        d.pop("_tpp_replay", None)      # a converted BERT layer's replays (ops.replay)
