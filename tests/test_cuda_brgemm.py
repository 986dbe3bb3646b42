"""The CUDA BRGEMM generator (tpp_cuda.brgemm).

Compile checks (nvcc, no GPU): a representative set of specs - the three batch modes; f32, bf16,
f16 and mixed inputs; trans_a, trans_b, vnni_b; beta 0/1; bias; every activation; the relu
bitmask; dtype_c f32/bf16/f16; sizes from 1x1x1 to 128x128x256 and lds larger than the rows -
builds for sm_80 and sm_90 in one translation unit per arch, and the main bf16 and f32 kernels
(128x128 tiles) use no local memory (ptxas -v: no spills, no stack).

Numerics (the CPU emulator of tests/cuda_emulator.py, skipped without it): small specs of every
kind against `tpp.core.reference` - the three batch modes, the layouts, dtypes, epilogues, odd sizes
(partial tiles, k not a multiple of 16 or 8, odd k with vnni whose unused half holds NaN),
unaligned blocks and lds (the element-wise copy path), count 0, and the 128x128 / 64x64 tiles
forced on small problems. Padding in every input buffer is NaN (reading it shows), C's padding
and the mask row after the block hold sentinels that must survive. Tolerance: f32 accumulation in
any order, (k*count + 4) * 2^-23 * sum|a||b| (+|C| +|bias|), then the activation's few ulps and
one rounding to dtype_c.
"""
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tpp
from tpp.core import reference
from tpp.core.errors import UnsupportedError
from tpp_cuda import brgemm, nvcc
from tpp_cuda.brgemm import MMA_TILES, SIMT_TILES

mk = tpp.make_brgemm


# ---------------------------------------------------------------- compile checks
def _compile_specs():
    specs = []
    for batch in ("stride", "offset", "address"):
        for dt in ("f32", "bf16", "f16"):
            specs.append(mk(100, 72, 40, dtype_a=dt, batch=batch))
    for dt in ("bf16", "f16", "f32"):
        for flags in ({"trans_a": True}, {"trans_b": True}, {"trans_a": True, "trans_b": True}):
            specs.append(mk(64, 64, 64, dtype_a=dt, **flags))
        if dt != "f32":
            specs.append(mk(64, 64, 64, dtype_a=dt, vnni_b=True, trans_a=True))
    for act in (None, "relu", "gelu", "sigmoid", "tanh"):
        for dc in ("f32", "bf16", "f16"):
            specs.append(mk(7, 13, 5, dtype_a="bf16", dtype_c=dc, beta=1, bias="row",
                            activation=act, batch="offset"))
    specs += [
        mk(1, 1, 1), mk(1, 1, 1, dtype_a="bf16", vnni_b=True),
        mk(7, 13, 5, lda=9, ldb=17, ldc=15, dtype_a="f16", activation="relu", bitmask=True),
        mk(7, 13, 5, lda=9, ldb=17, ldc=15, activation="relu", bitmask=True, batch="address"),
        mk(100, 72, 40, dtype_a="bf16", dtype_b="f16", vnni_b=True, activation="relu",
           bitmask=True),
        mk(100, 72, 40, dtype_a="f16", dtype_b="f32", trans_b=True, dtype_c="bf16"),
        mk(128, 128, 256, dtype_a="bf16", beta=1, bias="row", activation="gelu", dtype_c="bf16"),
        mk(128, 128, 256, dtype_a="f16", trans_a=True, vnni_b=True, ldb=300, lda=136),
        mk(128, 128, 256, trans_a=True, trans_b=True, activation="sigmoid", bias="row"),
        mk(33, 130, 17, dtype_a="bf16", trans_b=True, batch="address", lda=40, ldb=24, ldc=131),
    ]
    return specs


MAIN_BF16 = mk(4096, 4096, 256, dtype_a="bf16")
MAIN_F32 = mk(4096, 4096, 256)
COMPILE_SPECS = _compile_specs() + [MAIN_BF16, MAIN_F32]

needs_nvcc = pytest.mark.skipif(not nvcc.available(), reason="nvcc is not on PATH")


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_all_sources_compile(arch):
    sources = {brgemm.kernel_name(s): brgemm.source(s) for s in COMPILE_SPECS}
    assert len(sources) == len(COMPILE_SPECS)
    nvcc.compile_check(sources, arch)


@needs_nvcc
def test_main_kernels_do_not_spill():
    sources = {brgemm.kernel_name(s): brgemm.source(s) for s in (MAIN_BF16, MAIN_F32)}
    assert isinstance(brgemm.tile(MAIN_BF16), brgemm.MmaTile)
    assert brgemm.tile(MAIN_BF16) == MMA_TILES["large"]
    assert brgemm.tile(MAIN_F32) == SIMT_TILES["large"]
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "k.cu"
        cu.write_text("\n".join(sources.values()))
        proc = subprocess.run(["nvcc", "-arch=sm_80", "-cubin", "-Xptxas", "-v", "-o",
                               str(Path(tmp) / "k.cubin"), str(cu)],
                              capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                        r"loads", proc.stderr)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", proc.stderr)]
    assert len(frames) == 2 and len(regs) == 2, proc.stderr
    assert all(f == ("0", "0", "0") for f in frames), proc.stderr
    assert max(regs) <= 128, proc.stderr     # two 256-thread blocks per SM


# ---------------------------------------------------------------- the generator's contract
def test_kernel_names_unique_stable_and_signature():
    names = {brgemm.kernel_name(s) for s in COMPILE_SPECS}
    assert len(names) == len(set(COMPILE_SPECS))
    spec = mk(7, 13, 5, batch="offset", dtype_a="bf16", bias="row")
    assert brgemm.kernel_name(spec) == brgemm.kernel_name(mk(7, 13, 5, batch="offset",
                                                              dtype_a="bf16", bias="row"))
    src = brgemm.source(spec)
    sig = re.search(r'extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\(([^)]*)\)', src)
    assert sig.group(1) == brgemm.kernel_name(spec)
    params = [p.strip() for p in sig.group(2).split(",")]
    assert [p.split()[-1] for p in params] == ["a", "b", "c", "bias", "mask", "count",
                                               "offsets_a", "offsets_b"]
    assert params[0].startswith("const __nv_bfloat16*") and "long long*" in params[6]
    addr = brgemm.source(spec.replace(batch="address"))
    assert "const __nv_bfloat16* const* __restrict__ a" in addr
    assert brgemm.kernel_name(spec, MMA_TILES["large"]) != brgemm.kernel_name(spec)


def test_launch_geometry():
    la = brgemm.launch(MAIN_BF16)
    assert la.grid == (32, 32, 1) and la.block == (256, 1, 1)
    assert la.shared_bytes == 3 * 2 * (128 * 32 + 32 * 128) <= 48 * 1024
    assert brgemm.launch(MAIN_F32).shared_bytes == 0
    small = brgemm.launch(mk(7, 13, 5, dtype_a="f16"))
    assert small.grid == (1, 1, 1) and small.block == (64, 1, 1)
    assert brgemm.launch(mk(100, 72, 40)).grid == (2, 2, 1)


def test_unsupported():
    spec = tpp.make_unary("relu", 4, 4)
    assert not brgemm.supported(spec)
    with pytest.raises(UnsupportedError, match="BRGEMM"):
        brgemm.source(spec)
    assert not brgemm.supported(mk(16 * 1024 * 1024, 8, 8))    # grid y limit
    assert not brgemm.supported(mk(8, 8, 2**31))                 # int indices
    assert brgemm.supported(MAIN_BF16)
    with pytest.raises(UnsupportedError, match="tile"):
        brgemm.source(MAIN_F32, MMA_TILES["large"])


def test_paths_and_shared_pieces():
    assert brgemm.uses_tensor_cores(mk(8, 8, 8, dtype_a="bf16"))
    assert brgemm.uses_tensor_cores(mk(8, 8, 8, dtype_a="f16", vnni_b=True))
    assert not brgemm.uses_tensor_cores(mk(8, 8, 8, dtype_a="bf16", dtype_b="f16"))
    assert not brgemm.uses_tensor_cores(mk(8, 8, 8))
    src = brgemm.source(mk(8, 8, 8, dtype_a="bf16", activation="gelu", bitmask=False))
    assert "__fmaf_rn" in src and "tpp_mma_bf16_16816" in src
    assert "#ifndef TPP_CUDA_EMULATION" in src
    assert "extern __shared__ __align__(16) unsigned char tpp_smem[];" in src
    assert "mma" not in brgemm.source(mk(8, 8, 8, dtype_a="bf16", dtype_b="f16")).split(
        "/* brgemm(")[1]


# ---------------------------------------------------------------- numerics in the emulator
try:
    import cuda_emulator
    HAVE_EMULATOR = cuda_emulator.available()
except ImportError:       # the emulator is a test-support module that may be absent
    HAVE_EMULATOR = False

needs_emulator = pytest.mark.skipif(not HAVE_EMULATOR, reason="the CUDA emulator is unavailable")

RNG = np.random.default_rng(20240611)
_OUT_ULP = {"f32": 2.0 ** -23, "bf16": 2.0 ** -7, "f16": 2.0 ** -10}


def _values(shape, dt):
    """Random values exactly representable in dt (so the reference sees what the kernel does)."""
    return RNG.uniform(-1.0, 1.0, shape).astype(dt.numpy)


def _nan_buffer(size, dt):
    return np.full(size, np.nan, np.float32).astype(dt.numpy)


class Blocks:
    """count stored blocks of one input in one flat NaN-filled buffer, `gap` elements apart,
    the first `misalign` elements off 16 bytes; in reverse order unless `ascending` (stride
    mode), so offsets and addresses must really be followed."""

    def __init__(self, count, rows, cols, ld, dt, misalign=0, ascending=True, vnni_odd_k=False):
        self.logical = [_values((rows, cols), dt) for _ in range(count)]
        if vnni_odd_k:   # the last pair's unused half is never a value: NaN must not leak
            for blk in self.logical:
                blk[-1, 1::2] = np.nan
        span = rows * ld
        self.stride = span + 8 + (8 if count % 2 else 0)
        slots = range(count) if ascending else range(count - 1, -1, -1)
        self.offsets = np.array([misalign + i * self.stride for i in slots], np.int64)
        self.buffer = _nan_buffer(misalign + count * self.stride + 8, dt)
        for blk, off in zip(self.logical, self.offsets):
            self.buffer[off:off + span].reshape(rows, ld)[:, :cols] = blk
        self.dt = dt

    def addresses(self):
        base = self.buffer.__array_interface__["data"][0]
        return np.array([base + int(o) * self.dt.itemsize for o in self.offsets], np.uint64)

    def arguments(self, batch):
        """(pointer argument, arg_a/arg_b) of this input in the given batch mode."""
        if batch == "stride":
            return self.buffer[self.offsets[0] if len(self.offsets) else 0:], self.stride
        if batch == "offset":
            return self.buffer, self.offsets
        return self.addresses(), 0


# The emulator neither faults on a misaligned cp.async / ldmatrix address nor on anything else a
# GPU would reject: these wrappers (defined before the kernel, so its calls reach them) turn a
# misaligned 16-byte access into NaN bytes, which the numerical check then reports.
ALIGNMENT_CHECKS = r"""
static inline bool tpp_test_misaligned(const void* p) { return ((unsigned long long)p & 15) != 0; }
static inline void tpp_test_cp_async_16(void* dst, const void* src, int bytes) {
  if (tpp_test_misaligned(dst) || (bytes > 0 && tpp_test_misaligned(src))) memset(dst, 0xff, 16);
  else tpp_cp_async_16(dst, src, bytes);
}
#define tpp_cp_async_16 tpp_test_cp_async_16
#define TPP_TEST_LDMATRIX(name, count) \
  static inline void tpp_test_##name(unsigned r[count], const void* p) { \
    name(r, p); \
    if (tpp_test_misaligned(p)) for (int i = 0; i < count; ++i) r[i] = 0xffffffffu; }
TPP_TEST_LDMATRIX(tpp_ldmatrix_x4, 4)
TPP_TEST_LDMATRIX(tpp_ldmatrix_x4_trans, 4)
#define tpp_ldmatrix_x4 tpp_test_tpp_ldmatrix_x4
#define tpp_ldmatrix_x4_trans tpp_test_tpp_ldmatrix_x4_trans
"""


def _emulate(spec, count=2, misalign=(0, 0), tile=None):
    """Run the spec's kernel in the emulator; return (c, mask, reference c, reference mask,
    pre-activation x, tolerance of x, tolerance of c)."""
    stride = spec.batch == "stride"
    A = Blocks(count, *spec.a_shape, spec.lda, spec.dtype_a, misalign[0], stride)
    B = Blocks(count, *spec.b_shape, spec.ldb, spec.dtype_b, misalign[1], stride,
               spec.vnni_b and spec.k % 2 == 1)
    m, n, dc = spec.m, spec.n, spec.dtype_c
    c_in = _values((m, n), dc)
    cbuf = np.full((m + 1, spec.ldc), 7.0, np.float32).astype(dc.numpy)
    cbuf[:m, :n] = c_in if spec.beta else np.nan
    bias = _values((m,) if spec.bias == "col" else (n,), dc)
    col_bias = bias.reshape(m, 1) if spec.bias == "col" else bias
    mb = (n + 7) // 8
    mask = np.full((m + 1, mb), 0xA5, np.uint8)
    a_arg, arg_a = A.arguments(spec.batch)
    b_arg, arg_b = B.arguments(spec.batch)
    mod = cuda_emulator.EmulatedModule({brgemm.kernel_name(spec, tile):
                                        ALIGNMENT_CHECKS + brgemm.source(spec, tile)})
    mod.launch(brgemm.kernel_name(spec, tile), brgemm.launch(spec, tile),
               [a_arg, b_arg, cbuf, bias if spec.bias else 0, mask if spec.bitmask else 0,
                count, arg_a, arg_b])
    inputs = [A.logical, B.logical] + ([c_in] if spec.beta else []) + ([bias] if spec.bias else [])
    want = reference.run(spec, *inputs)
    want_c, want_mask = want if spec.bitmask else (want, None)
    # the pre-activation sum and its error bound
    logical_b = [reference._logical_b(spec, np.nan_to_num(b)) for b in B.logical]
    logical_a = [a.astype(np.float64).T if spec.trans_a else a.astype(np.float64)
                 for a in A.logical]
    x = sum((a @ b for a, b in zip(logical_a, logical_b)), np.zeros((m, n)))
    mag = sum((np.abs(a) @ np.abs(b) for a, b in zip(logical_a, logical_b)), np.zeros((m, n)))
    if spec.beta:
        x, mag = x + c_in.astype(np.float64), mag + np.abs(c_in.astype(np.float64))
    if spec.bias:
        x, mag = x + col_bias.astype(np.float64), mag + np.abs(col_bias.astype(np.float64))
    tol_x = (spec.k * count + 4) * 2.0 ** -23 * mag + 1e-30
    got = cbuf[:m, :n].astype(np.float64)
    tol_c = 1.2 * tol_x + (1.5e-5 + _OUT_ULP[dc.name]) * np.abs(want_c.astype(np.float64)) + 1e-30
    # the margins survive
    assert np.all(cbuf[m].astype(np.float32) == 7.0)
    if spec.ldc > n:
        assert np.all(cbuf[:, n:].astype(np.float32) == 7.0)
    if spec.bitmask:
        assert np.all(mask[m] == 0xA5)
    return got, mask[:m], want_c.astype(np.float64), want_mask, x, tol_x, tol_c


def _check(spec, **kw):
    got, mask, want, want_mask, x, tol_x, tol_c = _emulate(spec, **kw)
    bad = ~(np.abs(got - want) <= tol_c)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} wrong, e.g. at {np.argwhere(bad)[0]}: "
                           f"got {got[bad][0]}, want {want[bad][0]} (tol {tol_c[bad][0]})")
    if spec.bitmask:
        bits = reference.unpack_mask(mask, spec.n)
        sure = np.abs(x) > tol_x
        assert np.array_equal(bits[sure], (x > 0)[sure])
        n = spec.n
        if n % 8:     # unused high bits of the last byte are 0
            assert np.all(mask[:, -1] >> (n % 8) == 0)
        if sure.all():
            assert np.array_equal(mask, want_mask)


EMULATED = [
    # batch modes x dtypes, partial tiles, k not a multiple of 8 / 16 / 32
    mk(7, 13, 5, dtype_a="bf16"),
    mk(7, 13, 5, dtype_a="f16", batch="offset"),
    mk(7, 13, 5, batch="address"),
    mk(1, 1, 1, dtype_a="bf16", batch="address"),
    mk(1, 1, 1),
    mk(37, 45, 40, dtype_a="bf16", batch="offset", beta=1, bias="row", dtype_c="bf16"),
    mk(37, 45, 40, dtype_a="f16", batch="address", trans_a=True, dtype_c="f16"),
    mk(37, 45, 21, dtype_a="bf16", trans_b=True, activation="relu", bitmask=True),
    # layouts, lds larger than the rows
    mk(20, 24, 33, dtype_a="bf16", trans_a=True, trans_b=True, lda=24, ldb=40, ldc=30),
    mk(20, 24, 33, dtype_a="bf16", vnni_b=True, ldb=56, batch="offset"),
    mk(20, 24, 64, dtype_a="f16", vnni_b=True, trans_a=True, batch="address", beta=1),
    mk(20, 24, 33, trans_a=True, trans_b=True, lda=24, ldb=40, ldc=30, beta=1),
    mk(20, 17, 9, trans_a=True, activation="gelu", bias="row", dtype_c="f16"),
    # mixed inputs (SIMT, widened exactly), vnni on the SIMT path, odd k with vnni
    mk(20, 24, 27, dtype_a="bf16", dtype_b="f16", vnni_b=True, activation="sigmoid"),
    mk(20, 24, 27, dtype_a="f16", dtype_b="f32", trans_b=True, activation="tanh",
       dtype_c="bf16", batch="offset"),
    mk(18, 40, 31, dtype_a="bf16", vnni_b=True, activation="relu", bitmask=True, beta=1,
       bias="row"),
    # every activation on the tensor-core epilogue, the bitmask with n not a multiple of 8
    mk(33, 35, 16, dtype_a="bf16", activation="gelu", batch="offset"),
    mk(33, 35, 16, dtype_a="f16", activation="sigmoid", dtype_c="bf16"),
    mk(33, 35, 16, dtype_a="bf16", activation="tanh", bias="row"),
    mk(33, 35, 16, activation="relu", bitmask=True, ldc=40, batch="address"),
    # a "col" bias (one value per row of C): SIMT and tensor-core epilogues
    mk(37, 45, 40, dtype_a="bf16", batch="offset", beta=1, bias="col", dtype_c="bf16"),
    mk(20, 17, 9, trans_a=True, activation="gelu", bias="col", dtype_c="f16"),
    mk(33, 35, 16, dtype_a="bf16", activation="relu", bitmask=True, bias="col"),
]


@needs_emulator
@pytest.mark.parametrize("spec", EMULATED, ids=lambda s: f"{s.batch}-{s.m}x{s.n}x{s.k}-"
                         f"{s.dtype_a}{s.dtype_b}{s.dtype_c}-{'A' if s.trans_a else ''}"
                         f"{'B' if s.trans_b else ''}{'V' if s.vnni_b else ''}-{s.activation}")
def test_emulated(spec):
    _check(spec)


@needs_emulator
@pytest.mark.parametrize("spec,misalign", [
    (mk(20, 24, 40, dtype_a="bf16", batch="offset"), (1, 3)),           # blocks off 16 bytes
    (mk(20, 24, 40, dtype_a="f16", lda=41, ldb=43, trans_b=True), (0, 0)),   # odd lds
    (mk(20, 24, 40, dtype_a="bf16", vnni_b=True, trans_a=True, batch="address"), (2, 1)),
])
def test_emulated_unaligned(spec, misalign):
    _check(spec, misalign=misalign)


@needs_emulator
@pytest.mark.parametrize("spec", [mk(5, 9, 7, dtype_a="bf16", beta=1, bias="row",
                                     activation="relu", bitmask=True),
                                  mk(5, 9, 7, beta=1, activation="tanh", batch="address")])
def test_emulated_count_zero(spec):
    _check(spec, count=0)


@needs_emulator
@pytest.mark.parametrize("spec,tile", [
    (mk(130, 136, 40, dtype_a="bf16", batch="offset", activation="relu", bitmask=True,
        bias="row"), MMA_TILES["large"]),
    (mk(70, 66, 40, dtype_a="f16", trans_a=True, vnni_b=True, beta=1), MMA_TILES["medium"]),
    (mk(68, 40, 24, dtype_a="bf16", trans_b=True), MMA_TILES["medium"]),
    (mk(130, 136, 13, trans_b=True, activation="relu", bitmask=True), SIMT_TILES["large"]),
    (mk(70, 66, 12, dtype_a="bf16", dtype_b="f16", batch="address"), SIMT_TILES["medium"]),
], ids=["mma128", "mma64-vnni", "mma64-transb", "simt128", "simt64"])
def test_emulated_big_tiles(spec, tile):
    _check(spec, tile=tile, count=1)
