"""The callable BRGEMM: binding the three batch modes' arrays to the compiled function.

    mm = tpp.brgemm(64, 64, 64, beta=1)          # batch="stride"
    mm(A, B, C)                                   # A (count, 64, 64), B (count, 64, 64), C (64, 64)

Call forms, by the spec's batch mode (`count=` uses only the first pairs; default: all):
  stride   a, b: 3-D arrays (count, *stored block shape); any batch stride, row stride = ld,
           contiguous rows.
  offset   a, b: C-contiguous base arrays (any shape) read as flat element buffers, with
           offsets_a=, offsets_b=: int64 element offsets of each block's first element.
  address  a, b: sequences of 2-D blocks (all blocks of a sequence with the same row stride).
C is written in place and returned; it is allocated when beta=0 and c is None. As for every
kernel, the data choose the backend: all host arrays run the CPU code, all CUDA arrays the CUDA
kernel on their device (offset tables may be host or device arrays: they are checked on the host
and copied to the device; address mode builds its pointer table on the host and copies it).
With a relu bitmask the result is (c, mask). Every array is checked (shape, dtype, strides, offsets within
the base array, C not overlapping an input) before the compiled code runs; the raw path
(`Kernel.raw`, see tpp.brgemm_spec for its signature) checks nothing.
"""
from __future__ import annotations

import math

import numpy as np

from tpp_cpu import backend as cpu_backend

from . import arrays
from . import checks
from .checks import reject_unknown_call
from .errors import ArgumentError
from .kernel import KernelBase
from .lru import LRU, VARIANTS_PER_KERNEL

_SIGNATURE = "void(*)(intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t)"


class BrgemmKernel(KernelBase):
    def __init__(self, spec):
        self.spec = spec
        self._ops = {op.name: op for op in spec.operands()}
        self._variants = LRU(VARIANTS_PER_KERNEL, "variants")   # lds -> C function
        self._raw = None

    # ------------------------------------------------------------ compilation
    def _spec_for(self, lds: tuple):
        """The spec compiled for the row strides (lda, ldb, ldc) of a call."""
        spec = self.spec
        if lds != (spec.lda, spec.ldb, spec.ldc):
            spec = spec.replace(lda=lds[0], ldb=lds[1], ldc=lds[2])
        return spec

    def _variant(self, lds: tuple):
        fn = self._variants.get(lds)
        if fn is None:
            fn = arrays.ffi.cast(_SIGNATURE, cpu_backend.compile(self._spec_for(lds)).address)
            self._variants[lds] = fn
        return fn

    @property
    def raw(self):
        """The C function for the spec's own lds: raw(a, b, c, bias, mask, count, arg_a, arg_b)."""
        if self._raw is None:
            self._raw = self._variant((self.spec.lda, self.spec.ldb, self.spec.ldc))
        return self._raw

    # ------------------------------------------------------------ calls
    def __call__(self, a, b, c=None, *, bias=None, mask=None, offsets_a=None, offsets_b=None,
                 count=None, **unknown):
        if unknown:
            reject_unknown_call("brgemm kernel call", unknown,
                                ("c", "bias", "mask", "offsets_a", "offsets_b", "count"))
        spec, ops = self.spec, self._ops
        if spec.batch != "offset" and (offsets_a is not None or offsets_b is not None):
            raise ArgumentError(f"offsets_a/offsets_b belong to batch='offset'; this kernel's "
                                f"batch mode is {spec.batch!r}")
        if (bias is not None) != bool(spec.bias):
            raise ArgumentError("this kernel adds a bias row: pass bias=..." if spec.bias else
                                "this kernel has no bias (build it with bias='row')")
        if mask is not None and not spec.bitmask:
            raise ArgumentError("this kernel writes no bitmask (relu with bitmask=True does)")
        binder = {"stride": self._bind_stride, "offset": self._bind_offset,
                  "address": self._bind_address}[spec.batch]
        count, lda, ldb, a_base, b_base, arg_a, arg_b, inputs = binder(
            a, b, count, offsets_a, offsets_b)

        c_given = c is not None
        c = arrays.as_array(c, "c") if c_given else None
        bias = arrays.as_array(bias, "bias") if spec.bias else None
        mask = arrays.as_array(mask, "mask") if mask is not None else None
        named = [("a", x) for x in inputs[0]] + [("b", x) for x in inputs[1]] + \
            [(k, v) for k, v in (("c", c), ("bias", bias), ("mask", mask)) if v is not None]
        device = arrays.common_device(named)
        use_torch = any(arrays.is_torch(x) for _, x in named)
        inputs = inputs[0] + inputs[1]
        if c is None:
            if spec.beta:
                raise ArgumentError("beta=1 reads C: pass c=...")
            c = arrays.allocate(ops["c"], use_torch, device)
        ldc = arrays.check(ops["c"], c, "c")
        extras = []
        if spec.bias:
            arrays.check(ops["bias"], bias, "bias")
            inputs.append(bias)
        if spec.bitmask:
            mask = arrays.allocate(ops["mask"], use_torch, device) if mask is None else mask
            arrays.check(ops["mask"], mask, "mask")
            extras.append(mask)
        written = [c] + extras
        if c_given or extras:
            _check_no_overlap(written, inputs)

        keep = []       # the int64 tables the kernel reads, alive until the launch is queued
        arg_a, arg_b = (x if isinstance(x, int) else _table(x, device, use_torch, keep)
                        for x in (arg_a, arg_b))
        if spec.batch == "address":
            a_base, b_base = (_table(x, device, use_torch, keep) for x in (a_base, b_base))
        args = (a_base, b_base, arrays.address(c), arrays.address(bias) if spec.bias else 0,
                arrays.address(mask) if spec.bitmask else 0, count, arg_a, arg_b)
        if device is None:
            self._variant((lda, ldb, ldc))(*args)
        else:
            from tpp_cuda import runtime
            runtime.function(self._spec_for((lda, ldb, ldc)), device).launch(
                args, torch_stream=use_torch)
        del keep
        c, mask = arrays.user_object(c), arrays.user_object(mask)
        return (c, mask) if spec.bitmask else c

    def _count(self, count, available, what):
        """The number of blocks to use, as a Python int: count (any integral value in
        0..available), or all `available` blocks when count is None."""
        if count is None:
            return int(available)
        given, count = count, checks.as_int(count)
        if count is None or count < 0:
            raise ArgumentError(f"count must be a non-negative int, got {given!r}")
        if count > available:
            raise ArgumentError(f"count={count} but {what} holds only {available} block(s)")
        return count

    def _bind_stride(self, a, b, count, _oa, _ob):
        spec, ops = self.spec, self._ops
        a, b = arrays.as_array(a, "a"), arrays.as_array(b, "b")
        for name, arr in (("a", a), ("b", b)):
            shape = tuple(arr.shape)
            want = (ops[name].rows, ops[name].cols)
            if len(shape) != 3 or shape[1:] != want:
                raise ArgumentError(f"{name}: batch='stride' takes a 3-D array (count, {want[0]}, "
                                    f"{want[1]}), got shape {shape}")
        if a.shape[0] != b.shape[0] and count is None:
            raise ArgumentError(f"a holds {a.shape[0]} blocks and b {b.shape[0]}; pass count= "
                                f"to use fewer")
        count = self._count(count, min(a.shape[0], b.shape[0]), "a or b")
        lds = []
        for name, arr in (("a", a), ("b", b)):
            if arr.shape[0] == 0:
                lds.append(ops[name].ld)
                continue
            lds.append(arrays.check(ops[name], arrays.first_block(arr), name))
        stride = [int(arrays.geometry(x, n)[2][0]) if x.shape[0] > 1 else 0
                  for x, n in ((a, "a"), (b, "b"))]
        if min(stride) < 0:
            raise ArgumentError("a and b must have a non-negative batch stride")
        return count, lds[0], lds[1], arrays.address(a), arrays.address(b), stride[0], stride[1], \
            ([a], [b])

    def _bind_offset(self, a, b, count, offsets_a, offsets_b):
        spec, ops = self.spec, self._ops
        if offsets_a is None or offsets_b is None:
            raise ArgumentError("batch='offset' needs offsets_a=... and offsets_b=... "
                                "(int64 element offsets)")
        offs = []
        for name, o in (("offsets_a", offsets_a), ("offsets_b", offsets_b)):
            o = np.asarray(arrays.to_host(arrays.as_array(o, name)))
            if o.dtype != np.int64 or o.ndim != 1 or not o.flags.c_contiguous:
                raise ArgumentError(f"{name}: expected a contiguous 1-D int64 array, got "
                                    f"{o.dtype} of shape {o.shape}")
            offs.append(o)
        if len(offs[0]) != len(offs[1]) and count is None:
            raise ArgumentError(f"offsets_a has {len(offs[0])} entries and offsets_b "
                                f"{len(offs[1])}; pass count= to use fewer")
        count = self._count(count, min(len(offs[0]), len(offs[1])), "offsets_a or offsets_b")
        bases = []
        for name, arr, o in (("a", a, offs[0]), ("b", b, offs[1])):
            arr = arrays.as_array(arr, name)
            dt, shape, strides, _, given = arrays.geometry(arr, name)
            op = ops[name]
            if dt is not op.dtype:
                raise ArgumentError(f"{name}: expected dtype {op.dtype}, got {given}")
            if not arrays.contiguous(shape, strides):
                raise ArgumentError(f"{name}: batch='offset' reads a C-contiguous base array")
            _check_offsets(name, op, o[:count], math.prod(int(d) for d in shape))
            bases.append(arr)
        return count, spec.lda, spec.ldb, arrays.address(bases[0]), arrays.address(bases[1]), \
            offs[0], offs[1], ([bases[0]], [bases[1]])

    def _bind_address(self, a, b, count, _oa, _ob):
        ops = self._ops
        seqs, lds = [], []
        for name, seq in (("a", a), ("b", b)):
            if not isinstance(seq, (list, tuple)):
                raise ArgumentError(f"{name}: batch='address' takes a list or tuple of 2-D "
                                    f"blocks, got {type(seq).__name__}")
            seqs.append([arrays.as_array(x, f"{name}[{i}]") for i, x in enumerate(seq)])
        if len(seqs[0]) != len(seqs[1]) and count is None:
            raise ArgumentError(f"a has {len(seqs[0])} blocks and b {len(seqs[1])}; pass count= "
                                f"to use fewer")
        count = self._count(count, min(len(seqs[0]), len(seqs[1])), "a or b")
        pointer_arrays = []
        for name, seq in zip(("a", "b"), seqs):
            seq = seq[:count]
            found = {arrays.check(ops[name], x, f"{name}[{i}]") for i, x in enumerate(seq)}
            if len(found) > 1:
                raise ArgumentError(f"{name}: every block must have the same row stride (ld), "
                                    f"got {sorted(found)}")
            lds.append(found.pop() if found else ops[name].ld)
            pointer_arrays.append(np.array([arrays.address(x) for x in seq] or [0], np.int64))
        return count, lds[0], lds[1], pointer_arrays[0], pointer_arrays[1], 0, 0, \
            (seqs[0][:count], seqs[1][:count])


def _check_offsets(name: str, op, used: np.ndarray, size: int):
    """ArgumentError unless every offset in `used` starts an op-shaped block (ld op.ld) lying
    inside a base array of `size` elements. Exact Python ints: an offset near 2**63 must not
    wrap around to pass."""
    if not len(used):
        return
    block = f"{op.rows}x{op.cols} block (ld {op.ld}, {op.extent} elements)"
    if op.extent > size:
        raise ArgumentError(f"{name}: a {block} does not fit in the base array of {size} "
                            f"elements at any offset")
    lo, hi = int(used.min()), int(used.max())
    if lo < 0 or hi + op.extent > size:
        raise ArgumentError(f"{name}: offsets must lie in [0, {size - op.extent}] so that each "
                            f"{block} fits in the base array of {size} elements; got "
                            f"[{lo}, {hi}]")


def _table(host_table: np.ndarray, device, use_torch: bool, keep: list) -> int:
    """The address of an int64 table (offsets or block addresses) where the kernel reads it:
    the host array itself, or a copy on `device` (queued on the launch's stream)."""
    if device is not None:
        from tpp_cuda import runtime
        host_table = runtime.to_device(host_table, device, use_torch)
    keep.append(host_table)
    return arrays.address(arrays.as_array(host_table, "table"))


def _check_no_overlap(written, inputs):
    for k, w in enumerate(written):
        if any(arrays.overlap(w, x) for x in inputs):
            raise ArgumentError("c (and the bitmask) must not overlap a, b or bias")
        if any(arrays.overlap(w, other) for other in written[k + 1:]):
            raise ArgumentError("c and the bitmask must not overlap each other")
