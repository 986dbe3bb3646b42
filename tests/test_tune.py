"""ops.tune: the search is bounded, the winner is stored per CPU and problem, and ops.matmul /
ops.linear use a stored winner (same results, the winner's blocking) and nothing else."""
import importlib

import numpy as np
import pytest

import ops
from ops import autotune as tune
from tpp.core.errors import ArgumentError

matmul_module = importlib.import_module("ops.matmul")   # ops.matmul is the function


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TPP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TPP_DISK_CACHE", raising=False)
    tune.forget()
    matmul_module.forget_tuned()
    yield tmp_path
    tune.forget()
    matmul_module.forget_tuned()


def _fake_timing(monkeypatch, seconds):
    """Make each candidate's measured time seconds(candidate): deterministic searches."""
    def runner(a, b, bias, dt_out, activation, cand):
        def run():
            return cand
        return run
    monkeypatch.setattr(tune, "_runner", runner)
    monkeypatch.setattr(tune, "_baseline", runner)      # the heuristic's run: its Candidate
    monkeypatch.setattr(tune, "_time", lambda run: seconds(run()))


def _built_blockings(monkeypatch):
    """The list of blockings gemm_nest builds nests with from now on (appended per build)."""
    seen = []
    original = matmul_module.gemm_nest
    monkeypatch.setattr(matmul_module, "gemm_nest",
                        lambda *args, **kw: seen.append(args[7]) or original(*args, **kw))
    return seen


def test_candidates_are_valid_and_start_with_the_heuristic():
    space = tune.candidates(100, 96, 300, tune._dt.F32, tune._dt.F32)
    assert space[0] == tune.heuristic(300, 96, tune._dt.F32)
    assert len(set(space)) == len(space) > 10
    assert all(c.kc <= 300 and c.bm >= 1 and c.bn in (32, 64, 128) for c in space)
    bf16 = tune.candidates(64, 64, 300, tune._dt.BF16, tune._dt.BF16)
    assert all(c.kc == 300 for c in bf16)          # a bf16 C keeps K whole


def test_a_real_search_is_never_worse_than_the_heuristic(cache_dir):
    result = tune.tune("matmul", 48, 40, 72, budget_s=0.3, repeats=2)
    assert result.heuristic in result.seconds and result.best in result.seconds
    assert result.speedup >= 1.0
    assert result.gflops(result.best) > 0
    assert 1 <= len(result.seconds) <= len(tune.candidates(48, 40, 72, tune._dt.F32,
                                                           tune._dt.F32))


def test_the_search_stops_at_its_budget(cache_dir, monkeypatch):
    """A clock that advances 0.1 s per measurement: a 0.3 s budget measures the first few
    candidates only (whatever the machine's speed: the bound was asserted on wall time)."""
    now = [0.0]

    def timed(cand):
        now[0] += 0.1
        return 1.0
    _fake_timing(monkeypatch, timed)
    monkeypatch.setattr(tune.time, "perf_counter", lambda: now[0])
    space = tune.candidates(100, 96, 300, tune._dt.F32, tune._dt.F32)
    result = tune.tune("matmul", 100, 96, 300, budget_s=0.3, repeats=1)
    assert 2 <= len(result.seconds) <= 3 < len(space)


def test_the_winner_is_stored_and_used_by_matmul_and_linear(cache_dir, monkeypatch):
    winner = tune.Candidate(32, 64, 32, "BC", 1)
    _fake_timing(monkeypatch, lambda cand: 0.5 if cand == winner else 1.0)
    result = tune.tune("matmul", 70, 80, 128, space=[winner])
    assert result.best == winner and result.stored and result.speedup == 2.0
    assert tune.lookup(80, 128, "f32", "f32", False, None) == winner
    assert tune.lookup_bn(80, 128, "f32") == 32
    assert tune.lookup(80, 128, "f32", "f32", True, None) is None     # another problem

    seen = _built_blockings(monkeypatch)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((70, 128), np.float32)
    b = rng.standard_normal((128, 80), np.float32)
    packed = ops.pack_kn(b)
    assert packed.bn == 32                               # packed with the winner's width
    np.testing.assert_allclose(ops.matmul(a, packed), a @ b, rtol=1e-4, atol=1e-4)
    assert seen and seen[-1] == winner.blocking()
    w = np.ascontiguousarray(b.T)
    np.testing.assert_allclose(ops.linear(a, w), a @ b, rtol=1e-4, atol=1e-4)


def test_a_winner_serves_calls_near_its_m_and_fewer_rows_take_the_heuristic(cache_dir,
                                                                            monkeypatch):
    winner = tune.Candidate(32, 64, 64, "BC")
    _fake_timing(monkeypatch, lambda cand: 0.5 if cand == winner else 1.0)
    assert tune.tune("linear", 96, 64, 64, space=[winner]).stored
    assert tune.lookup_with_rows(64, 64, "f32", "f32", False, None) == (winner, 96 // tune.SHARE)
    seen = _built_blockings(monkeypatch)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 64), np.float32)
    packed = ops.pack_nk(w)
    heuristic = matmul_module.choose_blocking(64, tune._dt.F32)
    built = []
    for m in (96, 200, 48, 47, 1):
        x = rng.standard_normal((m, 64), np.float32)
        np.testing.assert_allclose(ops.linear(x, packed), x @ w.T, rtol=1e-4, atol=1e-4)
        built.append(list(seen))
    # the winner's nest at the first call, the heuristic's at the first call under 48 rows
    assert built == [[winner.blocking()]] * 3 + [[winner.blocking(), heuristic]] * 2
    plan, = packed.plans.values()
    assert plan.tuned_rows == 48
    assert plan.for_rows(48) is plan and plan.for_rows(47) is plan.for_rows(1) is not plan


def test_winners_of_the_earlier_format_are_not_read(cache_dir):
    disk = tune._disk()
    old = tune._key(64, 64, "f32", "f32", False, None)
    disk.store(old, b'{"bm": 32, "kc": 64, "bn": 64, "order": "BC", "threads": null}')
    assert tune.lookup(64, 64, "f32", "f32", False, None) is None


def test_no_winner_is_stored_when_nothing_beats_the_margin(cache_dir, monkeypatch):
    other = tune.Candidate(32, 64, 32)
    _fake_timing(monkeypatch, lambda cand: 0.99 if cand == other else 1.0)
    result = tune.tune("linear", 64, 64, 64, space=[other], margin=0.03)
    assert result.best == result.heuristic and not result.stored
    assert tune.lookup(64, 64, "f32", "f32", False, None) is None


def _search_then(fast_in_search, later, repeats=5):
    """seconds(cand) for _fake_timing: fast_in_search[cand] for a candidate's first `repeats`
    calls (the search's), later[cand] after (the confirmation round's); 1.0 otherwise."""
    calls = {}

    def seconds(cand):
        calls[cand] = calls.get(cand, 0) + 1
        table = fast_in_search if calls[cand] <= repeats else later
        return table.get(cand, 1.0)
    return seconds


def test_a_search_winner_that_does_not_hold_up_again_is_not_stored(cache_dir, monkeypatch):
    lucky = tune.Candidate(32, 64, 32)
    _fake_timing(monkeypatch, _search_then({lucky: 0.5}, {lucky: 1.0}))
    result = tune.tune("linear", 64, 64, 64, space=[lucky], repeats=5)
    assert result.best == result.heuristic and not result.stored
    assert result.seconds[lucky] == 1.0 and result.speedup == 1.0
    assert tune.lookup(64, 64, "f32", "f32", False, None) is None


def test_the_confirmation_round_picks_among_the_finalists(cache_dir, monkeypatch):
    first, second, slow = (tune.Candidate(32, 64, 32), tune.Candidate(16, 64, 64),
                           tune.Candidate(64, 64, 32, "BC"))
    _fake_timing(monkeypatch, _search_then({first: 0.5, second: 0.6, slow: 0.99},
                                           {first: 0.9, second: 0.7, slow: 0.1}))
    result = tune.tune("matmul", 64, 64, 64, space=[first, second, slow], repeats=5)
    # slow never beat the margin in the search, so it is not measured again
    assert result.best == second and result.stored
    assert result.seconds[slow] == 0.99 and result.speedup == pytest.approx(1 / 0.7)
    assert tune.lookup(64, 64, "f32", "f32", False, None) == second


def test_winners_of_another_cpu_are_not_read(cache_dir, monkeypatch):
    winner = tune.Candidate(32, 64, 32)
    _fake_timing(monkeypatch, lambda cand: 0.5 if cand == winner else 1.0)
    assert tune.tune("matmul", 64, 64, 64, space=[winner]).stored
    monkeypatch.setattr(tune, "_fingerprint", lambda: "another cpu")
    tune.forget()
    assert tune.lookup(64, 64, "f32", "f32", False, None) is None


def test_corrupt_or_foreign_entries_are_ignored(cache_dir):
    disk = tune._disk()
    disk.store(tune._key(64, 64, "f32", "f32", False, None), b"{not json")
    disk.store(tune._bn_key(64, 64, "f32"), b'"wide"')
    assert tune.lookup(64, 64, "f32", "f32", False, None) is None
    assert tune.lookup_bn(64, 64, "f32") is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(op="conv"), "op must be one of"),
    (dict(m=0), "m must be a positive int"),
    (dict(k=2.5), "k must be a positive int"),
    (dict(budget_s=0), "budget_s"),
])
def test_bad_arguments_are_tpp_errors(kwargs, match):
    args = dict(op="matmul", m=8, n=8, k=8)
    args.update(kwargs)
    budget = args.pop("budget_s", 1.0)
    with pytest.raises(ArgumentError, match=match):
        tune.tune(args.pop("op"), args.pop("m"), args.pop("n"), args.pop("k"), budget_s=budget)


def test_tpp_bench_tune_measures_the_winner_against_the_heuristic(cache_dir, monkeypatch,
                                                                  capsys):
    import json
    from bench import cli
    monkeypatch.setenv("TPP_TUNE_BUDGET", "0.3")
    path = cache_dir / "tune.json"
    assert cli.main(["tune", "--tiny", "-q", "--plain", "--json", str(path)]) == 0
    records = {r["provider"]: r for r in json.loads(path.read_text()) if r["suite"] == "tune"}
    assert {"tpp", "heuristic"} <= set(records)
    assert records["tpp"]["shape"] == [64, 64, 64] and "heuristic" in records["tpp"]["ratios"]
    assert {"bm", "kc", "bn", "order", "threads"} <= set(records["tpp"]["extra"]["winner"])


def test_the_heuristic_is_what_matmul_runs_without_a_winner():
    """Its panel width and order are pack_kn's and matmul's defaults (bf16 on a matrix unit:
    wide panels, row blocks outer for small weights), so winners are measured against them."""
    import tpp
    assert tune.heuristic(300, 96, tune._dt.F32) == tune.Candidate(64, 300, 64, "CB")
    bf16 = tune.heuristic(384, 1152, tune._dt.BF16)
    if tpp.has_matrix_unit(tune._dt.BF16):
        assert bf16 == tune.Candidate(64, 384, 384, "BC")
        assert any(c.bn == 384 for c in tune.candidates(256, 1152, 384, tune._dt.BF16,
                                                        tune._dt.BF16))
    else:
        assert bf16 == tune.Candidate(64, 384, 64, "CB")
    rng = np.random.default_rng(3)
    w = rng.standard_normal((384, 1152), np.float32).astype(tune._dt.BF16.numpy)
    assert ops.pack_kn(w).bn == bf16.bn


def test_the_baseline_is_the_default_plan_and_ignores_stored_winners(cache_dir, monkeypatch):
    """tune's yardstick runs ops.matmul as a call without blocking= does, stored winners
    aside: a winner stored earlier (of the heuristic's panel width) is not measured as the
    heuristic."""
    winner = tune.Candidate(32, 64, 64, "BC")
    _fake_timing(monkeypatch, lambda cand: 0.5 if cand == winner else 1.0)
    assert tune.tune("matmul", 96, 64, 64, space=[winner]).stored
    monkeypatch.undo()
    monkeypatch.setenv("TPP_CACHE_DIR", str(cache_dir))
    seen = _built_blockings(monkeypatch)
    rng = np.random.default_rng(4)
    a = rng.standard_normal((96, 64), np.float32)
    b = rng.standard_normal((64, 64), np.float32)
    run = tune._baseline(a, b, None, tune._dt.F32, None, tune.heuristic(64, 64, tune._dt.F32))
    assert seen == [matmul_module.choose_blocking(64, tune._dt.F32)]
    np.testing.assert_allclose(run(), a @ b, rtol=1e-4, atol=1e-4)
    assert tune.lookup(64, 64, "f32", "f32", False, None) == winner     # still stored


def test_the_baseline_of_a_long_k_bf16_output_sums_k_in_chunks(cache_dir, monkeypatch):
    """A bf16 output with K past matmul_longk.LONG_K runs the chunked plan by default: the
    baseline measures that plan, not the whole-K blocking no call takes."""
    from ops import matmul_longk
    runs = []
    original = matmul_longk.LongKPlan.run
    monkeypatch.setattr(matmul_longk.LongKPlan, "run",
                        lambda self, *args: runs.append(1) or original(self, *args))
    k = matmul_longk.LONG_K + 2
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, k), np.float32).astype(tune._dt.BF16.numpy)
    b = rng.standard_normal((k, 16), np.float32).astype(tune._dt.BF16.numpy)
    run = tune._baseline(a, b, None, tune._dt.BF16, None, tune.heuristic(k, 16, tune._dt.BF16))
    run()
    assert len(runs) == 2
