"""Weights updated behind their version counters: a training call packs afresh, so the manual
SGD of torch's tutorials (p.data.sub_(lr * p.grad)) trains a converted model exactly as it
trains the original, evaluations between the steps included; outside training,
ops.torch.invalidate_packed(model) makes such writes visible."""
import copy

import pytest

torch = pytest.importorskip("torch")
import ops.torch as T  # noqa: E402

nn = torch.nn


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


MODELS = {
    "linear": (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)),
               lambda: torch.randn(6, 8)),
    "conv": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(4, 2, 1)),
             lambda: torch.randn(2, 3, 6, 6)),
    "attention": (_Attention, lambda: torch.randn(2, 5, 8)),
    "encoder": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                lambda: torch.randn(2, 5, 8)),
}


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_manual_sgd_through_data_trains_like_torch(name):
    make, data = MODELS[name]
    torch.manual_seed(0)
    ref = make()
    mine = T.optimize(copy.deepcopy(ref))
    assert any(type(m).__module__.startswith("ops.") for m in mine.modules())
    x = data()
    for step in range(3):
        for m in (ref, mine):
            with torch.no_grad():
                m(x)                        # an evaluation between steps
            m.zero_grad()
            m(x).square().mean().backward()
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p.data.sub_(0.05 * p.grad.data)
        with torch.no_grad():
            _close(mine(x), ref(x))
        _close(mine(x), ref(x))             # grad mode on, training: packed afresh


def test_invalidate_packed_shows_writes_through_data_outside_training():
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Conv2d(1, 2, 3, padding=1))
    mine = T.optimize(copy.deepcopy(ref)).eval()
    lin = (ref[0], mine[0])
    x = torch.randn(4, 8)
    with torch.no_grad():
        _close(mine[0](x), ref[0](x))
        for m in lin:
            m.weight.data.mul_(-2.0)        # no version bump
        T.invalidate_packed(mine)
        _close(mine[0](x), ref[0](x))
        img = torch.randn(1, 1, 5, 5)
        _close(mine[1](img), ref[1](img))
        for m in (ref[1], mine[1]):
            m.weight.data.add_(1.0)
        T.invalidate_packed(mine)
        _close(mine[1](img), ref[1](img))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_fused_optimizer_step_is_seen(name):
    """torch's fused optimizers (fused=True) update weights without bumping their version
    counters; the packed copies count optimizer steps too (a global step hook)."""
    make, data = MODELS[name]
    torch.manual_seed(2)
    ref = make().eval()
    mine = T.optimize(copy.deepcopy(ref))
    x = data()
    for m in (ref, mine):
        with torch.no_grad():
            m(x)                                # packed
        params = list(m.parameters())
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        torch.optim.AdamW(params, lr=0.1, fused=True).step()
    with torch.no_grad():
        _close(mine(x), ref(x))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        T.invalidate_packed([mine])
