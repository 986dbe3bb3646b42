"""tune: autotune ops.matmul's blocking for transformer shapes, then time the winner against the
heuristic's blocking (and torch) in the same run. Opt-in (not a default suite): it writes the
winners to the disk cache (ops.tune), where ops.matmul / ops.linear then find them.

Cases [M, N, K] (f32, all cores): BERT-base's linear layers at 512 tokens (768x768, the
3072-wide FFN up and down) and 1024^3; --quick: 256x768x768; tiny (tests): 64x64x64. Each case
first searches within a time budget (TPP_TUNE_BUDGET seconds, default 20; quick 8; tiny 1),
then measures three providers interleaved: "tpp" (the stored winner, or the heuristic when
nothing beat it by the tuner's margin), "heuristic" (ops.matmul with choose_blocking's blocking,
explicitly) and torch.matmul. extra["winner"] is the winning candidate, extra["searched"] how
many candidates the budget measured.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from . import register
from ..timing import looped
from ._common import all_threads, compute_record, quick_sizes, team, timed_group

SUITE = "tune"
SHAPES = [(512, 768, 768), (512, 3072, 768), (512, 768, 3072), (1024, 1024, 1024)]


def _cases(ctx):
    if ctx.config.tiny:
        return [(64, 64, 64)], 1.0
    if quick_sizes(ctx):
        return [(256, 768, 768)], 8.0
    return SHAPES, 20.0


@register(SUITE, requires=("peak",),
          help="autotune ops.matmul's blocking (stored on disk) and time it vs the heuristic")
def run(ctx):
    import ops
    from ops import autotune as tune
    shapes, budget = _cases(ctx)
    budget = float(os.environ.get("TPP_TUNE_BUDGET", budget))
    threads = all_threads(ctx)
    rng = np.random.default_rng(5)
    for m, n, k in shapes:
        label = f"tune f32 {m}x{n}x{k}"
        ctx.step(f"{label}: searching for {budget:g} s")
        with team(ctx, threads):
            try:
                result = tune.tune("matmul", m, n, k, budget_s=budget)
            except Exception as exc:  # noqa: BLE001 - a broken case must not stop the run
                ctx.failed(label, exc)
                continue
            a = rng.standard_normal((m, k), dtype=np.float32)
            b = rng.standard_normal((k, n), dtype=np.float32)
            out = np.empty((m, n), np.float32)
            base = result.heuristic
            runs = {
                "tpp": looped(functools.partial(ops.matmul, out=out), a,
                              ops.pack_kn(b, bn=result.best.bn)),
                "heuristic": looped(functools.partial(ops.matmul, out=out,
                                                      blocking=base.blocking()),
                                    a, ops.pack_kn(b, bn=base.bn)),
            }
            torch = ctx.torch
            if torch is not None:
                tc = torch.empty((m, n))
                runs["torch"] = looped(functools.partial(torch.matmul, out=tc),
                                       torch.from_numpy(a), torch.from_numpy(b))
            results = timed_group(ctx, label, runs)
        for provider, stats in results.items():
            extra = {"threads": threads, "clock": "wall"}
            if provider == "tpp":
                extra.update(winner=vars(result.best), searched=len(result.seconds),
                             stored=result.stored, budget_s=budget)
            compute_record(ctx, suite=SUITE, case="f32", provider=provider, shape=(m, n, k),
                           stats=stats, flops=2 * m * n * k, cores=threads, **extra)
