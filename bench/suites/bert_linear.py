"""bert_linear: GFLOP/s of a BERT-sized stack of Linear layers, inference, ops.torch.Linear vs
torch.nn.Linear with the same weights, on a thread team.

The shapes of all-MiniLM-L6-v2 (a sentence-transformers BERT): hidden 384, intermediate 1536,
6 layers, a batch of 32 sentences x 128 tokens (M = 4096 rows). Each layer runs the products
of a BERT layer in order, attention itself, residuals and norms left out (they are no Linear):

    q, k, v = Q(h), K(h), V(h)          384 -> 384 each, from the layer's input
    a = O(v)                            384 -> 384 (the attention output's projection, on v)
    i = GELU(I(a))                      384 -> 1536
    h = Out(i)                          1536 -> 384, the next layer's input

The stack is built once as torch.nn.Linear modules (torch's default initialisation, seed 5);
the tpp provider is the same stack with every torch.nn.Linear swapped for an ops.torch.Linear
holding the same weight and bias (state_dict copied), the intermediate one with
activation="gelu" (its epilogue) where torch runs torch.nn.GELU after the Linear. Both run
under torch.inference_mode() on x (4096, 384) f32; GFLOP/s counts 2*M*K*N of every product,
6 layers of 4*384*384 + 2*384*1536 multiply-adds per row. The tpp output is checked against
torch's (relative 1e-4 of the largest |value|). Sizes: --quick and the default set run 2
sentences (M = 256); --tiny one layer of M = 16. Wall clock, every core (or --threads N).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import register
from ..timing import looped
from ._common import all_threads, big_settings, capped_group, compute_record, quick_sizes, team

SUITE = "bert_linear"
HIDDEN, INTERMEDIATE, LAYERS = 384, 1536, 6
TOKENS = 128
SENTENCES = {"full": 32, "quick": 2, "tiny": 1}
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Case:
    m: int          # rows: sentences x tokens
    layers: int
    threads: int

    @property
    def name(self) -> str:
        return f"f32 t{self.threads}"

    @property
    def shape(self) -> tuple:
        return (self.m, HIDDEN, INTERMEDIATE, self.layers)

    @property
    def flops(self) -> int:
        per_row = 4 * HIDDEN * HIDDEN + 2 * HIDDEN * INTERMEDIATE
        return 2 * self.m * per_row * self.layers


@register(SUITE, requires=("peak",),
          help="GFLOP/s of a BERT-sized (all-MiniLM-L6-v2) stack of Linear layers, inference: "
               "ops.torch.Linear vs torch.nn.Linear, all cores")
def run(ctx):
    torch = ctx.torch
    if torch is None:
        ctx.note("bert_linear: needs torch (the stack is torch modules); skipped")
        return
    if not ctx.wants_dtype("f32"):
        return
    mode = "tiny" if ctx.config.tiny else ("quick" if quick_sizes(ctx) else "full")
    tokens = 16 if mode == "tiny" else TOKENS
    case = Case(SENTENCES[mode] * tokens, 1 if mode == "tiny" else LAYERS, all_threads(ctx))
    label = f"bert_linear {case.name} {'x'.join(map(str, case.shape))}"
    torch.manual_seed(5)
    reference = _stack(torch, torch.nn.Linear, case.layers)
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((case.m, HIDDEN),
                                                                     dtype=np.float32))
    runs, ours = {}, None
    if ctx.wants("tpp"):
        try:
            ours = _swapped(torch, reference)
        except Exception as exc:  # noqa: BLE001
            ctx.failed(f"{label} tpp", exc)
    with team(ctx, case.threads), torch.inference_mode():
        if ours is not None:
            runs["tpp"] = looped(_forward, ours, x)
        runs["torch"] = looped(_forward, reference, x)
        results = capped_group(ctx, label, runs, big_settings(ctx), {})
        verified = (_verify(ctx, label, _forward(ours, x), _forward(reference, x))
                    if "tpp" in results and ctx.config.verify else None)
    for provider, stats in results.items():
        extra = {"threads": case.threads, "clock": "wall", "layers": case.layers,
                 "rows": case.m}
        if provider == "tpp":
            extra["modules"] = ("ops.torch.Linear (weights of the torch stack; intermediate "
                                "with activation='gelu')")
            if verified is not None:
                extra["verified"] = verified
        else:
            extra["modules"] = "torch.nn.Linear, torch.nn.GELU after the intermediate"
        compute_record(ctx, suite=SUITE, case=case.name, provider=provider, shape=case.shape,
                       stats=stats, flops=case.flops, dtype="f32", cores=case.threads,
                       **extra)


def _stack(torch, linear, layers: int):
    """[(q, k, v, o, intermediate, gelu, out)] per layer, torch modules."""
    nn = torch.nn
    return [(linear(HIDDEN, HIDDEN), linear(HIDDEN, HIDDEN), linear(HIDDEN, HIDDEN),
             linear(HIDDEN, HIDDEN), linear(HIDDEN, INTERMEDIATE), nn.GELU(),
             linear(INTERMEDIATE, HIDDEN)) for _ in range(layers)]


def _swapped(torch, reference):
    """The reference stack with each torch.nn.Linear replaced by an ops.torch.Linear holding
    its weight and bias; the GELU after the intermediate fused into that Linear's epilogue."""
    import ops.torch as ot

    def swap(module, activation=None):
        layer = ot.Linear(module.in_features, module.out_features, activation=activation)
        layer.load_state_dict(module.state_dict())
        return layer
    return [(swap(q), swap(k), swap(v), swap(o), swap(inter, "gelu"), None, swap(out))
            for q, k, v, o, inter, _, out in reference]


def _forward(stack, x):
    """The stack on x: every product of every layer (module docstring); returns h and q, k."""
    h = x
    outs = []
    for q, k, v, o, inter, gelu, out in stack:
        outs = [q(h), k(h)]
        i = inter(o(v(h)))
        if gelu is not None:
            i = gelu(i)
        h = out(i)
    return [h] + outs


def _verify(ctx, label, got, want) -> bool | None:
    """tpp's outputs (the last h, q, k) against torch's."""
    worst = 0.0
    for g, w in zip(got, want):
        w64 = w.double()
        scale = float(w64.abs().max()) or 1.0
        worst = max(worst, float((g.double() - w64).abs().max()) / scale)
    if worst > TOLERANCE:
        ctx.note(f"{label} tpp: WRONG RESULTS (max error {worst:.3g} of the largest |value|, "
                 f"vs torch); its GFLOP/s is not meaningful")
        return False
    return True
