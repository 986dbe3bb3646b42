"""ops.replay (a forward replayed as its recorded nest calls) and tpp.runtime.recording: what
is recorded, what refuses a recording, validation, and a converted BERT layer's inference
calls replayed with the answers of its plain forward, bit for bit."""
from __future__ import annotations

import copy
import io
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ops.replay as replay  # noqa: E402
import ops.torch  # noqa: E402
import tpp  # noqa: E402
from tpp.runtime import recording  # noqa: E402


def _modules(n=37, k=19):
    torch.manual_seed(0)
    ln, lin = ops.torch.LayerNorm(n), ops.torch.Linear(n, k)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-1, 1)
    return ln, lin


def test_a_chain_of_drop_ins_replays_bit_for_bit_on_new_inputs():
    ln, lin = _modules()

    def fn(x):
        return ops.torch.softmax(lin(ln(x)), -1)

    x = torch.randn(5, 37)
    with torch.no_grad():
        fn(x)                               # packed weights made outside the recording
        out, graph = replay.capture(fn, x)
        assert isinstance(graph, replay.Graph), graph
        assert len(graph.steps) == 3 and graph.arena_bytes > 0     # two intermediates
        assert torch.equal(out, fn(x))
        assert replay.validate(graph, fn, x)
        for seed in range(3):
            y = torch.randn(5, 37, generator=torch.Generator().manual_seed(seed))
            got = graph.replay(y)
            assert torch.equal(got, fn(y))
            assert got.data_ptr() != graph.replay(y).data_ptr()     # a fresh output
        odd = torch.randn(10, 37)[::2].contiguous()     # another address, same signature
        assert torch.equal(graph.replay(odd), fn(odd))


def test_what_refuses_a_recording():
    ln, lin = _modules()
    x = torch.randn(4, 37)
    kernel = tpp.unary("relu", 4, 37)
    cases = {
        "torch ran aten.mul": lambda t: lin(t) * 2,
        "Kernel called outside a nest": lambda t: torch.from_numpy(kernel(t.numpy())),
        "not a fresh contiguous tensor": lambda t: lin(t).t(),
        "not a tensor it allocated whole": lambda t: ln(t)[1:],
    }
    with torch.no_grad():
        for why, fn in cases.items():
            fn(x)
            out, graph = replay.capture(fn, x)
            assert isinstance(graph, str) and why in graph, (why, graph)
            assert torch.equal(out, fn(x))      # the call itself ran as usual


def test_undeclared_host_work_fails_validation():
    _, lin = _modules()

    def fn(t):      # numpy work the recording cannot see: replays would read stale data
        return lin(torch.from_numpy(t.numpy() + 1))

    x = torch.randn(3, 37)
    with torch.no_grad():
        fn(x)
        _, graph = replay.capture(fn, x)
        assert isinstance(graph, replay.Graph)
        assert not replay.validate(graph, fn, x)


def test_declared_host_steps_run_again_at_their_new_places():
    _, lin = _modules()

    def plus_one(dst, src):
        np.add(src, 1, out=dst)

    def fn(t):
        shifted = torch.empty_like(t)
        recording.host(plus_one, shifted.numpy(), t.numpy())
        return lin(shifted)

    x = torch.randn(3, 37)
    with torch.no_grad():
        fn(x)
        _, graph = replay.capture(fn, x)
        assert replay.validate(graph, fn, x)
        y = torch.randn(3, 37)
        assert torch.equal(graph.replay(y), fn(y))


def test_recordings_do_not_nest_and_end_cleanly():
    with recording.recording() as outer:
        assert recording.current() is outer
        with recording.recording() as inner:
            assert inner is None
        recording.refuse("because")
    assert recording.current() is None and recording.active == 0
    assert outer.refused == "because"
    with pytest.raises(ValueError):
        with recording.recording():
            raise ValueError
    assert recording.current() is None and recording.active == 0


def test_the_replayer_records_the_second_call_and_replays_from_the_third():
    ln, lin = _modules()
    fn = lambda t: lin(ln(t))     # noqa: E731
    r = replay.Replayer()
    key = ("k",)
    x = torch.randn(2, 37)
    with torch.no_grad():
        want = fn(x)
        for _ in range(4):
            assert torch.equal(r.run(key, fn, x), want)
        graph = r._graphs[(threading.get_ident(), *key)]
        assert type(graph) is replay.Graph and graph.validated
        r2 = replay.Replayer()
        bad = lambda t: lin(t) + 1      # noqa: E731
        for _ in range(3):
            assert torch.equal(r2.run(key, bad, x), bad(x))
        assert "aten.add" in r2.why_not(key)


def test_a_state_watch_sees_what_a_forward_reads():
    ln, lin = _modules()
    seq = torch.nn.Sequential(ln, lin)
    watch = replay.StateWatch(seq)
    assert watch.changed() and not watch.changed()
    with torch.no_grad():
        lin.weight.mul_(1)              # in place: the version counter moves
    assert watch.changed() and not watch.changed()
    ln.eps = 1e-3
    assert watch.changed() and not watch.changed()
    handle = lin.register_forward_hook(lambda *a: None)
    assert watch.changed() and not watch.changed()
    handle.remove()
    assert watch.changed()
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
    assert watch.changed()
    seq.eval()
    assert watch.changed()
    seq.eval()
    assert not watch.changed()


@pytest.mark.parametrize("batch_first,norm_first,act,shape", [
    (True, False, "gelu", (2, 7, 64)), (False, True, "relu", (9, 3, 64)),
    (True, True, "gelu", (5, 64))])        # unbatched
def test_the_encoder_layer_replays_calls_without_masks(batch_first, norm_first, act, shape):
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 96, batch_first=batch_first,
                                             norm_first=norm_first, activation=act).eval()
    fast = ops.torch.optimize(copy.deepcopy(layer))
    x = torch.randn(shape)
    with torch.no_grad():
        outs = [fast(x) for _ in range(4)]
        y = torch.randn(shape)
        assert torch.equal(fast(y), copy.deepcopy(fast)(y))     # a replay, a plain forward
        for got in outs[1:]:
            assert torch.equal(got, outs[0])
        torch.testing.assert_close(outs[0], layer(x), rtol=1e-4, atol=1e-4)
        graphs = [g for g in fast.__dict__["_tpp_replay"][0]._graphs.values()
                  if type(g) is replay.Graph]
        assert len(graphs) == 1 and graphs[0].validated
        pad = torch.zeros(shape[:-1], dtype=torch.bool).transpose(0, 1 - batch_first) \
            if len(shape) == 3 else torch.zeros(shape[0], dtype=torch.bool)
        pad[..., -1] = True
        for _ in range(3):      # a mask: the plain forward every call
            torch.testing.assert_close(fast(x, src_key_padding_mask=pad),
                                       layer(x, src_key_padding_mask=pad),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv2d_replays_inference_calls(dtype):
    torch.manual_seed(2)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16),
        torch.nn.Conv2d(16, 8, 1, bias=False)).eval().to(dtype)
    fast = ops.torch.optimize(copy.deepcopy(net))
    convs = [m for m in fast if isinstance(m, torch.nn.Conv2d)]
    assert all(type(m) is ops.torch.Conv2d for m in convs)
    x = torch.randn(2, 3, 9, 11).to(dtype)
    with torch.no_grad():
        outs = [fast(x) for _ in range(4)]
        for got in outs[1:]:
            assert torch.equal(got, outs[0])
        y = torch.randn(2, 3, 9, 11).to(dtype)
        want_y = copy.deepcopy(fast)(y)
        assert torch.equal(fast(y), want_y)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(outs[0], net(x), **tol)
    for m in convs:
        graphs = [g for g in m.__dict__["_tpp_replay"][0]._graphs.values()
                  if type(g) is replay.Graph]
        assert len(graphs) == 1 and graphs[0].validated
    fast.train()
    with torch.no_grad():       # a Conv2d's forward is the same in train mode: replayed too
        for _ in range(3):
            assert torch.equal(fast(y), want_y)
    for m in convs:
        assert [g.validated for g in m.__dict__["_tpp_replay"][0]._graphs.values()
                if type(g) is replay.Graph] == [True]
    x.requires_grad_(True)
    fast(x).float().sum().backward()        # training: the plain forward, autograd
    assert x.grad is not None and x.grad.shape == x.shape


transformers = pytest.importorskip("transformers")


def _tiny_bert(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval().to(dtype)
    return model, ops.torch.optimize(copy.deepcopy(model))


def _graphs(layer):
    return [g for g in layer.__dict__["_tpp_replay"][0]._graphs.values()
            if type(g) is replay.Graph]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_converted_bert_layer_replays_its_plain_forward(dtype):
    model, fast = _tiny_bert(dtype)
    layer = fast.encoder.layer[0]
    lengths = (11, 16, 5)       # tails of the attention block and none
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(3, 99, (1, length))
            # the first call of a length runs the plain forward, the second is recorded,
            # the third validated then replayed, the fourth replayed
            outs = [fast(input_ids=ids).last_hidden_state for _ in range(4)]
            want = model(input_ids=ids).last_hidden_state
            for got in outs[1:]:
                assert torch.equal(got, outs[0])
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
            assert (outs[-1].float() - want.float()).abs().max() <= tol * 10
    assert len(_graphs(layer)) == len(lengths)
    assert all(g.validated for g in _graphs(layer))


def test_a_changed_layer_is_recorded_again():
    _, fast = _tiny_bert()
    ids = torch.randint(3, 99, (1, 9))
    with torch.no_grad():
        for _ in range(3):
            fast(input_ids=ids)
        layer = fast.encoder.layer[1]
        assert _graphs(layer)
        layer.output.dense.weight.mul_(0.5)            # in place
        layer.attention.self.scaling = 0.25
        got = fast(input_ids=ids).last_hidden_state
        assert not _graphs(layer)
        want = copy.deepcopy(fast)(input_ids=ids).last_hidden_state    # its plain forward
        assert torch.equal(got, want)
        for _ in range(3):
            assert torch.equal(fast(input_ids=ids).last_hidden_state, want)
        assert _graphs(layer)
        calls = []
        layer.output.register_forward_hook(lambda *a: calls.append(1))
        for _ in range(3):
            fast(input_ids=ids)
        assert len(calls) == 3          # a hooked block: the original forward, every call


def test_threads_replay_their_own_graphs():
    _, fast = _tiny_bert()
    inputs = [torch.randint(3, 99, (1, n)) for n in (7, 12, 7, 12)]
    with torch.no_grad():
        want = [copy.deepcopy(fast)(input_ids=i).last_hidden_state for i in inputs]
        results, errors = {}, []

        def work(t):
            try:
                with torch.no_grad():
                    for rep in range(5):
                        for j, ids in enumerate(inputs):
                            results[t, rep, j] = fast(input_ids=ids).last_hidden_state
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors
    for (_, _, j), got in results.items():
        assert torch.equal(got, want[j])


def test_copies_and_pickles_start_without_graphs():
    _, fast = _tiny_bert()
    ids = torch.randint(3, 99, (1, 6))
    with torch.no_grad():
        for _ in range(3):
            fast(input_ids=ids)
        twin = copy.deepcopy(fast)
        buf = io.BytesIO()
        torch.save(fast, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        for m in (twin, loaded):
            assert "_tpp_replay" not in m.encoder.layer[0].__dict__
            for _ in range(3):
                assert torch.equal(m(input_ids=ids).last_hidden_state,
                                   fast(input_ids=ids).last_hidden_state)


def test_invalidate_packed_and_large_scratch(monkeypatch):
    _, fast = _tiny_bert()
    ids = torch.randint(3, 99, (1, 8))
    layer = fast.encoder.layer[0]
    with torch.no_grad():
        for _ in range(3):
            want = fast(input_ids=ids).last_hidden_state
        assert _graphs(layer)
        dense = layer.intermediate.dense
        old = dense.weight.detach().clone()
        dense.weight.data.mul_(2)       # bypasses the version counter: needs invalidate_packed
        ops.torch.invalidate_packed(fast)
        assert "_tpp_replay" not in layer.__dict__
        assert not torch.equal(fast(input_ids=ids).last_hidden_state, want)
        dense.weight.data.copy_(old)
        ops.torch.invalidate_packed(fast)
        monkeypatch.setattr(replay, "MAX_ARENA_BYTES", 64)
        for _ in range(3):
            assert torch.equal(fast(input_ids=ids).last_hidden_state, want)
        assert not _graphs(layer)
        assert "MAX_ARENA_BYTES" in layer.__dict__["_tpp_replay"][0].why_not(
            (ids.shape + (32,), torch.float32, tpp.get_num_threads(), torch.get_num_threads()))


def test_class_swaps_modes_and_transforms_are_served_as_the_plain_forward():
    _, fast = _tiny_bert()
    layer = fast.encoder.layer[0]
    ids = torch.randint(3, 99, (1, 11))
    long = torch.randint(3, 99, (1, 40))
    with torch.inference_mode():        # the thread's arena first made in inference mode,
        for _ in range(4):              # and the host steps' views
            fast(input_ids=long)
    with torch.no_grad():
        for _ in range(4):
            fast(input_ids=ids)
            fast(input_ids=long)
        assert len(_graphs(layer)) == 2

        class Doubling(torch.nn.Linear):
            def forward(self, x):
                return super().forward(x) * 2

        layer.output.dense.__class__ = Doubling        # not in any __dict__
        want = copy.deepcopy(fast)(input_ids=ids).last_hidden_state
        assert torch.equal(fast(input_ids=ids).last_hidden_state, want)
        layer.output.dense.__class__ = torch.nn.Linear

        from torch.overrides import TorchFunctionMode

        class Seen(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))
        for _ in range(3):
            fast(input_ids=ids)
        seen = []
        with Seen():
            layer(torch.randn(1, 11, 32))
        assert torch.nn.functional.linear in seen       # the original forward, under the mode
        x4 = torch.randn(3, 1, 11, 32)
        torch.testing.assert_close(torch.func.vmap(layer)(x4),
                                   torch.func.vmap(copy.deepcopy(layer))(x4))


def test_one_call_that_captures_outputs_does_not_end_the_fused_path():
    model, fast = _tiny_bert()
    ids = torch.randint(3, 99, (1, 13))
    with torch.no_grad():
        want = model(input_ids=ids, output_hidden_states=True)
        got = fast(input_ids=ids, output_hidden_states=True)
        assert any(m._forward_hooks for m in fast.modules())    # transformers' capture hooks
        plain = [fast(input_ids=ids).last_hidden_state for _ in range(4)]
        again = fast(input_ids=ids, output_hidden_states=True)
    assert _graphs(fast.encoder.layer[0])      # the hooks, idle, did not stop the replays
    for g in (got, again):
        assert len(g.hidden_states) == len(want.hidden_states) == 3
        for a, b in zip(g.hidden_states, want.hidden_states):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for p in plain:
        torch.testing.assert_close(p, want.last_hidden_state, rtol=1e-4, atol=1e-4)


def test_bad_input_after_replays_raises_as_the_plain_forward_does():
    torch.manual_seed(3)
    enc = ops.torch.optimize(torch.nn.TransformerEncoderLayer(64, 4, 96, batch_first=True).eval())
    conv = ops.torch.optimize(torch.nn.Conv2d(3, 8, 3))
    with torch.no_grad():
        for _ in range(4):
            enc(torch.randn(2, 7, 64))
            conv(torch.randn(1, 3, 8, 8))
        for _ in range(3):      # a first call and the calls after it alike
            with pytest.raises(RuntimeError, match="embed_dim"):
                enc(torch.randn(2, 7, 63))
            with pytest.raises(ValueError, match="channels"):
                conv(torch.randn(1, 4, 8, 8))
            with pytest.raises(RuntimeError):
                conv(torch.randn(1, 3, 8, 8, 2))
