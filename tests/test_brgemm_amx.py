"""BRGEMM on AMX tiles (tpp_cpu.brgemm_amx): bf16 A with VNNI bf16 B, an even k.

On a host with AMX (and the OS's permission) these specs run on the tile unit, edges by
overlapping or partial tiles and k in equal steps; elsewhere the same cases run the vector
code and still check it. Each case goes through test_brgemm's checked run (_run_case: NaN margins
around A and B, sentinel bytes around C and the bitmask, the summation error bound), so a
tile that reads past its block, writes past C or drops a k step fails here.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ops
import tpp
from test_brgemm import EPILOGUES, Case, _run_case
from tpp_cpu import amx, brgemm_amx, target

BF = ("bf16", "bf16")
HAS_AMX = target.current().amx
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this host (or TPP_CPU_AMX) has no AMX")

CASES = [
    Case(16, 16, 32, "stride", 1, 0, "vnni", BF + ("f32",)),            # one tile
    Case(64, 64, 64, "stride", 4, 1, "vnni", BF + ("f32",)),            # 2 x 2 blocks, beta
    Case(37, 53, 64, "offset", 3, 0, "vnni", BF + ("bf16",), 0, ("row", "gelu", False)),
    Case(48, 80, 96, "address", 2, 1, "vnni", BF + ("f16",), 0, (None, "relu", True)),
    Case(33, 33, 32, "stride", 2, 1, "vnni", BF + ("f32",), 5),         # ld > n, edge tiles
    Case(100, 17, 128, "stride", 0, 1, "vnni", BF + ("bf16",), 0, ("row", "sigmoid", False)),
    Case(17, 100, 32, "stride", 3, 0, "vnni", BF + ("f32",), 0, ("row", "relu", True), 1),
    Case(64, 64, 64, "stride", 8, 0, "vnni", BF + ("f32",), 16),
    Case(16, 48, 64, "offset", 2, 1, "vnni", BF + ("bf16",), 3, ("row", None, False)),
    Case(48, 16, 64, "address", 5, 0, "vnni", BF + ("f32",), 0, (None, "tanh", False)),
    Case(80, 96, 256, "stride", 1, 1, "vnni", BF + ("f32",), 1, ("row", "relu", False)),
    # partial tiles (m, n < 16), overlapping edge tiles, k in equal steps of < 32
    Case(7, 12, 48, "stride", 2, 1, "vnni", BF + ("bf16",), 0, ("row", "relu", True)),
    Case(1, 16, 2, "offset", 3, 0, "vnni", BF + ("f32",)),
    Case(28, 64, 28, "stride", 9, 1, "vnni", BF + ("f32",), 2),
    Case(56, 40, 56, "address", 2, 1, "vnni", BF + ("f16",), 0, ("row", "gelu", False)),
    Case(76, 77, 80, "stride", 2, 0, "vnni", BF + ("f32",), 3, ("row", None, False)),
    Case(64, 20, 14, "stride", 1, 1, "vnni", BF + ("bf16",), 0, (None, "relu", True)),
    Case(44, 9, 74, "offset", 2, 1, "vnni", BF + ("f32",), 1),
    # the deferred epilogue: each block's rows drained during the next block's k steps
    # (many blocks, 12 and 20 steps), lone row / column tiles pending after pairs, partial
    # and overlapping tiles, a bitmask
    Case(96, 160, 384, "stride", 2, 1, "vnni", BF + ("bf16",), 0, ("row", "gelu", False)),
    Case(48, 48, 96, "offset", 1, 0, "vnni", BF + ("f32",), 0, ("row", "relu", True)),
    Case(23, 70, 640, "stride", 1, 0, "vnni", BF + ("f16",), 0, (None, "gelu", False)),
    Case(7, 50, 64, "address", 3, 1, "vnni", BF + ("bf16",), 2, ("row", None, False)),
    Case(70, 90, 96, "stride", 2, 0, "vnni", BF + ("bf16",), 0, ("col", "gelu", False)),
    Case(40, 48, 64, "offset", 1, 1, "vnni", BF + ("f32",), 0, ("col", "relu", True)),
    # odd k: a tail step from zero-filled copies (B's padding half holds NaN here)
    Case(64, 64, 7, "stride", 3, 1, "vnni", BF + ("f32",)),
    Case(64, 64, 49, "stride", 2, 0, "vnni", BF + ("bf16",), 0, ("row", "relu", False)),
    Case(13, 37, 1, "offset", 4, 0, "vnni", BF + ("f32",), 3),
    Case(40, 24, 33, "address", 2, 1, "vnni", BF + ("f16",), 5, (None, "gelu", False)),
    Case(17, 100, 95, "stride", 1, 0, "vnni", BF + ("f32",), 0, ("row", None, False), 1),
    # transposed A (an even k): tiles built from A's stored rows
    Case(64, 64, 64, "stride", 2, 1, "ta.vnni", BF + ("f32",)),
    Case(37, 53, 48, "offset", 3, 0, "ta.vnni", BF + ("bf16",), 3, ("row", "gelu", False)),
    Case(7, 9, 14, "address", 2, 1, "ta.vnni", BF + ("f16",)),
    Case(64, 64, 256, "stride", 1, 0, "ta.vnni", BF + ("f32",), 5, (None, "relu", True)),
    Case(20, 30, 2, "stride", 0, 1, "ta.vnni", BF + ("f32",), 0, ("row", None, False)),
    Case(13, 40, 33, "address", 3, 1, "ta.vnni", BF + ("bf16",), 3),     # odd: vector code
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tiled_cases(case):
    spec = case.kernel().spec
    mask_overlap = spec.bitmask and spec.n > 16 and spec.n % 16    # stays on the vector code
    odd_transposed = spec.trans_a and spec.k % 2                    # so does this
    assert brgemm_amx.eligible(spec, target.current()) == \
        (HAS_AMX and not mask_overlap and not odd_transposed)
    _run_case(case)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 80), n=st.integers(1, 80), k=st.sampled_from([1, 2, 7, 14, 32, 33, 48, 49, 64, 90]),
       batch=st.sampled_from(["stride", "offset", "address"]), count=st.integers(0, 4),
       beta=st.sampled_from([0, 1]), dtype_c=st.sampled_from(["f32", "bf16", "f16"]),
       pad=st.sampled_from([0, 1, 16, 32]), epilogue=st.sampled_from(EPILOGUES),
       spare=st.sampled_from([0, 1]), layout=st.sampled_from(["vnni", "ta.vnni"]))
def test_tiled_hypothesis(m, n, k, batch, count, beta, dtype_c, pad, epilogue, spare, layout):
    _run_case(Case(m, n, k, batch, count, beta, layout, BF + (dtype_c,), pad, epilogue, spare))


def test_which_specs_run_on_tiles():
    """Tiles need bf16 A and VNNI bf16 B, any k (a transposed A: an even k); a bitmask with an
    overlapping column tile (n > 16, not a multiple of 16) stays on the vector code."""
    on = target.Target("avx512", 16, True, "x", bf16_dot=True, vector_registers=32,
                       masked_lanes=True, amx=True)
    off = target.Target("avx512", 16, True, "x", bf16_dot=True, vector_registers=32,
                        masked_lanes=True)
    spec = tpp.brgemm(64, 64, 64, dtype_a="bf16", vnni_b=True).spec
    assert brgemm_amx.eligible(spec, on) and not brgemm_amx.eligible(spec, off)
    for kwargs, want in (({"k": 48}, True), ({"m": 3, "n": 5}, True), ({"k": 33}, True),
                         ({"trans_a": True}, True), ({"trans_a": True, "k": 33}, False),
                         ({"vnni_b": False}, False),
                         ({"dtype_a": "f16", "dtype_b": "f16"}, False),
                         ({"n": 20, "activation": "relu", "bitmask": True}, False),
                         ({"n": 12, "activation": "relu", "bitmask": True}, True),
                         ({"n": 32, "activation": "relu", "bitmask": True}, True)):
        args = dict(m=64, n=64, k=64, dtype_a="bf16", dtype_b="bf16", vnni_b=True)
        args.update(kwargs)
        m, n, k = args.pop("m"), args.pop("n"), args.pop("k")
        assert brgemm_amx.eligible(tpp.brgemm(m, n, k, **args).spec, on) == want, kwargs


def test_tiles_cover_c_and_overlap_only_inside_a_block():
    """Every extent 1..200: the blocks' tiles cover [0, extent) and stay inside it; tiles
    overlap only within one block; k steps are even, at most 32, and sum to k."""
    for extent in range(1, 201):
        width = min(extent, brgemm_amx.TILE)
        tiles = []
        for blk in brgemm_amx.blocks(extent):
            assert len(blk.tiles) in (1, 2)
            for i in range(blk.count):
                tiles.append([blk.start + i * blk.step + t for t in blk.tiles])
        covered = np.zeros(extent, int)
        for block in tiles:
            seen = np.zeros(extent, bool)
            for t in block:
                assert 0 <= t and t + width <= extent, (extent, block)
                seen[t:t + width] = True
            covered += seen
        assert (covered == 1).all(), (extent, tiles)
    for k in range(2, 400, 2):
        steps, ks = brgemm_amx.k_steps(k)
        assert steps * ks == k and ks % 2 == 0 and ks <= 32 and steps >= -(-k // 32)
    for k in range(1, 400, 2):      # odd: whole steps in place, one tail step from copies
        lay = brgemm_amx.Layout.of(tpp.brgemm(16, 16, k, dtype_a="bf16", vnni_b=True).spec)
        assert lay.steps * lay.ks + lay.tail == k and lay.tail % 2 == 1 and lay.ks % 2 == 0
        assert lay.ks == min(32, k + 1) and lay.tail < lay.ks


def test_tile_configuration_bytes():
    """Palette 1; bytes per row at 16 + 2t (little-endian), rows at 48 + t."""
    raw = amx.config_bytes(brgemm_amx.Layout(16, 16, 2, 32).shapes())
    assert len(raw) == 64 and raw[0] == 1 and raw[1] == 0
    assert [int.from_bytes(raw[16 + 2 * t:18 + 2 * t], "little") for t in range(8)] == [64] * 8
    assert list(raw[48:56]) == [16] * 8 and not any(raw[56:]) and not any(raw[34:48])
    raw = amx.config_bytes(brgemm_amx.Layout(7, 12, 2, 24).shapes())
    assert [int.from_bytes(raw[16 + 2 * t:18 + 2 * t], "little") for t in range(8)] == \
        [48] * 4 + [48] * 2 + [48] * 2
    assert list(raw[48:56]) == [7] * 4 + [7] * 2 + [12] * 2
    for bad in ([(17, 64)], [(16, 68)], [(16, 62)], [(16, 64)] * 9):
        with pytest.raises(ValueError):
            amx.config_bytes(bad)


def test_tile_code_compiles_for_a_cpu_without_tiles():
    """A target with amx carries the tile features to LLVM whatever its CPU, so its code can
    be generated (and looked at) on any host."""
    from tpp_cpu import backend
    tgt = target.Target("avx512", 16, False, "none", cpu="znver4", bf16_dot=True,
                        vector_registers=32, masked_lanes=True, amx=True)
    asm = backend.dump(tpp.brgemm(37, 40, 49, dtype_a="bf16", vnni_b=True).spec, "asm", tgt)
    assert "tdpbf16ps" in asm and "ldtilecfg" in asm


@needs_amx
def test_the_code_uses_the_tiles():
    """The assembly configures, multiplies on and releases the tiles, with no vector dot
    products beside them, edges included."""
    for m, n, k in ((64, 64, 64), (37, 53, 48), (7, 9, 14), (64, 64, 49), (5, 70, 7)):
        asm = tpp.brgemm(m, n, k, dtype_a="bf16", vnni_b=True).dump("asm")
        assert "tdpbf16ps" in asm and "ldtilecfg" in asm and "tilerelease" in asm
        assert "vdpbf16ps" not in asm
    asm = tpp.brgemm(64, 64, 64, dtype_a="bf16", vnni_b=True).dump("asm")
    assert asm.count("tdpbf16ps") == 4


def test_tpp_cpu_amx_0_keeps_the_vector_code():
    """TPP_CPU_AMX=0 in a fresh process: no tiles, the same results within the bound."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = ("import sys; sys.path.insert(0, sys.argv[1])\n"
              "from tpp_cpu import target; assert not target.current().amx\n"
              "import tpp, test_brgemm_amx as t\n"
              "asm = tpp.brgemm(64, 64, 64, dtype_a='bf16', vnni_b=True).dump('asm')\n"
              "assert 'tdpbf16ps' not in asm and 'tileloadd' not in asm\n"
              "for c in t.CASES[:4]: t._run_case(c)\n"
              "print('ok')\n")
    env = dict(os.environ, TPP_CPU_AMX="0")
    out = subprocess.run([sys.executable, "-c", script, here], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@needs_amx
def test_tiles_in_threads_of_a_loop_nest():
    """A parallel nest calling a tiled BRGEMM from every thread: each call configures and
    releases its own tiles, so the threads' results are independent and exact."""
    mb = 8
    nest = tpp.LoopNest("A", a=mb)
    a, = nest.vars
    x = nest.tensor("x", (mb, 32, 64), "bf16")
    w = nest.tensor("w", (1, 32, 64), "bf16")
    y = nest.tensor("y", (mb, 32, 32))
    mm = tpp.brgemm(32, 32, 64, dtype_a="bf16", vnni_b=True)
    nest.call(mm, x[a], w[a * 0], y[a], count=1, stride_a=0, stride_b=0)
    run = nest.compile()
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((mb, 32, 64)).astype(np.float32).astype(tpp.BF16.numpy)
    ws = rng.standard_normal((64, 32)).astype(np.float32).astype(tpp.BF16.numpy)
    wv = tpp.unary("vnni2", 64, 32, dtype_in="bf16")(ws)
    out = np.empty((mb, 32, 32), np.float32)
    run(xs, wv[None], out, threads=2)
    want = xs.astype(np.float64) @ ws.astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_has_matrix_unit_says_where_bf16_runs_on_tiles():
    """tpp.has_matrix_unit: bf16 exactly where the CPU target has AMX, never another dtype;
    an unknown dtype is a SpecError and a device no backend runs an UnsupportedError, as for
    has_dot_instruction."""
    assert tpp.has_matrix_unit("bf16") == HAS_AMX
    assert tpp.has_matrix_unit(tpp.BF16, "cpu") == HAS_AMX
    assert not tpp.has_matrix_unit("f32") and not tpp.has_matrix_unit("f16")
    assert not HAS_AMX or tpp.has_dot_instruction("bf16")
    with pytest.raises(tpp.SpecError):
        tpp.has_matrix_unit("f64")
    with pytest.raises(tpp.UnsupportedError):          # a device no backend runs
        tpp.has_matrix_unit("bf16", "tpu:0")
    assert not tpp.has_matrix_unit("bf16", "cuda")      # the CUDA backend claims none


@needs_amx
def test_bf16_attention_products_read_p_untransposed_on_tiles():
    """With tiles, the bf16 attention nests multiply by P and dS (transposed once from the
    P^T and dS^T blocks they keep) instead of reading those with trans_a, which tiles run by
    transposing per k step and column block."""
    import ops.attention_kernels as K
    from tpp.core import dtypes
    o = K.Options(64, dtypes.BF16, 1, 1)
    assert K.tiles(o) and not K.tiles(K.Options(64, dtypes.F32, 1, 1))
    seen = []
    real = tpp.make_brgemm

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]
    import ops.attention_equations as E
    old = E.tpp.make_brgemm
    E.tpp.make_brgemm = spy
    try:
        K.Forward(o)
        K.Backward(o)
    finally:
        E.tpp.make_brgemm = old
    bf = [s for s in seen if s.dtype_a.name == "bf16"]
    assert bf and not any(s.trans_a for s in bf)
    assert all(brgemm_amx.eligible(s, target.current()) for s in bf)


@pytest.mark.parametrize("m, n, k, count", [(64, 64, 7, 2), (20, 33, 49, 3), (16, 16, 1, 1)])
def test_odd_k_never_reads_the_padding_half(m, n, k, count):
    """The last VNNI pair of an odd k has a padding half that may hold anything: NaN there
    (and NaN in A's column past k, where A's rows are padded) must not reach C."""
    from test_brgemm import _vnni
    rng = np.random.default_rng(k)
    a = rng.standard_normal((count, m, k + 1)).astype(np.float32).astype(tpp.BF16.numpy)
    a[:, :, k] = np.nan                          # A's storage past k (lda = k + 1)
    bk = rng.standard_normal((count, k, n)).astype(np.float32).astype(tpp.BF16.numpy)
    bv = _vnni(bk, pad=np.nan)                   # the padding halves NaN
    assert np.isnan(bv.astype(np.float32)).any()
    mm = tpp.brgemm(m, n, k, lda=k + 1, dtype_a="bf16", vnni_b=True)
    got = mm(a[:, :, :k], bv)
    want = np.einsum("bmk,bkn->mn", a[:, :, :k].astype(np.float64), bk.astype(np.float64))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_bf16_panels_are_wider_where_tiles_multiply():
    """default_bn: 64 (all of a narrower N) on vector code; with tiles the widest of 384,
    256, 192, 128 that cuts N into equal panels and whose K x bn bf16 panel fits in
    TILE_PANEL_BYTES (else the narrowest that cuts N), else 64. pack_* use it for bf16 host
    weights exactly where tpp.has_matrix_unit('bf16'); f32 keeps 64."""
    from ops.packing import default_bn
    assert [default_bn(n) for n in (1, 63, 64, 384, 1536)] == [1, 63, 64, 64, 64]
    assert [default_bn(n, True) for n in (48, 64, 70, 128, 384, 1152, 1536, 640, 2048)] == \
        [48, 64, 64, 128, 384, 384, 384, 128, 256]
    # the panel's bytes: K 3072 takes 192 of N 768 (256 and 384 exceed them), K 8192 the
    # narrowest that cuts N when none fits
    assert [default_bn(768, True, k) for k in (384, 768, 1536, 3072)] == [384, 384, 384, 192]
    assert default_bn(1024, True, 8192) == 128 and default_bn(1152, True, 1536) == 384
    tiles = tpp.has_matrix_unit("bf16")
    w = np.ones((384, 40), tpp.BF16.numpy)
    assert ops.pack_nk(w).bn == (384 if tiles else 64)
    assert ops.pack_nk(w.astype(np.float32)).bn == 64
    x = np.ones((5, 40), tpp.BF16.numpy)
    np.testing.assert_array_equal(ops.linear(x, ops.pack_nk(w)).astype(np.float32),
                                  np.full((5, 384), 40.0, np.float32))


def test_choosing_the_target_imports_no_llvm():
    """The tile permission and TPP_CPU_AMX are read when the target is chosen, which a
    process that only loads cached kernels does without LLVM (a fresh process)."""
    script = ("import sys\nfrom tpp_cpu import target\nt = target.current()\n"
              "assert not [m for m in sys.modules if m.startswith('llvmlite')], t\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
