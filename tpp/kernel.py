"""The callable a primitive is: array calls with validation, and a raw-pointer fast path.

`Kernel(spec)(*inputs, out=None, mask=None, seed=None)` validates every array against the
spec's operands, allocates outputs that were not given (numpy, or torch when the inputs are
torch tensors), takes each block's leading dimension from its strides and runs the kernel
compiled for exactly those lds (compiled on first use, then cached). The backend is chosen by
where the data lives: host arrays run the CPU code, CUDA arrays (torch CUDA tensors, cupy, any
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

import numpy as np

from tpp_cpu import backend as cpu_backend   # imports no LLVM: that happens on first compile

from . import arrays
from .checks import reject_unknown_call
from .errors import ArgumentError
from .lru import LRU, VARIANTS_PER_KERNEL

_INPLACE_KINDS = ("map", "map_inv", "compare")
_CPU_DUMPS, _CUDA_DUMPS = ("asm", "ir", "opt"), ("cuda", "ptx", "sass")
_CPU_ISAS = ("avx512", "avx2")


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
        """The generated code. CPU: what = "ir", "opt" (optimised IR) or "asm"; isa = "avx512"
        or "avx2" to see another target's code (default: the one that runs here). CUDA:
        what = "cuda" (the source), "ptx" or "sass" (through nvcc; isa = the arch, default
        "sm_90")."""
        if what in _CUDA_DUMPS:
            from tpp_cuda import generators, nvcc
            source = generators.source(self.spec)
            return source if what == "cuda" else nvcc.disassemble(source, isa or "sm_90", what)
        if what not in _CPU_DUMPS:
            raise ArgumentError(f"dump: what must be one of {', '.join(_CPU_DUMPS + _CUDA_DUMPS)}"
                                f", got {what!r}")
        if isa is not None and isa not in _CPU_ISAS:
            raise ArgumentError(f"dump: isa for CPU code must be one of {', '.join(_CPU_ISAS)} "
                                f"(or None for this host's), got {isa!r}")
        from tpp_cpu import target
        tgt = target.current() if isa is None else target.make_target(isa)
        return cpu_backend.dump(self.spec, what, tgt)


class Kernel(KernelBase):
    def __init__(self, spec):
        self.spec = spec
        self._operands = spec.operands()
        self._input_idx = [k for k, o in enumerate(self._operands) if o.role == "in"]
        self._output_idx = [k for k, o in enumerate(self._operands) if o.role != "in"]
        self._needs_seed = spec.scalars == ("seed",)
        self._own_lds = tuple(o.ld for o in self._operands)
        self._variants = LRU(VARIANTS_PER_KERNEL, "variants")   # lds -> C function
        self._raw = None
        self.input_names = tuple(self._operands[k].name for k in self._input_idx)
        self.output_names = tuple(self._operands[k].name for k in self._output_idx)
        self._fast = self._fast_plan()
        self._fastcall = None
        self._has_index = any(o.layout == "index" for o in self._operands)

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
        return cpu_backend.compile(spec)

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
        fn = self._variants.get(lds)
        if fn is None:
            compiled = self._compiled(self._spec_for(lds))
            fn = arrays.ffi.cast(self._signature("void *"), compiled.address)
            self._variants[lds] = fn
            if lds == self._own_lds:
                self._fastcall = self._make_fastcall(fn)
        return fn

    def _cuda_variant(self, lds: tuple, device: int):
        """The CUDA launcher for these lds on `device` (compiled on first use, then cached)."""
        from tpp_cuda import runtime
        return runtime.function(self._spec_for(lds), device)

    @property
    def raw(self):
        """The C function for the spec's own lds: raw(addr0, addr1, ..., [seed])."""
        if self._raw is None:
            compiled = self._compiled(self.spec)
            self._raw = arrays.ffi.cast(self._signature("intptr_t"), compiled.address)
        return self._raw

    # ------------------------------------------------------------ calls
    def __call__(self, *inputs, out=None, mask=None, seed=None, **unknown):
        if unknown:
            reject_unknown_call(f"{self.spec.op} kernel call", unknown, ("out", "mask", "seed"))
        fast = self._fastcall
        if fast is not None and mask is None and seed is None:
            result = fast(inputs, out)
            if result is not None:
                return result
        return self._call_checked(inputs, out, mask, seed)

    def _make_fastcall(self, fn):
        """A closure for the common call (see _fast_plan) in as few Python operations as
        possible; it returns None whenever the checked path must decide."""
        if self._fast is None or self._needs_seed:
            return None
        (ins, outs) = self._fast
        if len(outs) != 1 or len(ins) not in (1, 2):
            return None
        ndarray, empty, from_buffer, may_share = np.ndarray, np.empty, arrays.ffi.from_buffer, \
            np.may_share_memory
        odt, oshape, _ = outs[0]
        # out=x is allowed only where the op may write in place; for any other op the checked
        # path must refuse it, so an identical array is a miss here like any other overlap.
        inplace_ok = self.spec.info.kind in _INPLACE_KINDS
        # from_buffer raises BufferError for arrays that are not C-contiguous (and, with
        # require_writable, for read-only ones): that is the contiguity check.
        if len(ins) == 1:
            (dt, shape), = ins

            def fast1(inputs, out):
                if len(inputs) != 1:
                    return None
                x, = inputs
                if type(x) is not ndarray or x.dtype != dt or x.shape != shape:
                    return None
                try:
                    px = from_buffer(x)
                    if out is None:
                        out = empty(oshape, odt)
                    elif type(out) is not ndarray or out.dtype != odt or out.shape != oshape \
                            or ((out is not x or not inplace_ok) and may_share(x, out)):
                        return None
                    fn(px, from_buffer("char[]", out, True))
                except (BufferError, ValueError):
                    return None
                return out
            return fast1

        (dt0, shape0), (dt1, shape1) = ins

        def fast2(inputs, out):
            if len(inputs) != 2:
                return None
            a, b = inputs
            if type(a) is not ndarray or type(b) is not ndarray or a.dtype != dt0 \
                    or b.dtype != dt1 or a.shape != shape0 or b.shape != shape1:
                return None
            try:
                pa, pb = from_buffer(a), from_buffer(b)
                if out is None:
                    out = empty(oshape, odt)
                elif type(out) is not ndarray or out.dtype != odt or out.shape != oshape \
                        or ((out is not a or not inplace_ok) and may_share(a, out)) \
                        or ((out is not b or not inplace_ok) and may_share(b, out)):
                    return None
                fn(pa, pb, from_buffer("char[]", out, True))
            except (BufferError, ValueError):
                return None
            return out
        return fast2

    def _call_checked(self, inputs, out, mask, seed):
        operands = self._operands
        if len(inputs) != len(self._input_idx):
            raise ArgumentError(f"{self.spec.op} takes {len(self._input_idx)} input array(s) "
                                f"({', '.join(self.input_names)}), got {len(inputs)}")
        given = {"out": out, "mask": mask}
        for key in given:
            if given[key] is not None and key not in self.output_names:
                raise ArgumentError(f"{self.spec.op} has no output named {key!r}")
        if self._needs_seed:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
                raise ArgumentError(f"dropout needs an integer seed=..., got {seed!r}")
            seed = int(seed) & 0xFFFFFFFFFFFFFFFF
            seed = seed - (1 << 64) if seed >= 1 << 63 else seed
        elif seed is not None:
            raise ArgumentError(f"{self.spec.op} takes no seed")

        bound = [None] * len(operands)
        for k, obj in zip(self._input_idx, inputs):
            bound[k] = arrays.as_array(obj, operands[k].name)
        user_outputs = []
        for k in self._output_idx:
            obj = given[operands[k].name]
            if obj is not None:
                bound[k] = arrays.as_array(obj, operands[k].name)
                user_outputs.append(k)
        device = arrays.common_device((operands[k].name, a) for k, a in enumerate(bound)
                                      if a is not None)
        use_torch = any(arrays.is_torch(bound[k]) for k in self._input_idx)
        for k in self._output_idx:
            op = operands[k]
            if bound[k] is None:
                if op.role == "inout":
                    raise ArgumentError(f"{self.spec.op} reads and writes {op.name}: pass it "
                                        f"as {op.name}=...")
                if op.rows == -1:
                    raise ArgumentError(f"{self.spec.op} needs {op.name}=...")
                bound[k] = arrays.allocate(op, use_torch, device)
        lds = tuple(arrays.check(op, arr, op.name) for op, arr in zip(operands, bound))
        if user_outputs:
            self._check_overlap(bound, user_outputs)
        if self._has_index:
            self._check_indices(bound)
        scalars = (seed,) if self._needs_seed else ()
        if device is None:
            fn = self._variants.get(lds) or self._variant(lds)
            fn(*[arrays.pointer(arr) for arr in bound], *scalars)
        else:
            self._cuda_variant(lds, device).launch(
                [arrays.address(arr) for arr in bound] + list(scalars),
                torch_stream=any(arrays.is_torch(a) for a in bound))
        outs = [arrays.user_object(bound[k]) for k in self._output_idx]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _check_overlap(self, bound, user_outputs):
        inplace_ok = self.spec.info.kind in _INPLACE_KINDS
        for k in user_outputs:
            for j, other in enumerate(bound):
                if j == k:
                    continue
                if arrays.overlap(bound[k], other):
                    if inplace_ok and _same_view(bound[k], other):
                        continue
                    raise ArgumentError(
                        f"{self._operands[k].name} overlaps {self._operands[j].name}; only an "
                        f"elementwise op may write in place, and only onto the identical array")

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


def _same_view(a, b) -> bool:
    if isinstance(a, arrays.CudaView) != isinstance(b, arrays.CudaView) \
            or arrays.is_torch(a) != arrays.is_torch(b):
        return False
    if isinstance(a, arrays.CudaView):
        return (a.ptr == b.ptr and a.strides == b.strides and a.shape == b.shape
                and a.itemsize == b.itemsize)
    if arrays.is_torch(a):
        return (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
                and a.shape == b.shape and a.dtype == b.dtype)
    return (a.ctypes.data == b.ctypes.data and a.strides == b.strides and a.shape == b.shape
            and a.dtype.itemsize == b.dtype.itemsize)
