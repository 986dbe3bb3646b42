"""The threading runtime compiled loop nests run on: the OpenMP runtime (libgomp).

A nest's parallel band is handed to `GOMP_parallel`, whose thread team persists between calls
(no thread is created per call, and no home-made spinning pool). The library is loaded by its
soname, so a process that has loaded torch's bundled libgomp shares that one runtime.

Thread count: `set_num_threads(n)`, else `TPP_NUM_THREADS`, else `OMP_NUM_THREADS`, else the
cores this process may run on. Where libgomp cannot be loaded, nests run on one thread. Every
count is 1..MAX_THREADS (libgomp aborts the process when asked for absurd teams); the cores
default is capped there too.
"""
from __future__ import annotations

import ctypes
import functools
import os

from tpp.core.checks import MAX_THREADS, thread_count
from tpp.core.errors import ArgumentError

from .loopnest import RUNTIME

_chosen: int | None = None    # set_num_threads, or the environment as first read


@functools.lru_cache(maxsize=None)
def runtime() -> tuple | None:
    """Addresses of the runtime functions a nest calls (loopnest.RUNTIME order), or None."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
        return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in RUNTIME)
    except (OSError, AttributeError):
        return None


def _from_env() -> int:
    for name in ("TPP_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").split(",")[0].strip()
        if value:
            try:
                n = int(value)
            except ValueError:
                n = None
            if n is None or not 1 <= n <= MAX_THREADS:
                raise ArgumentError(f"{name}={value!r}: expected a positive integer of at most "
                                    f"{MAX_THREADS}")
            return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(cores, MAX_THREADS)


def num_threads() -> int:
    """The threads a parallel nest uses now (1 without libgomp). The environment is read
    once; set_num_threads(None) reads it again."""
    global _chosen
    if runtime() is None:
        return 1
    if _chosen is None:
        _chosen = _from_env()
    return _chosen


def set_num_threads(n):
    """Use n threads (any integral value in 1..MAX_THREADS) for parallel nests from now on;
    None: read the environment again."""
    global _chosen
    _chosen = None if n is None else thread_count(n, "set_num_threads: n")
