"""Recording what a function runs on the host, for a replay of it (ops.replay).

While a Recorder is open on a thread (`recording()`), every compiled nest called there on
host arrays adds a step: its entry, its call table as it was (threads, addresses, sizes),
and the extent of each array. Operators that compute on the host outside nests declare it
with `host(fn, *arrays)`, which runs fn(*arrays) and adds a host step. Anything else a
replay could not repeat (a primitive called outside a nest, a nest call that bound its
arrays itself, a per-call seed, work spread over other threads) refuses the recording with
a reason: it stays valid to run, it just cannot be replayed.

When no recorder is open anywhere, the hooks cost the nests one module attribute read.
Recorders do not nest: a function recorded inside a recording is part of the outer one.
"""
from __future__ import annotations

import contextlib
import threading

__all__ = ["Recorder", "active", "current", "host", "recording", "refuse"]

active = 0              # recorders open on any thread (the hooks' one check when 0)
_LOCK = threading.Lock()
_LOCAL = threading.local()


class Recorder:
    """The steps of one recording, in order:
    ("nest", nest, table, extents, written, arrays)
                      nest._int_entry(table) ran; table a list of ints; extents[k] the
                      (address, nbytes) of arrays[k], written[k] whether the nest writes it
    ("host", fn, arrays)                      fn(*arrays) ran (numpy arrays, as given)
    refused: None, or why the recording cannot be replayed (the first reason)."""

    def __init__(self):
        self.steps = []
        self.refused = None
        self.hosting = 0        # inside a host step (whose own operations it records whole)

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def nest(self, nest, table, extents, written, arrays) -> None:
        self.steps.append(("nest", nest, list(table), tuple(extents), tuple(written),
                           tuple(arrays)))

    def host(self, fn, arrays) -> None:
        self.steps.append(("host", fn, tuple(arrays)))


def current():
    """The recorder open on this thread, or None."""
    return getattr(_LOCAL, "recorder", None) if active else None


@contextlib.contextmanager
def recording():
    """Open a Recorder on this thread for the with-block (None when one is open already: the
    block's calls then belong to that one)."""
    global active
    if current() is not None:
        yield None
        return
    rec = _LOCAL.recorder = Recorder()
    with _LOCK:
        active += 1
    try:
        yield rec
    finally:
        _LOCAL.recorder = None
        with _LOCK:
            active -= 1


def refuse(reason: str) -> None:
    """Mark this thread's recording (if any) as not replayable, for reason."""
    rec = current()
    if rec is not None:
        rec.refuse(reason)


def host(fn, *arrays):
    """fn(*arrays): host work of an operator (numpy arrays or CPU torch tensors it was given
    or made), added to this thread's recording as a step to run again on the same arrays,
    or arrays at the same place in their replacements. fn must compute from its arguments
    alone, write only into them, and return nothing a caller keeps."""
    rec = current()
    if rec is None:
        return fn(*arrays)
    rec.hosting += 1
    try:
        result = fn(*arrays)
    finally:
        rec.hosting -= 1
    rec.host(fn, arrays)
    return result


def nest_call(nest, args, named, threads) -> None:
    """Add the host call nest(*args, threads=threads, **named) that just ran to this
    thread's recording (tpp.runtime.loops.CompiledNest's hook)."""
    rec = current()
    if rec is None:
        return
    if nest._seed_slots:
        rec.refuse("a nest took a per-call seed")
        return
    table = nest._fast_table(args, named, threads)     # its signature is known now
    if table is None:
        rec.refuse("a nest was called with arrays its fast path does not take")
        return
    given = args
    if named:
        given = [None] * len(nest._plain)
        for name, arr in named.items():
            given[nest._position[name]] = arr
    extents = []
    for k, arr in enumerate(given):
        nbytes = arr.nbytes if hasattr(arr, "nbytes") else arr.numel() * arr.element_size()
        extents.append((int(table[1 + k]), int(nbytes)))
    rec.nest(nest, table, extents, [written for _, written in nest._plain], given)
