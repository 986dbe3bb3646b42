"""brgemm: GFLOP/s of the batch-reduce GEMM (C = sum_i A_i @ B_i) vs numpy and torch, one core.

Cases (the BRGEMM issue's targets; data cache-resident, beta=0, batch="stride"): f32 at 64^3
(batch 16), 32^3 and 16^3 (batch 32); bf16 A with VNNI-packed bf16 B and f32 C at 64^3 (batch
16); f32 64^3 (batch 16) with a fused bias-row + gelu epilogue, whose tpp record also carries
extra["vs_plain"], its rate over the plain f32 64^3 kernel's in the same run (1.0: the epilogue
is free). A record's shape is [m, n, k, batch]; its GFLOP/s counts 2*m*n*k*batch per call;
`peak_fraction` divides by the compute peak the peak suite measured for its dtype
(ctx.peaks["f32"] or ["bf16"]); extra["bytes_per_call"] is the least traffic of a call (A, B
read once, C written once, the bias row), the denominator of its arithmetic intensity.

tpp runs through the raw-pointer path in a loop (`Kernel.raw`), B packed to VNNI-2 beforehand
for bf16. That path pays one Python -> C call (cffi, 8 arguments: ~0.5 us on Zen 4 in a VM) per
BRGEMM, a large share of a small one (16^3 x32 is ~2.3 us of FMAs). So that the kernel's own
rate shows too, the same kernel also runs from native code: a LoopNest calling it NATIVE_REPEAT
times on the same operands, timed in the same interleaved rounds; tpp's record carries
extra["native"] (its GFLOP/s and peak_fraction) and extra["call_us"] (a raw call with count 0:
the call itself and the tile's epilogue, the C tile zeroed, finished and stored), and a note
prints both. The references compute the same sum as ONE GEMM: C = A_cat @ B_cat with
A_cat = A.transpose(1, 0, 2).reshape(m, batch*k) (laid out once, outside the timed loop, as
tpp's VNNI packing is) and B_cat = B.reshape(batch*k, n), a view. That is the strongest fair
formulation: a single BLAS/oneDNN call with the reduction inside its k loop, no batched
products summed afterwards. numpy: np.matmul into a preallocated C, on f32 data (numpy has no
bf16 matmul: the bf16 case uses exact f32 copies of the bf16 values) and not for the epilogue
(numpy has no erf). torch (set to the configured threads): torch.mm (bf16 case: bfloat16
tensors, bf16 C, as torch CPU cannot write f32 from bf16 inputs) and torch.addmm + gelu_ for
the epilogue. `--quick` shortens the measurements, never the shapes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import register
from ..timing import looped
from ._common import compute_record, empty, filled, timed_group


@dataclass(frozen=True)
class Case:
    name: str
    m: int
    n: int
    k: int
    count: int
    dtype: str = "f32"          # "f32": all f32; "bf16": bf16 A, VNNI bf16 B, f32 C
    epilogue: bool = False      # bias row + gelu on the C tile

    @property
    def shape(self) -> tuple:
        return (self.m, self.n, self.k, self.count)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count

    @property
    def bytes(self) -> int:
        """Bytes one call must move at least: A and B read once (2 bytes an element for bf16,
        else 4), the f32 C written once (beta=0: not read), the f32 bias row read."""
        size = 2 if self.dtype == "bf16" else 4
        ab = self.count * (self.m * self.k + self.k * self.n) * size
        return ab + self.m * self.n * 4 + (self.n * 4 if self.epilogue else 0)


CASES = (Case("f32", 64, 64, 64, 16), Case("f32", 32, 32, 32, 32), Case("f32", 16, 16, 16, 32),
         Case("bf16 vnni", 64, 64, 64, 16, dtype="bf16"),
         Case("f32 bias+gelu", 64, 64, 64, 16, epilogue=True))
PLAIN = CASES[0]            # the epilogue case's baseline (same shape, no epilogue)
NATIVE_REPEAT = 256         # kernel calls per call of the native-loop nest


@register("brgemm", default=True, requires=("peak",),
          help="GFLOP/s of f32/bf16 BRGEMM (and a bias+gelu epilogue) vs numpy, torch matmul")
def run(ctx):
    rng = np.random.default_rng(2)
    tpp_rates = {}
    for case in CASES:
        if not ctx.wants_dtype(case.dtype):
            continue
        ours = _run_case(ctx, case, rng)
        if ours is not None:
            tpp_rates[case] = ours
    epi = next(c for c in CASES if c.epilogue)
    if epi in tpp_rates and PLAIN in tpp_rates:
        tpp_rates[epi].extra["vs_plain"] = tpp_rates[epi].median / tpp_rates[PLAIN].median


def _data(case: Case, rng) -> dict:
    """The operands: a (count, m, k) and b (count, k, n) in the case's input dtype, bias (n,)
    and the references' one-GEMM layout a_cat (m, count*k), b_cat (count*k, n), f32."""
    m, n, k, count = case.shape
    a32 = rng.standard_normal((count, m, k), dtype=np.float32)
    b32 = rng.standard_normal((count, k, n), dtype=np.float32)
    if case.dtype == "bf16":
        import tpp
        bf = tpp.BF16.numpy
        a32, b32 = a32.astype(bf).astype(np.float32), b32.astype(bf).astype(np.float32)
        a, b = filled(a32.astype(bf)), filled(b32.astype(bf))
    else:
        a, b = filled(a32), filled(b32)
    return {"a": a, "b": b, "bias": filled(rng.standard_normal(n, dtype=np.float32)),
            "a_cat": filled(a32.transpose(1, 0, 2).reshape(m, count * k)),
            "b_cat": filled(b32.reshape(count * k, n))}


def _run_case(ctx, case: Case, rng):
    """Measure every provider on one case; returns tpp's record (or None)."""
    label = f"brgemm {case.name} {'x'.join(map(str, case.shape))}"
    d = _data(case, rng)
    runs, outs, kernel, b_stored, internal = {}, {}, None, None, {}
    if ctx.wants("tpp"):
        try:
            kernel, b_stored = _tpp_kernel(case, d["b"])
            outs["tpp"] = c = empty((case.m, case.n))
            runs["tpp"] = _tpp_run(case, kernel, d["a"], b_stored, c, d["bias"])
        except Exception as exc:  # noqa: BLE001 - e.g. the generator is not there yet
            ctx.failed(f"{label} tpp", exc)
            kernel = None
        if kernel is not None:
            try:    # measured with the providers, reported in tpp's record (not providers)
                internal["native"] = _tpp_native(case, kernel, d["a"], b_stored, d["bias"])
                # its own C, kept alive here: the raw calls hold only its address
                outs["tpp call"] = c0 = empty((case.m, case.n))
                internal["call"] = _tpp_run(case, kernel, d["a"], b_stored, c0, d["bias"],
                                            count=0)
                runs.update({f"tpp {k}": v for k, v in internal.items()})
            except Exception as exc:  # noqa: BLE001
                ctx.failed(f"{label} tpp native loop", exc)
    if ctx.wants("numpy") and not case.epilogue:
        outs["numpy"] = c = empty((case.m, case.n))
        runs["numpy"] = looped(functools.partial(np.matmul, out=c), d["a_cat"], d["b_cat"])
    torch = ctx.torch
    if torch is not None:
        try:
            runs["torch"] = _torch_run(torch, case, d)
        except Exception as exc:  # noqa: BLE001
            ctx.failed(f"{label} torch", exc)
    notes = {"numpy": {"computed_on": "f32 copies (numpy has no bf16 matmul)"},
             "torch": {"computed_on": "bfloat16 tensors, bf16 C"}} if case.dtype == "bf16" else {}
    ours = None
    results = timed_group(ctx, label, runs)
    native, call = (results.pop(f"tpp {k}", None) for k in ("native", "call"))
    for provider, stats in results.items():
        extra = dict(notes.get(provider, {}))
        if provider == "tpp":
            extra["path"] = "raw"
            if native is not None and call is not None:
                extra.update(_native_extra(ctx, label, case, stats, native, call))
            if ctx.config.verify:
                extra["verified"] = _verify(ctx, label, kernel, d, b_stored, outs["tpp"])
        r = compute_record(ctx, suite="brgemm", case=case.name, provider=provider,
                           shape=case.shape, stats=stats, flops=case.flops, dtype=case.dtype,
                           bytes_per_call=case.bytes, **extra)
        if provider == "tpp":
            ours = r
    return ours


def _tpp_kernel(case: Case, b):
    """(kernel, B as the kernel reads it) for a case: bf16 B is packed with the vnni2 TPP."""
    import tpp
    if case.dtype == "bf16":
        pack = tpp.unary("vnni2", case.k, case.n, dtype_in="bf16")
        b = filled(np.stack([pack(blk) for blk in b]))
        kernel = tpp.brgemm(case.m, case.n, case.k, dtype_a="bf16", dtype_b="bf16",
                            dtype_c="f32", vnni_b=True)
    else:
        kernel = tpp.brgemm(case.m, case.n, case.k, bias="row" if case.epilogue else None,
                            activation="gelu" if case.epilogue else None)
    kernel.compile()
    return kernel, b


def _tpp_run(case: Case, kernel, a, b, c, bias, count=None):
    """run(k): k raw calls of the kernel over the whole batch (strides in elements); the
    caller keeps the arrays alive (run holds their addresses only)."""
    bias_addr = bias.ctypes.data if case.epilogue else 0
    return looped(kernel.raw, a.ctypes.data, b.ctypes.data, c.ctypes.data, bias_addr, 0,
                  case.count if count is None else count, a[0].size, b[0].size)


def _tpp_native(case: Case, kernel, a, b, bias):
    """run(k): k calls of a LoopNest that calls the kernel NATIVE_REPEAT times over the whole
    batch (the same operands each time; its own C), on one thread."""
    import tpp
    nest = tpp.LoopNest("a", a=NATIVE_REPEAT)
    count = case.count
    ta = nest.tensor("a", (count * a.shape[1], a.shape[2]), kernel.spec.dtype_a)
    tb = nest.tensor("b", (count * b.shape[1], b.shape[2]), kernel.spec.dtype_b)
    tc = nest.tensor("c", (case.m, case.n), kernel.spec.dtype_c)
    tbias = nest.tensor("bias", (case.n,), kernel.spec.dtype_c) if case.epilogue else None
    nest.call(kernel.spec, ta[0, 0], tb[0, 0], tc[0, 0], count=count, stride_a=a[0].size,
              stride_b=b[0].size, bias=tbias[0] if case.epilogue else None)
    fn = nest.compile()
    args = [a.reshape(ta.tensor.shape), b.reshape(tb.tensor.shape), empty((case.m, case.n))]
    if case.epilogue:
        args.append(bias)

    def run(k):
        for _ in range(k):
            fn(*args, threads=1)
    return run


def _native_extra(ctx, label, case: Case, raw, native, call) -> dict:
    """tpp's extra fields from the native loop's and the empty call's Stats, and a note."""
    gflops = case.flops * NATIVE_REPEAT / native.median / 1e9
    peak = ctx.peaks.get(case.dtype)
    call_us = call.median * 1e6
    share = call.median / raw.median
    text = (f"{label} tpp: {gflops:.1f} GFLOP/s in a native loop (a LoopNest of "
            f"{NATIVE_REPEAT} calls)")
    if peak:
        text += f", {gflops / peak:.0%} of the peak"
    ctx.note(f"{text}; a raw call from Python costs {call_us:.2f} us ({share:.0%} of one "
             f"call)")
    return {"native": {"gflops": gflops, "peak_fraction": gflops / peak if peak else None,
                       "repeat": NATIVE_REPEAT, "time_median_s": native.median},
            "call_us": call_us}


def _torch_run(torch, case: Case, d: dict):
    """run(k) of the one-GEMM reference in torch, into a preallocated C."""
    a, b = torch.from_numpy(d["a_cat"]), torch.from_numpy(d["b_cat"])
    if case.dtype == "bf16":
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    c = torch.empty((case.m, case.n), dtype=a.dtype)
    if not case.epilogue:
        return looped(functools.partial(torch.mm, out=c), a, b)
    bias, addmm, gelu_ = torch.from_numpy(d["bias"]), torch.addmm, torch._C._nn.gelu_

    def step():
        addmm(bias, a, b, out=c)
        gelu_(c)
    return looped(step)


def _verify(ctx, label, kernel, d, b_stored, got) -> bool | None:
    """Compare the C the timed calls left with tpp.core.reference (float64 sums)."""
    import tpp
    try:
        inputs = [d["a"], b_stored] + ([d["bias"]] if kernel.spec.bias else [])
        want = tpp.core.reference.run(kernel.spec, *inputs)
        scale = float(np.max(np.abs(want))) or 1.0
        err = float(np.max(np.abs(got.astype(np.float64) - want)))
    except Exception as exc:  # noqa: BLE001
        ctx.failed(f"{label} tpp verification", exc)
        return None
    if err > 1e-5 * scale * np.sqrt(kernel.spec.k * d["a"].shape[0]):
        ctx.note(f"{label} tpp: WRONG RESULTS (max abs error {err:.3g}, largest |C| "
                 f"{scale:.3g}, vs tpp.core.reference); its GFLOP/s is not meaningful")
        return False
    return True
