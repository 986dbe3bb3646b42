"""Loop nests compiled whole: declare loops and blocked tensors, call TPPs on blocks.

    Mb, Nb, Kb, bm, bn, bk = 8, 8, 16, 64, 64, 64
    nest = tpp.LoopNest("aBC", a=(0, Kb, 8), b=Mb, c=Nb)  # a: k blocks, 8 at a time
    a, b, c = nest.vars
    A = nest.tensor("A", (Mb, Kb, bm, bk))               # blocked, C-contiguous
    B = nest.tensor("B", (Nb, Kb, bk, bn))
    C = nest.tensor("C", (Nb, Mb, bm, bn))
    mm = tpp.brgemm(bm, bn, bk, beta=1)
    nest.call(tpp.unary("zero", bm, bn), C[c, b], when=(a == 0))
    nest.call(mm, A[b, a], B[c, a], C[c, b], count=8, stride_a=bm * bk, stride_b=bk * bn)
    gemm = nest.compile()
    gemm(A=a_blocks, B=b_blocks, C=c_blocks)             # or positionally, in declaration order

    M = tpp.size("M")                                    # a size, given at call time
    rows = tpp.LoopNest("A", a=(M + 63) // 64)           # loop bounds and shapes may use it
    x, y = rows.tensor("x", (M, 128)), rows.tensor("y", (M, 128))
    ...
    rows.compile()(x_any_m, y_any_m)                     # M from the arrays' shapes

Loops are given as keywords named a, b, c, ... in order: `n` (range(n)), `(start, stop)`,
`(start, stop, step)`, `(start, stop, step, blocks)` or a `Loop`. See tpp.core.loop_spec for the
order string (upper case: parallel; a repeated letter: another blocking level) and for what
the body sees. Loop expressions combine the variables with +, -, * by ints and // by positive
ints; comparisons of them guard calls (when=(a == 0) & (b < 2)). Indexing a tensor with loop
expressions gives the address of the element there (fewer indices than dimensions: the start
of that sub-block). Numbers (loop bounds, shapes, counts, threads=) are any integral values.
Sizes (`tpp.size(name)`) are symbols a nest takes at call time: loop stops, tensor dimensions,
BRGEMM counts, addresses and conditions may use them. A tensor dimension that is exactly a
size gives it from the array's shape; other sizes are keywords of the call (nest(x, M=5)).
Every address a call can touch is checked against its tensor when the nest is built (or, with
sizes, once per new assignment of sizes when it is called: tpp.core.loop_bounds), and every array
against its tensor's shape and dtype when the nest is called, so a nest never reads or writes
outside the arrays it is given.
"""
from __future__ import annotations

import functools
import math
import threading

import numpy as np

from . import arrays, recording as _recording, registry
from ..core import checks, loop_bounds
from ..core import dtypes as _dt
from ..core.errors import ArgumentError, SpecError, UnsupportedError
from .device import CPU
from .aliasing import aliasable_pairs
from .lru import LRU
from ..core.loop_spec import (LETTERS, Address, Affine, Call, Expr, Loop, LoopNestSpec, Tensor,
                        affine, conditions, parse_order, raw_operands, seed_only_sizes,
                        size_symbol, sizes_in)

_RESERVED = ("threads",)     # keywords of a nest's call that no size may take


def size(name: str) -> Expr:
    """The size called `name` (an identifier): a loop expression whose value each call of a
    nest gives, from an array dimension declared as exactly this size or as a keyword."""
    if not isinstance(name, str) or not name.isidentifier() or name in _RESERVED:
        raise SpecError(f"a size name is an identifier other than {', '.join(_RESERVED)}, "
                        f"got {name!r}")
    return size_symbol(name)


class TensorRef:
    """A declared tensor inside a nest under construction; index it to address its elements."""

    def __init__(self, nest, index: int, tensor: Tensor):
        self._nest, self.index, self.tensor = nest, index, tensor

    def __getitem__(self, idx) -> Address:
        idx = idx if isinstance(idx, tuple) else (idx,)
        shape = self.tensor.shape
        if len(idx) > len(shape):
            raise SpecError(f"tensor {self.tensor.name!r} has {len(shape)} dimensions, "
                            f"indexed with {len(idx)}")
        offset = Expr.of(0)
        for i, stride in zip(idx, self.tensor.strides()):
            offset = offset + Expr.of(i) * stride
        return Address(self.index, offset.affine)

    def at(self, element_offset) -> Address:
        """The address element_offset elements (a loop expression) past the first."""
        return Address(self.index, affine(element_offset))


class LoopNest:
    def __init__(self, order: str, **loops):
        """Loops are keywords a, b, c, ... in order; any other keyword is a SpecError."""
        checks.reject_unknown("tpp.LoopNest", {k: v for k, v in loops.items()
                                               if k not in LETTERS},
                              ("a, b, c, ... (the loops, in order)",))
        names = LETTERS[:len(loops)]
        if tuple(loops) != tuple(names):
            raise SpecError(f"loops must be given as keywords {', '.join(names) or 'a, b, ...'}"
                            f" in that order, got {', '.join(loops)}")
        self.loops = tuple(Loop.of(v) for v in loops.values())
        self.order = order
        parse_order(order, self.loops)          # fail early on a bad order string
        self.vars = tuple(Expr(Affine(((ch, 1),), 0)) for ch in names)
        self._tensors: list = []
        self._calls: list = []

    def tensor(self, name: str, shape, dtype="f32", **unknown) -> TensorRef:
        """Declare a C-contiguous tensor the nest is given at call time: shape is a sequence
        of integral values >= 1 or size expressions (tpp.size), and a tensor without sizes
        must fit in the address space."""
        checks.reject_unknown("LoopNest.tensor", unknown, ("dtype",))
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"tensor name must be an identifier, got {name!r}")
        if any(t.name == name for t in self._tensors):
            raise SpecError(f"tensor {name!r} declared twice")
        tensor = Tensor(name, shape, _dt.lookup(dtype))
        self._tensors.append(tensor)
        return TensorRef(self, len(self._tensors) - 1, tensor)

    def call(self, kernel, *operands, when=(), count=1, stride_a=0, stride_b=0, bias=None,
             mask=None, seed=None, **unknown):
        """Call a primitive (a tpp kernel or spec) on addresses. A unary/binary primitive
        takes one address per operand, in its operand order; a BRGEMM (stride batch mode)
        takes a, b, c and optionally bias=, mask=, with int count= and element strides.
        when= is a condition, conditions joined with &, or a tuple of them (all must hold)."""
        checks.reject_unknown("LoopNest.call", unknown, checks.keywords_of(LoopNest.call))
        spec = getattr(kernel, "spec", kernel)
        when = conditions(when)
        for a in operands:
            if not isinstance(a, Address):
                raise SpecError(f"operands are tensor addresses such as A[i, j], got {a!r}")
        if getattr(spec, "family", None) == "brgemm":
            args = self._brgemm_args(spec, operands, count, stride_a, stride_b, bias, mask)
        elif getattr(spec, "family", None) in ("unary", "binary", "equation"):
            ops = spec.operands()
            if len(operands) != len(ops):
                raise SpecError(f"{spec.op} takes {len(ops)} operands "
                                f"({', '.join(o.name for o in ops)}), got {len(operands)}")
            args = tuple(operands)
            if spec.scalars:
                if seed is None:
                    raise SpecError(f"{spec.op} in a nest needs seed= (an int or loop expression)")
                args += (affine(seed),)
        else:
            raise SpecError(f"a nest calls tpp primitives (kernels or specs), got {kernel!r}")
        for k, (arg, op) in enumerate(zip(args, raw_operands(spec))):
            if isinstance(arg, Address):
                want = None if op is None else op.dtype
                have = self._tensors[arg.tensor].dtype
                if want is not None and want != have:
                    raise SpecError(f"{spec.op} operand {k} is {want}, tensor "
                                    f"{self._tensors[arg.tensor].name!r} is {have}")
        self._calls.append(Call(spec, args, when))

    @staticmethod
    def _brgemm_args(spec, operands, count, stride_a, stride_b, bias, mask):
        if spec.batch != "stride":
            raise UnsupportedError("a nest calls BRGEMM in stride batch mode")
        if len(operands) != 3:
            raise SpecError(f"brgemm takes a, b, c addresses, got {len(operands)}")
        counts = []
        for name, v in (("count", count), ("stride_a", stride_a), ("stride_b", stride_b)):
            if isinstance(v, Expr) and v.affine.terms and v.affine.fixed:
                counts.append(v)     # a size expression: checked for each call's sizes
                continue
            n = checks.as_int(v)
            if n is None or not 0 <= n <= checks.INT64_MAX:
                raise SpecError(f"brgemm {name} must be an int in [0, 2**63) or an expression "
                                f"of sizes, got {v!r}")
            counts.append(n)
        if (bias is None) != (not spec.bias) or (mask is None) != (not spec.bitmask):
            raise SpecError("brgemm: pass bias= exactly when the spec has a bias, and mask= "
                            "exactly when it writes a bitmask")
        return tuple(operands) + (bias, mask) + tuple(affine(n) for n in counts)

    def spec(self) -> LoopNestSpec:
        if not self._calls:
            raise SpecError("the nest's body calls nothing")
        used = [lp.stop for lp in self.loops if lp.symbolic]
        used += [d for t in self._tensors for d in t.shape if isinstance(d, Affine)]
        for call in self._calls:
            used += [c.expr for c in call.when]
            used += [a.offset if isinstance(a, Address) else a for a in call.args
                     if a is not None]
        sizes = tuple(sorted(sizes_in(used)))
        clash = set(sizes) & {t.name for t in self._tensors}
        if clash:
            raise SpecError(f"{', '.join(sorted(clash))} names both a size and a tensor; the "
                            f"call takes both as keywords")
        return LoopNestSpec(self.loops, self.order, tuple(self._tensors), tuple(self._calls),
                            sizes)

    def compile(self) -> "CompiledNest":
        return compiled(self.spec())


_COMPILED = LRU(256, "loop_nests")   # LoopNestSpec -> CompiledNest


def compiled(spec: LoopNestSpec) -> "CompiledNest":
    """The CompiledNest of a spec, cached (the 256 most recently used specs keep theirs)."""
    nest = _COMPILED.get(spec)
    if nest is None:
        nest = _COMPILED[spec] = CompiledNest(spec)
    return nest


class CompiledNest:
    """A compiled loop nest: call it with one array per declared tensor, and the sizes the
    arrays do not give as keywords (nest(x, y), nest(x=x, y=y), nest(x, y, M=5))."""

    _MEMO = 1024     # shape signatures (and size assignments) remembered as checked

    def __init__(self, spec: LoopNestSpec):
        self.spec = spec
        self.names = tuple(t.name for t in spec.tensors)
        self.sizes = spec.sizes
        self._seed_only = seed_only_sizes(spec)
        written = set()
        for call in spec.calls:
            for arg, op in zip(call.args, raw_operands(call.spec)):
                if isinstance(arg, Address) and op is not None and op.role != "in":
                    written.add(arg.tensor)
        self._written = frozenset(written)
        self._aliasable = aliasable_pairs(spec, self._written)
        # the host backend's code of the nest and every kernel it calls (one library): its
        # entry takes a call table, `template` filled in but for the tensors, threads and sizes
        host = self._host = registry.for_device(CPU).compile_nest(spec, CPU)
        self._slots, self._template, self._entry = host.slots, host.template, host.entry
        self._has_runtime, self._num_threads = host.parallel, host.num_threads
        self._devices = LRU(8, "device_nests")      # Device -> that backend's compiled nest
        # sizes a tensor dimension gives: (tensor, dim, size name) for each dim that is exactly
        # one size; the others must come as keywords
        self._binders = tuple((k, d, dim.terms[0][0][1:]) for k, t in enumerate(spec.tensors)
                              for d, dim in enumerate(t.shape)
                              if isinstance(dim, Affine) and not dim.const
                              and len(dim.terms) == 1 and dim.terms[0][1] == 1
                              and isinstance(dim.terms[0][0], str))
        bound = {name for _, _, name in self._binders}
        self._inferable = bound == set(self.sizes)
        # sizes no tensor gives that only seeds use (a dropout's SEEDLO, SEEDHI): given as
        # keywords on every call, they change no address, so the fast path takes them too,
        # into their slots of the size values (position in spec.sizes)
        free = [name for name in self.sizes if name not in bound]
        self._seed_slots = tuple((name, self.sizes.index(name)) for name in free) \
            if free and set(free) <= self._seed_only else ()
        self._seed_names = frozenset(name for name, _ in self._seed_slots)
        # the common call, checked in a few Python operations: numpy arrays of exactly the
        # declared dtype, C-contiguous, writable where written, of a shape signature already
        # validated by `bind` (with the sizes it gives, and the arrays' byte sizes)
        self._plain = tuple((t.dtype.numpy, k in written) for k, t in enumerate(spec.tensors))
        self._position = {name: k for k, name in enumerate(self.names)}
        self._signatures: dict = {}     # tuple of array shapes -> ([size pointers], nbytes)
        self._checked: set = set()      # size tuples that passed loop_bounds.check
        if not spec.sizes:
            self._remember(tuple(t.shape for t in spec.tensors), (),
                           tuple(t.size * t.dtype.itemsize for t in spec.tensors))

    def __repr__(self):
        return f"<tpp loop nest {self.spec.order} over {', '.join(self.names)}>"

    def bind(self, *args, threads=None, **named) -> np.ndarray:
        """The call table for these host arrays and sizes (validated), for `run`; threads=
        (any integral value in 1..MAX_THREADS) overrides tpp.get_num_threads() for this call.
        Arrays on another device: UnsupportedError (call the nest itself)."""
        device, addresses, values, threads, _ = self._validate(args, threads, named)
        if not device.is_host:
            raise UnsupportedError(f"bind() makes the host's call table; the arrays are on "
                                   f"{device}: call the nest instead")
        return self._host.table(addresses, values, threads)


    def _validate(self, args, threads, named) -> tuple:
        """(device, addresses, size values, threads, any torch) of a call, after every check
        (arrays, sizes, bounds, overlap)."""
        if len(args) > len(self.names):
            raise ArgumentError(f"the nest takes {len(self.names)} arrays "
                                f"({', '.join(self.names)}), got {len(args)}")
        given, explicit = dict(zip(self.names, args)), {}
        for name, value in named.items():
            if name in self.sizes:
                explicit[name] = value
                continue
            if name not in self.names:
                sizes = f"; sizes {', '.join(self.sizes)}" if self.sizes else ""
                raise ArgumentError(f"the nest has no tensor {name!r} (it has "
                                    f"{', '.join(self.names)}{sizes})")
            if name in given:
                raise ArgumentError(f"tensor {name!r} given twice")
            given[name] = value
        found, bound = [], []
        for k, tensor in enumerate(self.spec.tensors):
            if tensor.name not in given:
                raise ArgumentError(f"missing array for tensor {tensor.name!r}")
            arr = arrays.as_array(given[tensor.name], tensor.name)
            bound.append((tensor.name, arr))
            found.append(_check(tensor, arr, k in self._written))
        device = arrays.common_device(bound)
        shapes = tuple(shape for _, shape in found)
        values = self._size_values(shapes, explicit)
        addresses = [address for address, _ in found]
        nbytes = tuple(math.prod(shape) * t.dtype.itemsize
                       for shape, t in zip(shapes, self.spec.tensors))
        self._check_overlap(addresses, nbytes)
        if device.is_host and (self._inferable and not explicit or self._seed_slots
                               and explicit.keys() == self._seed_names):
            self._remember(shapes, values, nbytes)
        if threads is not None:
            threads = checks.thread_count(threads, "threads")
        if not self._has_runtime:
            threads = 1
        threads = self._num_threads() if threads is None else threads
        return device, addresses, values, threads, any(arrays.is_torch(a) for _, a in bound)

    def _checked_call(self, args, threads, named) -> None:
        """A call that the fast path did not take: every check, then the host's code or the
        backend of the device where the arrays live."""
        device, addresses, values, threads, torch = self._validate(args, threads, named)
        code = self._host if device.is_host else self._devices.get(device)
        if code is None:
            code = self._devices[device] = registry.for_device(device).compile_nest(
                self.spec, device)
        code.run(addresses, values, threads=threads, torch_stream=torch)

    def _size_values(self, shapes, explicit) -> tuple:
        """The sizes of a call (in spec.sizes order) from the arrays' shapes and the explicit
        keywords, after checking that they agree, that every shape is what the sizes make
        it, and that the nest stays in bounds for them (loop_bounds.check, once per sizes)."""
        values, source = {}, {}
        for name, value in explicit.items():
            values[name] = checks.integer(value, f"size {name}", minimum=0,
                                          maximum=checks.ADDRESS_LIMIT, error=ArgumentError)
            source[name] = f"{name}={values[name]}"
        for k, d, name in self._binders:
            value, tensor = shapes[k][d], self.names[k]
            if values.setdefault(name, value) != value:
                raise ArgumentError(f"size {name}: {tensor} has {value} in dimension {d}, but "
                                    f"{source[name]} (conflicting sizes)")
            source.setdefault(name, f"{tensor} has {value} in dimension {d}")
        for name in self.sizes:
            if name not in values:
                raise ArgumentError(f"size {name} is not given: pass {name}= (no tensor "
                                    f"dimension is exactly {name})")
        env = {"$" + name: (v, v) for name, v in values.items()}
        where = ", ".join(f"{name}={values[name]}" for name in self.sizes)
        for tensor, shape in zip(self.spec.tensors, shapes):
            want = tensor.shape_at(env)
            if any(d < 0 for d in want):
                raise ArgumentError(f"{tensor.name}: shape {tensor.key()} is {want} with "
                                    f"{where}: a dimension is negative")
            if want != shape:
                note = f" (with {where})" if tensor.symbolic else ""
                raise ArgumentError(f"{tensor.name}: expected shape {want}, got {shape}{note}")
        # sizes that only seeds use move no address: a new seed needs no new bounds check
        checked = tuple(values[name] for name in self.sizes if name not in self._seed_only)
        if checked not in self._checked:
            loop_bounds.check(self.spec, env, ArgumentError)
            if len(self._checked) >= self._MEMO:
                self._checked.clear()
            self._checked.add(checked)
        return tuple(values[name] for name in self.sizes)

    def _remember(self, shapes, values, nbytes):
        """Let the fast path take arrays of these shapes (validated with these sizes)."""
        if len(self._signatures) >= self._MEMO:
            self._signatures.clear()
        self._signatures[shapes] = (list(values), nbytes)

    def __call__(self, *args, threads=None, **named):
        """Run the nest on these arrays (numpy or torch CPU, one per declared tensor)."""
        table = self._fast_table(args, named, threads)
        if table is None:
            self._checked_call(args, threads, named)
        else:
            self._int_entry(table)
        if _recording.active:
            _recording.nest_call(self, args, named, threads)

    def call(self, arrays: tuple, threads=None):
        """nest(*arrays, threads=threads) without the keyword handling (the operators' call:
        one array per declared tensor, in order; every check the same)."""
        table = self._fast_table(arrays, None, threads)
        if table is None:
            self._checked_call(arrays, threads, {})
        else:
            self._int_entry(table)
        if _recording.active:
            _recording.nest_call(self, arrays, None, threads)

    def _fast_table(self, args, named, threads):
        """The call table (a cffi intptr_t array, for `run`) for plain arrays of a shape
        signature `bind` validated before, or None: then `bind` checks and explains. Plain:
        numpy arrays or torch CPU tensors (torch.Tensor or Parameter, strided) of exactly the
        declared dtype, C-contiguous, numpy arrays writable where the nest writes; the
        arrays' addresses then only need the overlap check. The table is this thread's own,
        reused by its next call (a call runs to its end before the thread can start another)."""
        given, keywords = args, named
        plain = self._plain
        seeds = self._seed_slots
        if seeds:       # the seed sizes as keywords, every one of them, nothing else
            if not named or named.keys() != self._seed_names:
                return None
            values = []
            for name, slot in seeds:
                v = named[name]
                if type(v) is not int or not 0 <= v <= checks.ADDRESS_LIMIT:
                    return None
                values.append((slot, v))
            named = None
        if named:
            if args or len(named) != len(plain):
                return None
            given = [None] * len(plain)
            for name, arr in named.items():
                k = self._position.get(name)
                if k is None:
                    return None
                given[k] = arr
        elif len(given) != len(plain):
            return None
        if threads is None:
            threads = self._num_threads() if self._has_runtime else 1
        elif (not self._has_runtime or type(threads) is not int
              or not 1 <= threads <= checks.MAX_THREADS):
            return None
        addresses, shapes = [], []      # the arrays stay alive in the caller's arguments
        k = 0
        for arr in given:
            if type(arr) is _NDARRAY:
                dt, written = plain[k]
                if arr.dtype != dt:
                    return None
                flags = arr.flags
                if not flags.c_contiguous or (written and not flags.writeable):
                    return None
                addresses.append(_DATA_FIELD(id(arr) + _DATA_OFFSET).value if _DATA_FIELD
                                 else arr.ctypes.data)
                shapes.append(arr.shape)
            elif type(arr) in _TORCH_PLAIN:
                if (arr.dtype is not self._torch_dtypes[k] or not arr.is_cpu
                        or arr.layout is not _TORCH_PLAIN[type(arr)]
                        or not arr.is_contiguous() or arr.is_neg()
                        or (plain[k][1] and arr.requires_grad)):    # _check refuses
                    return None
                addresses.append(arr.data_ptr())
                shapes.append(arr.shape)    # a torch.Size: equal to (and hashed as) the tuple
            else:
                if _TORCH_PLAIN or not arrays.is_torch(arr) or not _learn_torch():
                    return None
                return self._fast_table(args, keywords, threads)
            k += 1
        known = self._signatures.get(tuple(shapes))
        if known is None:
            return None
        sizes, nbytes = known
        if self._written:
            self._check_overlap(addresses, nbytes)
        tables = self._tables
        table = tables.get(_get_ident())
        if table is None:
            if len(tables) >= _MAX_TABLES:
                tables.clear()
            table = tables[_get_ident()] = arrays.ffi.new(
                "intptr_t[]", [0] * (1 + k) + self._tail_ints + [0] * len(sizes))
        table[0] = threads
        table[1:1 + k] = addresses
        if sizes:
            base = len(table) - len(sizes)
            table[base:len(table)] = sizes
            if seeds:
                for slot, v in values:
                    table[base + slot] = v
        return table

    @functools.cached_property
    def _tables(self) -> dict:
        """thread id -> the fast path's call table of that thread (see _fast_table)."""
        return {}

    @functools.cached_property
    def _int_entry(self):
        """The nest's function taking its table as an intptr_t array (the fast path's)."""
        return arrays.ffi.cast("void(*)(intptr_t *)", self._entry)

    @functools.cached_property
    def _tail_ints(self) -> list:
        """The table's slots between the arrays and the sizes (kernels, runtime), as ints."""
        return [int(v) for v in self._template[1 + len(self.names):self._slots["sizes"]]]

    @functools.cached_property
    def _torch_dtypes(self) -> tuple:
        """The torch dtype of each tensor (None where torch has none)."""
        import torch
        return tuple(getattr(torch, t.dtype.torch_name, None) for t in self.spec.tensors)

    def _check_overlap(self, addresses, nbytes):
        """A tensor the nest writes may not share memory with another tensor of the call,
        except as the identical array where the nest allows it (see aliasing.aliasable_pairs).

        One sweep over the tensors in address order finds whether any two overlap at all
        (the usual answer: none; O(N log N) instead of a written x all pairs loop, 15 -> ~4 us
        for the 24 tensors of an attention backward nest); only then are the pairs judged."""
        end = 0
        for j in sorted(range(len(addresses)), key=addresses.__getitem__):
            size = nbytes[j]
            if size:
                start = addresses[j]
                if start < end:
                    self._judge_overlaps(addresses, nbytes)
                    return
                end = start + size      # (disjoint so far: the furthest end is this one's)

    def _judge_overlaps(self, addresses, nbytes):
        """_check_overlap's verdict pair by pair, where some tensors overlap."""
        for w in self._written:
            lo, hi = addresses[w], addresses[w] + nbytes[w]
            for j, start in enumerate(addresses):
                if j == w or not (start < hi and lo < start + nbytes[j]) or not nbytes[j] \
                        or lo == hi:    # (an empty tensor holds no memory to share)
                    continue
                if start == lo and (w, j) in self._aliasable:
                    continue
                raise ArgumentError(
                    f"{self.names[w]} overlaps {self.names[j]}: the nest writes "
                    f"{self.names[w]}, so it must not share memory with another tensor "
                    f"(the identical array is allowed only where one element-wise call "
                    f"alone touches both, at the same offsets, each block once)")

    def run(self, table):
        """Run with a table from `bind` or `_fast_table` (the arrays it was bound to must
        still be alive)."""
        _recording.refuse("a nest ran from a table its caller bound")
        if isinstance(table, np.ndarray):
            self._entry(arrays.ffi.cast("void **", table.ctypes.data))
        else:
            self._int_entry(table)

    def dump(self, what: str = "asm") -> str:
        """The nest's generated code (what: any kind a backend dumps; see tpp.Kernel.dump)."""
        from .kernel import dump
        return dump(self.spec, what)


_NDARRAY = np.ndarray
_MAX_TABLES = 64            # threads a nest keeps a fast-path call table for (then starts over)
_TORCH_PLAIN: dict = {}     # torch.Tensor and torch.nn.Parameter -> torch.strided, once seen


_DATA_FIELD, _DATA_OFFSET = arrays._DATA_FIELD, arrays._DATA_OFFSET   # (arrays.address)
_get_ident = threading.get_ident


def _learn_torch() -> bool:
    """Let the fast path take torch tensors (called when the first one arrives)."""
    import torch
    _TORCH_PLAIN.update({torch.Tensor: torch.strided, torch.nn.Parameter: torch.strided})
    return True


def _check(tensor: Tensor, arr, writable: bool) -> tuple:
    """(address, shape) of an array given for `tensor`, after checking its dtype, rank,
    C-contiguity, writability and autograd state (the shape: CompiledNest._size_values)."""
    dt, shape, strides, can_write, given = arrays.geometry(arr, tensor.name)
    shape = tuple(int(d) for d in shape)
    if dt != tensor.dtype:
        raise ArgumentError(f"{tensor.name}: expected {tensor.dtype}, got {given}")
    if len(shape) != len(tensor.shape):
        raise ArgumentError(f"{tensor.name}: expected shape {tensor.shape_text()}, got "
                            f"{shape}")
    if 0 not in shape and not arrays.contiguous(shape, strides):   # empty: any strides
        raise ArgumentError(f"{tensor.name}: expected a C-contiguous array, got strides "
                            f"{tuple(strides)} (elements)")
    if writable and not can_write:
        raise ArgumentError(f"{tensor.name}: the nest writes it, but the array is read-only")
    if writable:
        arrays.check_output_tensor(arr, tensor.name)
    return arrays.address(arr), shape
