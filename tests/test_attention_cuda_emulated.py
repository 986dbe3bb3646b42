"""ops.attention_forward / attention_backward on device arrays, without a GPU: the same nests
(ops.attention_kernels, the forward's device variant) run as generated CUDA code on the CPU
emulator (tests/cuda_device_harness.py) and are compared with the same operator on the host.

Checked: results equal the host's (up to float reassociation; bf16 to its rounding), stay on
the device as the kind the backend allocates, every step ran as CUDA code (loop nests and
TPPs launched, nothing computed on the host); causal, bool and float masks (key and 2-D),
GQA, different query and key lengths, dropout with a seed (the host's keep bits); mixed
host/device operands are an ArgumentError. Shapes are tiny (one OS thread per CUDA thread).
"""
import numpy as np
import pytest

import ops
from tpp.core import dtypes as _dt
from tpp.core.errors import ArgumentError

from cuda_device_harness import (HostDevice, available, emulated_cuda, fake_cuda_class,  # noqa: F401
                                 host_of)

pytestmark = pytest.mark.skipif(not available(), reason="g++ or the CUDA headers are missing")

D = 16


def _rand(rng, shape, dtype="f32"):
    return rng.standard_normal(shape).astype(np.float32).astype(_dt.lookup(dtype).numpy)


def _close(got, want, tol):
    assert isinstance(got, HostDevice), f"expected device data, got {type(got).__name__}"
    np.testing.assert_allclose(np.asarray(host_of(got), np.float32),
                               np.asarray(want, np.float32), rtol=tol, atol=tol)


def _inputs(rng, b, h, hk, sq, sk, dtype="f32"):
    return (_rand(rng, (b, h, sq, D), dtype), _rand(rng, (b, hk, sk, D), dtype),
            _rand(rng, (b, hk, sk, D), dtype))


def _dev(x):
    return None if x is None else HostDevice(x)


def _mask(rng, kind, h, sq, sk):
    if kind == "bool_key":          # per key (a key mask), some keys masked out
        m = rng.random((1, 1, 1, sk)) > 0.3
        m[..., 0] = True
        return m
    if kind == "float_2d":          # per (head, query, key): the per-query-block nest
        return (rng.standard_normal((1, h, sq, sk)) * 0.5).astype(np.float32)
    return None


CASES = [   # (name, h, hk, sq, sk, causal, mask kind, dropout)
    ("tail", 2, 2, 40, 40, False, None, 0.0),
    ("causal", 2, 2, 70, 70, True, None, 0.0),
    ("bool_key_mask", 2, 2, 40, 70, False, "bool_key", 0.0),
    ("float_2d_mask", 2, 2, 70, 40, False, "float_2d", 0.0),
    ("gqa_lengths", 2, 1, 30, 70, False, None, 0.0),
    ("dropout", 2, 2, 40, 40, True, None, 0.25),
]


def _nests(launched):
    return [s for s in launched if s.family == "loopnest"]


@pytest.mark.parametrize("name, h, hk, sq, sk, causal, mask, p", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_the_host(emulated_cuda, name, h, hk, sq, sk, causal, mask, p):
    rng = np.random.default_rng(len(name))
    q, k, v = _inputs(rng, 1, h, hk, sq, sk)
    m = _mask(rng, mask, h, sq, sk)
    kw = dict(mask=m, causal=causal, dropout_p=p, seed=1234 if p else None)
    want_o, want_l = ops.attention_forward(q, k, v, **kw)
    got_o, got_l = ops.attention_forward(HostDevice(q), HostDevice(k), HostDevice(v),
                                         **dict(kw, mask=_dev(m)))
    _close(got_o, want_o, 2e-5)
    _close(got_l, want_l, 2e-5)
    assert got_o.shape == q.shape and got_l.shape == (1, h, sq)
    assert _nests(emulated_cuda.launched), "the nest did not run as CUDA code"


def test_forward_bf16(emulated_cuda):
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 1, 2, 1, 40, 70, "bf16")
    want_o, want_l = ops.attention_forward(q, k, v, causal=True)
    got_o, got_l = ops.attention_forward(HostDevice(q), HostDevice(k), HostDevice(v),
                                         causal=True)
    assert got_o.dtype == _dt.BF16.numpy
    _close(got_o, want_o, 2e-2)
    _close(got_l, want_l, 1e-3)


def test_attention_returns_the_output(emulated_cuda):
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 1, 2, 2, 40, 40)
    _close(ops.attention(HostDevice(q), HostDevice(k), HostDevice(v)), ops.attention(q, k, v),
           2e-5)


BACKWARD = [    # (name, h, hk, sq, sk, causal, mask kind, dropout)
    ("causal_tail", 2, 2, 70, 70, True, None, 0.0),
    ("gqa_key_mask_dropout", 2, 1, 40, 70, False, "bool_key", 0.25),
    ("float_2d_mask", 2, 2, 70, 40, False, "float_2d", 0.0),
]


@pytest.mark.parametrize("name, h, hk, sq, sk, causal, mask, p", BACKWARD,
                         ids=[c[0] for c in BACKWARD])
def test_backward_matches_the_host(emulated_cuda, name, h, hk, sq, sk, causal, mask, p):
    rng = np.random.default_rng(len(name))
    q, k, v = _inputs(rng, 1, h, hk, sq, sk)
    m = _mask(rng, mask, h, sq, sk)
    kw = dict(mask=m, causal=causal, dropout_p=p, seed=99 if p else None)
    o, lse = ops.attention_forward(q, k, v, **kw)
    do = _rand(rng, o.shape)
    want = ops.attention_backward(do, q, k, v, o, lse, **kw)
    got = ops.attention_backward(*(HostDevice(x) for x in (do, q, k, v, o, lse)),
                                 **dict(kw, mask=_dev(m)))
    for g, w in zip(got, want):
        _close(g, w, 1e-4)
    assert _nests(emulated_cuda.launched)


def test_backward_need(emulated_cuda):
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 1, 2, 2, 40, 40)
    o, lse = ops.attention_forward(q, k, v)
    do = _rand(rng, o.shape)
    want = ops.attention_backward(do, q, k, v, o, lse)
    dq, dk, dv = ops.attention_backward(*(HostDevice(x) for x in (do, q, k, v, o, lse)),
                                        need=(False, True, False))
    assert dq is None and dv is None
    _close(dk, want[1], 1e-4)


def test_mixed_host_and_device_is_an_argument_error(emulated_cuda):
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, 1, 2, 2, 40, 40)
    with pytest.raises(ArgumentError, match="different devices"):
        ops.attention(HostDevice(q), k, HostDevice(v))
    with pytest.raises(ArgumentError, match="different devices"):
        ops.attention(q, k, v, mask=HostDevice(np.ones((1, 1, 1, 40), bool)))
    with pytest.raises(ArgumentError, match="different devices"):
        ops.attention(HostDevice(q), HostDevice(k), HostDevice(v), mask=np.ones((40,), bool))
    o, lse = ops.attention_forward(q, k, v)
    with pytest.raises(ArgumentError, match="different devices"):
        ops.attention_backward(o, HostDevice(q), HostDevice(k), HostDevice(v), HostDevice(o),
                               HostDevice(lse))
    with pytest.raises(ArgumentError, match="different devices"):
        ops.attention_backward(o, q, k, v, o, HostDevice(lse))


def test_torch_cuda_tensors_without_a_usable_backend_go_to_torch():
    """ops.torch.scaled_dot_product_attention takes CUDA tensors only where the CUDA backend
    runs (cupy and a GPU); here it does not, so torch's own kernel is asked (no plan)."""
    torch = pytest.importorskip("torch")
    from ops import torch_attention as ta
    from tpp_cuda import runtime
    if runtime.available():
        pytest.skip("a GPU is visible")

    FakeCuda = fake_cuda_class()

    x = FakeCuda((1, 2, 8, D))
    assert ta._plan(x, x, x, None, 0.0, None, False) is None
    cpu = torch.zeros(1, 2, 8, D)
    assert ta._plan(cpu, cpu, cpu, None, 0.0, None, False) is not None
