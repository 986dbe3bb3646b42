"""mlp: GFLOP/s of one MLP layer, y = gelu(x @ W.T + b), training step and inference, vs torch.

Cases, shape [tokens M, K, N] (x (M, K), W (N, K)), f32 and bf16 (bf16 data, f32
accumulation, bf16 results), on every core (or --threads N, N > 1): 4096 x 1024 -> 4096;
--quick (and the default set): 512 x 256 -> 512.
  fwd+bwd  tpp: y, saved = ops.mlp_forward(x, W, b, "gelu"); ops.mlp_backward(dy, saved)
           (W is packed inside the step: a training step's weight changes every step);
           torch eager: F.gelu(F.linear(x, W, b)) and torch.autograd.grad of it for x, W, b
           (all three requiring grad) with the same dy. GFLOP/s counts the three GEMMs,
           6*M*N*K, per step.
  fwd      inference: ops.mlp(x, W, b, "gelu", packed=W packed once) vs
           F.gelu(F.linear(x, W, b)) on tensors without grad; 2*M*N*K per call.
`peak_fraction` divides by the peak suite's one-core compute peak times the threads. numpy has
no gelu (no erf): no numpy column. torch bf16 on a CPU without native bf16 runs at ~1 GFLOP/s:
such a reference is measured alone within a time budget, or skipped with a note where one call
would not fit it (_common.capped_group). Wall clock. tpp's results are checked against torch
autograd in f32 on the same values (tolerance: 1e-4 of the largest |value| for f32, 2e-2 for
bf16, whose dz and outputs are rounded to bf16).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import register
from ..timing import looped
from ._common import (all_threads, big_settings, capped_group, compute_record, filled,
                      quick_sizes, team, torch_gflops)

SUITE = "mlp"
SIZES = {"full": (4096, 1024, 4096), "quick": (512, 256, 512), "tiny": (64, 32, 48)}
TOLERANCE = {"f32": 1e-4, "bf16": 2e-2}


@dataclass(frozen=True)
class Case:
    dtype: str
    m: int
    k: int
    n: int
    backward: bool
    threads: int

    @property
    def name(self) -> str:
        return f"{'fwd+bwd' if self.backward else 'fwd'} {self.dtype} t{self.threads}"

    @property
    def shape(self) -> tuple:
        return (self.m, self.k, self.n)

    @property
    def flops(self) -> int:
        return (6 if self.backward else 2) * self.m * self.n * self.k


@register(SUITE, default=True, requires=("peak",),
          help="GFLOP/s of one gelu MLP layer, forward+backward and forward (ops.mlp_*) vs "
               "torch eager, f32 and bf16, all cores")
def run(ctx):
    mode = "tiny" if ctx.config.tiny else ("quick" if quick_sizes(ctx) else "full")
    m, k, n = SIZES[mode]
    threads = all_threads(ctx)
    rng = np.random.default_rng(4)
    for dtype in ("f32", "bf16"):
        if not ctx.wants_dtype(dtype):
            continue
        data, reference = _data(dtype, m, k, n, rng), {}
        for backward in (True, False):
            _run_case(ctx, Case(dtype, m, k, n, backward, threads), data, reference)


def _data(dtype: str, m: int, k: int, n: int, rng) -> dict:
    """x, w, b, dy in the case's dtype ("tpp") and their exact f32 values ("f32")."""
    f32 = {"x": rng.standard_normal((m, k), dtype=np.float32),
           "w": rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)),
           "b": rng.standard_normal(n, dtype=np.float32),
           "dy": rng.standard_normal((m, n), dtype=np.float32)}
    if dtype == "bf16":
        import tpp
        ours = {key: filled(v.astype(tpp.BF16.numpy)) for key, v in f32.items()}
        f32 = {key: filled(v.astype(np.float32)) for key, v in ours.items()}
    else:
        ours = f32 = {key: filled(v) for key, v in f32.items()}
    return {"tpp": ours, "f32": f32}


def _run_case(ctx, case: Case, data: dict, reference: dict):
    label = f"mlp {case.name} {'x'.join(map(str, case.shape))}"
    runs, predicted, ours = {}, {}, None
    with team(ctx, case.threads):
        if ctx.wants("tpp"):
            try:
                ours = _tpp(case, data["tpp"])
                runs["tpp"] = looped(ours)
            except Exception as exc:  # noqa: BLE001
                ctx.failed(f"{label} tpp", exc)
        torch = ctx.torch
        if torch is not None:
            runs["torch"] = looped(_torch(torch, case, data["f32"]))
            if case.dtype == "bf16":    # slow where the CPU has no bf16 dot (f32: BLAS)
                predicted["torch"] = case.flops / 1e9 / torch_gflops(torch, case.threads)
        results = capped_group(ctx, label, runs, big_settings(ctx), predicted)
        verified = (_verify(ctx, label, case, ours(), data["f32"], reference)
                    if "tpp" in results and ctx.config.verify else None)
    for provider, stats in results.items():
        extra = {"threads": case.threads, "clock": "wall"}
        if provider == "tpp":
            extra["weights"] = ("packed inside each step" if case.backward
                                else "packed once (ops.pack_nk), outside the timed loop")
            if verified is not None:
                extra["verified"] = verified
        compute_record(ctx, suite=SUITE, case=case.name, provider=provider, shape=case.shape,
                       stats=stats, flops=case.flops, dtype=case.dtype, cores=case.threads,
                       **extra)


def _tpp(case: Case, d: dict):
    """step() -> the outputs ({"y": ..} and, with the backward, dx, dw, db) of one call."""
    import ops
    x, w, b, dy = d["x"], d["w"], d["b"], d["dy"]
    if not case.backward:
        infer = functools.partial(ops.mlp, x, w, b, "gelu", packed=ops.pack_nk(w))
        return lambda: {"y": infer()}
    forward, backward = ops.mlp_forward, ops.mlp_backward

    def step():
        y, saved = forward(x, w, b, "gelu")
        dx, dw, db = backward(dy, saved)
        return {"y": y, "dx": dx, "dw": dw, "db": db}
    return step


def _torch(torch, case: Case, d: dict):
    """step() of torch eager in the case's dtype."""
    tdt = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    x, w, b, dy = (torch.from_numpy(d[key]).to(tdt) for key in ("x", "w", "b", "dy"))
    linear, gelu = torch.nn.functional.linear, torch.nn.functional.gelu
    if not case.backward:
        return lambda: gelu(linear(x, w, b))
    params = tuple(t.requires_grad_() for t in (x, w, b))
    grad = torch.autograd.grad
    return lambda: grad(gelu(linear(*params)), params, dy)


def _expected(d: dict) -> dict:
    """y, dx, dw, db by torch autograd in f32 on the f32 values."""
    import torch
    x, w, b = (torch.from_numpy(d[key]).requires_grad_() for key in ("x", "w", "b"))
    y = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
    grads = torch.autograd.grad(y, (x, w, b), torch.from_numpy(d["dy"]))
    return {key: t.detach().numpy() for key, t in zip(("y", "dx", "dw", "db"), (y, *grads))}


def _verify(ctx, label, case: Case, got: dict, d: dict, reference: dict) -> bool | None:
    """tpp's outputs against torch autograd in f32 (computed once per dtype)."""
    try:
        if not reference:
            reference.update(_expected(d))
    except Exception as exc:  # noqa: BLE001 - e.g. no torch: nothing to check against
        ctx.failed(f"{label} tpp verification", exc)
        return None
    worst = 0.0
    for key, value in got.items():
        want = reference[key].astype(np.float64)
        scale = float(np.max(np.abs(want))) or 1.0
        err = float(np.max(np.abs(np.asarray(value).astype(np.float64) - want))) / scale
        worst = max(worst, err)
    if worst > TOLERANCE[case.dtype]:
        ctx.note(f"{label} tpp: WRONG RESULTS (max error {worst:.3g} of the largest |value|, "
                 f"vs torch autograd in f32); its GFLOP/s is not meaningful")
        return False
    return True
