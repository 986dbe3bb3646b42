"""Test session setup: a private kernel cache, so tests never read or write ~/.cache/tpp.

Unless TPP_CACHE_DIR is set already (by the user: then it is used as it is and kept), the
process that starts the test run makes one temporary cache directory when pytest is configured,
before any test module is imported, and removes it when the run ends. With pytest-xdist that
process is the controller: its workers start later, inherit TPP_CACHE_DIR and so share the
directory (and neither make nor remove one).
"""
import os
import shutil
import tempfile

import pytest

_MADE = []   # the directory this process made for the run in progress


def pytest_configure(config):
    if not os.environ.get("TPP_CACHE_DIR"):
        path = tempfile.mkdtemp(prefix="tpp-test-cache-")
        os.environ["TPP_CACHE_DIR"] = path
        _MADE.append(path)


def pytest_unconfigure(config):
    while _MADE:
        path = _MADE.pop()
        if os.environ.get("TPP_CACHE_DIR") == path:
            del os.environ["TPP_CACHE_DIR"]
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_threads():
    """Every test starts from the environment's thread count, whatever the last one set."""
    try:
        yield
    finally:
        import tpp      # imported here: TPP_CACHE_DIR must be set before tpp loads
        tpp.set_num_threads(None)


@pytest.fixture
def run_as_avx2():
    """run(module, call, timeout): `import <module> as t; t.<call>` in a fresh Python with
    AVX2 code (TPP_CPU_ISA=avx2) and its own disk cache, the tests directory on its path;
    returns the CompletedProcess. For the paths a host with AVX-512 or a bf16 dot
    instruction would not take by default."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))

    def run(module, call, timeout=600):
        script = (f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as t\n"
                  f"t.{call}\n")
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TPP_CPU_ISA="avx2", TPP_CACHE_DIR=cache)
            return subprocess.run([sys.executable, "-c", script, here], env=env,
                                  capture_output=True, text=True, timeout=timeout)
    return run
