"""bf16 results of a long contraction: summed in f32 over chunks of K, rounded to bf16 once.

A bf16 C cannot carry partial sums, so ops.matmul's nests with a bf16 output keep K whole: each
BRGEMM call then multiplies a (64 x K) block of rows by a (K x bn) panel, and from a few
thousand columns on neither stays in the L2 cache while the call's tiles stream through them.
For K > LONG_K the heuristic plan instead runs the f32-output nest with K chunks of KC (each
chunk's panel slice stays in L2 while every row block uses it; bias and activation in the last
chunk's epilogue, in f32) into an f32 buffer, and one identity TPP pass rounds that buffer to
the bf16 result. The rounding is the same single one as before (bias and activation were
applied to the f32 accumulator then, too), so the bits are those of the whole-K nest up to the
order of the f32 sums.

Measured (Sapphire Rapids, 2 threads, AMX; dz @ w of a 4096 x 4096 x 1024 MLP backward,
milliseconds, medians): whole K 28.5, chunks of 1024 into f32 19.2 (+ ~1 for the rounding
pass); torch 16.2. At K = 3072 (4096 x 3072 x 768) 11.1 against 10.2, at K = 1536 no gain:
hence LONG_K. A blocking given by the caller or stored by ops.tune is used as given.
"""
from __future__ import annotations

from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError
from tpp.runtime import arrays

from . import _host, blocked

LONG_K = 3072    # bf16 outputs with a longer K take this plan
KC = 1024        # K per chunk


def wanted(k: int, dt_out, blocking_given: bool) -> bool:
    """Whether a heuristic plan for a bf16 output of contraction length k is a LongKPlan."""
    return dt_out == _dt.BF16 and k > LONG_K and not blocking_given


class LongKPlan:
    """The plan interface of ops.matmul._Plan (run, thin_call, run_device, for_rows,
    dt_out) over `inner`, an f32-output plan of the same weight with K in chunks.
    checked_out(out, a, others, name) is ops.matmul's check of a caller's output."""

    __slots__ = ("inner", "n", "k", "dt_out", "tuned_rows", "checked_out")

    def __init__(self, inner, n, k, checked_out):
        self.inner, self.n, self.k, self.dt_out = inner, n, k, _dt.BF16
        self.tuned_rows = 0
        self.checked_out = checked_out

    def for_rows(self, m):
        return self

    def thin_call(self, x, packed, bias):
        """As _Plan.thin_call: None unless x is a C-contiguous (M, k) host array."""
        shape = x.shape
        if len(shape) != 2 or shape[1] != self.k or _host.on_device(x):
            return None
        if arrays.is_torch(x):
            if not (x.is_cpu and x.is_contiguous()) or x.is_neg():
                return None
        elif not x.flags.c_contiguous:
            return None
        return self.run(x, packed, None, bias, "x")

    def run(self, a, packed, out, bias, name):
        m, n = a.shape[0], self.n
        if out is None:
            result = view = _host.like(_host.np_empty((m, n), _dt.BF16.numpy,
                                                      _host.ALIGNED_FROM), a)
        else:
            result, view = out, self._checked(out, a, packed, bias, name)
        acc = _host.like(_host.scratch("matmul_longk", (m, n), _dt.F32), a)
        self.inner.run(a, packed, acc, self._f32_bias(bias, a), name)
        blocked.map_rows("identity", [acc], view)
        return result

    def _checked(self, out, a, packed, bias, name):
        """A caller's out after ops.matmul's checks and the nest's (which the rounding pass,
        an identity of any dtypes and shapes it is given, would not make)."""
        out = self.checked_out(out, a, (packed.data, bias), name)
        if _host.dtype_of(out, "out") != _dt.BF16:
            raise ArgumentError(f"out: expected bf16, got {_host.dtype_of(out, 'out')}")
        if tuple(out.shape) != (a.shape[0], self.n):
            raise ArgumentError(f"out: expected shape {(a.shape[0], self.n)}, got "
                                f"{tuple(out.shape)}")
        return out

    def run_device(self, a, packed, out, bias, names):
        m, n = a.shape[0], self.n
        if out is None:
            result = view = _host.empty((m, n), _dt.BF16, a)
        else:
            result, view = out, self._checked(out, a, packed, bias, names[0])
        acc = _host.empty((m, n), _dt.F32, a)
        self.inner.run_device(a, packed, acc, self._f32_bias(bias, a), names)
        blocked.map_rows("identity", [acc], view)
        return result

    def _f32_bias(self, bias, a):
        """The bias widened to f32 (the f32 nest's bias dtype), on a's device."""
        if bias is None:
            return None
        b = _host.contiguous(_host.host(bias, "bias", device=True))
        if tuple(b.shape) != (self.n,):
            return b        # the inner nest explains the shape
        if _host.dtype_of(b, "bias") != _dt.BF16:     # as the whole-K nest would say
            raise ArgumentError(f"bias: expected bf16, got {_host.dtype_of(b, 'bias')}")
        wide = _host.empty((1, self.n), _dt.F32, a)
        blocked.map_rows("identity", [_host.reshape(b, (1, self.n))], wide)
        return _host.reshape(wide, (self.n,))
