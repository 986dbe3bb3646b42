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
(`Kernel.raw`, see tpp.core.brgemm_spec for its signature) checks nothing. The checks cost O(1)
Python work per array (O(count) for the offset tables and address lists): what depends on an
array's layout is remembered per layout (tpp.runtime.arrays), overlap is decided on byte ranges.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from . import arrays, recording as _recording, registry
from ..core import checks
from ..core.checks import reject_unknown_call
from ..core.errors import ArgumentError
from .device import CPU
from .kernel import KernelBase
from .lru import LRU, VARIANTS_PER_KERNEL

_SIGNATURE = "void(*)(intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t)"


class Bound(NamedTuple):
    """An array of a call, checked: its name (for messages), the array as bound
    (tpp.runtime.arrays.as_array), its Layout and the address of its first element."""
    name: str
    arr: object
    layout: object
    address: int

    @property
    def span(self) -> tuple:
        """[first byte, last byte + 1) of its memory."""
        return _span(self.layout, self.address)


def _bound(arr, name: str) -> Bound:
    """Bound of an array already through tpp.runtime.arrays.as_array."""
    return Bound(name, arr, arrays.layout(arr, name), arrays.address(arr))


def _span(lay, address: int) -> tuple:
    return address + lay.low, address + lay.high


class _Plan(NamedTuple):
    """What a batch='stride' call on the host decides from its arrays' signatures alone: made
    by the first call that passes every check, used by every later call with the same
    signatures, which then checks only what depends on the arrays themselves (see _run)."""
    fn: object            # the C function for the call's (lda, ldb, ldc)
    blocks_a: int
    blocks_b: int
    stride_a: int         # batch strides in elements
    stride_b: int
    layouts: tuple        # of a, b, c, bias, mask; None where the caller passed none
    use_torch: bool       # outputs allocated here are torch tensors


class BrgemmKernel(KernelBase):
    def __init__(self, spec):
        self.spec = spec
        self._ops = {op.name: op for op in spec.operands()}
        self._variants = LRU(VARIANTS_PER_KERNEL, "variants")   # lds -> C function
        self._raw = None
        self._checks = {name: arrays.LayoutChecks(op) for name, op in self._ops.items()}
        self._stacks = {"a": {}, "b": {}}   # batch='stride': Layout -> (ld, batch stride)
        self._plans: dict = {}                # batch='stride': signatures -> _Plan
        self._bitmask = bool(spec.bitmask)

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
            code = registry.for_device(CPU).compile(self._spec_for(lds), CPU)
            fn = arrays.ffi.cast(_SIGNATURE, code.address)
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
        if _recording.active:
            _recording.refuse(f"a {type(self).__name__} called outside a nest")
        if unknown:
            reject_unknown_call("brgemm kernel call", unknown,
                                ("c", "bias", "mask", "offsets_a", "offsets_b", "count"))
        if self._plans and offsets_a is None and offsets_b is None:
            signature = arrays.signature       # arrays.signatures, unrolled
            plan = self._plans.get((signature(a), signature(b), signature(c),
                                    () if bias is None else signature(bias),
                                    () if mask is None else signature(mask)))
            if plan is not None:
                return self._run(plan, a, b, c, bias, mask, count)
        return self._call_checked(a, b, c, bias, mask, offsets_a, offsets_b, count)

    def _run(self, plan: _Plan, a, b, c, bias, mask, count):
        """A stride-mode call whose arrays have the signatures `plan` was made for: what does
        not follow from them is checked here (count, the outputs' writability and autograd
        state, overlap between outputs and the other arrays, on their addresses)."""
        fn, blocks_a, blocks_b, stride_a, stride_b, layouts, use_torch = plan
        la, lb, lc, lbias, lmask = layouts
        if count is None and blocks_a == blocks_b:
            count = blocks_a
        else:
            count = self._stride_count(count, blocks_a, blocks_b)
        address = arrays.address
        pa, pb = address(a), address(b)
        inputs = [(pa + la.low, pa + la.high), (pb + lb.low, pb + lb.high)]
        pbias = 0
        if lbias is not None:
            pbias = address(bias)
            inputs.append((pbias + lbias.low, pbias + lbias.high))
        c, pc, c_span = self._output("c", c, lc, use_torch)
        if not self._bitmask:
            _check_no_overlap((c_span,), inputs)
            fn(pa, pb, pc, pbias, 0, count, stride_a, stride_b)
            return c
        mask, pmask, mask_span = self._output("mask", mask, lmask, use_torch)
        _check_no_overlap((c_span, mask_span), inputs)
        fn(pa, pb, pc, pbias, pmask, count, stride_a, stride_b)
        return c, mask

    def _output(self, name: str, arr, lay, use_torch: bool) -> tuple:
        """(array, address, span) of an output of a planned call: the caller's, checked (its
        span: it may overlap something), or a new one where lay is None (span None)."""
        if lay is None:
            arr = arrays.allocate(self._ops[name], use_torch)
            return arr, arrays.address(arr), None
        arrays.check_output(arr, lay, name)
        addr = arrays.address(arr)
        return arr, addr, (addr + lay.low, addr + lay.high)

    def _call_checked(self, a, b, c, bias, mask, offsets_a, offsets_b, count):
        """Any call: every check; a stride-mode call on the host leaves a plan for the next
        call with the same array signatures."""
        spec, ops = self.spec, self._ops
        if spec.batch != "offset" and (offsets_a is not None or offsets_b is not None):
            raise ArgumentError(f"offsets_a/offsets_b belong to batch='offset'; this kernel's "
                                f"batch mode is {spec.batch!r}")
        if (bias is not None) != bool(spec.bias):
            raise ArgumentError(f"this kernel adds a bias {spec.bias}: pass bias=..." if spec.bias else
                                "this kernel has no bias (build it with bias='row')")
        if mask is not None and not spec.bitmask:
            raise ArgumentError("this kernel writes no bitmask (relu with bitmask=True does)")
        key = arrays.signatures(a, b, c, bias, mask) if spec.batch == "stride" else None
        binder = {"stride": self._bind_stride, "offset": self._bind_offset,
                  "address": self._bind_address}[spec.batch]
        count, lda, ldb, a_base, b_base, arg_a, arg_b, inputs = binder(
            a, b, count, offsets_a, offsets_b)

        given = {name: _bound(arrays.as_array(x, name), name)
                 for name, x in (("c", c), ("bias", bias), ("mask", mask)) if x is not None}
        named = inputs + list(given.values())
        device = arrays.shared_device([x.layout for x in named],
                                      [(x.name, x.arr) for x in named])
        use_torch = any(x.layout.kind == "torch" for x in named)
        if "c" not in given and spec.beta:
            raise ArgumentError("beta=1 reads C: pass c=...")
        written = {}
        for name in ("c", "mask") if spec.bitmask else ("c",):
            x = given.get(name)
            if x is None:
                x = _bound(arrays.allocate(ops[name], use_torch, device), name)
            written[name] = x
        ldc = self._checks["c"].ld(written["c"].layout, "c")
        if spec.bias:
            self._checks["bias"].ld(given["bias"].layout, "bias")
            inputs.append(given["bias"])
        if spec.bitmask:
            self._checks["mask"].ld(written["mask"].layout, "mask")
        for name, x in written.items():
            if name in given:
                arrays.check_output(x.arr, x.layout, name)
        _check_no_overlap([x.span if name in given else None for name, x in written.items()],
                          [x.span for x in inputs])

        keep = []       # the int64 tables the kernel reads, alive until the launch is queued
        arg_a, arg_b = (x if isinstance(x, int) else _table(x, device, use_torch, keep)
                        for x in (arg_a, arg_b))
        if spec.batch == "address":
            a_base, b_base = (_table(x, device, use_torch, keep) for x in (a_base, b_base))
        mask = written.get("mask")
        args = (a_base, b_base, written["c"].address, given["bias"].address if spec.bias else 0,
                mask.address if mask else 0, count, arg_a, arg_b)
        if device.is_host:
            fn = self._variant((lda, ldb, ldc))
            fn(*args)
            if key is not None:
                layouts = tuple(x.layout if x is not None else None for x in
                                (inputs[0], inputs[1], given.get("c"), given.get("bias"),
                                 given.get("mask")))
                arrays.remember(self._plans, key, _Plan(
                    fn, inputs[0].layout.shape[0], inputs[1].layout.shape[0], arg_a, arg_b,
                    layouts, use_torch))
        else:
            spec = self._spec_for((lda, ldb, ldc))
            registry.for_device(device).compile(spec, device).launch(args, torch_stream=use_torch)
        del keep
        c_out = arrays.user_object(written["c"].arr)
        return (c_out, arrays.user_object(mask.arr)) if spec.bitmask else c_out

    def _stride_count(self, count, blocks_a: int, blocks_b: int) -> int:
        """The blocks a stride-mode call uses: count, or all when a and b hold as many."""
        if blocks_a != blocks_b and count is None:
            raise ArgumentError(f"a holds {blocks_a} blocks and b {blocks_b}; pass count= "
                                f"to use fewer")
        return self._count(count, min(blocks_a, blocks_b), "a or b")

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
        ops = self._ops
        a, b = _bound(arrays.as_array(a, "a"), "a"), _bound(arrays.as_array(b, "b"), "b")
        for x in (a, b):
            shape = x.layout.shape
            want = (ops[x.name].rows, ops[x.name].cols)
            if len(shape) != 3 or shape[1:] != want:
                raise ArgumentError(f"{x.name}: batch='stride' takes a 3-D array (count, "
                                    f"{want[0]}, {want[1]}), got shape {shape}")
        count = self._stride_count(count, a.layout.shape[0], b.layout.shape[0])
        (lda, stride_a), (ldb, stride_b) = self._stack(a), self._stack(b)
        return count, lda, ldb, a.address, b.address, stride_a, stride_b, [a, b]

    def _stack(self, x: Bound) -> tuple:
        """(ld, batch stride in elements) of a 3-D stride-mode array of the right shape,
        remembered per layout: its blocks are checked as the operand (dtype, contiguous rows,
        ld; nothing to check when it holds none), its batch stride must be >= 0 (0 when it
        holds one block)."""
        seen = self._stacks[x.name]
        found = seen.get(x.layout)
        if found is None:
            lay, op = x.layout, self._ops[x.name]
            ld = op.ld
            if lay.shape[0]:
                block = dataclasses.replace(lay, shape=lay.shape[1:], strides=lay.strides[1:])
                ld = arrays.check_layout(op, block, x.name)     # the blocks' checks
            stride = lay.strides[0] if lay.shape[0] > 1 else 0
            if stride < 0:
                raise ArgumentError("a and b must have a non-negative batch stride")
            found = (ld, stride)
            arrays.remember(seen, x.layout, found)
        return found

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
            base = _bound(arrays.as_array(arr, name), name)
            lay, op = base.layout, ops[name]
            if lay.dtype is not op.dtype:
                raise ArgumentError(f"{name}: expected dtype {op.dtype}, got {lay.native}")
            if not arrays.contiguous(lay.shape, lay.strides):
                raise ArgumentError(f"{name}: batch='offset' reads a C-contiguous base array")
            _check_offsets(name, op, o[:count], math.prod(lay.shape))
            bases.append(base)
        return count, spec.lda, spec.ldb, bases[0].address, bases[1].address, \
            offs[0], offs[1], bases

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
        pointer_arrays, blocks = [], []
        for name, seq in zip(("a", "b"), seqs):
            seq = [_bound(x, f"{name}[{i}]") for i, x in enumerate(seq[:count])]
            found = {self._checks[name].ld(x.layout, x.name) for x in seq}
            if len(found) > 1:
                raise ArgumentError(f"{name}: every block must have the same row stride (ld), "
                                    f"got {sorted(found)}")
            lds.append(found.pop() if found else ops[name].ld)
            pointer_arrays.append(np.array([x.address for x in seq] or [0], np.int64))
            blocks += seq
        return count, lds[0], lds[1], pointer_arrays[0], pointer_arrays[1], 0, 0, blocks


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
    if not device.is_host:
        host_table = registry.for_device(device).to_device(host_table, device, use_torch)
    keep.append(host_table)
    return arrays.address(arrays.as_array(host_table, "table"))


def _check_no_overlap(written, inputs):
    """ArgumentError if an output the caller passed shares memory with an input or with the
    other output. written: the byte spans [lo, hi) of c (and the bitmask), None for an output
    allocated by the call (it shares memory with nothing); inputs: the spans of a, b (every
    block in address mode) and bias. (The tests are tpp.runtime.arrays.spans_overlap's, inline.)"""
    for k, w in enumerate(written):
        if w is None:
            continue
        lo, hi = w
        if lo == hi:
            continue
        for x_lo, x_hi in inputs:
            if x_lo < hi and lo < x_hi and x_lo < x_hi:
                raise ArgumentError("c (and the bitmask) must not overlap a, b or bias")
        for o in written[k + 1:]:
            if o is not None and arrays.spans_overlap(w, o):
                raise ArgumentError("c and the bitmask must not overlap each other")
