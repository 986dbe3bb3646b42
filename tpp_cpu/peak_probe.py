"""One core's floating-point peak, measured by a register-resident JIT kernel.

`void probe(i64 out, i64 iterations)` keeps N independent accumulator vectors in registers
(3/4 of the register file: 12 ymm on AVX2, 24 zmm on AVX-512, more than FMA latency x pipes),
updates each UNROLL times per loop trip from two loop-invariant vectors, reads no memory in the
loop, and stores the accumulators' sum (`lanes` f32) to `out` so that nothing is dead code.

  f32    `llvm.fma` (vfmadd231ps): 2 FLOPs per f32 lane per instruction.
  bf16   on AMX targets, `tdpbf16ps` on four independent accumulator tiles (tmm0-3) from
         two A and two B tiles (the blocking of tpp_cpu.brgemm_amx): 16 x 16 x 32 x 2 FLOPs
         per instruction, what bf16 BRGEMMs run on there. Else `vdpbf16ps` where the target
         has avx512_bf16: 4 FLOPs per f32 lane. Elsewhere bf16 is widened (exactly) to f32
         and computed by f32 FMAs, so the bf16 peak *is* the f32 probe: `build("bf16")`
         returns it, `via` says so.

`build(kind)` gives a `Probe` (runs `iterations` loop trips; knows one trip's FLOPs) for a
benchmark's timing loop; `measure_peak(kind)` measures GFLOP/s by itself.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from tpp.runtime.arrays import ffi
from tpp.core.errors import UnsupportedError

from . import amx, brgemm_amx, irx, jit
from .target import Target, current

UNROLL = 4                 # updates of every accumulator per loop trip
DEFAULT_ITERATIONS = 20_000   # loop trips per call: ~0.5 ms on a 2.5 GHz core
KINDS = ("f32", "bf16")


def accumulators(target: Target) -> int:
    """Independent accumulator vectors: 3/4 of the vector registers (16 ymm or 32 zmm)."""
    return target.vector_registers * 3 // 4


def flops_per_iteration(kind: str, target: Target) -> int:
    """FLOPs of one loop trip of the probe that `generate(kind, target)` builds."""
    if kind == "bf16" and target.amx:
        return len(_AMX_DOTS) * UNROLL * brgemm_amx.TILE ** 2 * brgemm_amx.K_STEP * 2
    return accumulators(target) * UNROLL * target.lanes * (4 if kind == "bf16" else 2)


def generate(kind: str, target: Target, symbol: str) -> ir.Module:
    """The IR of the probe (see the module docstring); kind "bf16" needs target.bf16_dot."""
    if kind not in KINDS or (kind == "bf16" and not target.bf16_dot):
        raise ValueError(f"no {kind!r} probe on the {target.isa} target (kinds: {KINDS})")
    module, b, (out,), (iterations,) = irx.new_kernel(symbol, 1, 1)
    if kind == "bf16" and target.amx:
        _amx_body(b, out, iterations)
        return module
    vf = irx.vec(irx.F32, target.lanes)
    if kind == "f32":
        # x*y is inexact, so LLVM cannot rewrite the fma as an add; acc saturates near 8
        x, y = irx.const(vf, 1.0 - 2.0 ** -24), irx.const(vf, 1e-6)
        update = functools.partial(irx.fma, b, x, y)
    else:   # bf16_dot targets are AVX-512: 16 f32 lanes, 32 bf16
        # every bf16 of x is 1.0 (bits 0x3F80), of y 2^-20 (0x3580): acc grows by 2^-19 a step
        x = irx.const(irx.vec(irx.I16, 2 * target.lanes), 0x3F80)
        y = irx.const(irx.vec(irx.I16, 2 * target.lanes), 0x3580)

        def update(acc):
            return irx.dpbf16(b, acc, x, y)
    # accumulators in stack slots, promoted to registers by SROA (for_range carries no values)
    slots = [b.alloca(vf, name=f"acc{j}") for j in range(accumulators(target))]
    for j, slot in enumerate(slots):
        b.store(irx.const(vf, float(j)), slot)
    with irx.for_range(b, iterations):
        vals = [b.load(s) for s in slots]
        for _u in range(UNROLL):
            vals = [update(v) for v in vals]
        for s, v in zip(slots, vals):
            b.store(v, s)
    irx.store_vec(b, functools.reduce(b.fadd, [b.load(s) for s in slots]), out, irx.i64(0))
    b.ret_void()
    return module


_AMX_DOTS = tuple((brgemm_amx.ACC[r][c], brgemm_amx.A_TILES[r], brgemm_amx.B_TILES[c])
                  for r in (0, 1) for c in (0, 1))       # (accumulator, A, B) tiles


def _amx_body(b, out, iterations):
    """Four accumulator tiles updated UNROLL times a trip from A tiles of 1.0 and B tiles of
    2^-20 (bf16), read from a module constant; tile 0's first row is stored to `out`."""
    ty = ir.ArrayType(irx.I16, 16 * 32)
    consts = []
    for name, bits in (("tpp_probe_ones", 0x3F80), ("tpp_probe_small", 0x3580)):
        g = ir.GlobalVariable(b.module, ty, name)
        g.initializer, g.global_constant, g.linkage, g.align = \
            ir.Constant(ty, [bits] * (16 * 32)), True, "internal", 64
        consts.append(g)
    rows = b.alloca(irx.F32, size=brgemm_amx.TILE ** 2, name="tile0")
    rows.align = 64
    amx.load_config(b, brgemm_amx.Layout(16, 16, 1, brgemm_amx.K_STEP).shapes())
    for c, a, bt in _AMX_DOTS:
        amx.zero(b, c)
    for tiles, g in ((brgemm_amx.A_TILES, consts[0]), (brgemm_amx.B_TILES, consts[1])):
        for t in tiles:
            amx.load(b, t, g, 64)
    with irx.for_range(b, iterations):
        for _u in range(UNROLL):
            for c, a, bt in _AMX_DOTS:
                amx.dot_bf16(b, c, a, bt)
    amx.store(b, 0, rows, 64)
    amx.release(b)
    irx.store_vec(b, irx.load_vec(b, rows, irx.i64(0), irx.F32, 16), out, irx.i64(0))
    b.ret_void()


@dataclass(frozen=True)
class Probe:
    kind: str                  # the kind asked for
    instruction: str           # what the loop executes: vfmadd231ps, vdpbf16ps or tdpbf16ps
    flops_per_iteration: int
    fn: object                 # cffi function (out_address, iterations)
    out: object                # the result buffer (lanes f32), kept alive with the probe
    via: str | None = None     # set when another kind's instruction stands in for this one

    def __call__(self, iterations: int = DEFAULT_ITERATIONS) -> None:
        self.fn(self.out.ctypes.data, iterations)


def _optimized(kind: str, target: Target):
    """(symbol, optimised binding module) of the probe."""
    symbol = f"tpp_peak_probe_{kind}_{target.isa}{'_amx' if target.amx else ''}"
    return symbol, jit.optimize(generate(kind, target, symbol), target, vectorize=False)


def assembly(kind: str = "f32", target: Target | None = None) -> str:
    """The probe's assembly for any target, including one this host cannot run."""
    target = current() if target is None else target
    return jit.emit_assembly(_optimized(kind, target)[1], target)


@functools.lru_cache(maxsize=None)
def build(kind: str = "f32", target: Target | None = None) -> Probe:
    """The runnable probe of `kind` for target (default: the current one), compiled once;
    ValueError for an unknown kind, UnsupportedError for a target the host cannot run."""
    target = current() if target is None else target
    if not target.runnable:
        raise UnsupportedError(f"this host cannot run {target.isa} code; assembly() shows it")
    run_kind, via = kind, None
    if kind == "bf16" and not target.bf16_dot:
        run_kind, via = "f32", "f32 fma (no bf16 dot instruction)"
    instruction = "vfmadd231ps" if run_kind == "f32" else \
        ("tdpbf16ps" if target.amx else "vdpbf16ps")
    return Probe(kind, instruction,
                 flops_per_iteration(run_kind, target),
                 ffi.cast("void(*)(intptr_t, intptr_t)", _address(run_kind, target)),
                 np.zeros(target.lanes, np.float32), via)


@functools.lru_cache(maxsize=None)
def _address(kind: str, target: Target) -> int:
    """Each probe enters the process's JIT engine once (build's cache keys may differ)."""
    symbol, mod = _optimized(kind, target)
    return jit.load(jit.emit_object(mod, target), symbol, target)


def measure_peak(kind: str = "f32", seconds: float = 0.2,
                 iterations: int = DEFAULT_ITERATIONS) -> tuple:
    """(GFLOP/s, via) of one core: the median over calls of `iterations` trips each, for about
    `seconds` of this thread's CPU time. via is None unless another instruction stood in."""
    probe = build(kind)
    probe(iterations)   # warm-up
    rates, deadline = [], time.thread_time() + seconds
    while time.thread_time() < deadline or len(rates) < 5:
        t0 = time.thread_time_ns()
        probe(iterations)
        rates.append(probe.flops_per_iteration * iterations / max(time.thread_time_ns() - t0, 1))
    return sorted(rates)[len(rates) // 2], probe.via
