"""The host buffers of ops.flash_attention's calls: the zero-padded tail blocks of sequences
that are not a multiple of the block, the shared dummies that stand in for them when they are,
the nests' per-thread scratch, and the constant key-tail mask and ones rows.

Fresh arrays are page-faulted on every call, which costs more than a short sequence's
compute, so each thread keeps its scratch and tail arrays (up to REUSED_BYTES) for its next
calls; no caller ever sees them, and a call is done with them when it returns.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from tpp.runtime import recording

from . import _host

_DUMMIES: dict = {}
_LOCAL = threading.local()
_SCRATCH_KEYS = 4        # scratch sets a thread keeps for its next calls
REUSED_BYTES = 2 << 20  # the largest backward scratch kept (the forward's is O(hc) blocks)


def dummy(role, shape, dtype):
    """A shared array of this shape for the tail tensor `role` that the nest never touches
    (its sequence is a multiple of the block): allocating (and page-faulting) one per call
    costs more than a small problem's compute. One per role: a nest's tensors must not
    overlap."""
    key = (role, tuple(shape), np.dtype(dtype))
    arr = _DUMMIES.get(key)
    if arr is None:
        if len(_DUMMIES) >= 32:
            _DUMMIES.clear()
        arr = _DUMMIES[key] = _host.np_zeros(shape, dtype)
    return arr


def reused(key, make):
    """A copy of the dict make() gives (scratch arrays, whose contents no call reads before
    writing), made once per thread and key and kept for that thread's next calls: fresh
    scratch is page-faulted on every call."""
    cache = getattr(_LOCAL, "scratch", None)
    if cache is None:
        cache = _LOCAL.scratch = {}
    arrays = cache.get(key)
    if arrays is None:
        if len(cache) >= _SCRATCH_KEYS:
            cache.clear()
        arrays = cache[key] = make()
    return dict(arrays)


def held(role, shape, dtype):
    """An array for the tail tensor `role` of one call (contents undefined): up to
    REUSED_BYTES, the calling thread's own, kept for its next calls (a short sequence is all
    tail, and a fresh array's page faults cost more than copying into it: B8 H12 S40 D32,
    three fresh input tails ~0.25 ms of a ~0.6 ms forward); larger ones fresh. Only for
    arrays that no caller sees and that a call is done with when it returns."""
    dtype = np.dtype(dtype)
    if math.prod(shape) * dtype.itemsize > REUSED_BYTES:
        return _host.np_empty(shape, dtype)
    cache = getattr(_LOCAL, "tails", None)
    if cache is None:
        cache = _LOCAL.tails = {}
    key = (role, tuple(shape), dtype)
    arr = cache.get(key)
    if arr is None:
        if len(cache) >= 4 * _SCRATCH_KEYS:
            cache.clear()
        arr = cache[key] = _host.np_empty(shape, dtype)
    return arr


def tail(x3, block, heads, role):
    """The zero-padded last partial block of each head of x3 (N, S, D): (N, block, D), or
    a shared dummy of `heads` heads when S is a multiple of block (the nest never reads it
    then)."""
    n, s, d = x3.shape
    r = s % block
    if r == 0:
        return dummy(role, (heads, block, d), x3.dtype)
    t = held(role, (n, block, d), x3.dtype)
    recording.host(_fill_tail, t, x3[:, s - r:])
    return t


def _fill_tail(t, rows):
    r = rows.shape[1]
    t[:, :r] = rows
    t[:, r:] = 0


def key_tail_mask(sk, block):
    cm = np.zeros(block, np.float32)
    r = sk % block
    if r:
        cm[r:] = -np.inf
    return cm


def ones(block):
    return np.ones(block, np.float32)


def chunk(arr, c, count):
    """Rows c * count ... of arr (a tail array of one block per head, or a dummy)."""
    return arr[c * count:(c + 1) * count] if arr.shape[0] > count else arr
