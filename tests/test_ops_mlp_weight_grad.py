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
