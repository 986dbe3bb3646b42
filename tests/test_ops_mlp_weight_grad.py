"""The MLP backward's weight gradient over packed operands (ops.mlp.weight_grad_packed) against
the rank-1 nest it replaces for 64+ rows and against float64."""
import importlib

import numpy as np
import pytest

import tpp


@pytest.mark.parametrize("m", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_weight_grad_packed_matches_weight_grad(m, dtype):
    """The MLP backward's dw over packed 64-row blocks (with rank-1 steps for the rows past
    the last whole block) sums in weight_grad's order: identical f32 results, bf16 within one
    output rounding, both near the float64 product."""
    mlp = importlib.import_module("ops.mlp")
    rng = np.random.default_rng(m)
    npdt = tpp.core.dtypes.lookup(dtype).numpy
    dz = rng.standard_normal((m, 70)).astype(np.float32).astype(npdt)
    x = rng.standard_normal((m, 90)).astype(np.float32).astype(npdt)
    got = mlp.weight_grad_packed(dz, x)
    want = mlp.weight_grad(dz, x)
    exact = dz.astype(np.float64).T @ x.astype(np.float64)
    assert got.shape == (70, 90) and got.dtype == npdt
    if dtype == "f32":
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4 * np.sqrt(m))
    else:
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2,
                                   atol=1e-2)
        np.testing.assert_allclose(got.astype(np.float64), exact, rtol=2e-2,
                                   atol=2e-2 * np.sqrt(m))
    again = mlp.weight_grad_packed(dz, x)         # the kept scratch, reused
    np.testing.assert_array_equal(again, got)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_torch_tensors_take_the_packed_gemm(dtype, monkeypatch):
    """torch CPU tensors (the drop-ins' backward) run the packed GEMM as numpy arrays do, with
    the same results, and get a torch tensor back."""
    torch = pytest.importorskip("torch")
    mlp = importlib.import_module("ops.mlp")
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    dz = torch.randn(130, 70, generator=gen).to(tdt)
    x = torch.randn(130, 90, generator=gen).to(tdt)
    want = mlp.weight_grad(dz, x)
    used = []
    real = mlp._packed_grad_nest
    monkeypatch.setattr(mlp, "_packed_grad_nest", lambda *a: used.append(a) or real(*a))
    got = mlp.weight_grad_packed(dz, x)
    assert used and isinstance(got, torch.Tensor) and got.dtype == tdt
    if dtype == "f32":
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_mlp_backward_dz_scratch_is_reused_and_results_are_fresh():
    """The activation's gradient dz is per-thread scratch: a second backward reuses it, and
    the gradients returned by the first call are not overwritten by the second."""
    import ops
    rng = np.random.default_rng(0)
    x = rng.standard_normal((130, 40), dtype=np.float32)
    w = rng.standard_normal((50, 40), dtype=np.float32)
    b = rng.standard_normal(50, dtype=np.float32)
    dy1, dy2 = (rng.standard_normal((130, 50), dtype=np.float32) for _ in range(2))
    _, saved = ops.mlp_forward(x, w, b, "gelu")
    first = [g.copy() for g in ops.mlp_backward(dy1, saved)]
    kept = ops.mlp_backward(dy1, saved)
    ops.mlp_backward(dy2, saved)
    for a, b_ in zip(first, kept):
        np.testing.assert_array_equal(a, b_)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mlp_backward_routes_dw_by_dtype(dtype, monkeypatch):
    """bf16 weight gradients take the packed GEMM (VNNI pairs), f32 the rank-1 nest (unless
    PACKED_F32_DW, whose default follows the host: forced off here), for numpy and torch
    alike."""
    torch = pytest.importorskip("torch")
    import ops
    mlp = importlib.import_module("ops.mlp")
    monkeypatch.setattr(mlp, "PACKED_F32_DW", False)
    used = []
    real = mlp._packed_grad_nest
    monkeypatch.setattr(mlp, "_packed_grad_nest", lambda *a: used.append(a) or real(*a))
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(130, 40, generator=gen).to(tdt)
    w = torch.randn(50, 40, generator=gen).to(tdt)
    dy = torch.randn(130, 50, generator=gen).to(tdt)
    _, saved = ops.mlp_forward(x, w, None, "relu")
    dw = ops.mlp_backward(dy, saved)[1]
    assert bool(used) == (dtype == "bf16") and isinstance(dw, torch.Tensor)
    z = torch.nn.functional.linear(x.float(), w.float())
    want = (dy.float() * (z > 0)).t() @ x.float()
    torch.testing.assert_close(dw.float(), want, rtol=1e-2 if dtype == "bf16" else 1e-5,
                               atol=1e-1 if dtype == "bf16" else 1e-4)


def test_f32_weight_gradient_route_follows_the_host(monkeypatch):
    """PACKED_F32_DW None: packed where the host has a matrix unit (Sapphire Rapids class),
    the rank-1 nest elsewhere; True / False force either."""
    import tpp
    mlp = importlib.import_module("ops.mlp")
    monkeypatch.setattr(mlp, "PACKED_F32_DW", None)
    assert mlp.packed_f32_dw() == tpp.has_matrix_unit("bf16")
    for forced in (True, False):
        monkeypatch.setattr(mlp, "PACKED_F32_DW", forced)
        assert mlp.packed_f32_dw() is forced


@pytest.mark.parametrize("m,n,k,dtype,in_place", [
    (130, 256, 96, "f32", True),       # x in place (384-byte rows), one partial step
    (2100, 200, 90, "f32", False),     # two whole steps, rank-1 rows, a narrow last row block
    (1100, 260, 1024, "f32", False),   # 4 KiB rows (packed), a step of one block
    (130, 256, 96, "bf16", False),     # bf16: VNNI-packed x
    (1100, 260, 70, "bf16", False),
])
def test_fused_transposes_match_weight_grad(m, n, k, dtype, in_place, monkeypatch):
    """From FUSED_ROW_BLOCKS blocks of dw rows the nest transposes dz's blocks itself (x read
    in place where in_place_rows allows): the same sums in the same order as weight_grad."""
    mlp = importlib.import_module("ops.mlp")
    used = []
    real = mlp._fused_grad_nest
    monkeypatch.setattr(mlp, "_fused_grad_nest", lambda *a: used.append(a) or real(*a))
    rng = np.random.default_rng(m + n + k)
    npdt = tpp.core.dtypes.lookup(dtype).numpy
    dz = rng.standard_normal((m, n)).astype(np.float32).astype(npdt)
    x = rng.standard_normal((m, k)).astype(np.float32).astype(npdt)
    got = mlp.weight_grad_packed(dz, x)
    assert used and used[-1][-1] is in_place
    want = mlp.weight_grad(dz, x)
    if dtype == "f32":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(mlp.weight_grad_packed(dz, x), got)   # scratch reused


def test_in_place_rows_rule():
    mlp = importlib.import_module("ops.mlp")
    f32, bf16 = tpp.core.dtypes.F32, tpp.core.dtypes.BF16
    assert mlp.in_place_rows(384, f32) and mlp.in_place_rows(96, f32)
    assert not mlp.in_place_rows(1536, f32) and not mlp.in_place_rows(1024, f32)
    assert not mlp.in_place_rows(90, f32) and not mlp.in_place_rows(384, bf16)
