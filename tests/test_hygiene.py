"""What a process leaves behind and holds on to: no temporary files after loading kernels or
after a test run, bounded per-process caches, and tpp.clear_caches() / tpp.cache_info()."""
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tpp
from tpp.runtime import lru
from tpp_cpu import backend, sharedlib

ROOT = Path(__file__).resolve().parent.parent


def _run(args, tmpdir: Path, **env):
    """Run a command with a private TMPDIR; returns the CompletedProcess."""
    environ = dict(os.environ, TMPDIR=str(tmpdir), **env)
    return subprocess.run(args, cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=600)


# ------------------------------------------------------------------ temporary files
_COMPILE = textwrap.dedent("""
    import numpy as np, tpp
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 6
    assert (tpp.unary("relu", 3, 4)(x) == np.maximum(x, 0)).all()
    print(tpp.cache_info()["compiled"], tpp.cache_info()["disk_hits"])
""")


def test_loading_kernels_leaves_no_temporary_files(tmp_path):
    tmpdir, cache_dir = tmp_path / "tmp", tmp_path / "cache"
    tmpdir.mkdir()
    built = _run([sys.executable, "-c", _COMPILE], tmpdir, TPP_CACHE_DIR=str(cache_dir))
    assert built.returncode == 0, built.stderr
    loaded = _run([sys.executable, "-c", _COMPILE], tmpdir, TPP_CACHE_DIR=str(cache_dir))
    assert loaded.returncode == 0, loaded.stderr
    assert (built.stdout.split(), loaded.stdout.split()) == (["1", "0"], ["0", "1"])
    assert sorted(p.name for p in tmpdir.iterdir()) == []


@pytest.mark.skipif(sharedlib.linker() is None, reason="kernels load as shared libraries only "
                    "where the system linker exists")
def test_the_same_library_is_loaded_once():
    spec = tpp.make_unary("abs", 5, 7)
    first = backend.compile(spec).address
    loaded = len(sharedlib._LIBS)
    assert backend.compile(spec).address == first     # reloaded from disk: same code
    assert len(sharedlib._LIBS) == loaded


def test_session_cache_dir_is_shared(tmp_path):
    """Run by test_a_test_run_removes_its_cache_dir in a pytest of its own: each worker
    writes down the kernel cache it uses."""
    report = os.environ.get("TPP_HYGIENE_REPORT")
    cache_dir = os.environ["TPP_CACHE_DIR"]
    assert os.path.isdir(cache_dir)
    tpp.unary("relu", 2, 3).compile()
    if report:
        with open(report, "a") as f:
            f.write(cache_dir + "\n")


def test_a_test_run_removes_its_cache_dir(tmp_path):
    tmpdir, report = tmp_path / "tmp", tmp_path / "report"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TPP_CACHE_DIR"}
    env.update(TMPDIR=str(tmpdir), TPP_HYGIENE_REPORT=str(report))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
         "tests/test_hygiene.py::test_session_cache_dir_is_shared",
         "tests/test_hygiene.py::test_the_same_library_is_loaded_once"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    used = set(report.read_text().split())
    assert len(used) == 1, used                       # one directory for the whole run
    assert Path(used.pop()).parent == tmpdir
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("tpp-")] == []


# ------------------------------------------------------------------ bounded caches
def _matmul_module():
    return importlib.import_module("ops.matmul")     # ops.matmul is the function


def test_lru_evicts_the_least_recently_used():
    cache = lru.LRU(2, "test")
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1                        # "a" is now the most recent
    cache["c"] = 3
    assert cache.keys() == ["a", "c"] and cache.get("b") is None
    assert cache.get("b", 0) == 0 and len(cache) == 2
    with pytest.raises(TypeError):
        cache.get(["unhashable"])
    assert lru.sizes()["test"] == 2
    lru.clear_all()
    assert len(cache) == 0


def test_a_kernel_keeps_a_bounded_number_of_stride_variants():
    k = tpp.unary("relu", 2, 3)
    strides = range(3, 3 + lru.VARIANTS_PER_KERNEL + 8)
    for ld in strides:
        x = np.arange(2 * ld, dtype=np.float32).reshape(2, ld) - ld
        np.testing.assert_array_equal(k(x[:, :3]), np.maximum(x[:, :3], 0))
    assert len(k._variants) == lru.VARIANTS_PER_KERNEL
    loaded = len(sharedlib._LIBS)
    x = np.ones((2, 3 + 1), np.float32)               # an evicted stride: back from disk
    k(x[:, :3])
    assert len(sharedlib._LIBS) == loaded             # ... without mapping its code again


def test_brgemm_variants_are_bounded():
    mm = tpp.brgemm(2, 2, 2)
    assert isinstance(mm._variants, lru.LRU)
    assert mm._variants.maxsize == lru.VARIANTS_PER_KERNEL


def test_process_wide_caches_keyed_by_user_input_are_bounded():
    import ops
    from tpp.runtime import loops
    for cache in (loops._COMPILED, _matmul_module()._PLANS):
        assert isinstance(cache, lru.LRU)
    with pytest.raises(tpp.ArgumentError):            # an unhashable argument still fails
        ops.matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32),
                   activation=["relu"])


def test_cuda_functions_are_bounded_without_cupy():
    from tpp_cuda import runtime
    assert isinstance(runtime._FUNCTIONS, lru.LRU)


# ------------------------------------------------------------------ clear_caches
def test_clear_caches_empties_every_cache_and_kernels_still_work():
    import ops
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    k = tpp.unary("relu", 3, 4)
    k(x)
    wide = np.zeros((3, 9), np.float32)
    k(wide[:, :4])                                    # a second stride variant
    a, b = np.ones((8, 16), np.float32), np.ones((16, 8), np.float32)
    ops.matmul(a, b)
    info = tpp.cache_info()
    assert info["kernels"] >= 1 and info["variants"] >= 2 and info["matmul_plans"] >= 1
    assert info["loop_nests"] >= 1
    compiled = info["compiled"] + info["disk_hits"]

    tpp.clear_caches()
    info = tpp.cache_info()
    for name in ("kernels", "variants", "loop_nests", "matmul_plans", "cuda_functions"):
        assert info[name] == 0, (name, info)
    assert _matmul_module().gemm_nest.cache_info().currsize == 0
    assert info["compiled"] + info["disk_hits"] == compiled   # counters are not reset

    np.testing.assert_array_equal(k(x), np.maximum(x, 0))     # a kernel in hand still works
    np.testing.assert_array_equal(tpp.unary("relu", 3, 4)(x), np.maximum(x, 0))
    np.testing.assert_allclose(ops.matmul(a, b), a @ b)
    after = tpp.cache_info()
    assert after["disk_hits"] > info["disk_hits"]     # rebuilt from the disk cache
    assert after["compiled"] == info["compiled"]
