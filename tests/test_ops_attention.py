"""ops.attention (fused flash-style attention from BRGEMMs and equations) against
torch.nn.functional.scaled_dot_product_attention: forward, lse and backward (torch autograd),
masks, causal, GQA, dropout, bf16, compile reuse, memory and argument errors."""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import ops
import tpp
from tpp.core.errors import ArgumentError

torch = pytest.importorskip("torch")
F = torch.nn.functional
A = importlib.import_module("ops.flash_attention")
TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _inputs(b, h, hk, sq, sk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, sk, d, generator=g).to(dtype)
    do = torch.randn(b, h, sq, d, generator=g).to(dtype)
    return q, k, v, do


def _torch_ref(q, k, v, do, mask=None, causal=False, scale=None):
    """torch's output, lse and gradients, computed in f32."""
    qq, kk, vv = (x.detach().float().requires_grad_() for x in (q, k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal,
                                         scale=scale, enable_gqa=True)
    out.backward(do.float())
    # lse from the scores (small problems only)
    rep = q.shape[1] // k.shape[1]
    kr = kk.detach().repeat_interleave(rep, 1)
    s = qq.detach() @ kr.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return out.detach(), torch.logsumexp(s, -1), qq.grad, kk.grad, vv.grad


def _close(got, want, dtype=torch.float32, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol["rtol"],
                               atol=tol["atol"] * scale)


def _check(q, k, v, do, mask=None, causal=False, scale=None):
    out, lse = A.attention_forward(q, k, v, mask=mask, causal=causal, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    dq, dk, dv = A.attention_backward(do, q, k, v, out, lse, mask=mask, causal=causal,
                                      scale=scale)
    r_out, r_lse, r_dq, r_dk, r_dv = _torch_ref(q, k, v, do, mask, causal, scale)
    dt = q.dtype
    _close(out, r_out, dt)
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    _close(lse[finite], r_lse[finite], torch.float32, 10.0)
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert got.shape == want.shape and got.dtype == dt
        _close(got, want, dt, max(1.0, float(want.abs().max())))


# (B, H, Hk, Sq, Sk, D, causal)
SHAPES = [
    (1, 2, 2, 1, 1, 32, False),
    (2, 2, 2, 7, 7, 32, True),
    (1, 2, 2, 64, 64, 64, False),
    (1, 2, 2, 65, 65, 64, True),
    (2, 2, 2, 128, 128, 80, False),
    (1, 2, 2, 128, 128, 80, True),
    (1, 4, 2, 300, 300, 64, True),      # GQA, a bigger sequence
    (2, 4, 1, 65, 130, 32, False),      # GQA (one kv head), Sq != Sk
    (1, 2, 2, 130, 65, 64, True),       # causal with Sq > Sk (top-left aligned)
    (1, 2, 2, 7, 300, 80, False),
    (2, 2, 2, 20, 27, 32, True),        # short sequences: 32-row blocks (block_for)
    (1, 4, 2, 40, 33, 64, False),       # 48-row blocks, GQA
]


@pytest.mark.parametrize("b,h,hk,sq,sk,d,causal", SHAPES)
def test_forward_backward_vs_torch(b, h, hk, sq, sk, d, causal):
    _check(*_inputs(b, h, hk, sq, sk, d, seed=sq + sk), causal=causal)


def test_scale_and_numpy_in_numpy_out():
    q, k, v, do = _inputs(2, 2, 2, 33, 70, 32)
    out, lse = A.attention_forward(q.numpy(), k.numpy(), v.numpy(), scale=0.3)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    r_out, r_lse, *_ = _torch_ref(q, k, v, do, scale=0.3)
    _close(torch.from_numpy(out), r_out)
    _close(torch.from_numpy(lse), r_lse)
    grads = A.attention_backward(do.numpy(), q.numpy(), k.numpy(), v.numpy(), out, lse,
                                 scale=0.3, need=(True, False, True))
    assert isinstance(grads[0], np.ndarray) and grads[1] is None
    np.testing.assert_array_equal(ops.attention(q.numpy(), k.numpy(), v.numpy(), scale=0.3),
                                  out)


def _masks(b, h, sq, sk):
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(b, 1, 1, sk, generator=g) > 0.3
    keep[..., 0] = True
    return [
        keep,                                                      # key padding
        torch.rand(sq, sk, generator=g) > 0.4,                     # (Sq, Sk) bool
        torch.randn(b, h, sq, sk, generator=g),                    # full float
        torch.randn(1, h, 1, sk, generator=g),                     # per-head key bias
        torch.randn(b, 1, sq, 1, generator=g),                     # per-query (broadcast keys)
    ]


@pytest.mark.parametrize("sq,sk", [(65, 70), (20, 27)])
@pytest.mark.parametrize("which", range(5))
def test_masks_vs_torch(which, sq, sk):
    b, h = 2, 2
    mask = _masks(b, h, sq, sk)[which]
    _check(*_inputs(b, h, h, sq, sk, 32, seed=which), mask=mask)


def test_tensors_requiring_grad_are_read_as_data():
    """ops.attention is not differentiable (ops.torch's is): like the other operators it reads
    a tensor that requires grad as its data, on the first call and the planned one."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(5, 5, requires_grad=True)
    want = torch.nn.functional.scaled_dot_product_attention(q.detach(), k, v)
    for _ in range(2):
        torch.testing.assert_close(ops.attention(q, k, v), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ops.attention_forward(q, k, v)[0], want, rtol=1e-4,
                                   atol=1e-5)
        torch.testing.assert_close(ops.attention(q, k, v, mask=mask), want, rtol=1e-4,
                                   atol=1e-5)


def test_mask_with_causal_and_gqa():
    b, h, hk, s = 1, 4, 2, 70
    mask = torch.rand(b, 1, 1, s, generator=torch.Generator().manual_seed(1)) > 0.2
    mask[..., 0] = True
    q, k, v, do = _inputs(b, h, hk, s, s, 32)
    out, lse = A.attention_forward(q, k, v, mask=mask, causal=True)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    r_out, _, r_dq, r_dk, r_dv = _torch_ref(q, k, v, do, mask=mask & causal)
    _close(out, r_out)
    grads = A.attention_backward(do, q, k, v, out, lse, mask=mask, causal=True)
    for got, want in zip(grads, (r_dq, r_dk, r_dv)):
        _close(got, want, scale=max(1.0, float(want.abs().max())))


def test_fully_masked_rows_give_zero():
    """A query that sees no key: torch's CPU kernel gives a zero row and zero gradients; so
    does the operator (lse -inf)."""
    b, h, sq, sk = 1, 2, 65, 70
    mask = torch.ones(sq, sk, dtype=torch.bool)
    mask[3] = False
    mask[64] = False
    q, k, v, do = _inputs(b, h, h, sq, sk, 32)
    out, lse = A.attention_forward(q, k, v, mask=mask)
    assert torch.all(out[:, :, [3, 64]] == 0) and torch.all(lse[:, :, [3, 64]] == -math.inf)
    _check(q, k, v, do, mask=mask)
    additive = torch.where(mask, 0.0, -math.inf)
    torch.testing.assert_close(A.attention(q, k, v, mask=additive), out, rtol=0, atol=0)


def test_bf16_vs_torch():
    for b, h, hk, sq, sk, d, causal in [(1, 2, 2, 65, 65, 64, True), (2, 4, 2, 33, 70, 32, False),
                                        (1, 2, 1, 40, 40, 64, True), (2, 2, 2, 7, 5, 32, False)]:
        _check(*_inputs(b, h, hk, sq, sk, d, torch.bfloat16), causal=causal)


def _bf16_cases_without_a_dot():
    """test_bf16_vs_torch, masks of both kinds and dropout in bf16 (its output and gradients
    against the f32 operator's with the same seed and bits); run by the test below with AVX2
    code, where bf16 takes the f32 layouts (attention_equations.vnni)."""
    assert not tpp.has_dot_instruction("bf16")
    test_bf16_vs_torch()
    g = torch.Generator().manual_seed(4)
    q, k, v, do = _inputs(2, 2, 1, 70, 90, 32, torch.bfloat16, seed=6)
    key = torch.rand(2, 1, 1, 90, generator=g) > 0.3
    full = torch.randn(70, 90, generator=g).bfloat16()
    for mask in (key, full):
        _check(q, k, v, do, mask=mask, causal=True)
    f32 = [x.float() for x in (q, k, v, do)]
    for causal, mask in ((False, None), (True, key)):
        got, lse = A.attention_forward(q, k, v, mask=mask, causal=causal, dropout_p=0.3, seed=9)
        want, lse32 = A.attention_forward(*f32[:3], mask=mask, causal=causal, dropout_p=0.3,
                                          seed=9)
        _close(got, want, torch.bfloat16)
        grads = A.attention_backward(do, q, k, v, got, lse, mask=mask, causal=causal,
                                     dropout_p=0.3, seed=9)
        wants = A.attention_backward(f32[3], *f32[:3], want, lse32, mask=mask, causal=causal,
                                     dropout_p=0.3, seed=9)
        for x, y in zip(grads, wants):
            _close(x, y, torch.bfloat16, scale=max(1.0, y.abs().max().item()))


def test_bf16_without_a_dot_instruction_in_a_subprocess(run_as_avx2):
    """bf16 attention where no bf16 dot instruction exists (AVX2 code, a fresh process),
    whatever this host runs by default."""
    out = run_as_avx2("test_ops_attention", "_bf16_cases_without_a_dot(); print('ok')", 900)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert out.stdout.strip() == "ok"


def _keep_bits(b, h, hk, sq, sk, p, seed):
    """The operator's dropout keep mask (B, H, Sq, Sk) for these sizes and seed: with q = 0
    every probability is 1 / Sk, and v = the identity makes out[i, j] = keep[i, j] * 1 /
    (Sk * (1 - p)). The bits depend on the sizes, heads and seed, not on D or the data."""
    q = torch.zeros(b, h, sq, sk)
    eye = torch.eye(sk).expand(b, hk, sk, sk).contiguous()
    out = A.attention(q, torch.zeros(b, hk, sk, sk), eye, dropout_p=p, seed=seed)
    return out * (sk * (1 - p)) > 0.5


@pytest.mark.parametrize("sq,sk", [(65, 64), (30, 45)])
def test_dropout_reproducible_and_backward_consistent(sq, sk):
    b, h, hk, d, p = 1, 4, 2, 32, 0.25
    q, k, v, do = _inputs(b, h, hk, sq, sk, d)
    o1, lse = A.attention_forward(q, k, v, dropout_p=p, seed=11)
    o2 = A.attention(q, k, v, dropout_p=p, seed=11)
    o3 = A.attention(q, k, v, dropout_p=p, seed=12)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    assert not torch.allclose(o1, o3)
    keep = _keep_bits(b, h, hk, sq, sk, p, 11)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.03
    # torch with that keep mask: softmax (undropped normaliser), dropout, @ v
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    kr, vr = kk.repeat_interleave(2, 1), vv.repeat_interleave(2, 1)
    prob = torch.softmax(qq @ kr.transpose(-1, -2) / math.sqrt(d), -1)
    ref = (prob * keep / (1 - p)) @ vr
    ref.backward(do)
    _close(o1, ref.detach())
    _close(lse, torch.logsumexp(q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(d),
                                -1))
    grads = A.attention_backward(do, q, k, v, o1, lse, dropout_p=p, seed=11)
    for got, want in zip(grads, (qq.grad, kk.grad, vv.grad)):
        _close(got, want, scale=max(1.0, float(want.abs().max())))


def test_new_sizes_compile_nothing():
    """A new batch size or sequence length compiles nothing: for the forward once one has run
    (its first call builds the nests of every block class, block_for's), for the backward
    once one of the same block class has."""
    def both(b, sq, sk):
        q, k, v, do = _inputs(b, 2, 2, sq, sk, 64)
        out, lse = A.attention_forward(q, k, v, causal=True)
        A.attention_backward(do, q, k, v, out, lse, causal=True)
    q, k, v, _ = _inputs(1, 2, 2, 65, 65, 64)
    A.attention_forward(q, k, v, causal=True)
    before = tpp.cache_info()["compiled"]
    for sq in (1, 17, 40, 300):
        A.attention_forward(*_inputs(2, 2, 2, sq, sq, 64)[:3], causal=True)
    assert tpp.cache_info()["compiled"] == before
    for n in (64, 16, 32, 48):       # one length of each block class (block_for)
        both(1, n, n)
    before = tpp.cache_info()["compiled"]
    for b, sq, sk in [(3, 1, 1), (2, 64, 300), (1, 200, 129), (4, 7, 7), (2, 17, 30),
                      (1, 40, 33), (2, 1, 49), (1, 16, 16), (1, 48, 48)]:
        both(b, sq, sk)
    assert tpp.cache_info()["compiled"] == before


def test_blocks_follow_the_padded_work():
    """block_for: a short sequence's one block rounded up to 16, whole multiples of 64 keep
    64, ragged lengths and a single query over many keys take the block with the least
    padded work (BLOCK_COST-weighted)."""
    from ops.attention_equations import block_for
    assert [block_for(n, n) for n in (1, 16, 17, 32, 33, 48, 49, 64, 65, 70, 128, 150, 200,
                                      256, 500, 4096)] == \
        [16, 16, 32, 32, 48, 48, 64, 64, 16, 16, 64, 32, 32, 64, 64, 64]
    assert block_for(1, 40) == block_for(40, 1) == block_for(1, 4096) == 16
    assert block_for(200, 129) == 32 and block_for(64, 300) == 64


def test_threads_give_the_same_result():
    q, k, v, do = _inputs(4, 2, 2, 130, 130, 32)
    outs = []
    for n in (1, 2):
        tpp.set_num_threads(n)
        out, lse = A.attention_forward(q, k, v, causal=True)
        outs.append((out, A.attention_backward(do, q, k, v, out, lse, causal=True)))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    for x, y in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_memory_is_linear_in_the_sequence():
    """Forward + backward at B1 H2 S4096 D64 allocates nothing of S x S size (64 MiB per head
    in f32): the peak of numpy's traced allocations stays under 64 MB."""
    import tracemalloc
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 4096, 64), dtype=np.float32) for _ in range(4))
    small = [x[:, :, :100] for x in (q, k, v, do)]
    out, lse = A.attention_forward(*small[:3])        # compile outside the measurement
    A.attention_backward(small[3], *small[:3], out, lse)
    tracemalloc.start()
    try:
        out, lse = A.attention_forward(q, k, v)
        grads = A.attention_backward(do, q, k, v, out, lse)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(np.isfinite(g).all() for g in grads)
    assert peak < 64e6, peak


_LONG_RUN = """
import sys, time
import numpy as np
from ops import flash_attention as A

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, 12, 8192, 64), dtype=np.float32) for _ in range(4))
small = [np.ascontiguousarray(x[:, :2, :100]) for x in (q, k, v, do)]
out, lse = A.attention_forward(*small[:3])     # compiles the nests S8192's calls use (2 heads)
A.attention_backward(small[3], *small[:3], out, lse)
del out, lse
with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
    f.write("5")
base = status("VmRSS:")
t0 = time.perf_counter()
out, lse = A.attention_forward(q, k, v)
grads = A.attention_backward(do, q, k, v, out, lse)
seconds = time.perf_counter() - t0
peak = status("VmHWM:")
assert all(np.isfinite(g).all() for g in grads) and np.isfinite(out).all()
outputs = sum(x.nbytes for x in (out, lse, *grads))
print(peak - base - outputs, seconds)
"""


def test_long_sequence_peak_rss_is_bounded():
    """B1 H12 S8192 D64 f32 forward + backward (5 to 15 s on 2 busy cores) in a fresh process: its
    peak resident memory grows by less than 64 MB beyond the outputs (out, lse, dq, dk, dv)
    over the RSS with the inputs in place (the S x S scores would be 3 GB; the operator's
    scratch is O(heads per call x S x D), SCRATCH_PER_CALL per call and worker)."""
    import os
    import subprocess
    import sys
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _LONG_RUN], capture_output=True, text=True,
                         cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr
    growth, seconds = (float(x) for x in res.stdout.split()[-2:])
    assert growth < 64e6, (growth, seconds)


def test_bad_arguments():
    q, k, v, do = _inputs(1, 4, 2, 8, 9, 16)
    bad = [
        dict(q=q[0]),                                      # 3-D
        dict(k=k[..., :8], v=v[..., :8]),                  # head dim mismatch
        dict(v=v[:, :, :5]),                               # v's shape differs from k's
        dict(k=torch.randn(1, 3, 9, 16), v=torch.randn(1, 3, 9, 16)),   # 4 % 3 heads
        dict(k=torch.randn(2, 2, 9, 16), v=torch.randn(2, 2, 9, 16)),   # batch mismatch
        dict(q=q.double(), k=k.double(), v=v.double()),    # f64
        dict(k=k.bfloat16(), v=v.bfloat16()),              # mixed dtypes
        dict(mask=torch.ones(8, 10, dtype=torch.bool)),    # mask does not broadcast
        dict(mask=torch.ones(2, 4, 8, 9, dtype=torch.bool)),
        dict(mask=torch.ones(8, 9, dtype=torch.float64)),  # mask dtype
        dict(scale=float("nan")), dict(scale="x"), dict(dropout_p=1.0),
        dict(dropout_p=0.1, seed=1.5), dict(causal=1), dict(bogus=1),
    ]
    for change in bad:
        args = dict(q=q, k=k, v=v)
        args.update(change)
        with pytest.raises(ArgumentError):
            A.attention(**args)
    out, lse = A.attention_forward(q, k, v)
    for change in [dict(dout=do[:, :, :4]), dict(out=out.bfloat16()), dict(lse=lse[..., :4]),
                   dict(need=(True,)), dict(dropout_p=0.1)]:    # dropout without its seed
        args = dict(dout=do, q=q, k=k, v=v, out=out, lse=lse)
        args.update(change)
        with pytest.raises(ArgumentError):
            A.attention_backward(**args)


@pytest.mark.parametrize("mask_kind", ["key", "full"])
def test_dropout_with_masks_and_causal(mask_kind):
    """Dropout's bits do not depend on the mask path (per-chunk or per-query-block nests)."""
    b, h, sq, sk, d, p = 2, 2, 70, 64, 32, 0.2
    q, k, v, do = _inputs(b, h, h, sq, sk, d, seed=5)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(b, 1, 1, sk, generator=g) > 0.3 if mask_kind == "key" else \
        torch.rand(sq, sk, generator=g) > 0.3
    mask[..., 0] = True
    out, lse = A.attention_forward(q, k, v, mask=mask, causal=True, dropout_p=p, seed=3)
    keep = _keep_bits(b, h, h, sq, sk, p, 3)
    visible = mask & torch.ones(sq, sk, dtype=torch.bool).tril()
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    s = (qq @ kk.transpose(-1, -2) / math.sqrt(d)).masked_fill(~visible, -math.inf)
    ref = (torch.softmax(s, -1) * keep / (1 - p)) @ vv
    ref.backward(do)
    _close(out, ref.detach())
    grads = A.attention_backward(do, q, k, v, out, lse, mask=mask, causal=True, dropout_p=p,
                                 seed=3)
    for got, want in zip(grads, (qq.grad, kk.grad, vv.grad)):
        _close(got, want, scale=max(1.0, float(want.abs().max())))


# ---------------------------------------------------------------- the plain forward's templates
def test_plain_forward_template_checks_every_call_and_keeps_no_data():
    """A plain forward (no mask, no dropout) reuses a validated template per (type, shapes,
    dtypes, causal, scale): repeated calls give the uncached results, bad inputs of other
    shapes or dtypes still raise ArgumentError after the template exists, the template keeps
    none of the caller's arrays, and tpp.clear_caches() drops it."""
    import gc
    import weakref
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 70, 32), dtype=np.float32) for _ in range(3))
    A._PLANS.clear()
    first = ops.attention(q, k, v)
    assert len(A._PLANS) == 1
    again = ops.attention(q, k, v)                  # from the template
    masked = ops.attention(q, k, v, mask=np.zeros((70, 70), np.float32))   # its own template
    np.testing.assert_array_equal(again, first)
    np.testing.assert_allclose(masked, first, rtol=1e-6, atol=1e-6)
    with pytest.raises(ArgumentError, match="head dim"):
        ops.attention(q, k[..., :16].copy(), v[..., :16].copy())
    with pytest.raises(ArgumentError, match="f32 or bf16"):
        ops.attention(q, k.astype(np.float64), v)
    with pytest.raises(ArgumentError, match="causal"):
        ops.attention(q, k, v, causal="yes")
    tq = torch.from_numpy(q).requires_grad_()
    tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    import ops.torch as ops_torch
    got = ops_torch.scaled_dot_product_attention(tq, tk, tv)     # requires grad: no template
    torch.testing.assert_close(got.detach(), torch.from_numpy(first))
    x = rng.standard_normal((1, 2, 70, 32), dtype=np.float32)
    ref = weakref.ref(x)
    ops.attention(x, k, v)
    del x
    gc.collect()
    assert ref() is None
    tpp.clear_caches()
    assert not A._PLANS


def test_masked_calls_take_a_template_and_read_the_mask_every_call():
    """A masked call (no dropout) reuses a template per mask shape and dtype too, but reads
    the mask's values every call: a mask changed in place between two calls changes the
    answer as torch's does; other shapes and dtypes are validated (bad ones still raise),
    and the template keeps no mask alive."""
    import gc
    import weakref
    F = torch.nn.functional
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 9, 16), dtype=np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    A._PLANS.clear()
    keys = np.ones((2, 1, 1, 9), bool)
    for step in range(3):       # the same array, changed in place between calls
        keys[0, 0, 0, 8 - step] = False
        got = ops.attention(q, k, v, mask=keys)
        want = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(keys))
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    assert len(A._PLANS) == 1
    full = rng.standard_normal((9, 9), dtype=np.float32)
    for step in range(2):
        full[step] = -np.inf if step else 0.5      # a row all -inf: torch gives NaN there too
        got = ops.attention(q, k, v, mask=full)
        want = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(full))
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    assert len(A._PLANS) == 2
    tmask = torch.zeros(2, 1, 1, 9)
    for step in range(2):       # torch masks: in place through a numpy view as well
        tmask.numpy()[1, 0, 0, step] = -1e4
        got = ops.attention(tq, tk, tv, mask=tmask)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(tq, tk, tv, tmask))
    with pytest.raises(ArgumentError, match="broadcast"):
        ops.attention(q, k, v, mask=np.zeros((2, 1, 1, 8), bool))
    with pytest.raises(ArgumentError, match="mask"):
        ops.attention(q, k, v, mask=np.zeros((2, 1, 1, 9), np.float64))
    held = np.zeros((2, 1, 1, 9), np.float32)
    ref = weakref.ref(held)
    ops.attention(q, k, v, mask=held)
    del held
    gc.collect()
    assert ref() is None


def test_plain_backward_takes_the_forward_template_and_still_checks():
    """A backward without mask or dropout reuses the plain forward's validated template
    (_plain_problem); its results equal the checked problem's and bad arguments still fail."""
    q, k, v, do = _inputs(1, 2, 2, 20, 20, 32)
    out, lse = A.attention_forward(q, k, v)
    first = A.attention_backward(do, q, k, v, out, lse)
    assert A._plain_problem(q, k, v, False, None) is not None
    again = A.attention_backward(do, q, k, v, out, lse)
    checked = A.attention_backward(do, q, k, v, out, lse, mask=torch.ones(20, 20, dtype=bool))
    for a, b, c in zip(first, again, checked):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c)
    for bad in (dict(k=k[..., :16].contiguous()), dict(dout=do[..., :16].contiguous()),
                dict(lse=lse[..., :5].contiguous()), dict(v=v.double())):
        args = dict(dout=do, q=q, k=k, v=v, out=out, lse=lse)
        args.update(bad)
        with pytest.raises(ArgumentError):
            A.attention_backward(**args)


@pytest.mark.parametrize("s, d, magnitude", [(70, 32, 1e9), (64, 8, 1e12), (130, 16, 1e10)])
def test_huge_scores_stay_finite(s, d, magnitude):
    """s * scale - max as one fma left up to half an ulp of a ~1e9 maximum above 0, past exp's
    non-positive domain: NaN and inf rows where torch is finite. The backward's recomputed
    scores are clamped at the saved maximum the same way."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, s, d, generator=g) * magnitude
    k, v, dy = (torch.randn(1, 2, s, d, generator=g) for _ in range(3))
    out, lse = ops.attention_forward(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5,
                               rtol=1e-5)
    grads = ops.attention_backward(dy, q, k, v, out, lse)
    assert all(torch.isfinite(t).all() for t in grads)
