"""Bounded per-process caches: a small LRU mapping, and the registry `tpp.clear_caches` uses.

Every cache the library keeps per process that is keyed by what callers pass (a kernel's
variants per row stride, compiled loop nests, matmul plans, CUDA functions) is an `LRU`: at
most `maxsize` entries, the least recently used one dropped when another is added. Dropping an
entry only forgets the Python handle: the machine code it points to stays loaded for the life
of the process (a call on another thread may still be running it); a dropped entry is
rebuilt on its next use, from the disk cache when there is one (tpp_cpu.sharedlib then hands
back the code already loaded instead of mapping another copy).

Each LRU registers itself under a name (weakly: a cache dies with its owner), so that
`clear_all()` empties them all and `sizes()` counts their entries by name. Caches that are not
LRUs (functools.lru_cache functions) join with `also_clear(fn)`.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

VARIANTS_PER_KERNEL = 32   # row-stride variants one Kernel/BrgemmKernel keeps

_LOCK = threading.Lock()
_REGISTRY: "weakref.WeakSet[LRU]" = weakref.WeakSet()
_CLEARERS: list = []


class LRU:
    """A mapping of at most `maxsize` entries with least-recently-used eviction.

    `get(key, default)` is a hit or `default` (a hit makes the entry the most recent); `cache[key]
    = value` adds or replaces an entry, dropping the least recent one beyond maxsize. An
    unhashable key raises TypeError, as a dict does. Safe to use from several threads (each
    operation is atomic under the GIL; a lookup racing an eviction is a miss)."""

    __slots__ = ("name", "maxsize", "_data", "__weakref__")

    def __init__(self, maxsize: int, name: str):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.name, self.maxsize = name, maxsize
        self._data = OrderedDict()
        with _LOCK:
            _REGISTRY.add(self)

    def get(self, key, default=None):
        data = self._data
        try:
            data.move_to_end(key)
        except KeyError:
            return default
        return data.get(key, default)

    def __setitem__(self, key, value) -> None:
        data = self._data
        data[key] = value
        data.move_to_end(key)
        while len(data) > self.maxsize:
            data.popitem(last=False)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> list:
        """The keys, least recently used first."""
        return list(self._data)

    def clear(self) -> None:
        self._data.clear()

    def __repr__(self):
        return f"<LRU {self.name}: {len(self._data)}/{self.maxsize}>"


def _live() -> list:
    with _LOCK:
        return list(_REGISTRY)


def also_clear(fn) -> None:
    """Have clear_all() call fn() too (e.g. a functools.lru_cache's cache_clear)."""
    with _LOCK:
        _CLEARERS.append(fn)


def clear_all() -> None:
    """Empty every live LRU and call every function registered with also_clear."""
    for cache in _live():
        cache.clear()
    with _LOCK:
        clearers = list(_CLEARERS)
    for fn in clearers:
        fn()


def sizes() -> dict:
    """{name: entries held by the live LRUs of that name}."""
    out: dict = {}
    for cache in _live():
        out[cache.name] = out.get(cache.name, 0) + len(cache)
    return out
