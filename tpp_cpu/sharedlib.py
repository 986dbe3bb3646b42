"""Kernels as shared libraries: linked once with the system linker, loaded with dlopen.

A cached kernel stored as a shared library loads in a fraction of a millisecond in a new
process without importing LLVM at all. Where no linker is installed, `link` returns None and
the caller keeps the relocatable objects, which the MCJIT engine loads (`jit.load_all`).

Loading leaves nothing behind on disk: each library is written to its own temporary file,
dlopen'ed and unlinked at once (no per-process directory to clean up, even after a crash).
A library stays loaded for the life of the process, and bytes loaded once are not loaded again:
a kernel whose in-process handle was dropped (tpp.clear_caches, an evicted variant) reuses its
code instead of mapping another copy.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_ET_REL, _ET_DYN = 1, 3
_LIBS = []   # keep every loaded library alive for the life of the process
_LOADED: dict = {}   # (sha256 of the library, symbol) -> address, for every load so far


@functools.lru_cache(maxsize=None)
def linker() -> str | None:
    return shutil.which("ld")


def link(objects) -> bytes | None:
    """The shared library made of relocatable objects (bytes, or a list of them: one link for
    all), or None without a working linker."""
    objects = [objects] if isinstance(objects, bytes) else list(objects)
    tool = linker()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory(prefix="tpp-link-") as tmp:
        sources = [Path(tmp) / f"k{i}.o" for i in range(len(objects))]
        for src, obj in zip(sources, objects):
            src.write_bytes(obj)
        dst = Path(tmp) / "k.so"
        try:
            done = subprocess.run([tool, "-shared", "-z", "noexecstack", "-o", str(dst)]
                                  + [str(src) for src in sources],
                                  capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode != 0 or not dst.exists():
            return None
        return dst.read_bytes()


def elf_type(blob: bytes) -> int | None:
    """ELF e_type (1: relocatable object, 3: shared library) of x86-64 ELF bytes, else None."""
    if len(blob) < 18 or blob[:4] != b"\x7fELF" or blob[4] != 2 or blob[5] != 1:
        return None
    return int.from_bytes(blob[16:18], "little")


def is_shared(blob: bytes) -> bool:
    return elf_type(blob) == _ET_DYN


def is_object(blob: bytes) -> bool:
    return elf_type(blob) == _ET_REL


def load(library: bytes, symbol: str) -> int:
    """The address of symbol in a shared library given as bytes (see load_all)."""
    return load_all(library, (symbol,))[0]


def load_all(library: bytes, symbols) -> tuple:
    """Load a shared library given as bytes and return the address of each of symbols
    (OSError if impossible). The same bytes and symbol give the address of the earlier load;
    otherwise the bytes are written to a new owner-only temporary file (mkstemp, fresh name),
    loaded once, and the file unlinked: what runs is exactly the bytes the caller verified,
    however the cache file changes later. Should dlopen hand back an earlier library of other
    bytes (it matches loaded files by inode, and an unlinked file's inode may be reused), that
    library lacks the symbols, whose names are unique to their cache key: OSError, never the
    wrong code."""
    digest = hashlib.sha256(library).digest()
    keys = [(digest, symbol) for symbol in symbols]
    if not all(key in _LOADED for key in keys):
        for key, address in zip(keys, _dlopen(library, symbols)):
            _LOADED[key] = address
    return tuple(_LOADED[key] for key in keys)


def _dlopen(library: bytes, symbols) -> list:
    """dlopen the bytes through a temporary file, unlinked at once; the address of each
    symbol."""
    fd, name = tempfile.mkstemp(prefix="tpp-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(library)
        lib = ctypes.CDLL(name, mode=ctypes.RTLD_LOCAL)
    finally:
        os.unlink(name)
    try:
        fns = [getattr(lib, symbol) for symbol in symbols]
    except AttributeError as exc:
        raise OSError(f"{exc} (a symbol is not in the library)") from exc
    _LIBS.append(lib)
    return [ctypes.cast(fn, ctypes.c_void_p).value for fn in fns]
