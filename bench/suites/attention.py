"""attention: GFLOP/s of the fused attention operator (ops.attention) vs torch's SDPA, 2 threads.

Cases, shape [B, H, S, D] (q, k, v all (B, H, S, D), self-attention lengths, no mask), on a
team of 2 threads (or --threads N, N > 1); case names end in the dtype ("fwd f32"):
  fwd             tpp: ops.attention(q, k, v) (inference: no log-sum-exp kept)
                  torch: F.scaled_dot_product_attention(q, k, v) under torch.no_grad()
  fwd+bwd         tpp: out, lse = attention_forward(q, k, v); attention_backward(dout, q, k,
                  v, out, lse) (dq, dk, dv); torch: the SDPA forward on tensors requiring grad
                  and torch.autograd.grad of it for q, k, v with the same dout
  causal fwd, causal fwd+bwd    the same with causal=True / is_causal=True
  fwd+bwd bf16    the fwd+bwd case on bf16 q, k, v, dout (bf16 outputs and gradients)
Sizes: B8 H12 S128 D64, B4 H12 S512 D64 and B1 H12 S2048 D64, causal on the S2048 shape;
--quick: B2 H4 S128 D64 and B1 H4 S512 D64, causal on S512; --tiny:
B1 H2 S32 D16. torch picks its own CPU kernel (flash or math).

GFLOP/s counts 4*B*H*S*S*D per forward (the two matrix products) and 2.5 times that for the
backward (five products, one of them recomputing the scores): 3.5x the forward per fwd+bwd
step; causal cases count half of those (the work above the diagonal is skipped, not done).
causal records carry extra["vs_noncausal"]: the same provider's non-causal time on the same
shape over the causal one's (ideal: 2); the bf16 records extra["vs_f32"]: their GFLOP/s over the
same provider's f32 fwd+bwd on the same shape. `peak_fraction` divides by the peak suite's
one-core compute peak of the dtype times the threads. Providers are measured in turn (not
interleaved: thread pools interfere), on the wall clock; a torch bf16 reference whose first
call is slow (no native bf16 kernel) is measured within a time budget (_common.capped_group).
tpp runs on numpy arrays (bf16: ml_dtypes arrays); its results are checked once per case
against torch autograd in f32 on the same values (tolerance: 1e-3 of the largest |value| for
f32, 3e-2 for bf16).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from . import register
from ..timing import looped
from ._common import big_settings, capped_group, compute_record, filled, quick_sizes, team

SUITE = "attention"
THREADS = 2
SHAPES = {"full": ((8, 12, 128, 64), (4, 12, 512, 64), (1, 12, 2048, 64)),
          "quick": ((2, 4, 128, 64), (1, 4, 512, 64)),
          "tiny": ((1, 2, 32, 16),)}
TOLERANCE = {"f32": 1e-3, "bf16": 3e-2}
BACKWARD_FACTOR = 2.5       # backward flops over forward flops


@dataclass(frozen=True)
class Case:
    dtype: str
    b: int
    h: int
    s: int
    d: int
    backward: bool
    causal: bool = False

    @property
    def name(self) -> str:
        kind = "fwd+bwd" if self.backward else "fwd"
        return f"{'causal ' if self.causal else ''}{kind} {self.dtype}"

    @property
    def shape(self) -> tuple:
        return (self.b, self.h, self.s, self.d)

    @property
    def flops(self) -> int:
        fwd = 4 * self.b * self.h * self.s * self.s * self.d
        total = fwd * (1 + BACKWARD_FACTOR) if self.backward else fwd
        return int(total / 2 if self.causal else total)

    def twin(self, **change) -> "Case":
        fields = dict(dtype=self.dtype, b=self.b, h=self.h, s=self.s, d=self.d,
                      backward=self.backward, causal=self.causal)
        fields.update(change)
        return Case(**fields)


def mode(ctx) -> str:
    return "tiny" if ctx.config.tiny else ("quick" if quick_sizes(ctx) else "full")


def cases(ctx) -> list:
    """The cases of the run, in order: f32 fwd and fwd+bwd per shape, causal on the longest
    shape, bf16 fwd+bwd per shape (f32 first: the causal and bf16 ratios read them)."""
    shapes = SHAPES[mode(ctx)]
    out = [Case("f32", *shape, backward) for shape in shapes for backward in (False, True)]
    out += [Case("f32", *shapes[-1], backward, causal=True) for backward in (False, True)]
    out += [Case("bf16", *shape, True) for shape in shapes]
    return [c for c in out if ctx.wants_dtype(c.dtype)]


def threads(ctx) -> int:
    return ctx.config.threads if ctx.config.threads > 1 else THREADS


@register(SUITE, default=False, requires=("peak",),
          help="GFLOP/s of fused attention forward and forward+backward (ops.attention) vs "
               "torch's scaled_dot_product_attention, f32 (causal too) and bf16, 2 threads")
def run(ctx):
    rng = np.random.default_rng(6)
    data, references, times = {}, {}, {}
    n = threads(ctx)
    for case in cases(ctx):
        key = (case.dtype, case.shape)
        if key not in data:
            data[key] = _data(case, rng)
        _run_case(ctx, case, n, data[key], references, times)


def _data(case: Case, rng) -> dict:
    """q, k, v, dout in the case's dtype ("tpp": numpy arrays) and their exact f32 values."""
    shape = case.shape
    f32 = {key: rng.standard_normal(shape, dtype=np.float32) for key in ("q", "k", "v", "dout")}
    if case.dtype == "bf16":
        import tpp
        ours = {key: filled(v.astype(tpp.BF16.numpy)) for key, v in f32.items()}
        f32 = {key: filled(v.astype(np.float32)) for key, v in ours.items()}
    else:
        ours = f32 = {key: filled(v) for key, v in f32.items()}
    return {"tpp": ours, "f32": f32}


def _run_case(ctx, case: Case, n: int, data: dict, references: dict, times: dict):
    label = f"attention {case.name} {'x'.join(map(str, case.shape))}"
    runs, predicted, ours = {}, {}, None
    with team(ctx, n):
        if ctx.wants("tpp"):
            try:
                ours = _tpp(case, data["tpp"])
                runs["tpp"] = looped(ours)
            except Exception as exc:  # noqa: BLE001
                ctx.failed(f"{label} tpp", exc)
        torch = ctx.torch
        if torch is not None:
            step = _torch(torch, case, data["f32"])
            runs["torch"] = looped(step)
            if case.dtype == "bf16":    # can be slow (no native bf16): its first call predicts
                t0 = time.perf_counter()
                step()
                predicted["torch"] = time.perf_counter() - t0
        results = capped_group(ctx, label, runs, big_settings(ctx), predicted)
        verified = (_verify(ctx, label, case, ours(), data["f32"], references)
                    if "tpp" in results and ctx.config.verify else None)
    for provider, stats in results.items():
        times[(provider, case)] = stats.median
        extra = {"threads": n, "clock": "wall"}
        if provider == "tpp" and verified is not None:
            extra["verified"] = verified
        noncausal, f32 = (provider, case.twin(causal=False)), (provider, case.twin(dtype="f32"))
        if case.causal and noncausal in times:
            extra["vs_noncausal"] = times[noncausal] / stats.median
        if case.dtype == "bf16" and f32 in times:      # the same flops: a ratio of rates
            extra["vs_f32"] = times[f32] / stats.median
        compute_record(ctx, suite=SUITE, case=case.name, provider=provider, shape=case.shape,
                       stats=stats, flops=case.flops, dtype=case.dtype, cores=n, **extra)


def _tpp(case: Case, d: dict):
    """step() -> the outputs ({"out": ..} and, with the backward, dq, dk, dv) of one call."""
    from ops.flash_attention import attention, attention_backward, attention_forward
    q, k, v, dout, causal = d["q"], d["k"], d["v"], d["dout"], case.causal
    if not case.backward:
        return lambda: {"out": attention(q, k, v, causal=causal)}

    def step():
        out, lse = attention_forward(q, k, v, causal=causal)
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=causal)
        return {"out": out, "dq": dq, "dk": dk, "dv": dv}
    return step


def _torch(torch, case: Case, d: dict):
    """step() of torch's SDPA in the case's dtype."""
    tdt = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    q, k, v, dout = (torch.from_numpy(d[key]).to(tdt) for key in ("q", "k", "v", "dout"))
    sdpa, causal = torch.nn.functional.scaled_dot_product_attention, case.causal
    if not case.backward:
        def infer():
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=causal)
        return infer
    params = tuple(t.requires_grad_() for t in (q, k, v))
    grad = torch.autograd.grad
    return lambda: grad(sdpa(*params, is_causal=causal), params, dout)


def _expected(case: Case, d: dict) -> dict:
    """out, dq, dk, dv by torch autograd in f32 on the f32 values (torch's own math, not its
    SDPA kernels)."""
    import torch
    q, k, v = (torch.from_numpy(d[key]).clone().requires_grad_() for key in ("q", "k", "v"))
    scores = q @ k.transpose(-1, -2) / math.sqrt(case.d)
    if case.causal:
        scores = scores.masked_fill(~torch.ones(case.s, case.s, dtype=torch.bool).tril(),
                                    -math.inf)
    out = torch.softmax(scores, -1) @ v
    grads = torch.autograd.grad(out, (q, k, v), torch.from_numpy(d["dout"]))
    return {key: t.detach().numpy() for key, t in zip(("out", "dq", "dk", "dv"),
                                                      (out, *grads))}


def _verify(ctx, label, case: Case, got: dict, d: dict, references: dict) -> bool | None:
    """tpp's outputs against the f32 torch reference of the same values (computed once per
    dtype, shape and causality)."""
    key = (case.dtype, case.shape, case.causal)
    try:
        if key not in references:
            references[key] = _expected(case, d)
        reference = references[key]
    except Exception as exc:  # noqa: BLE001 - e.g. no torch: nothing to check against
        ctx.failed(f"{label} tpp verification", exc)
        return None
    worst = 0.0
    for name, value in got.items():
        want = reference[name]
        scale = float(np.max(np.abs(want))) or 1.0
        err = float(np.max(np.abs(np.asarray(value).astype(np.float64) - want))) / scale
        worst = max(worst, err)
    if worst > TOLERANCE[case.dtype]:
        ctx.note(f"{label} tpp: WRONG RESULTS (max error {worst:.3g} of the largest |value|, "
                 f"vs torch autograd in f32); its GFLOP/s is not meaningful")
        return False
    return True
