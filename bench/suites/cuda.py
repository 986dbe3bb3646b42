"""The CUDA suites: device copy bandwidth, element-wise TPPs and BRGEMM against cupy.

Everything is timed with CUDA events (`bench.cuda_timing`) on cupy's current stream, inputs
generated on the device once per case.

  cuda_peak     device-to-device copy (cudaMemcpyAsync) GB/s: the bandwidth yardstick
                (ctx.peaks["cuda_copy"]); counts read + written bytes like the CPU's copy.
  cuda_eltwise  f32 maps on 64M elements (8192x8192; quick 4096x4096): identity, relu, gelu,
                add, mul by a broadcast row; GB/s and fraction of the copy bandwidth; cupy's
                own kernels where cupy has the op.
  cuda_brgemm   stride-batched BRGEMM on the work of an N^3 GEMM (N = 4096; quick 2048):
                count = N/256 blocks of A (N, 256) and B (256, N), A_i read in place from the
                column blocks of one (N, N) matrix, against cupy.matmul on the whole matrices
                (cuBLAS). f32 runs without TF32 on both sides (cupy uses TF32 only with
                CUPY_TF32=1; the record says which); bf16 accumulates in f32.
"""
from __future__ import annotations

import os

import numpy as np

from ..cuda_timing import measure_cuda
from ..records import Record
from . import register

ELTWISE = {"standard": (8192, 8192), "quick": (4096, 4096), "tiny": (256, 256)}
GEMM_N = {"standard": 4096, "quick": 2048, "tiny": 256}
BLOCK_K = {"standard": 256, "quick": 256, "tiny": 64}


def _mode(ctx) -> str:
    return "tiny" if ctx.config.tiny else ("quick" if ctx.config.quick or ctx.config.overview
                                          else "standard")


def _device_name(cupy) -> str:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _rate_record(ctx, *, suite, case, provider, shape, dtype, stats, amount, metric, peak=None,
                 **extra):
    unit = "GB/s" if metric == "bandwidth" else "GFLOP/s"
    median, p20, p80 = (v / 1e9 for v in stats.rate(amount))
    info = {"time_median_s": stats.median, "samples": stats.samples,
            "launches_per_sample": stats.calls_per_sample, "timer": "cuda events", **extra}
    return ctx.add(Record(suite=suite, case=case, provider=provider, shape=list(shape),
                          dtype=dtype, metric=metric, unit=unit, median=median, p20=p20,
                          p80=p80, backend="cuda",
                          peak_fraction=(median / peak) if peak else None, extra=info))


def _loop(fn, *args, **kwargs):
    def run(k):
        for _ in range(k):
            fn(*args, **kwargs)
    return run


@register("cuda_peak", help="CUDA: device-to-device copy bandwidth (the GB/s yardstick)",
          default=True, backend="cuda")
def peak(ctx):
    import cupy
    m, n = ELTWISE[_mode(ctx)]
    nbytes = m * n * 4
    src = cupy.random.standard_normal((m, n), dtype=cupy.float32)
    dst = cupy.empty_like(src)
    rt = cupy.cuda.runtime

    def run(k):
        stream = cupy.cuda.get_current_stream().ptr
        for _ in range(k):
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream)
    ctx.step(f"cuda copy {m}x{n}")
    stats = measure_cuda(run, ctx.settings)
    rec = _rate_record(ctx, suite="cuda_peak", case="copy", provider="cupy", shape=(m, n),
                       dtype="f32", stats=stats, amount=2 * nbytes, metric="bandwidth",
                       device=_device_name(cupy), how="cudaMemcpyAsync device to device")
    ctx.peaks["cuda_copy"] = rec.median
    rec.peak_fraction = 1.0


def _eltwise_cases(cupy, tpp, m, n):
    """(name, tpp kernel, inputs, cupy run or None, bytes moved per call)."""
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((m, n), dtype=cupy.float32)
    y = rng.standard_normal((m, n), dtype=cupy.float32)
    row = rng.standard_normal((n,), dtype=cupy.float32)
    out = cupy.empty_like(x)
    block = m * n * 4
    return [
        ("identity", tpp.unary("identity", m, n), (x,), out,
         _loop(cupy.copyto, out, x), 2 * block),
        ("relu", tpp.unary("relu", m, n), (x,), out,
         _loop(cupy.maximum, x, 0.0, out=out), 2 * block),
        ("gelu", tpp.unary("gelu", m, n), (x,), out, None, 2 * block),
        ("add", tpp.binary("add", m, n), (x, y), out, _loop(cupy.add, x, y, out=out), 3 * block),
        ("mul_row", tpp.binary("mul", m, n, bcast_in1="row"), (x, row), out,
         _loop(cupy.multiply, x, row, out=out), 2 * block + n * 4),
    ]


@register("cuda_eltwise", help="CUDA: element-wise TPPs on 64M f32 elements vs cupy, GB/s",
          default=True, backend="cuda", requires=("cuda_peak",))
def eltwise(ctx):
    import cupy

    import tpp
    m, n = ELTWISE[_mode(ctx)]
    peak_bw = ctx.peaks.get("cuda_copy")
    for name, kernel, inputs, out, cupy_run, nbytes in _eltwise_cases(cupy, tpp, m, n):
        if not ctx.wants_dtype("f32"):
            return
        label = f"cuda eltwise {name} {m}x{n}"
        try:
            kernel(*inputs, out=out)
            if ctx.config.verify:
                _verify_eltwise(ctx, label, kernel, inputs, out)
            ctx.step(label)
            stats = measure_cuda(_loop(kernel, *inputs, out=out), ctx.settings)
        except Exception as exc:  # noqa: BLE001 - report and go on
            ctx.failed(f"{label} tpp", exc)
            continue
        _rate_record(ctx, suite="cuda_eltwise", case=name, provider="tpp", shape=(m, n),
                     dtype="f32", stats=stats, amount=nbytes, metric="bandwidth", peak=peak_bw)
        if cupy_run is not None and ctx.wants("cupy"):
            stats = measure_cuda(cupy_run, ctx.settings)
            _rate_record(ctx, suite="cuda_eltwise", case=name, provider="cupy", shape=(m, n),
                         dtype="f32", stats=stats, amount=nbytes, metric="bandwidth",
                         peak=peak_bw)


def _verify_eltwise(ctx, label, kernel, inputs, out):
    """Compare the first rows with tpp.core.reference (the whole block would take too long)."""
    from tpp.core import reference
    rows = 4
    spec = kernel.spec.replace(m=rows)
    host = [inp.get() for inp in inputs]
    host = [h[:rows] if h.ndim == 2 else h for h in host]
    want = reference.run(spec, *host)
    got = out[:rows].get()
    if not np.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True):
        ctx.note(f"{label}: tpp's output differs from tpp.core.reference")


def _gemm_operands(cupy, dtype, n, k):
    rng = cupy.random.default_rng(0)
    a_full = rng.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
    b_full = rng.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
    count = n // k
    isz = a_full.itemsize
    # A_i = a_full[:, i*k:(i+1)*k], read in place: shape (count, n, k), batch stride k elements
    a_blocks = cupy.lib.stride_tricks.as_strided(a_full, (count, n, k), (k * isz, n * isz, isz))
    b_blocks = b_full.reshape(count, k, n)
    return a_full, b_full, a_blocks, b_blocks, count


@register("cuda_brgemm", help="CUDA: BRGEMM on the work of an N^3 GEMM vs cupy.matmul "
          "(cuBLAS), GFLOP/s", default=True, backend="cuda")
def brgemm(ctx):
    import cupy

    import tpp
    n, k = GEMM_N[_mode(ctx)], BLOCK_K[_mode(ctx)]
    flops = 2 * n ** 3
    tf32 = os.environ.get("CUPY_TF32", "0") not in ("", "0")
    for dtype in ("f32", "bf16"):
        if not ctx.wants_dtype(dtype):
            continue
        label = f"cuda brgemm {dtype} {n}^3"
        np_dtype = tpp.F32.numpy if dtype == "f32" else tpp.BF16.numpy
        try:
            a_full, b_full, a_blocks, b_blocks, count = _gemm_operands(cupy, np_dtype, n, k)
            kernel = tpp.brgemm(n, n, k, lda=n, dtype_a=dtype)
            c = cupy.empty((n, n), cupy.float32)
            kernel(a_blocks, b_blocks, c)
            ctx.step(label)
            stats = measure_cuda(_loop(kernel, a_blocks, b_blocks, c), ctx.settings)
        except Exception as exc:  # noqa: BLE001 - report and go on
            ctx.failed(f"{label} tpp", exc)
            continue
        extra = {"count": count, "block": [n, n, k], "tf32": False}
        _rate_record(ctx, suite="cuda_brgemm", case="brgemm", provider="tpp", shape=(n, n, n),
                     dtype=dtype, stats=stats, amount=flops, metric="compute", **extra)
        if not ctx.wants("cupy"):
            continue
        try:
            ref = cupy.empty((n, n), np_dtype)
            cupy.matmul(a_full, b_full, out=ref)
            stats = measure_cuda(_loop(cupy.matmul, a_full, b_full, out=ref), ctx.settings)
        except Exception as exc:  # noqa: BLE001 - e.g. a cupy without bf16 matmul
            ctx.failed(f"{label} cupy.matmul", exc)
            continue
        _rate_record(ctx, suite="cuda_brgemm", case="brgemm", provider="cupy", shape=(n, n, n),
                     dtype=dtype, stats=stats, amount=flops, metric="compute", tf32=tf32,
                     how="cupy.matmul (cuBLAS)")
        if ctx.config.verify:
            err = float(cupy.abs(c - ref.astype(cupy.float32)).max())
            scale = float(cupy.abs(ref.astype(cupy.float32)).max())
            if not err <= (1e-4 if dtype == "f32" else 3e-2) * max(scale, 1.0):
                ctx.note(f"{label}: tpp and cupy.matmul differ by {err:.3g} (max |C| {scale:.3g})")
