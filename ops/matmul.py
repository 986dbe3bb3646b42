"""matmul and linear: one compiled loop nest of BRGEMM calls over a packed weight.

    y = ops.matmul(a, b)                       # a (M, K), b (K, N) array or PackedWeight
    y = ops.linear(x, w, bias, "gelu")         # x (..., K), w (N, K) like torch.nn.Linear
    pw = ops.pack_nk(w); ops.linear(x, pw)     # pack once, reuse: no repacking per call

f32 in, f32 out; or bf16 in, f32 accumulation, bf16 (default) or f32 out. The output is
`act(a @ b + bias)`, bias one row of N values of the output dtype.

On a GPU: the same calls take device arrays (torch CUDA tensors, cupy, anything with
`__cuda_array_interface__`) and return device arrays of the input's kind on its device
(`_Plan.run_device`); the same nest runs there (its device code compiled once per device),
the weight packed there (ops.packing). Operands on different devices: ArgumentError.

The nest, for blocking (bm, bn, kc), runs over K chunks of kc (sequential, outermost), then the
N blocks (c) and the row blocks collapsed and split across threads, then the rows inside a
block (ops.blocked.row_blocks). Each step calls one BRGEMM of (rows x kc) @ (kc x bn) on the
row-major input and the weight's panel: the first chunk writes C (beta 0), later chunks add
(beta 1), and the last applies bias and activation while the tile is in registers. The row
count M is a size of the nest, given by the arrays at call time: one compiled nest serves
every M (and every batch/sequence shape behind a 3-D input). Rows past the last full block of
bm go to kernels of 8, 4, 2 and 1 rows (REMAINDER_PIECES), chosen at run time; columns and K
past the last full block get kernels of their own sizes (the weight's shape is fixed), so any
shape runs without padding the input.

Heuristic (`choose_blocking`, overridable with blocking=Blocking(...)): bm = 64 rows,
bn = the weight's panel width (64), kc = K up to 8192, else 4096-element chunks; bf16 output
keeps K whole (a bf16 C cannot carry partial sums), except that K > 3072 runs the f32 nest in
K chunks into an f32 buffer rounded to bf16 once (ops.matmul_longk); bf16 weights of at most
1 MiB on a matrix unit take the row band outer (order "BC"); f32 weights of several 64-column
panels run their panels in groups of at most 512 KB (Blocking.group, ops.matmul_blocking: the
groups outer, then the row blocks, then the group's panels, so x is read once per group).
None of it depends on M.
Problems under 4 MFLOP whose weight is under 1 MiB run on one thread (decided per call,
`serial`): the team's wake-up would cost more than it saves; a larger weight is streamed by
every core even at M = 1. A winner stored by `ops.tune` for the problem on this CPU replaces
the heuristic (its bm, kc, band order "CB"/"BC" and thread rule; its panel width when the
weight was packed with it) for calls of at least half the M it was measured at
(ops.autotune.SHARE); fewer rows run the heuristic's blocking in a second nest
(`_Plan.for_rows`).

Nests are compiled per (weight shape, dtypes, bias, activation, blocking), plans (`_Plan`: the
nest, output dtype and thread rule, validated once) kept by each PackedWeight for the calls it
sees and process-wide by the same key, so a new M costs neither a compile nor a plan, and a
call on a weight seen before costs one dict lookup before its nest's fast path.
"""
from __future__ import annotations

import functools
import weakref

import numpy as np

import tpp
from tpp.runtime import arrays
from tpp.core import checks
from tpp.core import dtypes as _dt
from tpp.core.brgemm_spec import ACTIVATIONS   # the BRGEMM epilogues (the op table's epilogue flag)
from tpp.core.errors import ArgumentError
from tpp.runtime.lru import LRU, also_clear

from . import _host, autotune
from . import matmul_longk as longk
from .blocked import row_blocks, split
from .matmul_blocking import (Blocking, as_blocking, check_blocking, choose_blocking,  # noqa: F401
                              heuristic_blocking, panel_group)
from .packing import PackedWeight, pack_kn, pack_nk

_SERIAL_FLOPS = 4e6
_PARALLEL_BYTES = 1 << 20   # a weight this large runs on every thread (see serial)
_OWN_PLANS = 16             # plans a PackedWeight keeps (start over when full)
# The rows past the last whole block of bm run as kernels of 8, 4, 2 and 1 rows (at most one of
# each), not as single rows after the 8s: each kernel streams the weight's panel once for its
# rows (from L2), so a single-row kernel ran at a third of a block's rate per row. 384 x 1536
# f32 with bias, 2 threads: M = 70 406 -> ~380 us (M = 72: 379); M = 65 and 71 as before.
REMAINDER_PIECES = (8, 4, 2)


@functools.lru_cache(maxsize=256)
def gemm_nest(n, k, bn, dtype, dtype_out, bias, activation, bl: Blocking, keep=False):
    """The compiled nest computing y (M, n) = act(x (M, k) @ packed + bias), for any M.
    keep: the nest computes z = x @ packed + bias into its third tensor and y = act(z) into
    a last one (after the bias), the activation as a unary TPP on each output tile right
    after the tile's last BRGEMM (while the tile is in cache): a training forward's two
    outputs in one pass."""
    bm, kc = bl.bm, bl.kc
    m = tpp.size("M")
    rows_loop, levels, row_cases = row_blocks(m, bm, REMAINDER_PIECES)
    col_cases, blocks_n = split(n, bn)
    chunks = -(-k // kc)
    k_last = k - (chunks - 1) * kc
    vnni = dtype == _dt.BF16
    sub_rows = "b" * (levels - 1)
    if bl.group and n % bn == 0:    # panel groups outer, the row blocks, the group's panels
        group = panel_group(bl.group, blocks_n)
        nest = tpp.LoopNest("aCBD" + sub_rows, a=chunks, b=rows_loop, c=blocks_n // group,
                            d=group)
        a, r, g, d = nest.vars
        c = g * group + d
    else:
        nest = tpp.LoopNest("a" + bl.order + sub_rows, a=chunks, b=rows_loop, c=blocks_n)
        a, r, c = nest.vars
    x = nest.tensor("x", (m, k), dtype)
    w = nest.tensor("w", (blocks_n, (k + 1) // 2, 2 * bn) if vnni else (blocks_n, k, bn), dtype)
    y = nest.tensor("y", (m, n), dtype_out)
    bias_t = nest.tensor("bias", (n,), dtype_out) if bias else None
    act_t = nest.tensor("act", (m, n), dtype_out) if keep else None

    if chunks == 1:
        k_cases = [(k, 0, True, ())]
    else:
        k_cases = [(kc, 0, False, (a == 0,)), (k_last, 1, True, (a == chunks - 1,))]
        if chunks > 2:
            k_cases.insert(1, (kc, 1, False, (a > 0, a < chunks - 1)))
    for rows, row_guard in row_cases:
        for cols, col_guard in col_cases:
            for depth, beta, last, kcond in k_cases:
                spec = tpp.make_brgemm(
                    rows, cols, depth, lda=k, ldb=2 * bn if vnni else bn, ldc=n,
                    dtype_a=dtype, dtype_b=dtype, dtype_c=dtype_out, beta=beta, vnni_b=vnni,
                    bias="row" if (bias and last) else None,
                    activation=activation if (last and not keep) else None)
                w_at = w[c, a * (kc // 2)] if vnni else w[c, a * kc]
                when = row_guard(r) + col_guard(c) + kcond
                nest.call(spec, x[r, a * kc], w_at, y[r, c * bn],
                          bias=bias_t[c * bn] if (bias and last) else None, when=when)
                if keep and last:
                    act = tpp.make_unary(activation, rows, cols, ldi=n, ldo=n,
                                         dtype_in=dtype_out, dtype_out=dtype_out)
                    nest.call(act, y[r, c * bn], act_t[r, c * bn], when=when)
    return nest.compile()


def matmul(a, b, out=None, bias=None, activation=None, *, out_dtype=None, blocking=None,
           **unknown):
    """act(a @ b + bias): a (M, K); b a (K, N) array or a PackedWeight (ops.pack_kn);
    out (M, N) written in place when given (not a torch tensor requiring grad while grad
    mode is on: autograd would not see the write). Returns the output."""
    if unknown:
        _host.reject_unknown(matmul, unknown)
    a = _host.host(a, "a", device=True)
    if a.ndim != 2:
        raise ArgumentError(f"a: expected a 2-D (M, K) array, got shape {tuple(a.shape)}")
    packed = b if isinstance(b, PackedWeight) else pack_kn(b)
    a = _host.contiguous(a)
    plan = _plan(a, packed, out_dtype, bias is not None, activation, blocking, "a")
    if _device_data(a):
        return plan.run_device(a, packed, out, bias, ("a", "b"))
    try:
        return plan.run(a, packed, out, bias, "a")
    except ArgumentError:
        _host.same_device(a=a, b=packed.data, bias=bias, out=out)   # a mix, in these names
        raise


def linear(x, w, b=None, activation=None, *, out_dtype=None, blocking=None, **unknown):
    """act(x @ w.T + b) like torch.nn.functional.linear: x (..., K); w (N, K) or a
    PackedWeight from ops.pack_nk(w); returns (..., N)."""
    if unknown:
        _host.reject_unknown(linear, unknown)
    tx = type(x)
    if ((tx is _NDARRAY or tx in _TORCH_TYPES) and type(w) is PackedWeight
            and blocking is None):
        # the thin path: a plan this weight validated before for this kind of call
        try:
            plan = w.plans.get((x.dtype, out_dtype, b is not None, activation))
        except TypeError:   # unhashable arguments: rejected by the checked way below
            plan = None
        if plan is not None:
            y = plan.thin_call(x, w, b)
            if y is not None:
                return y
    x = _host.host(x, "x", device=True)
    packed = w if isinstance(w, PackedWeight) else pack_nk(w)
    if len(x.shape) == 2 and x.shape[1] == packed.k:    # the common case: no reshape
        x2 = _host.contiguous(x)
        lead = None
    else:
        x2, lead = _host.rows(x, packed.k, "x")
    plan = _plan(x2, packed, out_dtype, b is not None, activation, blocking, "x")
    if _device_data(x2):
        y = plan.run_device(x2, packed, None, b, ("x", "w"))
        return y if lead is None else _host.reshape(y, (*lead, packed.n))
    try:
        y = plan.run(x2, packed, None, b, "x")
    except ArgumentError:
        _host.same_device(x=x2, w=packed.data, b=b)     # a mix, in these names
        raise
    return y if lead is None else y.reshape(*lead, packed.n)


def linear_keep(x, packed, bias, activation):
    """(z, act(z)) for z = x @ packed + bias, x (M, K) a 2-D array of the weight's dtype: both
    in one nest (gemm_nest's keep), the activation applied to each output tile while it is in
    cache (a training forward whose backward reads z: one pass less over z than linear then
    ops.blocked.map_rows). Validated as ops.linear validates its calls; activation not None.
    On x's device (the weight and bias there too: ArgumentError naming them otherwise)."""
    x = _host.contiguous(_host.host(x, "x", device=True))
    if x.ndim != 2:
        raise ArgumentError(f"x: expected a 2-D (M, K) array, got shape {tuple(x.shape)}")
    # the plain linear's plan validates x, the weight and the bias (and is what a call
    # without the activation runs); its output dtype holds for this nest too
    plan = _plan(x, packed, None, bias is not None, None, None, "x")
    if activation is None or activation not in ACTIVATIONS:
        raise ArgumentError(f"activation must be one of {ACTIVATIONS[1:]}, got {activation!r}")
    m, n, k = x.shape[0], packed.n, packed.k
    if bias is not None and not _dense(bias):
        bias = _host.contiguous(_host.host(bias, "bias", device=True))
    if _device_data(x):
        _host.same_device(x=x, weight=packed.data, bias=bias)
    dt = plan.dt_out
    bl = heuristic_blocking(k, n, packed.bn, packed.dtype, dt, not _device_data(x))
    nest = gemm_nest(n, k, packed.bn, packed.dtype, dt, bias is not None, activation,
                     check_blocking(bl, k, dt, dt == _dt.BF16), keep=True)
    z, y = _host.empty((m, n), dt, x), _host.empty((m, n), dt, x)
    # the heuristic's thread rule, as this nest has its blocking (not a tuned winner's)
    threads = 1 if m < serial_rows(n, k, k * n * packed.dtype.itemsize) else None
    nest.call((x, packed.data, z, y) if bias is None else (x, packed.data, z, bias, y),
              threads)
    return z, y


def serial(flops: float, nbytes: int) -> bool:
    """Whether a product of `flops` that streams `nbytes` (its weight, read once per call
    however few the rows) runs on one thread: under 4 MFLOP and 1 MiB. A weight that large
    is worth both cores even at M = 1 (a memory-bound GEMV: their combined bandwidth, and
    each core's share stays in its own L2 across calls); below, the team's wake-up costs more
    than it saves."""
    return flops < _SERIAL_FLOPS and nbytes < _PARALLEL_BYTES


def serial_rows(n, k, weight_bytes, always=False) -> int:
    """The rows below which a call on an (n, k) weight of weight_bytes runs on one thread
    (serial() solved for M); always: every call (a tuned winner that found the team slower
    at every M it saw)."""
    if always:
        return 1 << 62
    return 0 if not serial(0, weight_bytes) else int(-(-_SERIAL_FLOPS // (2 * n * k)))


class _Plan:
    """One kind of problem (weight geometry and dtype, input dtype, output dtype, bias,
    activation, blocking), validated once: its nest, output dtype and thread rule; and for a
    problem of one BRGEMM call per M (N within one panel, K in one chunk), `direct`: rows ->
    the nest's own kernel for that many rows, called by direct_call without the nest."""

    __slots__ = ("nest", "dt_out", "n", "k", "serial_rows", "np_out", "direct", "np_in",
                 "w_shape", "torch_out", "tuned_rows", "fewer_rows", "_fewer")

    def __init__(self, nest, dt_out, n, k, weight_bytes, single=False, serial_always=False):
        self.nest, self.dt_out, self.n, self.k, self.np_out = nest, dt_out, n, k, dt_out.numpy
        self.torch_out = None
        # a tuned plan: calls of fewer than tuned_rows rows run the plan fewer_rows() makes
        self.tuned_rows, self.fewer_rows, self._fewer = 0, None, None
        self.serial_rows = serial_rows(n, k, weight_bytes, serial_always)
        self.direct = self.np_in = self.w_shape = None
        if single and _DATA_FIELD is not None:
            self._direct_kernels()

    def _direct_kernels(self):
        """Fill `direct` from the nest's calls: each kernel computing all n columns over all k
        for a row count R, dense (lda k, ldc n), one pair, in the nest's table."""
        spec = self.nest.spec
        plain = self.nest._plain
        if not (len(spec.tensors) in (3, 4) and plain[2][0] == self.np_out
                and (len(plain) == 3 or plain[3][0] == self.np_out)):
            return
        kernels = spec.kernel_specs()
        base = self.nest._slots["kernels"]
        direct = {}
        for call in spec.calls:
            ks = call.spec
            counts = call.args[5:]
            if (ks.n != self.n or ks.k != self.k or ks.lda != self.k or ks.ldc != self.n
                    or ks.beta != 0 or any(not c.const == v or c.terms
                                           for c, v in zip(counts, (1, 0, 0)))):
                continue
            address = int(self.nest._template[base + kernels.index(ks)])
            direct.setdefault(ks.m, arrays.ffi.cast(_RAW_SIGNATURE, address))
        if direct:
            self.direct, self.np_in = direct, plain[0][0]
            self.w_shape = tuple(spec.tensors[1].shape_at({}))

    def direct_call(self, x, packed, bias):
        """act(x @ packed + bias) by one kernel call for numpy x (R, k), R a row count of
        `direct`, C-contiguous of the nest's dtype, packed.data and bias numpy arrays of the
        nest's geometry (every check the nest makes; the output is new, so it overlaps
        nothing); None for anything else (the nest's path then checks and explains)."""
        shape = x.shape
        if len(shape) != 2 or shape[1] != self.k:
            return None
        fn = self.direct.get(shape[0])
        if fn is None or x.dtype != self.np_in or not x.flags.c_contiguous:
            return None
        data = packed.data
        if (type(data) is not _NDARRAY or data.shape != self.w_shape
                or data.dtype != self.np_in or not data.flags.c_contiguous):
            return None
        if bias is None:
            pb = 0
        elif (type(bias) is not _NDARRAY or bias.shape != (self.n,)
              or bias.dtype != self.np_out or not bias.flags.c_contiguous):
            return None
        else:
            pb = _DATA_FIELD(id(bias) + _DATA_OFFSET).value
        out = _host.np_empty((shape[0], self.n), self.np_out, _host.ALIGNED_FROM)
        fn(_DATA_FIELD(id(x) + _DATA_OFFSET).value, _DATA_FIELD(id(data) + _DATA_OFFSET).value,
           _DATA_FIELD(id(out) + _DATA_OFFSET).value, pb, 0, 1, 0, 0)
        return out

    def thin_call(self, x, packed, bias):
        """act(x @ packed + bias) for a call whose kind (x's dtype, output dtype, bias or not,
        activation) this plan was validated for on `packed`: x a numpy array or CPU torch
        tensor (M, k), C-contiguous; by direct_call where the plan has a kernel for M rows,
        else by `run` (the nest checks the arrays' dtypes, layouts, shapes and memory again
        on every call). None for anything else: the caller's checked path then explains."""
        shape = x.shape
        if len(shape) != 2 or shape[1] != self.k:
            return None
        if type(x) is _NDARRAY:
            if self.direct is not None:
                y = self.direct_call(x, packed, bias)
                if y is not None:
                    return y
            if not x.flags.c_contiguous:
                return None
        elif not (x.is_cpu and x.is_contiguous()) or x.is_neg():
            return None
        return self.run(x, packed, None, bias, "x")

    def run(self, a, packed, out, bias, name):
        """act(a @ packed + bias) into out (None: a new array of a's kind); a is C-contiguous
        (M, K) of the plan's dtype and K, packed of the plan's weight geometry."""
        m = a.shape[0]
        if m < self.tuned_rows:
            return self.for_rows(m).run(a, packed, out, bias, name)
        if bias is not None and not _dense(bias):
            bias = _host.contiguous(_host.host(bias, "bias", device=True))
            _host.same_device(**{name: a, "bias": bias})     # a device bias is a mix
        if out is None:
            if type(a) is _NDARRAY:
                out = _host.np_empty((m, self.n), self.np_out, _host.ALIGNED_FROM)
            else:
                tdt = self.torch_out
                if tdt is None:
                    import torch
                    tdt = self.torch_out = getattr(torch, self.dt_out.torch_name)
                # sizes as separate arguments: torch parses them ~0.5 us faster than a tuple;
                # torch.empty itself below the huge-page size (torch_empty costs ~0.3 us more)
                if m * self.n * self.dt_out.itemsize < _host.ADVISE_BYTES:
                    out = _TORCH_EMPTY[0](m, self.n, dtype=tdt)
                else:
                    out = _host.torch_empty(m, self.n, dtype=tdt)
        else:
            out = _checked_out(out, a, (packed.data, bias), name)
        threads = 1 if m < self.serial_rows else None
        self.nest.call((a, packed.data, out) if bias is None else (a, packed.data, out, bias),
                       threads)
        return out

    def for_rows(self, m):
        """The plan serving calls of m rows: this one, or for a tuned plan and m under
        tuned_rows, the heuristic's (made on the first such call)."""
        if m >= self.tuned_rows:
            return self
        fewer = self._fewer
        if fewer is None:
            fewer = self._fewer = self.fewer_rows()
        return fewer

    def run_device(self, a, packed, out, bias, names):
        """`run` for a on a device: the weight, bias and out (None: a new array of a's kind
        from the device's backend) on a's device, else an ArgumentError naming them (names:
        the caller's for a and the weight); the nest runs there (tpp.runtime.loops.CompiledNest
        dispatches by device). Returns out as given, or the new array."""
        if a.shape[0] < self.tuned_rows:
            return self.for_rows(a.shape[0]).run_device(a, packed, out, bias, names)
        name = names[0]
        _host.same_device(**{name: a, names[1]: packed.data, "bias": bias, "out": out})
        if bias is not None:
            bias = _host.contiguous(_host.host(bias, "bias", device=True))
        if out is None:
            result = view = _host.empty((a.shape[0], self.n), self.dt_out, a)
        else:
            result, view = out, _checked_out(out, a, (packed.data, bias), name)
        self.nest.call((a, packed.data, view) if bias is None else
                       (a, packed.data, view, bias))
        return result


def _checked_out(out, a, others, name):
    """A given output (host or device) after the checks the nests do not make: on a's device
    (ArgumentError naming a mix), not a torch tensor autograd would miss a write into, and no
    overlap with a or the other inputs (the nest reads them while it writes out: shared
    memory gives wrong results)."""
    out = _host.host(out, "out", device=True)
    _host.same_device(**{name: a, "out": out})
    arrays.check_output_tensor(out, "out")
    if any(_host.overlap(out, t) for t in (a, *others) if t is not None):
        raise ArgumentError(f"out must not overlap {name}, the weight or the bias")
    return out


def _device_data(a) -> bool:
    """Whether a, an array _host.host(..., device=True) returned, is device data: _host's
    on_device with its host answers first (numpy, a CPU tensor of a type seen before)."""
    t = type(a)
    return not (t is _NDARRAY or (t in _TORCH_TYPES and a.is_cpu)) and _host.on_device(a)


def _dense(t) -> bool:
    """Whether t is a C-contiguous numpy array or a contiguous CPU torch tensor (without
    torch's negative bit) of a type _host.host accepts as it is (else `run` passes it through
    _host first)."""
    if type(t) is _NDARRAY:
        return t.flags.c_contiguous
    return type(t) in _TORCH_TYPES and t.is_cpu and t.is_contiguous() and not t.is_neg()


_NDARRAY = np.ndarray
_TORCH_TYPES = _host._CPU_TENSOR_TYPES  # torch.Tensor, Parameter: once _host.host saw them
_DATA_FIELD, _DATA_OFFSET = arrays._DATA_FIELD, arrays._DATA_OFFSET   # (arrays.address)
_RAW_SIGNATURE = ("void(*)(intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, "
                  "intptr_t, intptr_t)")




def _torch_empty(*args, **kw):
    import torch
    _TORCH_EMPTY[0] = torch.empty
    return torch.empty(*args, **kw)


_TORCH_EMPTY = [_torch_empty]      # torch.empty once torch is imported (no import per call)


_PLANS = LRU(256, "matmul_plans")   # problem -> _Plan
_PLANNED = weakref.WeakSet()        # the PackedWeights holding plans of their own
also_clear(gemm_nest.cache_clear)   # tpp.clear_caches() empties the nests too


def _forget_plans():
    for packed in list(_PLANNED):
        packed.plans.clear()


also_clear(_forget_plans)


def _default_blocking(packed, k, dt, dt_out, has_bias, activation):
    """(blocking, rows) for a call without blocking=: a winner ops.tune stored for this
    problem on this CPU (when the weight is packed with its panel width) and the fewest rows
    it serves (ops.autotune.SHARE); else choose_blocking's and 0."""
    found = autotune.lookup_with_rows(packed.n, k, dt, dt_out, has_bias, activation)
    if found is not None and found[0].bn == packed.bn:
        return found[0].blocking(), found[1]
    return heuristic_blocking(k, packed.n, packed.bn, dt, dt_out,
                              not _host.on_device(packed.data)), 0




def forget_tuned() -> None:
    """Forget the plans made so far (ops.tune calls it after storing a winner, so that the
    next call of that problem takes it) and the memo of stored winners."""
    autotune.forget()
    _PLANS.clear()
    _forget_plans()


def _plan(a, packed, out_dtype, has_bias, activation, blocking, name) -> _Plan:
    """The _Plan of a call on a (M, K) array: from the weight's own plans (keyed by what the
    call may vary: a's native dtype, out_dtype, bias or not, activation), else the process-
    wide ones, else validated and built. blocking= always takes the checked way."""
    if not isinstance(packed, PackedWeight):
        raise ArgumentError(f"expected a PackedWeight, got {type(packed).__name__}")
    own = packed.plans
    key = None
    if blocking is None:
        key = (a.dtype, out_dtype, has_bias, activation)
        try:
            plan = own.get(key)
        except TypeError:   # unhashable (activation=["relu"], ...): rejected below
            plan = key = None
        if plan is not None and a.shape[1] == packed.k:
            return plan
    plan = _checked_plan(a.shape[1], packed, _host.dtype_of(a, name), out_dtype, has_bias,
                         activation, as_blocking(blocking))
    if key is not None:
        if len(own) >= _OWN_PLANS:
            own.clear()
        own[key] = plan
        _PLANNED.add(packed)
    return plan


def _checked_plan(k, packed, dt, dt_out_arg, has_bias, activation, blocking) -> _Plan:
    """The _Plan for one kind of problem (any M), validated once and then looked up."""
    key = (k, packed.k, packed.n, packed.bn, dt, packed.dtype, dt_out_arg, has_bias,
           activation, blocking)     # the weight's K and dtype too: they are checked below
    try:
        plan = _PLANS.get(key)
    except TypeError:       # an unhashable argument (activation=["relu"], ...): the checks
        plan = key = None   # below reject it with an ArgumentError
    if plan is not None:
        return plan
    if dt != packed.dtype:
        raise ArgumentError(f"the input is {dt} but the weight is {packed.dtype}; use one dtype")
    if k != packed.k:
        raise ArgumentError(f"the input has {k} columns, but the weight has K = {packed.k} rows")
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    dt_out = dt if dt_out_arg is None else _dt.lookup(dt_out_arg)
    if dt_out not in (_dt.F32, _dt.BF16) or (dt == _dt.F32 and dt_out != _dt.F32):
        raise ArgumentError(f"out_dtype {dt_out} with {dt} inputs: f32 gives f32, bf16 gives "
                            f"bf16 or f32")
    bl, tuned_rows = _default_blocking(packed, k, dt, dt_out, has_bias, activation) \
        if blocking is None else (blocking, 0)

    n, bn = packed.n, packed.bn     # (the plans outlive the weight: not kept by make)

    def make(bl, out=dt_out):
        bl = check_blocking(bl, k, out, dt == _dt.BF16)
        nest = gemm_nest(n, k, bn, dt, out, has_bias, activation, bl)
        return _Plan(nest, out, n, k, k * n * dt.itemsize, single=bl.kc >= k and n <= bn,
                     serial_always=bl.threads == 1)
    if longk.wanted(k, dt_out, blocking is not None or tuned_rows > 0):
        # f32 sums over K chunks, rounded to bf16 once (ops.matmul_longk)
        chunked = Blocking(bl.bm, longk.KC, bl.order, bl.threads, bl.group)
        plan = longk.LongKPlan(make(chunked, _dt.F32), n, k, _checked_out)
    else:
        plan = make(bl)
    if tuned_rows > 1:      # fewer rows take the heuristic's plan (built on first use)
        plan.tuned_rows = tuned_rows
        plan.fewer_rows = lambda: make(heuristic_blocking(k, n, bn, dt, dt_out))
    if key is not None:
        _PLANS[key] = plan
    return plan
