"""ops.conv_memo: a Conv2d module's remembered forward, taken while a call's signature repeats
and never where anything that the checked call looked at has changed."""
import copy
import io
import pickle

import pytest

from tpp.core.errors import ArgumentError

torch = pytest.importorskip("torch")
F = torch.nn.functional
tc = pytest.importorskip("ops.torch_conv")
from ops import conv  # noqa: E402


def _same(mine, ref, x, tol=1e-4):
    with torch.no_grad():
        torch.testing.assert_close(mine(x), ref(x), atol=tol, rtol=tol)


@pytest.fixture
def checked_calls(monkeypatch):
    """The number of checked forward calls (ops.conv._inputs runs once in each) so far."""
    calls = []
    real = conv._inputs
    monkeypatch.setattr(conv, "_inputs", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("layer", [
    dict(in_channels=5, out_channels=7, kernel_size=3, padding=1),             # blocked
    dict(in_channels=3, out_channels=8, kernel_size=7, stride=2, padding=3),   # the stem
    dict(in_channels=16, out_channels=8, kernel_size=1),                       # 1x1 GEMMs
    dict(in_channels=6, out_channels=6, kernel_size=3, groups=6, bias=False),  # depthwise
])
def test_repeated_calls_skip_the_checks_and_stay_right(layer, checked_calls):
    torch.manual_seed(0)
    mine = tc.Conv2d(**layer)
    ref = torch.nn.Conv2d(**layer)
    ref.load_state_dict(mine.state_dict())
    c = layer["in_channels"]
    for step in range(3):
        _same(mine, ref, torch.randn(2, c, 9, 8))
    assert len(checked_calls) == 1
    _same(mine, ref, torch.randn(3, c, 9, 8))          # a new batch size: checked again
    assert len(checked_calls) == 2


def test_every_change_of_what_was_checked_takes_the_checked_call(checked_calls):
    torch.manual_seed(1)
    mine = tc.Conv2d(4, 6, 3, padding=1)
    ref = torch.nn.Conv2d(4, 6, 3, padding=1)
    ref.load_state_dict(mine.state_dict())
    x = torch.randn(2, 4, 7, 7)
    _same(mine, ref, x)
    changes = [
        lambda: None,                                           # nothing: remembered
        lambda: x.__setitem__(Ellipsis, torch.randn_like(x)),   # new values only: remembered
        lambda: [m.weight.detach().mul_(0.5) for m in (mine, ref)],  # in place: repacked
        lambda: [setattr(m, "stride", (2, 1)) for m in (mine, ref)],
        lambda: [setattr(m, "padding", (0, 2)) for m in (mine, ref)],
        lambda: [setattr(m, "dilation", (2, 2)) for m in (mine, ref)],
        lambda: [setattr(m, "bias", None) for m in (mine, ref)],
    ]
    checked_so_far = [1, 1, 1, 2, 3, 4, 5]
    for change, count in zip(changes, checked_so_far):
        change()
        _same(mine, ref, x)
        assert len(checked_calls) == count
    # a channels-last or a sliced input has no signature: checked every time, still right
    for odd in (x.to(memory_format=torch.channels_last), x[:, :, :, 1:]):
        _same(mine, ref, odd)
    assert len(checked_calls) == checked_so_far[-1] + 2


def test_dtype_change_and_bad_input_after_a_remembered_call():
    torch.manual_seed(2)
    mine = tc.Conv2d(3, 4, 3, padding=1)
    ref = torch.nn.Conv2d(3, 4, 3, padding=1)
    ref.load_state_dict(mine.state_dict())
    x = torch.randn(1, 3, 6, 6)
    for _ in range(2):
        _same(mine, ref, x)
    mine.bfloat16()
    with torch.no_grad():
        y = mine(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref(x).detach(), atol=0.1, rtol=0.05)
    with pytest.raises((ArgumentError, RuntimeError)):
        mine(torch.randn(1, 5, 6, 6).bfloat16())            # wrong channel count
    mine.float()
    ref.load_state_dict(mine.state_dict())              # the weights rounded to bf16 and back
    _same(mine, ref, x)


def test_training_through_the_memo_matches_torch():
    torch.manual_seed(3)
    mine = tc.Conv2d(4, 5, 3, stride=2, padding=1)
    ref = torch.nn.Conv2d(4, 5, 3, stride=2, padding=1)
    ref.load_state_dict(mine.state_dict())
    opt_m = torch.optim.SGD(mine.parameters(), lr=0.01)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.01)
    x = torch.randn(2, 4, 9, 9)
    for _ in range(3):
        xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        ym, yr = mine(xm), ref(xr)
        torch.testing.assert_close(ym, yr, atol=1e-4, rtol=1e-4)
        dy = torch.randn(ym.shape)
        ym.backward(dy)
        yr.backward(dy)
        torch.testing.assert_close(xm.grad, xr.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.weight.grad, ref.weight.grad, atol=1e-3, rtol=1e-4)
        opt_m.step(), opt_r.step(), opt_m.zero_grad(), opt_r.zero_grad()


def test_a_used_module_copies_and_pickles_without_its_memo():
    torch.manual_seed(4)
    mine = tc.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 5, 5)
    with torch.no_grad():
        want = mine(x)
        mine(x)
    assert mine._tpp_memo.entry is not None
    buffer = io.BytesIO()
    torch.save(mine, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(mine), pickle.loads(pickle.dumps(mine)),
                  torch.load(buffer, weights_only=False)):
        assert other._tpp_memo is None and other._tpp_packs is None
        with torch.no_grad():
            torch.testing.assert_close(other(x), want)


def test_groups_changed_after_a_call_repacks():
    """The packed weight was keyed on the weight alone: a module whose groups changed after a
    call (torch takes it: the weight's shape stays valid) raised at every later call."""
    torch.manual_seed(5)
    mine = tc.Conv2d(4, 4, 3, padding=1).eval()
    ref = torch.nn.Conv2d(4, 4, 3, padding=1).eval()
    ref.load_state_dict(mine.state_dict())
    _same(mine, ref, torch.randn(2, 4, 6, 6))
    mine.groups = ref.groups = 2
    _same(mine, ref, torch.randn(2, 8, 6, 6))
