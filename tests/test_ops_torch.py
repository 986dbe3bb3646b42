"""ops.torch: the Linear / MLP drop-ins against torch.nn, autograd, training and DDP."""
import copy
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ops
import tpp

torch = pytest.importorskip("torch")
import ops.torch as ot  # noqa: E402

F = torch.nn.functional
REPO = Path(__file__).resolve().parent.parent

TORCH_ACT = {None: lambda t: t, "relu": torch.relu, "gelu": F.gelu, "sigmoid": torch.sigmoid,
             "tanh": torch.tanh}
# f32: both sides accumulate in f32 (differently ordered); TPP's gelu is more exact than
# torch's (~3e-5). bf16: results rounded to bf16 (2^-8 relative) on both sides.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-3)}


def _pair(k, n, bias, activation, dtype, seed=0):
    """(ops.torch.Linear, torch.nn.Linear) holding the same weights."""
    torch.manual_seed(seed)
    ours = ot.Linear(k, n, bias=bias, dtype=dtype, activation=activation)
    ref = torch.nn.Linear(k, n, bias=bias, dtype=dtype)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _compare(ours, ref, activation, x_shape, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g).to(dtype)
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    y1 = ours(x1)
    y2 = TORCH_ACT[activation](ref(x2))
    assert y1.shape == y2.shape and y1.dtype == y2.dtype == dtype
    dy = torch.randn(y2.shape, generator=g).to(dtype)
    y1.backward(dy)
    y2.backward(dy)
    tol = TOL[dtype]
    torch.testing.assert_close(y1, y2, **tol)
    torch.testing.assert_close(x1.grad, x2.grad, **tol)
    # weight/bias grads sum over the rows: scale the absolute tolerance with their size
    rows = x.numel() // x.shape[-1]
    gtol = dict(rtol=tol["rtol"], atol=tol["atol"] * max(1.0, rows ** 0.5))
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **gtol)
    if ref.bias is not None:
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **gtol)
    else:
        assert ours.bias is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "sigmoid", "tanh"])
def test_linear_matches_torch_every_activation(activation, dtype):
    ours, ref = _pair(70, 130, True, activation, dtype)
    _compare(ours, ref, activation, (2, 9, 70), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("x_shape,n,bias", [
    ((1, 70), 130, True),          # a single row
    ((70,), 33, False),            # a 1-D input: one row, no leading dims
    ((3, 5, 70), 130, False),      # 3-D input
    ((37, 64), 64, True),          # full panels, M not a multiple of 64
    ((130, 200), 70, True),        # M past one block, ragged N
    ((16, 900), 70, False),        # K > 768: chunked K in f32
], ids=["row", "1d", "3d", "m37", "m130", "k900"])
def test_linear_matches_torch_shapes(x_shape, n, bias, dtype):
    ours, ref = _pair(x_shape[-1], n, bias, "gelu", dtype)
    _compare(ours, ref, "gelu", x_shape, dtype)


def test_init_parameters_and_state_dict_match_torch():
    torch.manual_seed(3)
    ours = ot.Linear(20, 7)
    torch.manual_seed(3)
    ref = torch.nn.Linear(20, 7)
    # same initialisation, same random stream
    torch.testing.assert_close(ours.weight, ref.weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.bias, ref.bias, rtol=0, atol=0)
    assert [(k, p.shape) for k, p in ours.named_parameters()] == \
           [(k, p.shape) for k, p in ref.named_parameters()]
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]

    # torch -> ours
    other = torch.nn.Linear(20, 7)
    ours.load_state_dict(other.state_dict())
    x = torch.randn(4, 20)
    torch.testing.assert_close(ours(x), other(x), rtol=1e-5, atol=1e-5)
    # ours -> torch
    mine = ot.Linear(20, 7)
    ref.load_state_dict(mine.state_dict())
    torch.testing.assert_close(ref(x), mine(x), rtol=1e-5, atol=1e-5)
    # no bias: one key on both sides
    assert list(ot.Linear(3, 2, bias=False).state_dict()) == ["weight"]
    torch.nn.Linear(3, 2, bias=False).load_state_dict(ot.Linear(3, 2, bias=False).state_dict())

    assert repr(ot.Linear(4, 5, activation="relu")) == \
        "Linear(in_features=4, out_features=5, bias=True, activation='relu')"
    lin = ot.Linear(4, 5, dtype=torch.bfloat16)
    assert lin.weight.dtype == lin.bias.dtype == torch.bfloat16


def test_no_grad_and_inputs_without_grad():
    ours, ref = _pair(24, 40, True, "tanh", torch.float32)
    x = torch.randn(6, 24)
    want = torch.tanh(ref(x)).detach()
    with torch.no_grad():
        y = ours(x)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    # inference mode too
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)
    # x without grad, parameters with grad: weight and bias grads only
    y = ours(x)
    assert y.requires_grad
    y.sum().backward()
    torch.tanh(ref(x)).sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-4)
    # only the weight requires grad; only x requires grad
    ours.zero_grad()
    ours.bias.requires_grad_(False)
    ours(x).square().sum().backward()
    assert ours.bias.grad is None and ours.weight.grad is not None
    ours.weight.requires_grad_(False)
    xg = x.clone().requires_grad_()
    ours(xg).sum().backward()
    xr = x.clone().requires_grad_()
    torch.tanh(ref(xr)).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-4, atol=1e-4)
    # nothing requires grad: no graph
    assert ours(x).grad_fn is None


def test_functional_linear_and_empty_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=g, requires_grad=True)
    w = torch.randn(9, 12, generator=g, requires_grad=True)
    b = torch.randn(9, generator=g)
    y = ot.linear(x, w, b, "relu")
    torch.testing.assert_close(y, torch.relu(F.linear(x, w, b)), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    # a non-contiguous x and a transposed (non-contiguous) weight
    xt = torch.randn(12, 5, generator=g).t()
    wt = torch.randn(12, 9, generator=g).t()
    torch.testing.assert_close(ot.linear(xt, wt, b), F.linear(xt, wt, b), rtol=1e-5, atol=1e-5)
    # an empty batch, like torch.nn.Linear
    lin = ot.Linear(12, 9)
    e = torch.empty(0, 12, requires_grad=True)
    out = lin(e)
    assert out.shape == (0, 9)
    out.sum().backward()
    assert e.grad.shape == (0, 12)
    torch.testing.assert_close(lin.weight.grad, torch.zeros(9, 12), rtol=0, atol=0)
    with torch.no_grad():
        assert lin(torch.empty(2, 0, 12)).shape == (2, 0, 9)


def test_output_allows_inplace_ops_and_detects_modified_saved_tensors():
    lin = ot.Linear(8, 16, activation="gelu")
    x = torch.randn(4, 8)
    y = lin(x)
    assert not y._is_view()
    torch.nn.ReLU(inplace=True)(y).sum().backward()   # in-place on our output: allowed
    # tanh's backward reads its output: changing it in place must raise, as in torch
    t = ot.Linear(8, 16, activation="tanh")
    y = t(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_packed_weight_cache_follows_the_weight():
    torch.manual_seed(0)
    lin = ot.Linear(30, 50)
    x = torch.randn(8, 30)
    with torch.no_grad():
        y0 = lin(x)
        p = lin.packed_weight()
        lin(x)
        assert lin.packed_weight() is p            # inference: packed once
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(x).square().sum().backward()
    opt.step()                                     # in-place update of the weight
    with torch.no_grad():
        y1 = lin(x)
        assert lin.packed_weight() is not p
        torch.testing.assert_close(y1, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(y0, y1)
        # load_state_dict and an in-place copy_ under no_grad: repacked too
        lin.load_state_dict({"weight": torch.ones(50, 30), "bias": torch.zeros(50)})
        torch.testing.assert_close(lin(x), x.sum(1, keepdim=True).expand(8, 50))
        lin.weight.copy_(2 * torch.ones(50, 30))
        torch.testing.assert_close(lin(x), 2 * x.sum(1, keepdim=True).expand(8, 50))
        # writes through .data skip the version counter: invalidate_packed() says so
        lin.weight.data.fill_(3.0)
        lin.invalidate_packed()
        torch.testing.assert_close(lin(x), 3 * x.sum(1, keepdim=True).expand(8, 50))
    # dtype conversion of the module: new storage, new packing
    lin.bfloat16()
    with torch.no_grad():
        yb = lin(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), 3 * x.bfloat16().float().sum(1, keepdim=True)
                               .expand(8, 50), rtol=2e-2, atol=5e-2)
    # copies and pickles do not carry the packed weight
    assert copy.deepcopy(lin)._packed_cache is None
    assert pickle.loads(pickle.dumps(lin))._packed_cache is None


def _torch_mlp_from(mlp, activation):
    """The equivalent torch.nn.Sequential (Linear, act, Linear, act, ..., Linear)."""
    mods = []
    for i, layer in enumerate(mlp):
        ref = torch.nn.Linear(layer.in_features, layer.out_features,
                              bias=layer.bias is not None, dtype=layer.weight.dtype)
        ref.load_state_dict(layer.state_dict())
        mods.append(ref)
        if i < len(mlp) - 1:
            mods.append({"gelu": torch.nn.GELU(), "relu": torch.nn.ReLU(),
                         "tanh": torch.nn.Tanh(), "sigmoid": torch.nn.Sigmoid()}[activation])
    return torch.nn.Sequential(*mods)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_mlp_matches_torch_sequential(dtype):
    torch.manual_seed(0)
    mlp = ot.MLP(48, [96, 70, 10], activation="gelu", dtype=dtype)
    assert [type(m) for m in mlp] == [ot.Linear] * 3
    assert [m.activation for m in mlp] == ["gelu", "gelu", None]
    assert list(mlp.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight",
                                      "2.bias"]
    ref = _torch_mlp_from(mlp, "gelu")
    x = torch.randn(3, 11, 48).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = mlp(x1), ref(x2)
    dy = torch.randn(y1.shape).to(dtype)
    y1.backward(dy)
    y2.backward(dy)
    tol = TOL[dtype]
    gtol = dict(rtol=tol["rtol"], atol=tol["atol"] * 6)
    torch.testing.assert_close(y1, y2, **tol)
    torch.testing.assert_close(x1.grad, x2.grad, **tol)
    for ours, theirs in zip(mlp, [m for m in ref if isinstance(m, torch.nn.Linear)]):
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, **gtol)
        torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, **gtol)
    # no bias, another activation
    m2 = ot.MLP(16, [8, 4], activation="relu", bias=False)
    assert list(m2.state_dict()) == ["0.weight", "1.weight"]
    x = torch.randn(5, 16)
    torch.testing.assert_close(m2(x), _torch_mlp_from(m2, "relu")(x), rtol=1e-5, atol=1e-5)


def _train(make_layer, steps=50, dtype=torch.float32):
    """Loss per step of 32 -> 64 -> 64 -> 10 (gelu) trained by SGD on fixed data."""
    torch.manual_seed(0)
    init = ot.MLP(32, [64, 64, 10], activation="gelu").state_dict()
    acts = ["gelu", "gelu", None]
    layers = []
    for i, (k, n) in enumerate([(32, 64), (64, 64), (64, 10)]):
        layers.append(make_layer(k, n, acts[i]))
    net = torch.nn.Sequential(*[m for layer in layers for m in layer])
    linears = [m for m in net if isinstance(m, (torch.nn.Linear, ot.Linear))]
    for i, m in enumerate(linears):
        m.load_state_dict({"weight": init[f"{i}.weight"], "bias": init[f"{i}.bias"]})
    net.to(dtype)
    g = torch.Generator().manual_seed(42)
    x = torch.randn(96, 32, generator=g).to(dtype)
    teacher = torch.randn(32, 10, generator=g) / 32 ** 0.5
    target = (x.float() @ teacher).to(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(net(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), linears


def test_training_loss_curve_matches_torch():
    def ours(k, n, act):
        return [ot.Linear(k, n, activation=act)]

    def theirs(k, n, act):
        return [torch.nn.Linear(k, n)] + ([torch.nn.GELU()] if act else [])

    l1, m1 = _train(ours)
    l2, m2 = _train(theirs)
    assert l1[-1] < 0.95 * l1[0]                   # it learns
    torch.testing.assert_close(l1, l2, rtol=1e-3, atol=0)
    for a, b in zip(m1, m2):
        torch.testing.assert_close(a.weight, b.weight, rtol=1e-3, atol=1e-4)


# --- DistributedDataParallel, gloo, 2 processes -------------------------------------------

DDP_COMMON = textwrap.dedent('''
    import torch
    import ops.torch as ot

    STEPS, BATCH, LR = 5, 24, 0.1

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(ot.Linear(16, 32, activation="gelu"),
                                   ot.Linear(32, 32, activation="tanh"), ot.Linear(32, 4))

    def data(world):
        g = torch.Generator().manual_seed(7)
        return torch.randn(world * BATCH, 16, generator=g), torch.randn(world * BATCH, 4,
                                                                       generator=g)

    def train(net, x, y):
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for _ in range(STEPS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
''')

DDP_RANK = DDP_COMMON + textwrap.dedent('''
    import datetime, os, sys
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    net = model(seed=rank)              # ranks start different: DDP broadcasts rank 0's state
    x, y = data(world)
    with torch.no_grad():
        net(x[:2])                      # fill the packed-weight caches before the broadcast
    ddp = DDP(net)
    train(ddp, x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH])
    with torch.no_grad():
        pred = net(x)
    torch.save({"state": net.state_dict(), "pred": pred}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    # both ranks saved: leave without gloo's teardown, which can abort a rank whose peer has
    # already closed its connections ("terminate called without an active exception")
    os._exit(0)
''')


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(tmp_path, world=2, timeout=120):
    script = tmp_path / "ddp_rank.py"
    script.write_text(DDP_RANK)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               TPP_NUM_THREADS="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(tmp_path)],
                              env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        pytest.fail(f"DDP ranks did not finish within {timeout} s:\n" + "\n---\n".join(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    return codes, outputs


def test_ddp_gloo_two_ranks_match_single_process(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    # the single-process reference first: it also compiles, into the disk cache the ranks
    # share (TPP_CACHE_DIR), every kernel the ranks run, so they only load them
    ns = {}
    exec(DDP_COMMON, ns)
    ref = ns["model"](0)
    init = copy.deepcopy(ref.state_dict())
    x, y = ns["data"](2)
    ns["train"](ref, x, y)
    with torch.no_grad():
        ref_pred = ref(x)
    warm = ns["model"](1)
    with torch.no_grad():
        warm(x[:2])
    ns["train"](warm, x[:ns["BATCH"]], y[:ns["BATCH"]])

    codes, outputs = _run_ranks(tmp_path)
    if any(codes) and any("ddress already in use" in o for o in outputs):
        codes, outputs = _run_ranks(tmp_path)      # lost the port race once: retry
    assert codes == [0, 0], "a DDP rank failed:\n" + "\n---\n".join(outputs)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    # the gradients are all-reduced: both ranks hold the same parameters, bit for bit
    assert list(r0["state"]) == list(r1["state"]) == list(init)
    for k in r0["state"]:
        torch.testing.assert_close(r0["state"][k], r1["state"][k], rtol=0, atol=0)
    torch.testing.assert_close(r0["pred"], r1["pred"], rtol=0, atol=0)
    # and they equal one process trained on both ranks' data (mean loss over the whole batch);
    # rank 1 started from other weights, packed before DDP's broadcast replaced them
    torch.testing.assert_close(r0["pred"], ref_pred, rtol=1e-4, atol=1e-5)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-4, atol=1e-5)
        assert not torch.equal(v, init[k])             # training moved every parameter


def test_errors():
    lin = ot.Linear(8, 4)
    with pytest.raises(tpp.UnsupportedError, match="meta"):
        lin(torch.empty(2, 8, device="meta"))
    meta = ot.Linear(8, 4, device="meta")              # construction on meta works, as in torch
    assert meta.weight.device.type == "meta"
    with pytest.raises(tpp.UnsupportedError, match="meta"):
        meta(torch.empty(2, 8, device="meta"))
    with pytest.raises(tpp.UnsupportedError, match="float32 and torch.bfloat16"):
        lin(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(tpp.UnsupportedError, match="torch.float16 is not supported"):
        lin.half()(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(tpp.UnsupportedError, match="float64 is not supported"):
        ot.Linear(8, 4, dtype=torch.float64)
    lin = ot.Linear(8, 4)
    with pytest.raises(tpp.ArgumentError, match="input is torch.bfloat16 but weight is "
                                                "torch.float32"):
        lin(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(tpp.ArgumentError, match=r"expected shape \(\.\.\., 8\)"):
        lin(torch.zeros(2, 7))
    with pytest.raises(tpp.ArgumentError, match="activation must be one of"):
        ot.Linear(8, 4, activation="swish")
    with pytest.raises(tpp.ArgumentError, match="hidden_features"):
        ot.MLP(8, [])
    with pytest.raises(tpp.ArgumentError, match="bias is torch.bfloat16"):
        ot.linear(torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(tpp.ArgumentError, match="packed"):
        ot.linear(torch.zeros(2, 8), torch.zeros(4, 8), packed=ops.pack_nk(torch.zeros(5, 8)))
    # every one of them is a TPPError
    assert issubclass(tpp.UnsupportedError, tpp.TPPError)


# ------------------------------------------------------------------ the layer's thin path
def _fails(*args, **kw):
    raise AssertionError("the checked path was taken")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear_common_call_takes_the_thin_path(bias, dtype, monkeypatch):
    """An eval-mode layer that packed its weight skips _check and _linear for a 2-D CPU input
    of its dtype (the packed weight's key vouches), with torch's results and gradients, grad
    mode or not, bias or not, f32 and bf16; a training call packs afresh (checked path)."""
    ours, ref = _pair(70, 130, bias, "gelu", dtype)
    ours.eval()
    x = torch.randn(5, 70).to(dtype)
    ours(x)                                         # packs the weight (the checked path)
    monkeypatch.setattr(ot, "_check", _fails)
    monkeypatch.setattr(ot, "_linear", _fails)
    _compare(ours, ref, "gelu", (5, 70), dtype)     # x requires grad: LinearFunction
    y = ours(x)                                     # only the parameters require grad
    assert type(y.grad_fn).__name__ == "LinearFunctionBackward"
    for ctx in (torch.no_grad(), torch.inference_mode()):
        with ctx:
            y = ours(x)
        assert y.grad_fn is None and not y._is_view()
        torch.testing.assert_close(y, F.gelu(ref(x)).detach(), **TOL[dtype])
    xs = torch.randn(70, 5).to(dtype).t()           # non-contiguous: copied on the way
    torch.testing.assert_close(ours(xs), F.gelu(ref(xs)), **TOL[dtype])
    with torch.no_grad():
        torch.testing.assert_close(ours(xs), F.gelu(ref(xs)), **TOL[dtype])
    _compare(ours, ref, "gelu", (33, 70), dtype)    # a new batch size: nothing repacked
    with pytest.raises(AssertionError, match="checked path"):
        ours.train()(x)


def test_linear_thin_path_falls_back_to_the_checks(monkeypatch):
    """Every call the thin path does not vouch for goes through _check (and _linear): other
    ranks, empty batches, tensor subclasses, other devices and dtypes, a replaced weight or
    bias, an invalid activation set after construction."""
    ours, ref = _pair(12, 9, True, None, torch.float32)
    x = torch.randn(4, 12)
    ours(x)
    checked = []
    real = ot._check
    monkeypatch.setattr(ot, "_check", lambda *a, **kw: (checked.append(1), real(*a, **kw)))

    def goes_checked(call):
        checked.clear()
        out = call()
        assert checked, "the thin path was taken"
        return out

    for shape in ((12,), (2, 3, 12), (0, 12)):
        xx = torch.randn(shape)
        torch.testing.assert_close(goes_checked(lambda: ours(xx)), ref(xx))
    param = torch.nn.Parameter(x.clone())           # a subclass: the checks decide
    torch.testing.assert_close(goes_checked(lambda: ours(param)), ref(param))
    with pytest.raises(tpp.ArgumentError, match="input is torch.bfloat16"):
        goes_checked(lambda: ours(x.bfloat16()))
    with pytest.raises(tpp.UnsupportedError, match="meta"):
        goes_checked(lambda: ours(torch.empty(4, 12, device="meta")))
    with pytest.raises(tpp.ArgumentError, match=r"expected shape \(\.\.\., 12\)"):
        goes_checked(lambda: ours(torch.zeros(4, 11)))
    # a new weight tensor: checked and packed again
    ours.weight = torch.nn.Parameter(torch.randn(9, 12))
    ref.weight = torch.nn.Parameter(ours.weight.detach().clone())
    torch.testing.assert_close(goes_checked(lambda: ours(x)), ref(x))
    torch.testing.assert_close(ours(x), ref(x))     # and the thin path again after it
    bias = ours.bias
    ours.bias = torch.nn.Parameter(torch.zeros(9, dtype=torch.bfloat16))
    with pytest.raises(tpp.ArgumentError, match="bias is torch.bfloat16"):
        goes_checked(lambda: ours(x))
    ours.bias = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(tpp.ArgumentError, match=r"bias: expected shape \(9,\)"):
        goes_checked(lambda: ours(x))
    ours.bias = bias
    ours.activation = "swish"
    with pytest.raises(tpp.ArgumentError, match="activation must be one of"):
        goes_checked(lambda: ours(x))


def test_linear_reads_parameters_moved_out_of_parameters():
    """Parametrizations and functional_call move the weight out of _parameters: the layer
    reads the attribute then, computing with the weight they give (packed again each call
    where it is a new tensor)."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    ours, ref = _pair(12, 9, True, "relu", torch.float32)
    x = torch.randn(4, 12, requires_grad=True)
    ours(x)
    parametrize.register_parametrization(ours, "weight", Double())
    parametrize.register_parametrization(ref, "weight", Double())
    for _ in range(2):
        torch.testing.assert_close(ours(x), torch.relu(ref(x)))
    ours(x).sum().backward()
    ours_grad = ours.parametrizations.weight.original.grad.clone()
    torch.relu(ref(x)).sum().backward()
    torch.testing.assert_close(ours_grad, ref.parametrizations.weight.original.grad)

    plain, _ = _pair(12, 9, True, None, torch.float32)
    plain(x)
    w, b = torch.randn(9, 12), torch.randn(9)
    got = torch.func.functional_call(plain, {"weight": w, "bias": b}, (x,))
    torch.testing.assert_close(got, F.linear(x, w, b))
    torch.testing.assert_close(plain(x), F.linear(x, plain.weight, plain.bias))


def test_function_apply_shortcut_matches_function_apply(monkeypatch):
    """ops.torch._apply (Function.apply without its Python wrapper) gives the same results,
    graph and gradients as Function.apply, which it becomes where torch lacks the internals;
    inside torch.func transforms torch's own linear takes the call."""
    ours, ref = _pair(16, 24, True, "tanh", torch.float32)
    x = torch.randn(3, 16)
    y = ours(x)
    assert type(y.grad_fn).__name__ == "LinearFunctionBackward"
    grads = torch.autograd.grad(y.sum(), (ours.weight, ours.bias))
    monkeypatch.setattr(ot, "_APPLY_INTERNALS", None)
    y2 = ours(x)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    for g, g2 in zip(grads, torch.autograd.grad(y2.sum(), (ours.weight, ours.bias))):
        torch.testing.assert_close(g, g2, rtol=0, atol=0)
    monkeypatch.undo()
    xs = torch.randn(2, 3, 16)
    torch.testing.assert_close(torch.func.vmap(ours)(xs), torch.tanh(ref(xs)))


def test_linear_made_under_inference_mode_sees_in_place_writes():
    """Inference tensors have no version counter: the packed weight is rebuilt per call."""
    import ops.torch as ot
    with torch.inference_mode():
        layer = ot.Linear(8, 4)
        x = torch.randn(3, 8)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
