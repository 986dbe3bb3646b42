"""Replaying an inference forward as the nest calls it made, for short inputs whose Python
costs more than their compute (a converted BERT layer on one 16-token sentence: ~230 us of
operator Python around ~7 nest calls; replayed, ~11 us of key and state check).

A Replayer belongs to one module and keys its graphs by a signature the module computes
(input shape and dtype, thread counts; inference_key). The first call of a signature runs
the forward plainly (it may fill the operators' caches: packed weights). The second runs it
while tpp.runtime.recording records every nest call and declared host step, and a torch
dispatch mode watches the torch operations: views and allocations only, or the recording is
refused. The recording becomes a Graph: each step's arrays are classified by address as the
input's (patched with the new input's address on a replay), the output's (a fresh tensor
every replay), scratch that torch allocated during the call (relocated into a per-thread
arena) or constant (weights, packed copies, the operators' cached buffers: kept alive by the
graph, used as they are).

The third call validates the graph before trusting it: on a seeded random input of the same
shape, with the arena filled with NaNs, the replay must give bit for bit what the forward
gives. A step the recording missed (a numpy copy an operator did not declare, work on
another thread) leaves stale or NaN data that shows there; the signature then runs the
plain forward for good. From then on (that call included) the replay: the nests run with
their tables patched, no Python of the operators in between. A module's graphs are dropped
whenever anything its forward reads changed (StateWatch, for_module).

Graphs are per thread (the constant buffers an operator reuses are per thread too) and per
signature, at most MAX_GRAPHS per module (least recently used dropped).
"""
from __future__ import annotations

import collections
import itertools
import operator
import threading

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tpp
from tpp.runtime import arrays as _arrays
from tpp.runtime import recording

from . import _host

__all__ = ["Graph", "Replayer", "StateWatch", "capture", "for_module", "inference_key",
           "validate"]

MAX_GRAPHS = 64
MAX_ARENA_BYTES = 64 << 20     # a thread's arena lives as long as the thread: large inputs,
                               # whose Python costs little beside their compute, get none
_ALIGN = 64
_INPUT, _OUTPUT, _ARENA = 0, 1, 2
_LOCAL = threading.local()
_aten = torch.ops.aten
_ALLOCATIONS = frozenset((_aten.empty.memory_format, _aten.empty_strided.default,
                          _aten.empty_like.default, _aten.new_empty.default,
                          _aten.new_empty_strided.default))
_METADATA = frozenset((_aten._unsafe_view.default,))    # views by another name


class _Watch(TorchDispatchMode):
    """The torch operations of a recording: allocations are noted (address, bytes, the step
    count when made), views pass, anything that computes refuses the recording."""

    def __init__(self, rec, born):
        super().__init__()
        self.rec, self.born = rec, born

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.rec.hosting:
            pass
        elif func in _ALLOCATIONS:
            self.born.append((out.data_ptr(), out.untyped_storage().nbytes(),
                              len(self.rec.steps)))
        elif not func.is_view and func not in _METADATA:
            self.rec.refuse(f"torch ran {func} (not a nest)")
        return out


class Graph:
    """The nest calls of one recorded forward, replayable on another input of its shape."""

    def __init__(self, steps, keep, arena_bytes, out_shape, out_dtype):
        self.steps, self.keep = steps, keep
        self.arena_bytes, self.out_shape, self.out_dtype = arena_bytes, out_shape, out_dtype
        self.validated = False

    def replay(self, x):
        """The forward of x (a contiguous tensor of the recorded shape and dtype)."""
        out = torch.empty(self.out_shape, dtype=self.out_dtype)
        bases = (x.data_ptr(), out.data_ptr(), _arena(self.arena_bytes))
        for step in self.steps:
            if step[0] is None:         # a nest: (None, entry, table, patches)
                table = step[2]
                for slot, region, offset in step[3]:
                    table[slot] = bases[region] + offset
                step[1](table)
            else:                       # host work: [fn, specs, regions, bases, arrays]
                now = tuple(bases[r] for r in step[2])
                if now != step[3]:      # views made again only where a base moved, as
                    with torch.inference_mode(False):  # normal tensors: writable in any mode
                        step[3], step[4] = now, [_view(a, bases) for a in step[1]]
                step[0](*step[4])
        return out


def _view(spec, bases):
    """A host step's argument: the constant array itself, or a view made again at its
    place in the replay's input, output or arena."""
    if type(spec) is not tuple:
        return spec
    region, offset, shape, strides, dtype, span = spec
    buf = _arrays.ffi.buffer(_arrays.ffi.cast("char *", bases[region] + offset), span)
    if isinstance(dtype, torch.dtype):
        return torch.frombuffer(buf, dtype=dtype).as_strided(shape, strides)
    return np.ndarray(shape, dtype, buffer=buf, strides=strides)


def _arena(nbytes):
    """The address of this thread's scratch arena, grown to nbytes (64-byte aligned; numpy
    memory, which no torch mode marks: an inference tensor could not be written outside
    inference mode)."""
    have = getattr(_LOCAL, "arena", None)
    if have is None or have[1] < nbytes:
        buf = np.empty(nbytes + _ALIGN, np.uint8)
        start = -buf.ctypes.data % _ALIGN
        have = _LOCAL.arena = (buf[start:start + nbytes], nbytes, buf.ctypes.data + start)
    return have[2]


def _poison_arena(nbytes):
    _arena(nbytes)
    _LOCAL.arena[0][:nbytes] = 0xFF     # NaN in f32 and in bf16


def capture(fn, x):
    """(fn(x), Graph or the reason there is none): fn(x) run as usual, recorded."""
    born = []
    with recording.recording() as rec:
        if rec is None:
            return fn(x), "recorded inside another recording"
        with _Watch(rec, born):
            out = fn(x)
    if rec.refused is not None:
        return out, rec.refused
    return out, _graph(rec, born, x, out)


def _graph(rec, born, x, out):
    if not (type(out) is torch.Tensor and out.is_contiguous() and out.numel()):
        return "the forward's result is not a fresh contiguous tensor"
    o_start = out.data_ptr()
    o_alloc = [b for b in born if b[0] == o_start and b[1] == out.nbytes]
    if not o_alloc:
        return "the forward's result is not a tensor it allocated whole"
    regions = [(x.data_ptr(), x.nbytes, _INPUT, 0), (o_start, out.nbytes, _OUTPUT, 0)]
    arena = {}                  # born allocation -> its offset in the arena
    cursor = [0]

    def place(address, nbytes, step):
        for start, size, region, base in regions:
            if start <= address and address + nbytes <= start + size:
                return region, base + address - start
            if address < start + size and start < address + nbytes:
                return "partial"
        for b in reversed(born):        # the latest allocation there when the step ran
            if b[2] <= step and b[0] <= address and address + nbytes <= b[0] + b[1]:
                if b not in arena:
                    end = cursor[0] + (-cursor[0] % _ALIGN)
                    arena[b] = end + b[0] % _ALIGN
                    cursor[0] = arena[b] + b[1]
                return _ARENA, arena[b] + address - b[0]
        return None             # constant: the graph keeps the array

    steps, keep = [], []
    for i, step in enumerate(rec.steps):
        if step[0] == "nest":
            _, nest, table, extents, _written, given = step
            keep.append(nest)       # its code lives as long as it does
            patches = []
            for k, (address, nbytes) in enumerate(extents):
                where = place(address, nbytes, i) if nbytes else None
                if where == "partial":
                    return "an array straddles the input or the output"
                if where is None:
                    keep.append(given[k])
                else:
                    patches.append((1 + k, *where))
            steps.append((None, nest._int_entry, _arrays.ffi.new("intptr_t[]", table),
                          tuple(patches)))
        else:
            _, fn, given = step
            specs = []
            for a in given:
                extent = _extent(a)
                if extent is None:
                    return "a host step took something other than numpy arrays or CPU " \
                           "tensors with non-negative strides"
                where = place(*extent, i)
                if where == "partial":
                    return "an array straddles the input or the output"
                if where is None:
                    if isinstance(a, torch.Tensor) and a.is_inference():
                        return "a host step took an inference tensor it did not make"
                    specs.append(a)
                else:
                    strides = a.stride() if isinstance(a, torch.Tensor) else a.strides
                    specs.append((*where, tuple(a.shape), strides, a.dtype, extent[1]))
            used = sorted({spec[0] for spec in specs if type(spec) is tuple})
            steps.append([fn, specs, tuple(used), None, None])
    size = max((off + b[1] for b, off in arena.items()), default=0)
    if size > MAX_ARENA_BYTES:
        return f"its scratch ({size} bytes) is over MAX_ARENA_BYTES"
    return Graph(steps, keep, size, tuple(out.shape), out.dtype)


def _extent(a):
    """(first element's address, bytes from it to the end of the last) of a numpy array or
    CPU torch tensor whose strides are not negative (tpp.runtime.arrays.extent), or None."""
    if not (isinstance(a, np.ndarray) or (type(a) is torch.Tensor and a.is_cpu
                                          and a.layout is torch.strided)):
        return None
    low, high = _arrays.extent(a)
    start = _arrays.address(a)
    if low != start and high != low:        # a negative stride reaches below it
        return None
    return start, high - start


def validate(graph, fn, x):
    """Whether graph.replay gives fn's result bit for bit on a random input shaped like x,
    from an arena of NaNs (module docstring)."""
    g = torch.Generator().manual_seed(0x7E57)
    probe = torch.randn(x.shape, generator=g, dtype=torch.float32).to(x.dtype)
    _poison_arena(graph.arena_bytes)
    got = graph.replay(probe)
    want = fn(probe)
    return type(want) is torch.Tensor and torch.equal(got, want)


class Replayer:
    """One module's graphs by signature (module docstring): run(key, fn, x) is fn(x)."""

    def __init__(self, limit=MAX_GRAPHS):
        self.limit = limit
        self._graphs = collections.OrderedDict()    # key -> Graph, or why there is none

    def run(self, key, fn, x):
        if recording.current() is not None:
            return fn(x)
        key = (threading.get_ident(), *key)
        graphs = self._graphs
        graph = graphs.get(key)
        if type(graph) is Graph:
            if not graph.validated:
                try:
                    ok = validate(graph, fn, x)
                except Exception as exc:    # noqa: BLE001  (fn raises again below if it must)
                    ok = False
                    graphs[key] = f"its validation raised {type(exc).__name__}: {exc}"
                else:
                    graphs[key] = "its replay did not reproduce the forward"
                if not ok:
                    return fn(x)
                graphs[key] = graph
                graph.validated = True
            graphs.move_to_end(key)
            return graph.replay(x)
        if graph is None:   # a first call may fill the operators' caches (packed weights):
            if len(graphs) >= self.limit:       # the second one is recorded
                graphs.popitem(last=False)
            graphs[key] = _SEEN
            return fn(x)
        if graph is not _SEEN:
            return fn(x)
        out, graphs[key] = capture(fn, x)
        return out

    def clear(self):
        """Forget every graph (the module changed)."""
        self._graphs.clear()

    def why_not(self, key):
        """Why this thread's signature key has no replay (None: it has one, or is new)."""
        got = self._graphs.get((threading.get_ident(), *key))
        return got if type(got) is str and got is not _SEEN else None


_SEEN = "seen once"     # (a key's state after its first call)


class StateWatch:
    """Whether a module tree is as it was at the last look: `changed()` is True the first
    time and whenever a module's attributes, children, parameters, buffers or hooks were
    set (to something unequal), added or removed, or a parameter or buffer was written in
    place or given other data, since the call before. It holds what it saw and compares
    with tuple equality, which takes identical objects as equal without asking them
    (~10 us for the 18 modules of a BERT layer)."""

    def __init__(self, root):
        self.root = root
        self._seen = None

    def _look(self, modules, dicts, tensors):
        return (tuple(map(type, modules)),
                tuple(itertools.chain.from_iterable(map(dict.values, dicts))),
                _versions(tensors), tuple(map(torch.Tensor.data_ptr, tensors)),
                _host.optimizer_steps())

    def changed(self) -> bool:
        seen = self._seen
        if seen is not None:
            try:
                if self._look(*seen[:3]) == seen[3]:
                    return False
            except Exception:   # noqa: BLE001  (an unequal tensor has no truth value)
                pass
        modules = list(self.root.modules())
        dicts = [d for m in modules for d in (m.__dict__, m._parameters, m._buffers,
                                               m._modules, m._forward_hooks,
                                               m._forward_pre_hooks)]
        tensors = [t for m in modules for t in (*m._parameters.values(), *m._buffers.values())
                   if t is not None]
        self._seen = (modules, dicts, tensors, self._look(modules, dicts, tensors))
        return True


_VERSION = operator.attrgetter("_version")


def _versions(tensors):
    """The tensors' version counters; an object equal to nothing where one is an inference
    tensor (which keeps none: a module with one never replays)."""
    try:
        return tuple(map(_VERSION, tensors))
    except RuntimeError:
        return object()


def inference_key(module, x, any_mode=False):
    """The part of a replay key every module shares, for a call on x: (shape, dtype, thread
    counts), or None where the call is not one to replay: train mode (unless any_mode: a
    module whose forward does not depend on it), autograd on, autocast, a torch function mode
    or torch.func transform, x not a contiguous CPU tensor."""
    if ((module.training and not any_mode) or torch.is_grad_enabled()
            or type(x) is not torch.Tensor
            or not x.is_cpu or x.layout is not torch.strided or _host.torchs_to_dispatch((x,))
            or not x.is_contiguous() or x.is_neg() or _autocast()):
        return None
    return x.shape, x.dtype, tpp.get_num_threads(), torch.get_num_threads()


def _autocast() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled()


def for_module(module) -> Replayer:
    """module's Replayer, kept in its __dict__ as "_tpp_replay" (which the converted modules'
    __getstate__ leaves out: copies and pickles start without graphs) and emptied whenever
    the module changed (StateWatch)."""
    got = module.__dict__.get("_tpp_replay")
    if got is None:
        got = module.__dict__["_tpp_replay"] = (Replayer(), StateWatch(module))
    if got[1].changed():
        got[0].clear()
    return got[0]
