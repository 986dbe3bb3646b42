"""The disk cache: atomic, owner-only, and never trusting an entry it cannot verify."""
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tpp
from tpp.runtime import cache
from tpp_cpu import backend

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "kernels"
    monkeypatch.setenv("TPP_CACHE_DIR", str(d))
    backend.reset_disk_cache()
    yield d
    backend.reset_disk_cache()


def test_directory_is_owner_only_and_entries_round_trip(cache_dir):
    dc = cache.DiskCache(cache_dir)
    dc.store("k1", b"payload")
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    assert dc.load("k1") == b"payload"
    assert dc.load("k2") is None


def test_corrupt_truncated_and_foreign_entries_are_not_trusted(cache_dir):
    dc = cache.DiskCache(cache_dir)
    dc.store("key", b"x" * 100)
    path = dc.path_for("key")
    blob = path.read_bytes()
    path.write_bytes(blob[:-10])                      # truncated
    assert dc.load("key") is None
    path.write_bytes(blob[:-1] + b"y")                # payload flipped: checksum fails
    assert dc.load("key") is None
    path.write_bytes(b"garbage")                      # not an entry at all
    assert dc.load("key") is None
    dc.store("other", b"z" * 100)                     # another key's entry under this name
    path.write_bytes(dc.path_for("other").read_bytes())
    assert dc.load("key") is None
    path.unlink()
    path.symlink_to(dc.path_for("other"))             # a symlink is never followed
    assert dc.load("key") is None


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_entries_of_other_users_are_ignored(cache_dir):
    dc = cache.DiskCache(cache_dir)
    dc.store("key", b"data")
    os.chown(dc.path_for("key"), 12345, 12345)
    assert dc.load("key") is None


def test_a_corrupt_kernel_entry_is_rebuilt(cache_dir):
    spec = tpp.unary("abs", 3, 11).spec
    backend.compile(spec)
    key = backend.cache_key(spec, backend.current())
    path = backend._disk().path_for(key)
    assert path.exists()
    path.write_bytes(path.read_bytes()[:50])
    compiled = backend.compile(spec)                  # rebuilds instead of loading junk
    fn = tpp.runtime.arrays.ffi.cast("void(*)(intptr_t, intptr_t)", compiled.address)
    x = -np.arange(33, dtype=np.float32).reshape(3, 11)
    y = np.empty_like(x)
    fn(x.ctypes.data, y.ctypes.data)
    np.testing.assert_array_equal(y, np.abs(x))
    assert backend._disk().load(key) is not None     # and the entry was rewritten


def test_keys_change_with_generator_version_and_target(cache_dir, monkeypatch):
    spec = tpp.unary("abs", 3, 11).spec
    k1 = backend.cache_key(spec, backend.current())
    monkeypatch.setattr(backend, "generator_version", lambda: "another")
    assert backend.cache_key(spec, backend.current()) != k1
    from tpp_cpu import target
    assert target.make_target("avx2").key() != target.make_target("avx512").key()


_CHILD = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {root!r})
    import tpp
    from tpp_cpu import backend
    if sys.argv[1] == "forbid-build":
        def refuse(*a, **k):
            raise SystemExit("compiled although the disk cache had the kernel")
        backend.build_object = refuse
    k = tpp.unary("gelu", 13, 29)
    x = np.linspace(-5, 5, 13 * 29, dtype=np.float32).reshape(13, 29)
    want = tpp.core.reference.run(k.spec, x)
    np.testing.assert_allclose(k(x), want, rtol=1e-6, atol=1e-30)
    if sys.argv[1] == "forbid-build" and backend.sharedlib.linker():
        assert "llvmlite.binding" not in sys.modules, "a cache hit should not need LLVM"
    print("ok")
""")


def _spawn(cache_dir, mode):
    env = dict(os.environ, TPP_CACHE_DIR=str(cache_dir))
    return subprocess.Popen([sys.executable, "-c", _CHILD.format(root=str(ROOT)), mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_compile_the_same_kernel_at_once(cache_dir):
    procs = [_spawn(cache_dir, "build") for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == "ok"
    entries = list(cache_dir.glob("*.tppk"))
    assert len(entries) == 1 and not list(cache_dir.glob(".tmp-*"))
    p = _spawn(cache_dir, "forbid-build")             # a new process loads it from disk
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err


def test_disk_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("TPP_DISK_CACHE", "0")
    assert cache.default_directory() is None
    dc = cache.DiskCache(None)
    dc.store("k", b"v")
    assert dc.load("k") is None


def _read_only(directory, monkeypatch):
    """Make directory read-only for this process: chmod 0500, and for root (who may write
    anyway) a cache that sees it as not writable. Undone by the `restore` it returns."""
    os.chmod(directory, 0o500)
    if os.getuid() == 0:
        monkeypatch.setattr(cache, "_writable", lambda d: False)
    return lambda: os.chmod(directory, 0o700)


def test_a_read_only_cache_is_read_but_not_written(cache_dir, monkeypatch):
    cache.DiskCache(cache_dir).store("key", b"payload")
    restore = _read_only(cache_dir, monkeypatch)
    try:
        ro = cache.DiskCache(cache_dir)
        assert ro.load("key") == b"payload"           # a pre-filled shared cache is used
        assert not ro.writable
        assert ro.store("other", b"x") is None and ro.load("other") is None
        assert sorted(p.name for p in cache_dir.iterdir()) == [ro.path_for("key").name]
    finally:
        restore()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_a_read_only_cache_trusts_only_the_user_and_root(cache_dir, monkeypatch):
    dc = cache.DiskCache(cache_dir)
    dc.store("mine", b"a")
    dc.store("foreign", b"b")
    os.chown(dc.path_for("foreign"), 12345, 12345)
    restore = _read_only(cache_dir, monkeypatch)
    try:
        ro = cache.DiskCache(cache_dir)
        assert ro.load("mine") == b"a" and ro.load("foreign") is None
    finally:
        restore()


def test_kernels_load_from_a_read_only_cache(cache_dir, monkeypatch):
    spec = tpp.make_unary("abs", 3, 13)
    backend.compile(spec)                             # pre-fills the cache
    entries = sorted(cache_dir.iterdir())
    restore = _read_only(cache_dir, monkeypatch)
    try:
        backend.reset_disk_cache()
        counts = dict(backend.COUNTS)
        backend.compile(spec)
        assert backend.COUNTS["loaded"] == counts["loaded"] + 1
        assert backend.COUNTS["built"] == counts["built"]
        compiled = backend.compile(tpp.make_unary("abs", 3, 14))   # a miss: built, not stored
        assert backend.COUNTS["built"] == counts["built"] + 1
        assert sorted(cache_dir.iterdir()) == entries
        fn = tpp.runtime.arrays.ffi.cast("void(*)(intptr_t, intptr_t)", compiled.address)
        x = -np.arange(42, dtype=np.float32).reshape(3, 14)
        y = np.empty_like(x)
        fn(x.ctypes.data, y.ctypes.data)
        np.testing.assert_array_equal(y, np.abs(x))
    finally:
        restore()
