"""The on-disk kernel cache: bytes stored under a text key, safely.

Directory: `TPP_CACHE_DIR`, default `~/.cache/tpp`; `TPP_DISK_CACHE=0` turns the disk cache off.
The directory is created owner-only (0700). An entry is one file named by the SHA-256 of its key:
the payload first, then the full key, then a trailer with a magic tag, the lengths and the
payload's SHA-256. `load` returns None, so the caller rebuilds, for anything it cannot trust: a
missing, truncated, corrupt or foreign entry (another key, another format), one not owned by
this user, a symlink. `store` writes a temporary file and renames it into place, so readers
never see half an entry and two processes storing the same key at once both succeed.

A directory this process cannot write to (a shared cache, pre-filled and mounted read-only) is
still read, and only stores are skipped; there an entry owned by root is trusted too, besides
this user's own (whoever filled a shared cache, no other user's file is ever loaded). A
writable directory is used only when it belongs to this user.
"""
from __future__ import annotations

import hashlib
import os
import stat
import struct
import tempfile
from pathlib import Path

MAGIC = b"TPPKRN02"
_TRAILER = struct.Struct("<IQ32s8s")  # key length, payload length, payload sha256, magic


def default_directory() -> Path | None:
    if os.environ.get("TPP_DISK_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    configured = os.environ.get("TPP_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "tpp"


def _writable(directory: Path) -> bool:
    """Whether this process may create files in directory."""
    return os.access(directory, os.W_OK | os.X_OK)


class DiskCache:
    def __init__(self, directory: Path | None):
        self.directory = None if directory is None else Path(directory)
        self.writable = False     # settled by _prepare: False for a read-only cache
        self._owners = frozenset((os.getuid(),))   # whose entries load() trusts
        self._ready = False

    def _prepare(self) -> bool:
        """Create the directory (owner-only) once and settle what the cache may do; False
        disables it (no directory, or a writable one of another user)."""
        if self.directory is None:
            return False
        if not self._ready:
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                st = self.directory.stat()
            except OSError:
                self.directory = None
                return False
            self.writable = _writable(self.directory)
            if self.writable and st.st_uid != os.getuid():
                self.directory = None
                return False
            if not self.writable:
                self._owners = frozenset((os.getuid(), 0))
            self._ready = True
        return True

    def path_for(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest() + ".tppk")

    def load(self, key: str) -> bytes | None:
        """The payload stored under key, or None."""
        if not self._prepare():
            return None
        path = self.path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in self._owners:
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                blob = f.read()
        except OSError:
            return None
        finally:
            os.close(fd)
        return _decode(blob, key)

    def store(self, key: str, payload: bytes) -> Path | None:
        """Store payload under key; returns the entry's path, or None if it could not be written
        (or the cache is read-only)."""
        if not self._prepare() or not self.writable:
            return None
        blob = _encode(key, payload)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                path = self.path_for(key)
                os.replace(tmp, path)
                return path
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError:
            return None  # a full or read-only disk costs a recompile next time, nothing more


def _encode(key: str, payload: bytes) -> bytes:
    kb = key.encode()
    trailer = _TRAILER.pack(len(kb), len(payload), hashlib.sha256(payload).digest(), MAGIC)
    return payload + kb + trailer


def _decode(blob: bytes, key: str) -> bytes | None:
    if len(blob) < _TRAILER.size:
        return None
    klen, plen, digest, magic = _TRAILER.unpack_from(blob, len(blob) - _TRAILER.size)
    kb = key.encode()
    if magic != MAGIC or klen != len(kb) or len(blob) != plen + klen + _TRAILER.size:
        return None
    if blob[plen:plen + klen] != kb:
        return None
    payload = blob[:plen]
    if hashlib.sha256(payload).digest() != digest:
        return None
    return payload
