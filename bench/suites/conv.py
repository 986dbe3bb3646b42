"""conv: GFLOP/s of 2-D convolutions (ops.torch_conv on ops.conv's BRGEMM nests) vs torch's
conv2d (oneDNN), on the ResNet-50 layer set, forward and training, f32 and bf16.

Layers (C -> K, H x W input, R x S kernel, stride; ResNet-50 at 224x224): the 7x7 stride-2
stem, 1x1 (64 -> 256 at 56, 256 -> 64 at 56, 256 -> 1024 at 14, 1024 -> 256 at 14, 512 -> 2048
at 7), 3x3 stride 1 (64 at 56, 128 at 28, 256 at 14, 512 at 7), the 3x3 stride-2
downsampling (128 at 56) and the 1x1 stride-2 projection shortcut (256 -> 512 at 56).
Batch 4; --quick (and the default set): batch 1 and a 1x1, a 3x3 and a stride-2 3x3 layer;
--tiny: small channels and images (numbers meaningless). All cores (or --threads N, N > 1).
  fwd    inference: ops.torch_conv.Conv2d (its weight packed once, at the first call) vs
         torch.nn.functional.conv2d, no grad; 2*N*K*P*Q*C*R*S flops per call.
  train  forward + both backward passes: torch.autograd.grad of tc.conv2d (the functional
         form: the weight is packed inside the step, as a training step's weight changes
         every step) for x, w, b with one dy, vs the same with F.conv2d; 3x the forward's
         flops per step.
NCHW in and out (each tpp call includes its NCHW <-> blocked conversions, except the 1x1
layers: ops.conv_pointwise runs them as GEMMs on the NCHW data, nothing converted or
packed). `peak_fraction` divides by the peak suite's one-core compute peak times the threads. Wall clock. tpp's
forward is checked against torch's conv2d in f32 on the same values (tolerance: 1e-4 of the
largest |value| for f32, 2e-2 for bf16).

A small ResNet-style network, converted whole by ops.torch.optimize (its Conv2d and Linear
modules swapped, the BatchNorm2d, ReLU and pooling left as torch's): the 7x7 stride-2 stem
(3 -> 64) with BatchNorm and ReLU, a 1x1 projection to 256 channels, two bottleneck blocks
(1x1 256 -> 64, 3x3 64, 1x1 64 -> 256, each with BatchNorm, the identity added before the last
ReLU), global average pooling and a Linear to 10 classes; input (N, 3, 112, 112) (the blocks at
56 x 56, ResNet-50's first stage), N = the layer cases' batch; --tiny: 32 x 32 with 8/32
channels. Cases (time per call, ms, and the network's GFLOP/s of convolutions and Linear):
  net fwd    eval mode, no grad
  net train  train mode: forward, loss = mean of the squared logits, backward (gradients of
             every parameter), per step
both against the unconverted network (seeded init, same parameters) in the same interleaved
rounds; the eval output is checked against torch's as the layers are.

The cost of a call around a small kernel (case "call"): microseconds per call of a Conv2d
module (16 -> 16 channels, 3x3, padding 1, bias) on one (1, 16, 8, 8) f32 image, no grad,
its weight packed at an earlier call, against torch.nn.Conv2d with the same parameters
(0.3 MFLOP: what is measured is the Python and dispatch around the nests). Every mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import register
from ..timing import looped
from ._common import (all_threads, big_settings, capped_group, compute_record, quick_sizes,
                      team, time_record, timed_group, torch_gflops)

SUITE = "conv"
# name: (C, K, H(=W), R(=S), stride, padding)
LAYERS = {
    "stem 7x7/2": (3, 64, 224, 7, 2, 3),
    "1x1 64-256 @56": (64, 256, 56, 1, 1, 0),
    "1x1 256-64 @56": (256, 64, 56, 1, 1, 0),
    "1x1 256-1024 @14": (256, 1024, 14, 1, 1, 0),
    "1x1 1024-256 @14": (1024, 256, 14, 1, 1, 0),
    "1x1 512-2048 @7": (512, 2048, 7, 1, 1, 0),
    "3x3 64 @56": (64, 64, 56, 3, 1, 1),
    "3x3 128 @28": (128, 128, 28, 3, 1, 1),
    "3x3 256 @14": (256, 256, 14, 3, 1, 1),
    "3x3 512 @7": (512, 512, 7, 3, 1, 1),
    "3x3/2 128 @56": (128, 128, 56, 3, 2, 1),
    "1x1/2 256-512 @56": (256, 512, 56, 1, 2, 0),
}
QUICK = ("1x1 64-256 @56", "3x3 64 @56", "3x3/2 128 @56")
TINY = {"1x1 16-32 @8": (16, 32, 8, 1, 1, 0), "3x3/2 16 @9": (16, 16, 9, 3, 2, 1)}
BATCH = {"full": 4, "quick": 1, "tiny": 1}
NET = {"full": (112, 64, 256), "quick": (112, 64, 256), "tiny": (32, 8, 32)}  # H, stem C, width
TOLERANCE = {"f32": 1e-4, "bf16": 2e-2}


@dataclass(frozen=True)
class Case:
    layer: str
    dtype: str
    n: int
    c: int
    k: int
    h: int
    r: int
    stride: int
    padding: int
    train: bool
    threads: int

    @property
    def name(self) -> str:
        return f"{self.layer} {'train' if self.train else 'fwd'} {self.dtype} t{self.threads}"

    @property
    def shape(self) -> tuple:
        return (self.n, self.c, self.k, self.h, self.h, self.r, self.r, self.stride)

    @property
    def out(self) -> int:
        return (self.h + 2 * self.padding - self.r) // self.stride + 1

    @property
    def flops(self) -> int:
        fwd = 2 * self.n * self.k * self.out ** 2 * self.c * self.r ** 2
        return 3 * fwd if self.train else fwd


@register(SUITE, default=False, requires=("peak",),
          help="GFLOP/s of conv2d on the ResNet-50 layers (ops.torch_conv) vs torch's conv2d "
               "(oneDNN), forward and training, f32 and bf16, all cores")
def run(ctx):
    mode = "tiny" if ctx.config.tiny else ("quick" if quick_sizes(ctx) else "full")
    layers = TINY if mode == "tiny" else (
        {k: LAYERS[k] for k in QUICK} if mode == "quick" else LAYERS)
    if ctx.torch is None:
        ctx.note("conv: torch is required (ops.torch_conv and the reference); suite skipped")
        return
    threads = all_threads(ctx)
    rng = np.random.default_rng(6)
    for layer, (c, k, h, r, stride, padding) in layers.items():
        for dtype in ("f32", "bf16"):
            if not ctx.wants_dtype(dtype):
                continue
            for train in (False, True):
                case = Case(layer, dtype, BATCH[mode], c, k, h, r, stride, padding, train,
                            threads)
                _run_case(ctx, case, rng)
    for dtype in ("f32", "bf16"):
        if ctx.wants_dtype(dtype):
            for train in (False, True):
                _run_net(ctx, mode, dtype, train, threads)
    if ctx.wants_dtype("f32"):
        _run_call(ctx, threads)


CALL = (1, 16, 16, 8, 3, 1)     # the call case: N, C, K, H (= W), R (= S), padding


def _run_call(ctx, threads):
    """The call case (see the module docstring): a small layer's time per call."""
    import ops.torch
    torch = ctx.torch
    n, c, k, h, r, padding = CALL
    torch.manual_seed(8)
    ref = torch.nn.Conv2d(c, k, r, padding=padding)
    x = torch.randn(n, c, h, h)
    runs, calls = {}, {}
    with team(ctx, threads), torch.no_grad():
        if ctx.wants("tpp"):
            try:
                mine = ops.torch.Conv2d(c, k, r, padding=padding)
                mine.load_state_dict(ref.state_dict())
                mine(x)         # packs the weight, compiles the nests
                runs["tpp"], calls["tpp"] = looped(mine, x), "ops.torch.Conv2d(...)(x), no grad"
            except Exception as exc:  # noqa: BLE001
                ctx.failed("conv call tpp", exc)
        runs["torch"], calls["torch"] = looped(ref, x), "torch.nn.Conv2d(...)(x), no grad"
        results = timed_group(ctx, f"conv call {n}x{c}x{h}x{h} {r}x{r}", runs)
    for provider, stats in results.items():
        time_record(ctx, suite=SUITE, case="call", provider=provider, shape=CALL,
                    stats=stats, unit="us", call=calls[provider], threads=threads)


def _data(torch, case: Case, rng) -> dict:
    """x, w, b, dy as torch tensors of the case's dtype."""
    tdt = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    n, c, k, h, r = case.n, case.c, case.k, case.h, case.r
    vals = {"x": rng.standard_normal((n, c, h, h), dtype=np.float32),
            "w": rng.standard_normal((k, c, r, r), dtype=np.float32) / np.float32(
                np.sqrt(c * r * r)),
            "b": rng.standard_normal(k, dtype=np.float32),
            "dy": rng.standard_normal((n, k, case.out, case.out), dtype=np.float32)}
    return {key: torch.from_numpy(v).to(tdt) for key, v in vals.items()}


def _run_case(ctx, case: Case, rng):
    torch = ctx.torch
    label = f"conv {case.name} {'x'.join(map(str, case.shape))}"
    d = _data(torch, case, rng)
    runs, predicted, verified = {}, {}, None
    with team(ctx, case.threads):
        if ctx.wants("tpp"):
            try:
                ours = _tpp(torch, case, d)
                if not case.train and ctx.config.verify:
                    verified = _verify(ctx, label, case, torch, ours(), d)
                runs["tpp"] = looped(ours)
            except Exception as exc:  # noqa: BLE001
                ctx.failed(f"{label} tpp", exc)
        runs["torch"] = looped(_torch(torch, case, d))
        if case.dtype == "bf16":    # slow where the CPU has no bf16 dot
            predicted["torch"] = case.flops / 1e9 / torch_gflops(torch, case.threads)
        results = capped_group(ctx, label, runs, big_settings(ctx), predicted)
    for provider, stats in results.items():
        extra = {"threads": case.threads, "clock": "wall", "batch": case.n,
                 "pass": "forward + backward data + backward weight/bias" if case.train
                 else "forward"}
        if provider == "tpp":
            extra["weights"] = ("packed inside each step" if case.train
                                else "packed once (Conv2d's cache), outside the timed loop")
            if verified is not None:
                extra["verified"] = verified
        compute_record(ctx, suite=SUITE, case=case.name, provider=provider, shape=case.shape,
                       stats=stats, flops=case.flops, dtype=case.dtype, cores=case.threads,
                       **extra)


def _tpp(torch, case: Case, d: dict):
    """step() -> the forward's output (fwd) or the three gradients (train)."""
    import ops.torch_conv as tc
    hyper = (case.stride, case.padding)
    if not case.train:
        mod = tc.Conv2d(case.c, case.k, case.r, stride=case.stride, padding=case.padding,
                        dtype=d["w"].dtype)
        with torch.no_grad():
            mod.weight.copy_(d["w"])
            mod.bias.copy_(d["b"])
        mod.requires_grad_(False)
        x = d["x"]
        return lambda: mod(x)
    params = tuple(d[key].clone().requires_grad_() for key in ("x", "w", "b"))
    dy, grad = d["dy"], torch.autograd.grad
    return lambda: grad(tc.conv2d(*params, *hyper), params, dy)


def _torch(torch, case: Case, d: dict):
    conv2d = torch.nn.functional.conv2d
    hyper = (case.stride, case.padding)
    if not case.train:
        x, w, b = d["x"], d["w"], d["b"]

        def fwd():
            with torch.no_grad():
                return conv2d(x, w, b, *hyper)
        return fwd
    params = tuple(d[key].clone().requires_grad_() for key in ("x", "w", "b"))
    dy, grad = d["dy"], torch.autograd.grad
    return lambda: grad(conv2d(*params, *hyper), params, dy)


def _verify(ctx, label, case: Case, torch, got, d: dict) -> bool | None:
    """tpp's forward against torch's conv2d in f32 on the same values."""
    want = torch.nn.functional.conv2d(d["x"].float(), d["w"].float(), d["b"].float(),
                                      case.stride, case.padding).double()
    scale = float(want.abs().max()) or 1.0
    err = float((got.double() - want).abs().max()) / scale
    if err > TOLERANCE[case.dtype]:
        ctx.note(f"{label} tpp: WRONG RESULTS (max error {err:.3g} of the largest |value|, "
                 f"vs torch in f32); its GFLOP/s is not meaningful")
        return False
    return True


# ---------------------------------------------------------------- a small network
def _network(torch, mode: str):
    """The seeded ResNet-style network of the module docstring, in f32, and its conv and
    Linear FLOPs per image."""
    nn = torch.nn
    h, stem, width = NET[mode]
    mid = width // 4

    class Bottleneck(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(width, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                nn.Conv2d(mid, width, 1, bias=False), nn.BatchNorm2d(width))
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(x + self.body(x))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, stem, 7, stride=2, padding=3, bias=False),
                        nn.BatchNorm2d(stem), nn.ReLU(), nn.Conv2d(stem, width, 1, bias=False),
                        Bottleneck(), Bottleneck(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(width, 10))
    p = h // 2
    flops = 2 * (p * p * (stem * 3 * 49 + width * stem)
                 + 2 * p * p * (width * mid + mid * mid * 9 + mid * width) + width * 10)
    return net, h, flops


def _run_net(ctx, mode, dtype, train, threads):
    import ops.torch
    torch = ctx.torch
    case = f"net {'train' if train else 'fwd'} {dtype}"
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    n = BATCH[mode]
    net, h, flops = _network(torch, mode)
    net = net.to(tdt).train(train)
    label = f"conv {case} {n}x3x{h}x{h}"
    runs, verified = {}, None
    x = torch.from_numpy(np.random.default_rng(7).standard_normal(
        (n, 3, h, h), dtype=np.float32)).to(tdt)
    with team(ctx, threads):
        if ctx.wants("tpp"):
            try:
                fast, summary = ops.torch.optimize(net, report=True)
                convs = sum(1 for m in net.modules() if isinstance(m, torch.nn.Conv2d))
                swapped = sum(1 for _, old, _, _ in summary.swapped if old == "torch.nn.Conv2d")
                if swapped != convs:
                    raise RuntimeError(f"optimize swapped {swapped} of {convs} Conv2d:\n"
                                       f"{summary}")
                if not train and ctx.config.verify:
                    verified = _verify_net(ctx, label, dtype, torch, fast, net, x)
                runs["tpp"] = looped(_net_step(torch, fast, x, train))
            except Exception as exc:  # noqa: BLE001
                ctx.failed(f"{label} tpp", exc)
        runs["torch"] = looped(_net_step(torch, net, x, train))
        results = capped_group(ctx, label, runs, big_settings(ctx), {})
    for provider, stats in results.items():
        extra = {"threads": threads, "clock": "wall", "batch": n,
                 "gflops": n * flops * (3 if train else 1) / stats.median / 1e9,
                 "pass": "forward + backward" if train else "forward, eval"}
        if verified is not None and provider == "tpp":
            extra["verified"] = verified
        time_record(ctx, suite=SUITE, case=case, provider=provider, shape=(n, 3, h, h),
                    stats=stats, unit="ms", dtype=dtype, **extra)


WARMUP_CALLS = 3   # torch's batch_norm is slow on its first two calls with a new input


def _net_step(torch, net, x, train):
    """The case's step (called WARMUP_CALLS times here: first calls compile or set up)."""
    if not train:
        def step():
            with torch.no_grad():
                return net(x)
    else:
        params = tuple(net.parameters())

        def step():
            loss = net(x).float().square().mean()
            return torch.autograd.grad(loss, params)
    for _ in range(WARMUP_CALLS):
        step()
    return step


def _verify_net(ctx, label, dtype, torch, fast, net, x) -> bool:
    with torch.no_grad():
        got, want = fast(x).double(), net(x).double()
    err = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
    if err > 10 * TOLERANCE[dtype]:
        ctx.note(f"{label} tpp: WRONG RESULTS (max error {err:.3g} of the largest |value| vs "
                 f"the unconverted network); its time is not meaningful")
        return False
    return True
