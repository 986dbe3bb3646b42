"""Loop nests lowered to CUDA (tpp_cuda.loopnest), run on the CPU emulator (tests/cuda_emulator.py)
and compared with the same nest compiled and run by the CPU backend (the reference here).

Each nest below is built with the public builder; its kernel runs as the CUDA runtime runs it:
one launch per `outer_iterations` tuple, all with `launch(spec, sizes)`, arguments the tensors,
the sizes, then the outer levels' values. Covered: a matmul "aCB" with K chunks (zero when
a == 0, BRGEMM beta=1), a runtime size M and a remainder tile (guards), M = 0 (empty band);
blocked levels ("Aa", "aA", "AA", a blocked loop with a size stop); element-wise calls with
row / col broadcasts and a relu bitmask; transforms (transpose, vnni2, reductions on both
axes); a layer-norm equation; a bf16 BRGEMM with VNNI B, bias, relu and its bitmask (the
tensor-core block function), an f16 one on 64 x 64 tiles with beta chosen by guards; floor
division of negative values; a nest without a parallel band; a band between sequential loops;
dropout whose seed is a size (and a loop expression); a grid smaller than the band; a nest
called with device arrays through the runtime. All nests build as one emulated module.
Also: specs the backend cannot run raise UnsupportedError, and a nest compiles with nvcc for
sm_80 and sm_90 when nvcc is here.
"""
import numpy as np
import pytest

import tpp
from tpp.core.errors import UnsupportedError
from tpp_cuda import generators, loopnest, nvcc

import cuda_emulator

pytestmark = pytest.mark.skipif(not cuda_emulator.available(),
                                reason="g++ or the CUDA headers are missing")

RNG = np.random.default_rng(11)


def _np(dtype):
    return tpp.core.dtypes.lookup(dtype).numpy


def _rand(shape, dtype="f32"):
    return RNG.standard_normal(shape).astype(np.float32).astype(_np(dtype))


# ---------------------------------------------------------------- the nests
BM, BN, BK, KB, NB = 16, 16, 8, 4, 3


def matmul():
    """C[M, NB*BN] = A[M, KB*BK] @ B (blocked), K in chunks of 2 blocks (the outer level),
    M a size (M % BM in (0, 8)); rows past the last full tile go through an 8-row remainder
    call."""
    M = tpp.size("M")
    nest = tpp.LoopNest("aCB", a=(0, KB, 2), b=(M + BM - 1) // BM, c=NB)
    a, b, c = nest.vars
    A = nest.tensor("A", (M, KB * BK))
    B = nest.tensor("B", (NB, KB, BK, BN))
    C = nest.tensor("C", (M, NB * BN))
    full, rest = (b < M // BM), (b == M // BM)       # M % BM is 0 or 8
    ldc = NB * BN
    for m, guard in ((BM, full), (8, rest)):
        nest.call(tpp.unary("zero", m, BN, ldo=ldc), C[b * BM, c * BN], when=(a == 0) & guard)
        nest.call(tpp.brgemm(m, BN, BK, beta=1, lda=KB * BK, ldc=ldc), A[b * BM, a * BK],
                  B[c, a], C[b * BM, c * BN], count=2, stride_a=BK, stride_b=BK * BN,
                  when=guard)
    return nest


def blocked(order):
    """y[a] = exp(x[a]) + y[a] for a in Loop(0, 10, blocks=(4,)), its two levels in `order`."""
    nest = tpp.LoopNest(order, a=tpp.Loop(0, 10, 1, blocks=(4,)))
    (a,) = nest.vars
    x, y = nest.tensor("x", (10, 24)), nest.tensor("y", (10, 24))
    nest.call(tpp.unary("exp", 1, 24), x[a], x[a])
    nest.call(tpp.binary("add", 1, 24), x[a], y[a], y[a])
    return nest


def blocked_sized():
    """A blocked loop whose stop is a size: rows a of Loop(0, R, 2, blocks=(6,)), 2 rows each."""
    R = tpp.size("R")
    nest = tpp.LoopNest("Aa", a=tpp.Loop(0, R, 2, blocks=(6,)))
    (a,) = nest.vars
    x, y = nest.tensor("x", (R + 1, 8)), nest.tensor("y", (R + 1, 8))
    nest.call(tpp.unary("sigmoid", 2, 8), x[a], y[a])
    return nest


def eltwise():
    """Row blocks x column blocks: bias (row broadcast), scale (col broadcast), relu + mask."""
    nest = tpp.LoopNest("AB", a=3, b=2)
    a, b = nest.vars
    x, bias = nest.tensor("x", (12, 40)), nest.tensor("bias", (40,))
    s, y = nest.tensor("s", (12,)), nest.tensor("y", (12, 40))
    mask = nest.tensor("mask", (12, 5), "u8")
    nest.call(tpp.binary("add", 4, 20, bcast_in1="row", ldi0=40, ldo=40),
              x[4 * a, 20 * b], bias[20 * b], y[4 * a, 20 * b])
    nest.call(tpp.binary("mul", 4, 20, bcast_in0="col", ldi1=40, ldo=40),
              s[4 * a], y[4 * a, 20 * b], y[4 * a, 20 * b])
    nest.call(tpp.unary("relu", 4, 16, bitmask=True, ldi=40, ldo=40), y[4 * a, 16 * b],
              y[4 * a, 16 * b], mask[4 * a, 2 * b], when=(b == 0))
    return nest


def transforms():
    """Per row block: transpose (bf16), vnni2 (bf16), row sums and column maxima."""
    nest = tpp.LoopNest("A", a=3)
    (a,) = nest.vars
    x = nest.tensor("x", (3, 6, 10), "bf16")
    xt = nest.tensor("xt", (3, 10, 6), "bf16")
    xv = nest.tensor("xv", (3, 3, 20), "bf16")
    f = nest.tensor("f", (3, 6, 10))
    rs, cm = nest.tensor("rs", (3, 6)), nest.tensor("cm", (3, 10))
    nest.call(tpp.unary("transpose", 6, 10, dtype_in="bf16"), x[a], xt[a])
    nest.call(tpp.unary("vnni2", 6, 10, dtype_in="bf16"), x[a], xv[a])
    nest.call(tpp.unary("reduce_sum", 6, 10, axis=1), f[a], rs[a])
    nest.call(tpp.unary("reduce_max", 6, 10, axis=0), f[a], cm[a])
    return nest


def _layer_norm_spec(m, n):
    eq = tpp.equation(m, n)
    x = eq.input("x")
    g, b, eps = eq.input("g", bcast="row"), eq.input("b", bcast="row"), eq.param("eps")
    mu = eq.mean(x, axis=1)
    xc = x - mu
    rstd = eq.rsqrt(eq.mean(xc * xc, axis=1) + eps)
    return eq.compile(xc * rstd * g + b, mu=mu, rstd=rstd).spec


def layer_norm():
    """Layer norm over blocks of 5 rows (the block's warps stride over the rows)."""
    nest = tpp.LoopNest("A", a=4)
    (a,) = nest.vars
    x, g, b = nest.tensor("x", (20, 48)), nest.tensor("g", (48,)), nest.tensor("b", (48,))
    eps = nest.tensor("eps", (1,))
    y, mu, rstd = nest.tensor("y", (20, 48)), nest.tensor("mu", (20,)), nest.tensor("rstd", (20,))
    nest.call(_layer_norm_spec(5, 48), x[5 * a], g[0], b[0], eps[0], y[5 * a], mu[5 * a],
              rstd[5 * a])
    return nest


def bf16_vnni():
    """C (f32) = relu(sum_k A_k @ B_k + bias), bf16 inputs, B in VNNI pairs, the relu mask."""
    mb, nb, kb, bm, bn, bk = 2, 2, 3, 32, 24, 16
    nest = tpp.LoopNest("BA", a=mb, b=nb)
    a, b = nest.vars
    A = nest.tensor("A", (mb, kb, bm, bk), "bf16")
    B = nest.tensor("B", (nb, kb, bk // 2, 2 * bn), "bf16")
    bias = nest.tensor("bias", (nb, bn))
    C = nest.tensor("C", (nb, mb, bm, bn))
    mask = nest.tensor("mask", (nb, mb, bm, bn // 8), "u8")
    mm = tpp.brgemm(bm, bn, bk, dtype_a="bf16", vnni_b=True, bias="row", activation="relu",
                    bitmask=True)
    nest.call(mm, A[a, 0], B[b, 0], C[b, a], count=kb, stride_a=bm * bk, stride_b=bk * bn,
              bias=bias[b], mask=mask[b, a])
    return nest


def f16_tiles():
    """C (f16) = sum_k A_k @ B_k^T on 64 x 64 blocks (the larger tensor-core block tile),
    beta=1 after the first K chunk: "aBC" with the K chunks as the outer level."""
    nest = tpp.LoopNest("aBC", a=(0, 4, 2), b=2, c=1)
    a, b, c = nest.vars
    A = nest.tensor("A", (2, 4, 64, 32), "f16")
    B = nest.tensor("B", (1, 4, 64, 32), "f16")
    C = nest.tensor("C", (2, 1, 64, 64), "f16")
    for beta, guard in ((0, a == 0), (1, a > 0)):
        nest.call(tpp.brgemm(64, 64, 32, dtype_a="f16", dtype_c="f16", trans_b=True, beta=beta),
                  A[b, a], B[c, a], C[b, c], count=2, stride_a=64 * 32, stride_b=64 * 32,
                  when=guard)
    return nest


def floors():
    """Addresses and guards with floor division of negative values (Python's //)."""
    nest = tpp.LoopNest("A", a=7)
    (a,) = nest.vars
    x, y = nest.tensor("x", (4, 8)), nest.tensor("y", (7, 8))
    nest.call(tpp.unary("identity", 1, 8), x[(a - 3) // 2 + 2], y[a], when=((a - 5) // 3 >= -1))
    return nest


def no_band():
    """All levels sequential: y[a] += x[a, b] over b, then y[a] *= 2 once (one block)."""
    nest = tpp.LoopNest("ab", a=3, b=4)
    a, b = nest.vars
    x, y = nest.tensor("x", (3, 4, 5, 12)), nest.tensor("y", (3, 5, 12))
    nest.call(tpp.unary("zero", 5, 12), y[a], when=(b == 0))
    nest.call(tpp.binary("add", 5, 12), y[a], x[a, b], y[a])
    nest.call(tpp.binary("mul", 5, 12, bcast_in1="scalar"), y[a], x[0, 0, 0, 0], y[a],
              when=(b == 3))
    return nest


def band_between():
    """a (outer launches), B (parallel), c (sequential in the block): y[b] = sum x[a, b, c]."""
    nest = tpp.LoopNest("aBc", a=3, b=5, c=2)
    a, b, c = nest.vars
    x, y = nest.tensor("x", (3, 5, 2, 4, 8)), nest.tensor("y", (5, 4, 8))
    nest.call(tpp.unary("zero", 4, 8), y[b], when=(a == 0) & (c == 0))
    nest.call(tpp.binary("add", 4, 8), y[b], x[a, b, c], y[b])
    return nest


def dropout():
    """Dropout per row block, the seed a size plus a loop expression."""
    S = tpp.size("S")
    nest = tpp.LoopNest("A", a=3)
    (a,) = nest.vars
    x, y = nest.tensor("x", (3, 4, 19)), nest.tensor("y", (3, 4, 19))
    m = nest.tensor("m", (3, 4, 3), "u8")
    nest.call(tpp.unary("dropout", 4, 19, p=0.4), x[a], y[a], m[a], seed=S + 1000 * a)
    return nest


NESTS = {"matmul": matmul, "blocked_Aa": lambda: blocked("Aa"),
         "blocked_aA": lambda: blocked("aA"), "blocked_AA": lambda: blocked("AA"),
         "blocked_sized": blocked_sized, "eltwise": eltwise, "transforms": transforms,
         "layer_norm": layer_norm, "bf16_vnni": bf16_vnni, "no_band": no_band,
         "band_between": band_between, "dropout": dropout, "f16_tiles": f16_tiles,
         "floors": floors}


@pytest.fixture(scope="module")
def module():
    specs = [build().spec() for build in NESTS.values()]
    return cuda_emulator.EmulatedModule({loopnest.kernel_name(s): loopnest.source(s)
                                         for s in specs})


# ---------------------------------------------------------------- running
def _emulate(module, spec, arrays: dict, sizes: dict):
    """Run the nest's kernel as the CUDA runtime does (tpp_cuda.plugin.CudaNest)."""
    name = loopnest.kernel_name(spec)
    geometry = loopnest.launch(spec, sizes)
    head = [arrays[t.name] for t in spec.tensors] + [sizes[s] for s in spec.sizes]
    for outer in loopnest.outer_iterations(spec, sizes):
        module.launch(name, geometry, head + list(outer))


def _both(module, key, arrays: dict, sizes=None):
    """(cpu, cuda): copies of the arrays after the CPU nest and after the emulated kernel."""
    nest = NESTS[key]()
    sizes = sizes or {}
    cpu = {k: v.copy() for k, v in arrays.items()}
    nest.compile()(**cpu, **sizes)
    gpu = {k: v.copy() for k, v in arrays.items()}
    _emulate(module, nest.spec(), gpu, sizes)
    return cpu, gpu


def _close(cpu, gpu, rtol=1e-5, atol=1e-5, exact=()):
    for name in cpu:
        if name in exact or cpu[name].dtype == np.uint8:
            np.testing.assert_array_equal(gpu[name], cpu[name], err_msg=name)
        else:
            np.testing.assert_allclose(gpu[name].astype(np.float64),
                                       cpu[name].astype(np.float64), rtol=rtol, atol=atol,
                                       err_msg=name)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("m", [40, 8, 48])
def test_matmul_with_k_chunks_a_runtime_m_and_a_remainder(module, m):
    spec = matmul().spec()
    assert loopnest.outer_iterations(spec, {"M": m}) == [(0,), (2,)]
    assert loopnest.launch(spec, {"M": m}).grid == (NB * -(-m // BM), 1, 1)
    arrays = dict(A=_rand((m, KB * BK)), B=_rand((NB, KB, BK, BN)),
                  C=np.full((m, NB * BN), np.nan, np.float32))
    cpu, gpu = _both(module, "matmul", arrays, {"M": m})
    b = arrays["B"].transpose(1, 2, 0, 3).reshape(KB * BK, NB * BN)
    np.testing.assert_allclose(gpu["C"], arrays["A"] @ b, rtol=1e-5, atol=1e-4)
    _close(cpu, gpu, atol=1e-4)


def test_an_empty_range_launches_nothing_harmful(module):
    spec = matmul().spec()
    assert loopnest.launch(spec, {"M": 0}).grid == (1, 1, 1)
    arrays = dict(A=np.zeros((0, KB * BK), np.float32), B=_rand((NB, KB, BK, BN)),
                  C=np.zeros((0, NB * BN), np.float32))
    cpu, gpu = _both(module, "matmul", arrays, {"M": 0})
    _close(cpu, gpu)
    # an outer level with an empty range: no launch at all
    R = tpp.size("R")
    nest = tpp.LoopNest("aB", a=R, b=2)
    x = nest.tensor("x", (R + 1, 2, 4))
    nest.call(tpp.unary("zero", 1, 4), x[nest.vars[0], nest.vars[1]])
    assert loopnest.outer_iterations(nest.spec(), {"R": 0}) == []
    assert loopnest.outer_iterations(nest.spec(), {"R": 3}) == [(0,), (1,), (2,)]


@pytest.mark.parametrize("order", ["Aa", "aA", "AA"])
def test_blocked_levels(module, order):
    spec = blocked(order).spec()
    outer = loopnest.outer_iterations(spec, {})
    assert outer == ([(0,), (4,), (8,)] if order == "aA" else [()])
    cpu, gpu = _both(module, f"blocked_{order}", dict(x=_rand((10, 24)), y=_rand((10, 24))))
    _close(cpu, gpu, exact=("x", "y"))


@pytest.mark.parametrize("r", [12, 9, 1])
def test_blocked_level_with_a_size_stop(module, r):
    arrays = dict(x=_rand((r + 1, 8)), y=np.full((r + 1, 8), 5.0, np.float32))
    cpu, gpu = _both(module, "blocked_sized", arrays, {"R": r})
    _close(cpu, gpu, exact=("x", "y"))


def test_eltwise_broadcasts_and_a_guarded_bitmask(module):
    arrays = dict(x=_rand((12, 40)), bias=_rand((40,)), s=_rand((12,)),
                  y=np.zeros((12, 40), np.float32), mask=np.full((12, 5), 0xA5, np.uint8))
    cpu, gpu = _both(module, "eltwise", arrays)
    _close(cpu, gpu, exact=("y",))


def test_transforms(module):
    arrays = dict(x=_rand((3, 6, 10), "bf16"), xt=np.zeros((3, 10, 6), _np("bf16")),
                  xv=np.zeros((3, 3, 20), _np("bf16")), f=_rand((3, 6, 10)),
                  rs=np.zeros((3, 6), np.float32), cm=np.zeros((3, 10), np.float32))
    cpu, gpu = _both(module, "transforms", arrays)
    _close(cpu, gpu, exact=("xt", "xv", "cm"))


def test_layer_norm_equation(module):
    arrays = dict(x=_rand((20, 48)), g=_rand((48,)), b=_rand((48,)),
                  eps=np.full(1, 1e-5, np.float32), y=np.zeros((20, 48), np.float32),
                  mu=np.zeros(20, np.float32), rstd=np.zeros(20, np.float32))
    cpu, gpu = _both(module, "layer_norm", arrays)
    _close(cpu, gpu, rtol=1e-5, atol=1e-5)


def test_bf16_brgemm_with_vnni_b_bias_relu_and_mask(module):
    spec = bf16_vnni().spec()
    assert loopnest.launch(spec, {}).shared_bytes > 0       # the tensor-core pipeline
    arrays = dict(A=_rand((2, 3, 32, 16), "bf16"), B=_rand((2, 3, 8, 48), "bf16"),
                  bias=_rand((2, 24)), C=np.full((2, 2, 32, 24), np.nan, np.float32),
                  mask=np.full((2, 2, 32, 3), 0xA5, np.uint8))
    cpu, gpu = _both(module, "bf16_vnni", arrays)
    _close(cpu, gpu, rtol=1e-4, atol=1e-4)


def test_f16_brgemm_on_64x64_block_tiles_with_beta_by_guard(module):
    arrays = dict(A=_rand((2, 4, 64, 32), "f16"), B=_rand((1, 4, 64, 32), "f16"),
                  C=np.full((2, 1, 64, 64), np.nan, np.float16))
    cpu, gpu = _both(module, "f16_tiles", arrays)
    _close(cpu, gpu, rtol=2e-3, atol=2e-2)


def test_floor_division_is_pythons(module):
    arrays = dict(x=_rand((4, 8)), y=np.full((7, 8), 3.0, np.float32))
    cpu, gpu = _both(module, "floors", arrays)
    assert (cpu["y"][:2] == 3.0).all() and not (cpu["y"][2:] == 3.0).any()
    _close(cpu, gpu, exact=("y",))


def test_a_nest_without_a_parallel_band_runs_in_one_block(module):
    spec = no_band().spec()
    assert loopnest.launch(spec, {}).grid == (1, 1, 1)
    assert loopnest.outer_iterations(spec, {}) == [()]
    arrays = dict(x=_rand((3, 4, 5, 12)), y=np.full((3, 5, 12), np.nan, np.float32))
    cpu, gpu = _both(module, "no_band", arrays)
    _close(cpu, gpu, exact=("y",))


def test_a_band_between_sequential_loops(module):
    spec = band_between().spec()
    assert loopnest.outer_iterations(spec, {}) == [(0,), (1,), (2,)]
    assert loopnest.launch(spec, {}).grid == (5, 1, 1)
    arrays = dict(x=_rand((3, 5, 2, 4, 8)), y=np.full((5, 4, 8), np.nan, np.float32))
    cpu, gpu = _both(module, "band_between", arrays)
    _close(cpu, gpu, exact=("y",))


@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 17])
def test_dropout_with_the_seed_as_a_size(module, seed):
    arrays = dict(x=_rand((3, 4, 19)), y=np.zeros((3, 4, 19), np.float32),
                  m=np.zeros((3, 4, 3), np.uint8))
    cpu, gpu = _both(module, "dropout", arrays, {"S": seed})
    _close(cpu, gpu, exact=("y",))


def test_a_small_grid_strides_over_the_band(module):
    """The grid-stride loop covers a band larger than the grid (one block does it all)."""
    nest = matmul()
    spec, m = nest.spec(), 40
    arrays = dict(A=_rand((m, KB * BK)), B=_rand((NB, KB, BK, BN)),
                  C=np.full((m, NB * BN), np.nan, np.float32))
    cpu = {k: v.copy() for k, v in arrays.items()}
    nest.compile()(**cpu)
    g = loopnest.launch(spec, {"M": m})
    one = type(g)((1, 1, 1), g.block, g.shared_bytes)
    name = loopnest.kernel_name(spec)
    for outer in loopnest.outer_iterations(spec, {"M": m}):
        module.launch(name, one, [arrays["A"], arrays["B"], arrays["C"], m, *outer])
    _close(cpu, arrays, atol=1e-4)


def test_a_nest_called_with_device_arrays_runs_through_the_cuda_backend(module, monkeypatch):
    """tpp's runtime routes a nest whose arrays live on a CUDA device to tpp_cuda (plugin's
    CudaNest: one launch per outer iteration, the geometry for the call's sizes); here the
    "device" is host memory and the kernel runs on the emulator."""
    from test_cuda_calls_emulated import HostDevice
    from tpp_cuda import runtime

    class Emulated:
        def __init__(self, spec):
            self.name = loopnest.kernel_name(spec)

        def launch(self, args, torch_stream=False, geometry=None):
            module.launch(self.name, geometry, [int(a) for a in args])

    monkeypatch.setattr(runtime, "function", lambda spec, device: Emulated(spec))
    m = 40
    a, b = _rand((m, KB * BK)), _rand((NB, KB, BK, BN))
    c = np.full((m, NB * BN), np.nan, np.float32)
    matmul().compile()(HostDevice(a), HostDevice(b), HostDevice(c))
    np.testing.assert_allclose(c, a @ b.transpose(1, 2, 0, 3).reshape(KB * BK, NB * BN),
                               rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- contract
def test_names_are_stable_and_the_generators_route_nests():
    spec = matmul().spec()
    assert loopnest.kernel_name(spec) == loopnest.kernel_name(matmul().spec())
    assert loopnest.kernel_name(spec) != loopnest.kernel_name(no_band().spec())
    assert generators.kernel_name(spec) == loopnest.kernel_name(spec)
    assert generators.supported(spec) and loopnest.supported(spec)
    src = loopnest.source(spec)
    assert src.count('extern "C" __global__') == 1
    assert loopnest.kernel_name(spec) in cuda_emulator.kernels_in(src)


def test_calls_without_a_cuda_block_form_raise_unsupported():
    eq = tpp.equation(4, 8)
    x = eq.input("x")
    spec = eq.compile(eq.sum(x, axis=0)).spec      # a reduction over the rows: CPU-only
    nest = tpp.LoopNest("A", a=2)
    X, Y = nest.tensor("X", (2, 4, 8)), nest.tensor("Y", (2, 8))
    nest.call(spec, X[nest.vars[0]], Y[nest.vars[0]])
    assert not loopnest.supported(nest.spec())
    for fn in (loopnest.kernel_name, loopnest.source):
        with pytest.raises(UnsupportedError, match="call 0"):
            fn(nest.spec())
    with pytest.raises(UnsupportedError):
        loopnest.source(tpp.unary("exp", 2, 2).spec)


@pytest.mark.skipif(not nvcc.available(), reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nest_sources_compile_with_nvcc(arch):
    specs = [matmul().spec(), bf16_vnni().spec(), layer_norm().spec(), transforms().spec()]
    nvcc.compile_check({loopnest.kernel_name(s): loopnest.source(s) for s in specs}, arch)
