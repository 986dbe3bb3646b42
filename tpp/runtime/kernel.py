"""The callable a primitive is: array calls with validation, and a raw-pointer fast path.

`Kernel(spec)(*inputs, out=None, mask=None, seed=None)` validates every array against the
spec's operands, allocates outputs that were not given (numpy, or torch when the inputs are
torch tensors), takes each block's leading dimension from its strides and runs the kernel
compiled for exactly those lds (compiled on first use, then cached). The backend is the one
that owns the Device where the data lives (tpp.runtime.registry): host arrays run the CPU code, CUDA arrays (torch CUDA tensors, cupy, any
`__cuda_array_interface__`) the CUDA kernel of the same spec on their device, launched on the
current stream (torch's for torch tensors, else cupy's); outputs are allocated there. Operands
on different devices are an ArgumentError. It returns the output, or
a tuple (out, mask) when the op writes a bitmask too.

`Kernel.raw` is the compiled C function for the spec's own lds, called with one integer
address per operand (and the seed last, for dropout): no checks, so it costs about what a
foreign call costs. Wrong pointers, too-small buffers and out-of-range gather/scatter indices
there are the caller's responsibility.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import arrays, recording as _recording, registry
from .device import CPU
from ..core.checks import reject_unknown_call
from ..core.errors import ArgumentError
from .lru import LRU, VARIANTS_PER_KERNEL

_INPLACE_KINDS = ("map", "map_inv", "compare", "equation")


class KernelBase:
    """What every compiled primitive offers besides its call: repr, compile() and dump().
    Subclasses define `spec` and `raw` (the compiled function for the spec's own lds)."""

    def __repr__(self):
        return f"<tpp kernel {self.spec.key()}>"

    def compile(self):
        """Compile now (for the spec's own lds) instead of on the first call; returns self."""
        self.raw
        return self

    def dump(self, what: str = "asm", isa: str | None = None) -> str:
        """The generated code, from the backend whose dumps include `what`. CPU: what = "ir",
        "opt" (optimised IR) or "asm"; isa = "avx512" or "avx2" to see another target's code
        (default: the one that runs here). CUDA: what = "cuda" (the source), "ptx" or "sass"
        (through nvcc; isa = the arch, default "sm_90")."""
        return dump(self.spec, what, isa)


def dump(spec, what: str, isa: str | None = None) -> str:
    """spec's generated code, from the backend whose dump_kinds include `what`."""
    kinds = []
    for name in registry.names():
        backend = registry.get(name)
        if what in backend.dump_kinds:
            return backend.dump(spec, what, isa)
        kinds += backend.dump_kinds
    raise ArgumentError(f"dump: what must be one of {', '.join(kinds)}, got {what!r}")


class _Plan(NamedTuple):
    """What a checked call decides from its arrays' signatures alone (tpp.runtime.arrays.signature):
    made by the first call with those signatures, reused by every later one."""
    layouts: tuple        # one Layout per operand (of the array a missing output gets)
    lds: tuple            # the lds to compile for
    device: object        # the tpp.runtime.device.Device of the call's data
    use_torch: bool       # outputs allocated here are torch tensors
    fn: object            # the C function for lds (host calls), else None


class Kernel(KernelBase):
    def __init__(self, spec):
        self.spec = spec
        self._operands = spec.operands()
        self._input_idx = [k for k, o in enumerate(self._operands) if o.role == "in"]
        self._output_idx = [k for k, o in enumerate(self._operands) if o.role != "in"]
        self._needs_seed = spec.scalars == ("seed",)
        self._seed_user = "dropout" if spec.family != "equation" else "this equation"
        self._own_lds = tuple(o.ld for o in self._operands)
        self._variants = LRU(VARIANTS_PER_KERNEL, "variants")   # lds -> C function (ints)
        self._raw = None
        self._checks = [arrays.LayoutChecks(op) for op in self._operands]
        self._plans: dict = {}      # the operands' signatures (() for missing outputs) -> _Plan
        self._inplace = self._inplace_pairs(spec.info.kind)
        self.input_names = tuple(self._operands[k].name for k in self._input_idx)
        self.output_names = tuple(self._operands[k].name for k in self._output_idx)
        self._fast = self._fast_plan()
        self._fastcall = None
        self._has_index = any(o.layout == "index" for o in self._operands)

    def _inplace_pairs(self, kind) -> frozenset:
        """(output k, operand j) pairs where output k may be the very array of operand j (in
        place): any pair of an element-wise op; an equation's block output onto a block input
        only (a broadcast input is read for every row or column, after an output written onto
        it may have changed it; a reduction output is written when its block may still be
        read; two outputs on one array would lose one)."""
        if kind not in _INPLACE_KINDS:
            return frozenset()
        ops = self._operands
        return frozenset(
            (k, j) for k in self._output_idx for j in range(len(ops)) if j != k and (
                kind != "equation" or (ops[k].layout == ops[j].layout == "block"
                                       and ops[j].role == "in")))

    def _fast_plan(self):
        """(input checks, output allocations) for the common call: C-contiguous numpy arrays of
        exactly the operands' shapes, the spec's lds equal to the row lengths, outputs either
        allocated or given. None where the spec does not allow it (other lds, inout, index)."""
        ops = self._operands
        for op in ops:
            if op.layout == "index" or op.role == "inout" or op.rows == -1:
                return None
            if op.layout == "block" and op.ld != op.cols:
                return None
        shape = {"block": lambda o: (o.rows, o.cols), "mask": lambda o: (o.rows, o.cols),
                 "row": lambda o: (o.cols,), "vector": lambda o: (o.cols,),
                 "col": lambda o: (o.rows,), "scalar": lambda o: ()}
        ins = tuple((ops[k].dtype.numpy, shape[ops[k].layout](ops[k])) for k in self._input_idx)
        outs = tuple((ops[k].dtype.numpy, shape[ops[k].layout](ops[k]), ops[k].name)
                     for k in self._output_idx)
        return ins, outs

    # ------------------------------------------------------------ compilation
    def _compiled(self, spec):
        """The host backend's compiled code of spec (it has the C function's `address`)."""
        return registry.for_device(CPU).compile(spec, CPU)

    def _signature(self, ctype: str) -> str:
        args = [ctype] * len(self._operands) + (["int64_t"] if self._needs_seed else [])
        return f"void(*)({', '.join(args)})"

    def _spec_for(self, lds: tuple):
        """The spec compiled for operand leading dimensions `lds` (one per operand)."""
        if lds == self._own_lds:
            return self.spec
        changes = {}
        for op, ld in zip(self._operands, lds):
            if op.ld_param is None:
                continue
            if changes.get(op.ld_param, ld) != ld:
                names = [o.name for o in self._operands if o.ld_param == op.ld_param]
                raise ArgumentError(f"{' and '.join(names)} must have the same row "
                                    f"stride (ld); got different strides")
            changes[op.ld_param] = ld
        return self.spec.replace(**changes)

    def _variant(self, lds: tuple):
        """The C function compiled for these lds, taking one integer address per operand."""
        fn = self._variants.get(lds)
        if fn is None:
            address = self._compiled(self._spec_for(lds)).address
            fn = arrays.ffi.cast(self._signature("intptr_t"), address)
            self._variants[lds] = fn
            if lds == self._own_lds:
                self._fastcall = self._make_fastcall(fn)
        return fn

    def _device_variant(self, lds: tuple, device):
        """The compiled code for these lds on a device other than the host, from the backend
        that owns it (which caches it)."""
        return registry.for_device(device).compile(self._spec_for(lds), device)

    @property
    def raw(self):
        """The C function for the spec's own lds: raw(addr0, addr1, ..., [seed])."""
        if self._raw is None:
            self._raw = self._variant(self._own_lds)
        return self._raw

    # ------------------------------------------------------------ calls
    def __call__(self, *inputs, out=None, mask=None, seed=None, **unknown):
        if _recording.active:
            _recording.refuse(f"a {type(self).__name__} called outside a nest")
        if unknown:
            reject_unknown_call(f"{self.spec.op} kernel call", unknown, ("out", "mask", "seed"))
        fast = self._fastcall
        if fast is not None and mask is None and seed is None:
            result = fast(inputs, out)
            if result is not None:
                return result
        outputs = {}
        if out is not None:
            outputs["out"] = out
        if mask is not None:
            outputs["mask"] = mask
        return self._call_checked(inputs, outputs, seed)

    def _make_fastcall(self, fn):
        """A closure for the common call (see _fast_plan) in as few Python operations as
        possible; it returns None whenever the checked path must decide. fn takes integer
        addresses (the spec's own lds)."""
        if self._fast is None or self._needs_seed:
            return None
        (ins, outs) = self._fast
        if len(outs) != 1 or len(ins) not in (1, 2):
            return None
        ndarray, empty, address = np.ndarray, np.empty, arrays.address
        odt, oshape, _ = outs[0]
        out_bytes = int(np.prod(oshape)) * np.dtype(odt).itemsize
        # out=x is allowed only where the op may write in place onto that input; elsewhere the
        # checked path must refuse it, so an identical array is a miss like any other overlap.
        out_k = self._output_idx[0]
        inplace_ok = [(out_k, k) in self._inplace for k in self._input_idx]
        # Each closure: inputs and a given output must be C-contiguous numpy arrays of the
        # operands' dtypes and shapes, the output writable and sharing no byte with an input
        # (or being that very input, for an in-place op); anything else is a miss.
        if len(ins) == 1:
            (dt, shape), = ins
            in_bytes = int(np.prod(shape)) * np.dtype(dt).itemsize

            def fast1(inputs, out):
                if len(inputs) != 1:
                    return None
                x, = inputs
                if type(x) is not ndarray or x.dtype != dt or x.shape != shape \
                        or not x.flags.c_contiguous:
                    return None
                px = address(x)
                if out is None:
                    out = empty(oshape, odt)
                    fn(px, address(out))
                    return out
                if type(out) is not ndarray or out.dtype != odt or out.shape != oshape:
                    return None
                flags = out.flags
                if not (flags.c_contiguous and flags.writeable):
                    return None
                po = address(out)
                if px < po + out_bytes and po < px + in_bytes and not (inplace_ok[0] and out is x):
                    return None
                fn(px, po)
                return out
            return fast1

        (dt0, shape0), (dt1, shape1) = ins
        bytes0 = int(np.prod(shape0)) * np.dtype(dt0).itemsize
        bytes1 = int(np.prod(shape1)) * np.dtype(dt1).itemsize

        def fast2(inputs, out):
            if len(inputs) != 2:
                return None
            a, b = inputs
            if type(a) is not ndarray or type(b) is not ndarray or a.dtype != dt0 \
                    or b.dtype != dt1 or a.shape != shape0 or b.shape != shape1 \
                    or not (a.flags.c_contiguous and b.flags.c_contiguous):
                return None
            pa, pb = address(a), address(b)
            if out is None:
                out = empty(oshape, odt)
                fn(pa, pb, address(out))
                return out
            if type(out) is not ndarray or out.dtype != odt or out.shape != oshape:
                return None
            flags = out.flags
            if not (flags.c_contiguous and flags.writeable):
                return None
            po = address(out)
            if pa < po + out_bytes and po < pa + bytes0 and not (inplace_ok[0] and out is a):
                return None
            if pb < po + out_bytes and po < pb + bytes1 and not (inplace_ok[1] and out is b):
                return None
            fn(pa, pb, po)
            return out
        return fast2

    def _call_checked(self, inputs, outputs: dict, seed):
        """The call of any arrays, with every check; outputs maps the names of the outputs the
        caller passed to their arrays. What follows from the arrays' signatures (dtypes,
        shapes, strides, devices: the lds) is decided once per signature (_plan); what depends
        on the arrays themselves is checked on every call: the outputs' writability and
        autograd state, overlap, index ranges."""
        operands = self._operands
        if len(inputs) != len(self._input_idx):
            raise ArgumentError(f"{self.spec.op} takes {len(self._input_idx)} input array(s) "
                                f"({', '.join(self.input_names)}), got {len(inputs)}")
        for name in outputs:
            if name not in self.output_names:
                raise ArgumentError(f"{self.spec.op} has no output named {name!r}")
        if self._needs_seed:
            scalars = (self._seed(seed),)
        elif seed is not None:
            raise ArgumentError(f"{self.spec.op} takes no seed")
        else:
            scalars = ()

        bound = [None] * len(operands)
        for k, obj in zip(self._input_idx, inputs):
            bound[k] = arrays.as_array(obj, operands[k].name)
        user_outputs = []
        for k in self._output_idx:
            obj = outputs.get(operands[k].name)
            if obj is not None:
                bound[k] = arrays.as_array(obj, operands[k].name)
                user_outputs.append(k)
        key = arrays.signatures(*bound)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(bound)
            arrays.remember(self._plans, key, plan)
        else:
            for k in self._output_idx:
                if bound[k] is None:
                    bound[k] = arrays.allocate(operands[k], plan.use_torch, plan.device)
        layouts = plan.layouts
        for k in user_outputs:
            arrays.check_output(bound[k], layouts[k], operands[k].name)
        addresses = [arrays.address(a) for a in bound]
        if user_outputs:
            self._check_overlap(layouts, addresses, user_outputs)
        if self._has_index:
            self._check_indices(bound)
        if plan.fn is not None:
            plan.fn(*addresses, *scalars)
        else:
            self._device_variant(plan.lds, plan.device).launch(
                addresses + list(scalars), torch_stream=any(lay.kind == "torch" for lay in layouts))
        if len(self._output_idx) == 1:
            return arrays.user_object(bound[self._output_idx[0]])
        return tuple(arrays.user_object(bound[k]) for k in self._output_idx)

    def _plan(self, bound: list) -> _Plan:
        """The _Plan of a call's arrays (bound: one per operand, None for outputs not given,
        which are allocated here): every check that depends on their signatures alone."""
        operands = self._operands
        layouts = [None if a is None else arrays.layout(a, operands[k].name)
                   for k, a in enumerate(bound)]
        present = [k for k, a in enumerate(bound) if a is not None]
        device = arrays.shared_device([layouts[k] for k in present],
                                      [(operands[k].name, bound[k]) for k in present])
        use_torch = any(layouts[k].kind == "torch" for k in self._input_idx)
        for k in self._output_idx:
            if bound[k] is None:
                bound[k] = self._allocate(operands[k], use_torch, device)
                layouts[k] = arrays.layout(bound[k], operands[k].name)
        lds = tuple(self._checks[k].ld(layouts[k], op.name) for k, op in enumerate(operands))
        fn = self._variant(lds) if device.is_host else None
        return _Plan(tuple(layouts), lds, device, use_torch, fn)

    def _seed(self, seed) -> int:
        """The seed as the int64 the kernel takes (any integer, wrapped to 64 bits)."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ArgumentError(f"{self._seed_user} needs an integer seed=..., got {seed!r}")
        seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        return seed - (1 << 64) if seed >= 1 << 63 else seed

    def _allocate(self, op, use_torch: bool, device):
        """A new array for an output the caller did not pass (where the op allows it)."""
        if op.role == "inout":
            raise ArgumentError(f"{self.spec.op} reads and writes {op.name}: pass it "
                                f"as {op.name}=...")
        if op.rows == -1:
            raise ArgumentError(f"{self.spec.op} needs {op.name}=...")
        return arrays.allocate(op, use_torch, device)

    def _check_overlap(self, layouts, addresses, user_outputs):
        """ArgumentError if an output the caller passed shares memory with another operand;
        an element-wise op may write onto the identical array (in place)."""
        inplace = self._inplace
        spans = [(a + lay.low, a + lay.high) for lay, a in zip(layouts, addresses)]
        for k in user_outputs:
            for j in range(len(spans)):
                if j == k or not arrays.spans_overlap(spans[k], spans[j]):
                    continue
                if (k, j) in inplace and layouts[k].same_view(addresses[k], layouts[j],
                                                              addresses[j]):
                    continue
                raise ArgumentError(
                    f"{self._operands[k].name} overlaps {self._operands[j].name}; an output may "
                    f"be written in place only onto the identical array of an input read "
                    f"element by element (an elementwise op's input, an equation's block input)")

    def _check_indices(self, bound):
        """Row indices must address rows of the operand with a free row count."""
        for k, op in enumerate(self._operands):
            if op.layout != "index":
                continue
            idx = arrays.to_host(bound[k])
            addressed = next(j for j, o in enumerate(self._operands) if o.rows == -1)
            rows = bound[addressed].shape[0]
            if idx.size and (idx.min() < 0 or idx.max() >= rows):
                raise ArgumentError(f"{op.name}: row indices must lie in [0, {rows}), got "
                                    f"[{idx.min()}, {idx.max()}]")

